"""Extract stage: the tokens table -> committed hidden-states shards, the training data.

- config: the extract section of the job's config
- extractor: one shard of prepared samples through the target (a vLLM engine, or transformers as the
  reference) -> a hidden-states table, with rejects
- schedule: which shard goes to which engine replica, and what happens when one is lost
- manifest: the output directory's layout and its exactly-once commit protocol
- shards: shard files (Arrow IPC or Parquet), written and read
- codec: how hidden states are stored in a shard's columns, both ways; the one decoder
The regenerate stage (eagle3.prepare.regenerate) and online mode (eagle3.train.online_feed) run their
engines on the same schedule and, for regeneration, the same commit protocol.
"""

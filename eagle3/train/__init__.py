"""Train stage: hidden-states shards -> a trained draft, exported in speculators' format.

- config: the stage's config (`train:` in a job file: optimizer, draft, data, checkpoint, online)
- trainer: one data-parallel rank's draft, step, held-out accuracy and checkpoints (actors/trainer.py
  wraps it for Ray Train)
- deepspeed_backend: the one place that knows DeepSpeed: the config -> a DeepSpeed engine
- export: the trained draft -> a directory vLLM loads as an eagle3 draft (the stage's output)
- rounds: the draft's predictions counted as vLLM counts its drafts (the held-out evaluation's, and
  eagle3.evaluate.draft_accuracy's)
- data/: the training input, from stored shards (or tables in the object store) to a step's model
  inputs on the device
- online_feed: online mode's bookkeeping (`train.source: online`): which tables the ranks asked
  for, which the engines extract now, and the back-pressure between them
"""

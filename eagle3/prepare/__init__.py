"""Prepare stage: conversations -> the tokens table (tokens.parquet) the extract stage reads.

- conversations: chat records from files (JSONL, JSON, Parquet, Arrow) -> messages, with reject reasons
- chat_template: a conversation -> training samples, token ids and the assistant-only loss mask
- heldout: which conversations are held out of training (chosen here, read again by training)
- tokens: the stage itself: records -> samples -> tokens.parquet, rejects, eval prompts, in one
  process or over Ray tasks
- config: the prepare and regenerate sections of the job's config
- regenerate: the optional stage after it: the target rewrites every assistant turn, and the result
  is tokenized again into the same table
"""

"""Prepare stage: conversations -> chat template -> input_ids + loss_mask (Arrow).

Owns: the stage itself: which records become samples, held-out eval prompts, the rejects
file, and writing `tokens.parquet` under `TOKENS_SCHEMA`. Does not own: reading sources
(`eagle3.conversations`), rendering and masks (`eagle3.chat_template`), the schema
(`eagle3.schema`), the tokenizer or its template (they come from the target's directory),
provenance files (the driver writes them).

Imports neither torch nor transformers at module level: drivers import this module
before deciding where the work runs.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.chat_template import eval_prompt, tokenize_conversation
from eagle3.config import PrepareConfig
from eagle3.conversations import iter_records, load_conversations  # noqa: F401  (re-exported)
from eagle3.schema import TOKENS_SCHEMA, check_schema

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.parquet"
REJECTS_FILE = "rejects.jsonl"
EVAL_PROMPTS_FILE = "eval_prompts.jsonl"

_WRITE_BATCH_ROWS = 1024


def _atomic_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


class _TokensWriter:
    """Streams rows to a hidden temporary file; `commit` renames it into place."""

    def __init__(self, final: Path):
        self.final, self.tmp = final, _atomic_path(final)
        self.writer = pq.ParquetWriter(str(self.tmp), TOKENS_SCHEMA)
        self.rows: dict[str, list] = {f.name: [] for f in TOKENS_SCHEMA}

    def add(self, sample_id: str, input_ids: list[int], loss_mask: list[int]) -> None:
        self.rows["sample_id"].append(sample_id)
        self.rows["input_ids"].append(input_ids)
        self.rows["loss_mask"].append(loss_mask)
        self.rows["num_tokens"].append(len(input_ids))
        if len(self.rows["sample_id"]) >= _WRITE_BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.rows["sample_id"]:
            self.writer.write_table(pa.Table.from_pydict(self.rows, schema=TOKENS_SCHEMA))
            self.rows = {k: [] for k in self.rows}

    def commit(self) -> None:
        self.flush()
        self.writer.close()
        os.replace(self.tmp, self.final)

    def abort(self) -> None:
        self.writer.close()
        self.tmp.unlink(missing_ok=True)


def _write_jsonl_atomic(final: Path, rows: list[dict]) -> None:
    tmp = _atomic_path(final)
    with open(tmp, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    os.replace(tmp, final)


def read_eval_prompts(out_dir: str | Path) -> list[list[int]]:
    path = Path(out_dir) / EVAL_PROMPTS_FILE
    return [json.loads(line)["prompt_token_ids"] for line in path.read_text().splitlines() if line.strip()]


def prepare_dataset(cfg: PrepareConfig, tokenizer_dir: str, out_dir: str) -> dict[str, Any]:
    """Write out_dir/tokens.parquet (TOKENS_SCHEMA) and out_dir/rejects.jsonl; return counts.

    Over-long samples are rejected rather than truncated: a truncated conversation
    teaches the draft turns that end where the target would not have ended them.
    Both files appear under their final names only once complete.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer in {tokenizer_dir!r} has no chat_template; prepare renders every "
                         "conversation with the target's own template, so use a chat/instruct model's "
                         "tokenizer or add a chat_template to its tokenizer_config.json")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A re-run invalidates the previous output: if this run fails, no stale tokens file
    # should sit next to this run's rejects and pass for its result.
    (out / TOKENS_FILE).unlink(missing_ok=True)

    rejects: list[dict] = []
    eval_prompts: list[dict] = []
    num_samples = num_tokens = num_loss_tokens = max_tokens = 0
    writer = _TokensWriter(out / TOKENS_FILE)
    try:
        for rec in iter_records(cfg.conversations, cfg.max_samples):
            if rec.reason is not None:
                rejects.append(rec.reject(rec.reason))
                continue
            try:
                input_ids, loss_mask = tokenize_conversation(tokenizer, rec.messages, cfg.max_length,
                                                             cfg.assistant_only_loss)
            except ValueError as e:
                rejects.append(rec.reject(f"line {rec.line}: {e}"))
                continue
            n_loss = sum(loss_mask)
            if n_loss == 0:
                rejects.append(rec.reject(f"line {rec.line}: 0 loss tokens (no assistant content to learn from)"))
                continue
            if len(eval_prompts) < cfg.num_eval_prompts:
                eval_prompts.append({"sample_id": rec.sample_id, "prompt_token_ids": eval_prompt(tokenizer, rec.messages)})
                continue
            writer.add(rec.sample_id, input_ids, loss_mask)
            num_samples += 1
            num_tokens += len(input_ids)
            num_loss_tokens += n_loss
            max_tokens = max(max_tokens, len(input_ids))
        _write_jsonl_atomic(out / REJECTS_FILE, rejects)
        _write_jsonl_atomic(out / EVAL_PROMPTS_FILE, eval_prompts)
        if num_samples == 0:
            first = "; ".join(f"{r['source']}: {r['reason']}" for r in rejects[:3])
            raise ValueError(f"prepare kept 0 samples of {len(rejects)} records from {cfg.conversations!r}; "
                             f"see {out / REJECTS_FILE} (first reasons: {first})")
        writer.commit()
    except BaseException:
        writer.abort()
        raise

    summary = {"num_samples": num_samples, "num_rejected": len(rejects), "num_eval_prompts": len(eval_prompts),
               "num_tokens": num_tokens,
               "num_loss_tokens": num_loss_tokens, "max_tokens": max_tokens}
    log.info("prepare: %s -> %s: %s", cfg.conversations, out / TOKENS_FILE, summary)
    if rejects:
        log.warning("prepare rejected %d records; reasons in %s", len(rejects), out / REJECTS_FILE)
    return summary


def read_tokens(path: str | Path) -> pa.Table:
    """Read a tokens.parquet (or the directory holding one), refusing other schema versions."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENS_FILE
    table = pq.read_table(str(p))
    try:
        check_schema(table.schema, "tokens")
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
    want = [(f.name, f.type) for f in TOKENS_SCHEMA]
    found = [(f.name, f.type) for f in table.schema]
    if found != want:
        raise ValueError(f"{p}: expected columns {want}, found {found}; re-run the prepare stage")
    return table

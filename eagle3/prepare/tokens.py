"""Prepare stage: conversations -> chat template -> input_ids + loss_mask (Arrow).

Owns: the stage itself: which records become samples, held-out eval prompts, the held-out
split's threshold (heldout.json; the rule is eagle3.prepare.heldout's), the rejects file,
writing `tokens.parquet` under `TOKENS_SCHEMA`, and spreading the tokenizing over Ray tasks
in contiguous chunks (`prepare_dataset_ray`; `prepare_dataset` is the same stage in one process,
and both assemble chunks through one function, so their output is identical).
Does not own: reading sources (`eagle3.prepare.conversations`), rendering and masks
(`eagle3.prepare.chat_template`), the schema (`eagle3.schema`), the tokenizer or its template (they
come from the target's directory), provenance files (the driver writes them).

Imports neither torch nor transformers at module level: drivers import this module
before deciding where the work runs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle3.prepare.chat_template import RenderReject, eval_prompt, render_conversation
from eagle3.prepare.chat_template import tokenize_conversation  # noqa: F401  (re-exported)
from eagle3.config import PrepareConfig
from eagle3.prepare.conversations import Record, iter_records, load_conversations  # noqa: F401  (re-exported)
from eagle3.prepare.heldout import HELDOUT_FILE, choose_split
from eagle3.schema import TOKENS_SCHEMA, check_schema

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.parquet"
REJECTS_FILE = "rejects.jsonl"
EVAL_PROMPTS_FILE = "eval_prompts.jsonl"

# Records a chunk (one Ray task): a few seconds of tokenizing for chat-length records, so a
# task's overhead is noise and the progress line moves; the output does not depend on it.
CHUNK_RECORDS = 256
_PROGRESS_S = 5.0


def _atomic_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


class _TokensWriter:
    """Streams tables to a hidden temporary file; `commit` renames it into place."""

    def __init__(self, final: Path):
        self.final, self.tmp = final, _atomic_path(final)
        self.writer = pq.ParquetWriter(str(self.tmp), TOKENS_SCHEMA)

    def write(self, table: pa.Table) -> None:
        self.writer.write_table(table)

    def commit(self) -> None:
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


# transformers' generic fast tokenizer: AutoTokenizer builds this class for a tokenizer_config.json that
# names it (as transformers 5 saves most models, SmolLM2 and the tiny target among them).
GENERIC_TOKENIZER_CLASS = "TokenizersBackend"


def load_tokenizer(tokenizer_dir: str):
    """The target's tokenizer, refused when it has no chat template. Where its tokenizer_config.json
    names the generic fast tokenizer (GENERIC_TOKENIZER_CLASS, and no auto_map of remote code), that
    class loads it directly: the tokenizer AutoTokenizer gives, without AutoTokenizer's resolution of
    the model's config, which imports torch: seconds saved in every process that prepares
    (tests/test_prepare.py checks both give the same tokens)."""
    tokenizer_cls = _generic_tokenizer_class(tokenizer_dir)
    if tokenizer_cls is None:
        from transformers import AutoTokenizer as tokenizer_cls

    tokenizer = tokenizer_cls.from_pretrained(tokenizer_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer in {tokenizer_dir!r} has no chat_template; prepare renders every "
                         "conversation with the target's own template, so use a chat/instruct model's "
                         "tokenizer or add a chat_template to its tokenizer_config.json")
    return tokenizer


def _generic_tokenizer_class(tokenizer_dir: str):
    """GENERIC_TOKENIZER_CLASS where tokenizer_dir's tokenizer_config.json names it and maps no remote
    code; else None (AutoTokenizer decides)."""
    try:
        config = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("tokenizer_class") != GENERIC_TOKENIZER_CLASS or "auto_map" in config:
        return None
    import transformers

    return getattr(transformers, GENERIC_TOKENIZER_CLASS, None)


@dataclass
class ChunkResult:
    """One contiguous run of records, tokenized. Rows of `samples` are the samples of every good
    record of the chunk in source order (rows_per_record[k] rows for the k-th: a conversation is
    several samples when its template rewrites earlier turns, eagle3.prepare.chat_template); its first
    len(eval_prompts) records are also in `eval_prompts`, since only the assembler knows how
    many good records came before the chunk."""

    num_records: int
    rejects: list[dict]
    samples: pa.Table
    eval_prompts: list[dict]
    rows_per_record: list[int] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    """Per-record counts over the good records (samples and eval prompts alike), summed over
    chunks: `mapped_roles:<role>` (turns mapped by the reader) becomes summary["mapped_roles"];
    a key without ':' goes into the summary as it is; `rejected:<kind>`, one per reject, becomes
    summary["num_rejected_by_reason"]."""


def tokenize_chunk(cfg: PrepareConfig, tokenizer, records: list[Record]) -> ChunkResult:
    """Records -> tokens, rejects and the eval prompts of the chunk's first good records."""
    rejects: list[dict] = []
    rows: dict[str, list] = {f.name: [] for f in TOKENS_SCHEMA}
    eval_prompts: list[dict] = []
    rows_per_record: list[int] = []
    counts: Counter = Counter()
    for rec in records:
        if rec.reason is not None:
            rejects.append(rec.reject(rec.reason, rec.kind))
            counts[f"rejected:{rec.kind}"] += 1
            continue
        try:
            rendered = render_conversation(tokenizer, rec.messages, max_length=cfg.max_length,
                                           over_length=cfg.over_length, assistant_only_loss=cfg.assistant_only_loss,
                                           chat_template_kwargs=cfg.chat_template_kwargs)
        except RenderReject as e:
            rejects.append(rec.reject(f"{rec.where}: {e}", e.kind))
            counts[f"rejected:{e.kind}"] += 1
            continue
        if not any(1 in s.loss_mask for s in rendered.samples):
            rejects.append(rec.reject(f"{rec.where}: 0 loss tokens (no assistant content to learn from)",
                                      "no_loss_tokens"))
            counts["rejected:no_loss_tokens"] += 1
            continue
        if len(eval_prompts) < cfg.num_eval_prompts:
            eval_prompts.append({"sample_id": rec.sample_id,
                                 "prompt_token_ids": eval_prompt(tokenizer, rec.messages, cfg.chat_template_kwargs)})
        counts.update(f"mapped_roles:{r}" for r in rec.mapped_roles)
        counts["num_leading_assistant_dropped"] += rec.num_dropped_leading > 0
        counts["num_truncated"] += rendered.num_turns_cut > 0
        counts["num_turns_cut"] += rendered.num_turns_cut
        counts["num_split"] += len(rendered.samples) > 1
        rows_per_record.append(len(rendered.samples))
        for s in rendered.samples:
            rows["sample_id"].append(rec.sample_id + s.id_suffix)
            rows["input_ids"].append(s.input_ids)
            rows["loss_mask"].append(s.loss_mask)
            rows["num_tokens"].append(len(s.input_ids))
    return ChunkResult(len(records), rejects, pa.Table.from_pydict(rows, schema=TOKENS_SCHEMA), eval_prompts,
                       rows_per_record, counts)


def _chunks(cfg: PrepareConfig, chunk_records: int) -> Iterator[list[Record]]:
    chunk: list[Record] = []
    for rec in iter_records(cfg.conversations, cfg.max_samples, leading_assistant=cfg.leading_assistant):
        chunk.append(rec)
        if len(chunk) >= chunk_records:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class _Progress:
    """Records and tokens per second, as a tqdm line (the total is unknown while streaming)."""

    def __init__(self, enabled: bool):
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(desc="prepare", unit="record", mininterval=_PROGRESS_S)

    def update(self, num_records: int, num_tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(num_records)
            self.bar.set_postfix(tok_s=f"{num_tokens / max(time.perf_counter() - self.t0, 1e-9):,.0f}", refresh=False)

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        return time.perf_counter() - self.t0


def _assemble(cfg: PrepareConfig, out_dir: str, results: Iterable[ChunkResult], progress: bool) -> dict[str, Any]:
    """Chunk results, in source order -> the stage's four files and its summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A re-run invalidates the previous output: if this run fails, no stale tokens file
    # should sit next to this run's rejects and pass for its result.
    (out / TOKENS_FILE).unlink(missing_ok=True)
    (out / HELDOUT_FILE).unlink(missing_ok=True)
    sample_ids: list[str] = []

    rejects: list[dict] = []
    eval_prompts: list[dict] = []
    counts: Counter = Counter()
    num_records = num_conversations = num_samples = num_tokens = num_loss_tokens = max_tokens = 0
    bar = _Progress(progress)
    writer = _TokensWriter(out / TOKENS_FILE)
    try:
        for res in results:
            num_records += res.num_records
            rejects.extend(res.rejects)
            counts.update(res.counts)
            held = min(cfg.num_eval_prompts - len(eval_prompts), len(res.eval_prompts))
            eval_prompts.extend(res.eval_prompts[:held])
            table = res.samples.slice(sum(res.rows_per_record[:held]))
            num_conversations += len(res.rows_per_record) - held
            if table.num_rows:
                writer.write(table)
                sample_ids.extend(table.column("sample_id").to_pylist())
                num_samples += table.num_rows
                n = table.column("num_tokens")
                num_tokens += pc.sum(n).as_py()
                num_loss_tokens += pc.sum(pc.list_flatten(table.column("loss_mask"))).as_py()
                max_tokens = max(max_tokens, pc.max(n).as_py())
            bar.update(res.num_records, num_tokens)
        seconds = bar.close()
        _write_jsonl_atomic(out / REJECTS_FILE, rejects)
        _write_jsonl_atomic(out / EVAL_PROMPTS_FILE, eval_prompts)
        if num_samples == 0:
            first = "; ".join(f"{r['source']}: {r['reason']}" for r in rejects[:3])
            raise ValueError(f"prepare kept 0 samples of {num_records} records from {cfg.conversations!r}; "
                             f"see {out / REJECTS_FILE} (first reasons: {first})")
        split = choose_split(sample_ids, cfg.heldout_fraction, cfg.heldout_min_conversations)
        split.write(out)
        writer.commit()
    except BaseException:
        bar.close()
        writer.abort()
        raise
    assert num_records == num_conversations + len(rejects) + len(eval_prompts), "a record was neither kept nor rejected"

    # num_truncated: conversations cut by over_length=truncate (num_turns_cut: their turns left
    # out); num_split: conversations trained as several samples (a template that rewrites
    # earlier turns); num_rejected_by_reason: rejects by kind (the reader's REJECT_KINDS, the
    # chat template's RenderReject kinds, no_loss_tokens).
    summary = {"num_records": num_records, "num_conversations": num_conversations, "num_samples": num_samples,
               "num_rejected": len(rejects),
               "num_rejected_by_reason": {k.split(":", 1)[1]: v for k, v in sorted(counts.items())
                                          if k.startswith("rejected:")},
               "num_truncated": counts["num_truncated"], "num_turns_cut": counts["num_turns_cut"],
               "num_split": counts["num_split"],
               "num_eval_prompts": len(eval_prompts),
               "num_heldout_conversations": split.num_heldout_conversations,
               "num_heldout_samples": split.num_heldout_samples, "num_tokens": num_tokens,
               "num_loss_tokens": num_loss_tokens, "max_tokens": max_tokens,
               "mapped_roles": {k.split(":", 1)[1]: v for k, v in sorted(counts.items())
                                if k.startswith("mapped_roles:")}}
    summary.update({k: v for k, v in sorted(counts.items()) if ":" not in k})
    log.info("prepare: %s -> %s: %s; %.0f records/s, %.0f tokens/s", cfg.conversations, out / TOKENS_FILE, summary,
             num_records / max(seconds, 1e-9), num_tokens / max(seconds, 1e-9))
    if summary["mapped_roles"]:
        log.info("prepare: turns whose role was mapped to assistant, by source role: %s", summary["mapped_roles"])
    if rejects:
        log.warning("prepare rejected %d of %d records; reasons in %s", len(rejects), num_records, out / REJECTS_FILE)
    return summary


def prepare_dataset(cfg: PrepareConfig, tokenizer_dir: str, out_dir: str, *,
                    chunk_records: int = CHUNK_RECORDS, progress: bool = False) -> dict[str, Any]:
    """Write out_dir/tokens.parquet (TOKENS_SCHEMA), rejects.jsonl, eval_prompts.jsonl and
    heldout.json in this process, without Ray; return the summary. `prepare_dataset_ray` gives
    the same files.

    Every record read is a kept conversation (one or more samples, ids '<id>#t<k>' when
    several), an eval prompt (the first cfg.num_eval_prompts good records) or a reject with its
    reason; summary["num_records"] is their sum. Of the kept conversations, those of the held-out
    split (cfg.heldout_fraction, eagle3.prepare.heldout) stay in tokens.parquet like the rest, and
    heldout.json records the split (the trainer leaves them out and measures accuracy on them).
    An over-length conversation is cut after whole assistant turns or rejected (cfg.over_length), never inside a turn: a turn cut short would
    teach the draft an ending the target never wrote. Files appear under their final names only
    once complete.
    """
    return _prepare_here(cfg, tokenizer_dir, out_dir, _chunks(cfg, chunk_records), progress)


def _prepare_here(cfg: PrepareConfig, tokenizer_dir: str, out_dir: str, chunks: Iterable[list[Record]],
                  progress: bool) -> dict[str, Any]:
    """The stage over `chunks` in this process (prepare_dataset, and prepare_dataset_ray's one chunk)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    return _assemble(cfg, out_dir, (tokenize_chunk(cfg, tokenizer, chunk) for chunk in chunks), progress)


@functools.lru_cache(maxsize=2)
def _worker_tokenizer(tokenizer_dir: str):
    # Ray reuses a worker process for the tasks of one function: the tokenizer loads once per process.
    return load_tokenizer(tokenizer_dir)


def _tokenize_chunk_task(cfg: PrepareConfig, tokenizer_dir: str, records: list[Record]) -> ChunkResult:
    return tokenize_chunk(cfg, _worker_tokenizer(tokenizer_dir), records)


def prepare_dataset_ray(cfg: PrepareConfig, tokenizer_dir: str, out_dir: str, *, num_workers: int | None = None,
                        chunk_records: int = CHUNK_RECORDS, progress: bool = True) -> dict[str, Any]:
    """`prepare_dataset`, with the tokenizing spread over Ray tasks (1 CPU each) on any node.

    This process reads the source (decoding records is a small part of the work: rendering
    and tokenizing is the rest) and ships contiguous
    chunks of records through the object store, so only it needs the conversations file;
    the tokenizer directory must be readable on every node (it is the target's). Results
    are taken back in submission order and assembled exactly as the serial path does, so
    the output does not depend on the number of workers or on which task finishes first.
    Plain tasks rather than Ray Data: the eval prompts are the first good records of the
    whole source and samples keep source order, which an ordered map over our own reader
    gives directly; Ray Data would need a datasource per format and preserve_order.
    At most 2 x workers chunks are in flight, which bounds the driver's and the object
    store's memory whatever the source's size.
    A source of one chunk (fewer than chunk_records records: the demo's 232 conversations) is
    tokenized in this process: a task would start a worker process and load the tokenizer there
    for the same work, with nothing to run beside it.
    """
    import itertools

    import ray

    chunks = _chunks(cfg, chunk_records)
    head = list(itertools.islice(chunks, 2))
    if len(head) < 2:
        log.info("prepare: %s is one chunk (< %d records): tokenized in this process", cfg.conversations,
                 chunk_records)
        return _prepare_here(cfg, tokenizer_dir, out_dir, head, progress)
    workers = num_workers or cfg.num_workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    task = ray.remote(num_cpus=1)(_tokenize_chunk_task)
    cfg_ref = ray.put(cfg)
    log.info("prepare: %s with %d Ray tasks in flight at most (1 CPU each), %d records a task",
             cfg.conversations, 2 * workers, chunk_records)

    def ordered_results() -> Iterator[ChunkResult]:
        pending: deque = deque()
        try:
            for chunk in itertools.chain(head, chunks):
                pending.append(task.remote(cfg_ref, tokenizer_dir, chunk))
                if len(pending) >= 2 * workers:
                    yield ray.get(pending.popleft())
            while pending:
                yield ray.get(pending.popleft())
        finally:
            for ref in pending:
                ray.cancel(ref)

    return _assemble(cfg, out_dir, ordered_results(), progress)


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

"""Regenerate stage, without Ray: the target rewrites every assistant turn of a shard of
conversations with its own sampling, and the result is re-encoded for extraction.

Owns: the turn-by-turn rounds (round r generates assistant turn r of every conversation of
the shard that has one, each prompt being the conversation so far with the turns before it
already regenerated: one batch per round, so an engine decodes many conversations at once),
the reasons a conversation is rejected, a `<think>` block split into `reasoning_content`,
per-turn seeds, the sampling defaults read from the target's generation_config.json, the
shard file, and the output layout:
    regenerated/
      MANIFEST.json                     the input's fingerprint (eagle3.manifest's protocol:
      data/shard-000003.parquet         a shard counts once its commit file exists)
      committed/shard-000003.json
      tokens.parquet                    TOKENS_SCHEMA rows of all shards, in shard order (written last)
      rejects.jsonl
A shard file holds the regenerated conversations and their tokens: one row per training
sample as eagle3.chat_template.render_conversation encodes it (sample_id, input_ids,
loss_mask, num_tokens), with its conversation's messages. That is one row per conversation
for a prefix-stable template, and one per assistant turn (ids suffixed '#t<k>', as prepare
names them) for a template that rewrites earlier turns.
Does not own: the engine and its arguments (compat.vllm_engine, actors/regenerator.py),
placement, retries and commits (ray_jobs/regenerate.py, eagle3.schedule, eagle3.manifest),
rendering and masks (eagle3.chat_template), reading sources (eagle3.conversations).

The source messages are read again from prepare.conversations by sample id rather than kept
by prepare: tokens.parquet keeps its one schema for every consumer, and the read is one
streaming pass that keeps only the prepared samples' messages.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.schema import TOKENS_SCHEMA

TOKENS_FILE = "tokens.parquet"
REJECTS_FILE = "rejects.jsonl"

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string())])
SHARD_SCHEMA = pa.schema([pa.field("sample_id", pa.string(), nullable=False),
                          pa.field("messages", pa.list_(MESSAGE_TYPE), nullable=False),
                          *[f for f in TOKENS_SCHEMA if f.name != "sample_id"]],
                         metadata={"eagle3.kind": "regenerated"})

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Sampling:
    """The sampling every turn is generated with (resolved: no None)."""

    temperature: float
    top_p: float
    max_tokens: int
    seed: int


def resolve_sampling(cfg, target_dir: str) -> Sampling:
    """regenerate.temperature / top_p, or where null the target's own generation_config.json
    (what the model's authors sample it with), else 1.0: the target's unmodified distribution."""
    gen = {}
    path = Path(target_dir) / "generation_config.json"
    if path.exists():
        gen = json.loads(path.read_text())
    temperature = cfg.temperature if cfg.temperature is not None else float(gen.get("temperature", 1.0))
    top_p = cfg.top_p if cfg.top_p is not None else float(gen.get("top_p", 1.0))
    return Sampling(temperature=temperature, top_p=top_p, max_tokens=cfg.max_tokens, seed=cfg.seed)


def turn_seed(seed: int, sample_id: str, turn: int) -> int:
    """A turn's sampling seed: a function of the config's seed, the sample and the turn only, so
    a conversation reads the same whatever shard, batch or resumed run generates it."""
    h = hashlib.sha256(f"{seed}\0{sample_id}\0{turn}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def split_reasoning(text: str) -> dict:
    """An assistant message from a generation: a `<think>...</think>` block becomes
    reasoning_content and the rest content. A closing tag without an opening one counts too:
    templates of reasoning models often end their generation prompt with `<think>`."""
    close = text.find(THINK_CLOSE)
    if close < 0:
        return {"role": "assistant", "content": text}
    open_ = text.find(THINK_OPEN, 0, close)
    start = open_ + len(THINK_OPEN) if open_ >= 0 else 0
    return {"role": "assistant", "content": text[close + len(THINK_CLOSE):].lstrip("\n"),
            "reasoning_content": text[start:close].strip("\n")}


@dataclass
class Generation:
    """What an engine gives back for one prompt."""

    text: str
    num_tokens: int
    finish_reason: str | None
    """'stop' (end of turn), 'length' (max_tokens or the context's end), or another engine reason."""


# prompts (token ids), per-prompt sampling (temperature, top_p, max_tokens, seed) -> one Generation each
GenerateFn = Callable[[list[list[int]], list[dict]], list[Generation]]


@dataclass
class RegenStats:
    num_samples: int = 0
    """Conversations kept (a conversation may be several training rows: SHARD_SCHEMA)."""
    num_rejected: int = 0
    num_turns: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_tokens: int = 0
    """Tokens of the kept, re-encoded samples."""
    num_ended_early: int = 0
    """Conversations kept but ended before their last assistant turn (regenerate.cut 'end')."""
    generate_s: float = 0.0
    seconds: float = 0.0
    rejects: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


_TURN_SUFFIX = re.compile(r"#t\d+$")


def conversation_ids(sample_ids: list[str]) -> list[str]:
    """The conversations behind prepared sample ids, in first-seen order: a conversation that
    prepare split into one sample per assistant turn (ids '<id>#t<k>',
    eagle3.chat_template.Sample.id_suffix) is regenerated once, as a whole."""
    return list(dict.fromkeys(_TURN_SUFFIX.sub("", s) for s in sample_ids))


def regenerate_conversations(generate: GenerateFn, tokenizer, samples: list[tuple[str, list[dict]]],
                             sampling: Sampling, *, max_model_len: int, max_length: int,
                             assistant_only_loss: bool = True, chat_template_kwargs: dict | None = None,
                             cut: str = "reject") -> tuple[pa.Table, RegenStats]:
    """Every assistant turn of `samples` (conversation id, messages) rewritten by `generate`;
    returns the kept conversations' training rows (SHARD_SCHEMA, input order) and the counts.
    An empty generation rejects its conversation. What else cannot be regenerated whole (a prompt
    with no room left within max_model_len, a generation stopped at its length limit:
    finish_reason 'length', the answer cut; a regenerated conversation over max_length tokens)
    depends on `cut` (regenerate.cut): 'reject' rejects the conversation with the turn and the
    reason; 'end' ends it there and keeps what came before: a cut answer as its last assistant
    turn, a turn with no room dropped with every turn after it, an over-length conversation cut
    after its last whole assistant turn that fits (a conversation left with no assistant turn is
    still a reject). The kept turns are exactly what the target generated from the history they
    had; only the chat template's end-of-turn after a cut answer is a token the target did not
    choose. `chat_template_kwargs` (prepare.chat_template_kwargs) renders prompts and samples as
    prepare does."""
    if cut not in ("reject", "end"):
        raise ValueError(f"regenerate cut={cut!r}: expected 'reject' or 'end'")
    from eagle3.chat_template import prompt_ids, render_conversation

    t0 = time.perf_counter()
    stats = RegenStats()
    convs = [[dict(m) for m in messages] for _, messages in samples]
    turns = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
    rejected: dict[int, str] = {}
    ended: set[int] = set()  # cut 'end': no turn of these is generated any more

    def end_or_reject(k: int, r: int, reason: str, keep: dict | None = None) -> None:
        """Conversation k cannot go on at assistant turn r: with cut 'end' keep its first r
        regenerated turns (and `keep`, the cut answer of turn r), else reject it."""
        if cut == "end" and (r > 0 or keep is not None):
            last = turns[k][r] if keep is not None else turns[k][r - 1]
            convs[k] = convs[k][:last + 1]
            if keep is not None:
                convs[k][last] = keep
            ended.add(k)
        else:
            rejected[k] = f"assistant turn {r}: {reason}"

    for r in range(max((len(t) for t in turns), default=0)):
        batch = []  # (conversation, message index, prompt ids, max_tokens)
        for k, conv in enumerate(convs):
            if k in rejected or k in ended or r >= len(turns[k]):
                continue
            i = turns[k][r]
            try:
                ids = prompt_ids(tokenizer, conv[:i], chat_template_kwargs)
            except ValueError as e:
                rejected[k] = f"assistant turn {r}: {e}"
                continue
            room = max_model_len - len(ids)
            if room < 1:
                end_or_reject(k, r, f"the prompt has {len(ids)} tokens, no room to generate within "
                                    f"max_model_len={max_model_len} (prepare.max_length)")
                continue
            batch.append((k, i, ids, min(sampling.max_tokens, room)))
        if not batch:
            continue
        t = time.perf_counter()
        # A seed only where there is sampling: greedy decoding needs no generator.
        outs = generate([b[2] for b in batch],
                        [{"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": mt,
                          **({"seed": turn_seed(sampling.seed, samples[k][0], r)} if sampling.temperature > 0 else {})}
                         for k, _, _, mt in batch])
        stats.generate_s += time.perf_counter() - t
        if len(outs) != len(batch):
            raise RuntimeError(f"[regenerate] engine returned {len(outs)} generations for {len(batch)} prompts")
        for (k, i, ids, mt), out in zip(batch, outs):
            stats.num_turns += 1
            stats.num_prompt_tokens += len(ids)
            stats.num_generated_tokens += out.num_tokens
            msg = split_reasoning(out.text)
            if not msg["content"].strip():
                rejected[k] = (f"assistant turn {r}: empty generation"
                               + (" after its reasoning" if msg.get("reasoning_content") else "")
                               + f" (finish_reason {out.finish_reason!r})")
                continue
            if out.finish_reason == "length":
                limit = ("regenerate.max_tokens" if mt == sampling.max_tokens
                         else f"the context's end (max_model_len={max_model_len}, prompt {len(ids)} tokens)")
                end_or_reject(k, r, f"generation cut at {out.num_tokens} tokens by {limit} (finish_reason 'length')",
                              keep=msg)
                continue
            convs[k][i] = msg
    rows: dict[str, list] = {f.name: [] for f in SHARD_SCHEMA}
    for k, (sample_id, _) in enumerate(samples):
        if k not in rejected:
            try:
                rendered = render_conversation(tokenizer, convs[k], max_length=max_length,
                                               over_length="truncate" if cut == "end" else "reject",
                                               assistant_only_loss=assistant_only_loss,
                                               chat_template_kwargs=chat_template_kwargs)
            except ValueError as e:
                rejected[k] = f"regenerated conversation: {e}"
            else:
                stats.num_samples += 1
                stats.num_ended_early += k in ended or rendered.num_turns_cut > 0
                messages = [{"role": m["role"], "content": m["content"],
                             "reasoning_content": m.get("reasoning_content")} for m in convs[k]]
                for s in rendered.samples:
                    rows["sample_id"].append(sample_id + s.id_suffix)
                    rows["messages"].append(messages)
                    rows["input_ids"].append(s.input_ids)
                    rows["loss_mask"].append(s.loss_mask)
                    rows["num_tokens"].append(len(s.input_ids))
                    stats.num_tokens += len(s.input_ids)
        if k in rejected:
            stats.rejects.append({"sample_id": sample_id, "reason": rejected[k]})
    stats.num_rejected = len(stats.rejects)
    stats.seconds = time.perf_counter() - t0
    return pa.Table.from_pydict(rows, schema=SHARD_SCHEMA), stats


def write_shard_table(table: pa.Table, path: str | Path) -> int:
    """Write a shard file under a temporary name and rename it into place (a reader never sees
    half a file); returns its size in bytes."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, str(tmp))
    os.replace(tmp, path)
    return path.stat().st_size


def regenerate_fingerprint(sample_ids: list[str], samples_per_shard: int, sampling: Sampling, *, target: str,
                           max_length: int, assistant_only_loss: bool,
                           chat_template_kwargs: dict | None = None, cut: str = "reject") -> dict:
    """What a resumed run must share with the run that wrote the shards."""
    h = hashlib.sha256()
    for s in sample_ids:
        h.update(s.encode())
        h.update(b"\0")
    return {"num_samples": len(sample_ids), "sample_ids_sha256": h.hexdigest(), "samples_per_shard": samples_per_shard,
            "sampling": asdict(sampling), "target": str(target), "max_length": max_length,
            "assistant_only_loss": assistant_only_loss, "chat_template_kwargs": chat_template_kwargs or {},
            "cut": cut}


def source_messages(conversations: str, max_samples: int | None, wanted: set[str], *,
                    leading_assistant: str = "reject") -> dict[str, list[dict]]:
    """The messages of the `wanted` sample ids, read from the conversations prepare read (same
    records: max_samples counts records read, as in prepare; leading_assistant as prepare's)."""
    from eagle3.conversations import iter_records

    out = {}
    for rec in iter_records(conversations, max_samples, leading_assistant=leading_assistant):
        if rec.reason is None and rec.sample_id in wanted:
            out[rec.sample_id] = rec.messages
    missing = wanted - set(out)
    if missing:
        raise ValueError(f"{len(missing)} prepared samples (e.g. {sorted(missing)[:3]}) are not in "
                         f"prepare.conversations={conversations!r} any more: the file changed since prepare ran; "
                         "re-run the prepare stage")
    return out


def finalize(manifest, num_shards: int) -> dict:
    """tokens.parquet (TOKENS_SCHEMA, shard order) and rejects.jsonl from the committed shards, both
    renamed into place once complete; returns the counts. Every shard must be committed."""
    records = manifest.committed()
    if len(records) != num_shards:
        missing = sorted(set(range(num_shards)) - set(records))
        raise RuntimeError(f"regeneration ended with shards {missing[:10]} uncommitted")
    root = Path(manifest.root)
    tables = [pq.read_table(str(manifest.data_dir / rec["file"]), columns=[f.name for f in TOKENS_SCHEMA])
              for _, rec in sorted(records.items())]
    tokens = pa.concat_tables(tables).cast(TOKENS_SCHEMA) if tables else TOKENS_SCHEMA.empty_table()
    rejects = [rej for _, rec in sorted(records.items()) for rej in rec.get("rejects", [])]
    tmp = root / f".{REJECTS_FILE}.tmp-{os.getpid()}"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rejects))
    os.replace(tmp, root / REJECTS_FILE)
    if tokens.num_rows == 0:
        first = "; ".join(f"{r['sample_id']}: {r['reason']}" for r in rejects[:3])
        raise ValueError(f"regenerate kept 0 of {len(rejects)} conversations; see {root / REJECTS_FILE} "
                         f"(first reasons: {first})")
    write_shard_table(tokens, root / TOKENS_FILE)
    gen = sum(r["num_generated_tokens"] for r in records.values())
    gen_s = sum(r["generate_s"] for r in records.values())
    return {"num_samples": sum(r["num_samples"] for r in records.values()), "num_rows": tokens.num_rows,
            "num_rejected": len(rejects),
            "num_turns": sum(r["num_turns"] for r in records.values()), "num_generated_tokens": gen,
            "num_ended_early": sum(r.get("num_ended_early", 0) for r in records.values()),
            "num_tokens": sum(r["num_tokens"] for r in records.values()),
            "tokens_per_s_per_replica": gen / gen_s if gen_s else None,
            "tokens": str(root / TOKENS_FILE), "files": manifest.committed_files()}

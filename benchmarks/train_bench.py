"""Training throughput: our DeepSpeed trainer (actors.trainer.run_training, Ray Train, one
worker) against speculators' own trainer (`speculators train` under torchrun, one process), on the
same samples, in one command that runs each trainer --repeats times in ABBA order (ours, theirs,
theirs, ours, ...), so that a drift of the machine or going first touches both alike.

    python -m benchmarks.train_bench --shape 1b --repeats 2 --out DIR        # one GPU, ~12 min
    python -m benchmarks.train_bench --shape tiny --extract-backend hf --skip-speculators --out DIR  # CPU

Data format: both trainers read bf16 hidden states by default (ours from Arrow IPC shards,
theirs from one safetensors file per sample, its own format); `--hs-dtype float8_e4m3fn` gives
ours fp8 shards while theirs stay bf16, and the report says which. The result holds each repeat's
tokens/s, each repeat's ratio ours / theirs, and their median and range. With --skip-ours or
--skip-speculators only one trainer runs and no ratio is reported. On a CPU-only machine
speculators' trainer cannot run as shipped (it needs an accelerator), so use --skip-speculators.

What one run does:
1. Builds the target: a Llama of benchmarks/shapes.py's shape with seeded random bf16 weights
   (no tokenizer: speculators is given --mask-token-id, which EAGLE-3 does not use).
2. Extracts hidden states of N random-token prompts of L tokens with ray_jobs.extract.run_extract
   (vLLM, or transformers with --extract-backend hf) into our shard files.
3. Converts exactly those samples to speculators' layout (benchmarks/speculators_data.py),
   checking every sample's token ids against the prompts sent to extraction.
4. Trains S optimizer steps with each trainer, --repeats times each in ABBA order, one process a
   run; each run's data files are dropped from the page cache (--page-cache) before it starts.
5. Writes <out>/train[-TAG].json and .md.

Tokens/s, the same rule for both: every optimizer step ends with a time-stamped log record (ours:
actors.trainer's rank-0 "step i/S" line; theirs: the "speculators.metrics" record); steady-state
tokens/s = tokens of steps K+1..S / (time of step S - time of step K), so both trainers' start-up
(compile, DataLoader workers, Ray Train) is left out alike and each step's data loading is in.

Settings kept equal: one draft layer, TTT 3 steps with loss decay 1.0, kl_div with speculators'
"eager" loss in both (compat/speculators_loss.py), the same draft attention, draft vocabulary and
d2t/t2d, AdamW lr and weight decay, clipping 1.0, bf16, no norm_before_fc / norm_output, the same
samples per optimizer step (checked equal), aux layers (2, n//2, n-3). What differs is what is
compared: ours = DeepSpeed ZeRO-2 reading memory-mapped Arrow shards in the training process;
theirs = DDP under torch.autocast reading its files with DataLoader worker processes.

`--profile-steps FIRST LAST` records those steps of ours with torch.profiler (top ops, trace and
the GPU's idle gaps, benchmarks.trace_gaps); the profiler slows what it records, so such a run's
throughput is not a figure to compare.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.common import random_llama, read_step_log, set_page_cache, steady_state, wait_gpu_released
from compat.speculators_loss import loss_implementation

logger = logging.getLogger("eagle3.train_bench")

REPO_ROOT = Path(__file__).resolve().parents[1]
STEP_LOG_ENV = "EAGLE3_TRAIN_BENCH_STEP_LOG"
OUR_STEP_FORMAT = "step %d/%d loss %.4f full_acc_0 %.3f lr %.2e tokens %d input_wait_ms %.1f"
"""actors.trainer's rank-0 per-step log line, whose arguments the step clock reads;
tests/test_train_bench.py fails if actors/trainer.py stops logging it."""
SPECULATORS_NEEDS_ACCELERATOR = (
    "speculators' trainer needs an accelerator as shipped (model.to(local_rank), "
    "torch.accelerator.synchronize(), Triton fused losses); not run on this CPU-only machine")


@dataclass(frozen=True)
class Preset:
    prompt_len: int
    """Tokens per prompt (every prompt has exactly this many)."""
    micro_batch_tokens: int
    """Token budget of one optimizer step: ours' micro_batch_tokens, speculators' --total-seq-len."""
    num_steps: int
    """Optimizer steps each trainer runs."""
    skip_steps: int
    """Leading steps left out of the steady-state figure (>= 1: step K's end starts the clock)."""


PRESETS = {
    "tiny": Preset(prompt_len=256, micro_batch_tokens=2048, num_steps=8, skip_steps=3),
    "1b": Preset(prompt_len=1024, micro_batch_tokens=8192, num_steps=20, skip_steps=5),
}


@dataclass(frozen=True)
class BenchSettings:
    shape: str
    prompt_len: int
    micro_batch_tokens: int
    num_steps: int
    skip_steps: int
    samples_per_step: int
    """Samples packed into one step (the same in both trainers)."""
    num_train_prompts: int
    """num_steps * samples_per_step: speculators' training split, exactly one epoch of num_steps."""
    num_val_prompts: int
    """Speculators' held-out validation split (it requires one); ours trains on every prompt."""
    lr: float
    warmup_steps: int
    seed: int
    draft_attn_impl: str
    ttt_steps: int = 3
    num_draft_layers: int = 1
    loss: str = "kl_div"
    weight_decay: float = 0.01

    @property
    def num_prompts(self) -> int:
        return self.num_train_prompts + self.num_val_prompts

    @property
    def tokens_per_step(self) -> int:
        return self.samples_per_step * (self.prompt_len - 1)

    @property
    def train_data_ratio(self) -> float:
        """speculators' --train-data-ratio giving a training split of exactly num_train_prompts rows
        (it takes int(len * ratio) rows; the ratio must be < 1)."""
        return (self.num_train_prompts + 0.5) / self.num_prompts


def resolve_settings(args: argparse.Namespace) -> BenchSettings:
    preset = PRESETS[args.shape]
    L = args.prompt_len or preset.prompt_len
    B = args.micro_batch_tokens or preset.micro_batch_tokens
    S = args.num_steps or preset.num_steps
    K = preset.skip_steps if args.skip_steps is None else args.skip_steps
    if L < 2:
        raise ValueError(f"--prompt-len={L}: must be >= 2 (training pairs token t+1 with hidden state t)")
    ours_k, theirs_k = B // (L - 1), B // L
    if theirs_k < 1 or ours_k != theirs_k:
        raise ValueError(
            f"--micro-batch-tokens={B} with --prompt-len={L}: speculators packs {theirs_k} samples per step (by "
            f"length {L}), ours {ours_k} (by shifted length {L - 1}); pick L so that both are equal and >= 1, "
            f"e.g. a divisor of {B}")
    if not 1 <= K < S:
        raise ValueError(f"--skip-steps={K}: must be in [1, --num-steps={S}) (the end of step K starts the clock)")
    return BenchSettings(shape=args.shape, prompt_len=L, micro_batch_tokens=B, num_steps=S, skip_steps=K,
                         samples_per_step=ours_k, num_train_prompts=S * ours_k, num_val_prompts=1, lr=args.lr,
                         warmup_steps=min(args.warmup_steps, S), seed=args.seed,
                         draft_attn_impl=args.draft_attn_impl)


# ---------------------------------------------------------------------------------------------
# step clocks


class _OurStepClock(logging.Handler):
    """actors.trainer's per-step record -> one JSON line {t, step, tokens, loss}."""

    def __init__(self, path: str):
        super().__init__()
        self.path = Path(path)

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg != OUR_STEP_FORMAT or not isinstance(record.args, tuple) or len(record.args) != 7:
            return
        step, _num_steps, loss, _acc, _lr, tokens, wait_ms = record.args
        with self.path.open("a") as f:
            f.write(json.dumps({"t": record.created, "step": int(step), "tokens": int(tokens),
                                "loss": float(loss), "input_wait_ms": float(wait_ms)}) + "\n")


def install_step_clock() -> None:
    """Ray worker_process_setup_hook (every worker process of the benchmark's cluster runs it):
    when EAGLE3_TRAIN_BENCH_STEP_LOG is set, time-stamp actors.trainer's per-step records there."""
    path = os.environ.get(STEP_LOG_ENV)
    if not path:
        return
    log = logging.getLogger("actors.trainer")
    log.setLevel(logging.DEBUG)  # every step's record; only every train.log_every_s one is INFO
    log.addHandler(_OurStepClock(path))


# ---------------------------------------------------------------------------------------------
# stages


def speculators_flags(s: BenchSettings, *, target_dir: str, data_path: str, save_path: str, log_dir: str,
                      aux_layer_ids: list[int], draft_vocab_size: int, d2t_path: str | None,
                      t2d_path: str | None) -> list[str]:
    """`speculators train` flags matching our TrainConfig (see the module docstring)."""
    flags = [
        "--verifier-name-or-path", target_dir, "--data-path", data_path, "--save-path", save_path,
        "--log-dir", log_dir, "--speculator-type", "eagle3",
        "--num-layers", str(s.num_draft_layers), "--draft-arch", "llama",
        "--full-attention-indices", *map(str, range(s.num_draft_layers)),
        "--target-layer-ids", *map(str, aux_layer_ids),
        "--mask-token-id", "0",  # EAGLE-3 does not use it; given, no tokenizer is read
        "--no-norm-before-fc", "--no-norm-output", "--draft-attn-impl", s.draft_attn_impl,
        "--total-seq-len", str(s.micro_batch_tokens), "--hidden-states-dtype", "bfloat16",
        "--hidden-states-backend", "file", "--on-missing", "raise", "--train-data-ratio", repr(s.train_data_ratio),
        "--loss-fn", s.loss, "--loss-implementation", loss_implementation(), "--ttt-steps", str(s.ttt_steps),
        "--ttt-step-loss-decay", "1.0",
        "--optimizer", "adamw", "--lr", repr(s.lr), "--weight-decay", repr(s.weight_decay),
        "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(s.warmup_steps),
        "--epochs", "1", "--max-steps", str(s.num_steps), "--log-freq", "1", "--checkpoint-freq", "1",
        "--no-resume-from-checkpoint", "--seed", str(s.seed),
    ]
    if d2t_path is not None:  # without a mapping speculators' draft head has the full target vocabulary
        flags += ["--draft-vocab-size", str(draft_vocab_size), "--d2t-path", d2t_path, "--t2d-path", t2d_path]
    return flags


def check_speculators_flags(flags: list[str], s: BenchSettings) -> dict:
    """Resolve the flags with speculators' own parser and config schema (what its CLI does before
    training) and check that they mean what we intend, and that its packing sampler gives exactly
    num_steps batches of samples_per_step samples. Raises ValueError otherwise. Runs on CPU."""
    import numpy as np
    from speculators.train.config import TrainConfig as SpecTrainConfig
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    try:
        cfg = SpecTrainConfig.resolve(list(flags))
    except SystemExit as e:
        raise ValueError(f"speculators' argument parser refused the flags (exit {e.code}): {flags}") from None
    flat = cfg.flatten()
    want = {"speculator_type": "eagle3", "num_layers": s.num_draft_layers, "ttt_steps": s.ttt_steps,
            "ttt_step_loss_decay": 1.0, "lr": s.lr, "weight_decay": s.weight_decay, "optimizer": "adamw",
            "total_seq_len": s.micro_batch_tokens, "max_steps": s.num_steps, "epochs": 1, "loss_fn": s.loss,
            "norm_before_fc": False, "norm_output": False, "draft_attn_impl": s.draft_attn_impl,
            "full_attention_indices": list(range(s.num_draft_layers)), "on_missing": "raise", "log_freq": 1,
            "hidden_states_dtype": "bfloat16", "embed_requires_grad": False,
            "loss_implementation": loss_implementation()}
    wrong = {k: (flat.get(k), v) for k, v in want.items() if flat.get(k) != v}
    if wrong:
        raise ValueError(f"speculators resolved these settings otherwise than intended (found, wanted): {wrong}")
    split = int(s.num_prompts * cfg.data.train_data_ratio)
    if split != s.num_train_prompts:
        raise ValueError(f"--train-data-ratio {cfg.data.train_data_ratio} gives {split} training rows of "
                         f"{s.num_prompts}, wanted {s.num_train_prompts}")
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=s.micro_batch_tokens,
                                                 lengths=np.full(split, s.prompt_len), num_replicas=1, rank=0,
                                                 seed=s.seed)
    sizes = sorted({len(b) for b in sampler})
    if len(sampler) != s.num_steps or sizes != [s.samples_per_step]:
        raise ValueError(f"speculators' sampler packs {len(sampler)} batches of {sizes} samples per epoch; "
                         f"wanted {s.num_steps} of {s.samples_per_step}")
    return {"resolved": {k: flat[k] for k in want}, "train_rows": split, "batches_per_epoch": len(sampler)}


def speculators_command(step_log: str | Path, flags: list[str]) -> list[str]:
    """`torchrun --standalone --nproc_per_node 1 -m benchmarks.speculators_data STEP_LOG -- FLAGS`
    (torchrun as `python -m torch.distributed.run`: packages installed with pip --target have no console scripts)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            "-m", "benchmarks.speculators_data", str(step_log), "--", *flags]


def run_speculators(flags: list[str], work: Path, timeout_s: float, name: str = "speculators") -> dict:
    """Launch speculators' trainer (torchrun, one process) through benchmarks.speculators_data;
    returns its step records, or the error text. `name` names this run's step log and log."""
    step_log = work / f"{name}_steps.jsonl"
    step_log.unlink(missing_ok=True)
    log_path = work / f"{name}.log"
    cmd = speculators_command(step_log, flags)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               COLUMNS="200")
    out = {"command": cmd, "log": str(log_path)}
    print(f"speculators' trainer running (log: {log_path})", flush=True)
    t0 = time.perf_counter()
    try:
        with log_path.open("w") as logf:
            proc = subprocess.run(cmd, cwd=str(REPO_ROOT), env=env, stdout=logf, stderr=subprocess.STDOUT,
                                  timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = f"timeout after {timeout_s:.0f} s"
    out["wall_s"] = time.perf_counter() - t0
    out["records"] = read_step_log(step_log)
    if rc != 0:
        out["error"] = failure_text(log_path.read_text(errors="replace") if log_path.exists() else "", rc, log_path)
    return out


_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b.*)")
"""An exception line, also under torchrun's "[rank0]: " prefix."""


def failure_text(log: str, rc, log_path) -> str:
    """The error of a failed speculators run: its first exception line (the worker's, not torchrun's
    ChildFailedError), then the first traceback
    (the trainer's own; torchrun's ChildFailedError report follows it) and the log's last lines."""
    found = [m.group(1) for m in map(_EXCEPTION_LINE.match, log.splitlines()) if m]
    # torchrun's own ChildFailedError only says that a worker failed: name the worker's exception
    first = next((e for e in found if "ChildFailedError" not in e), found[0] if found else "no exception line found")
    start = log.find("Traceback (most recent call last)")
    head = log[start:start + 3000] if start >= 0 else ""
    return (f"[speculators] exit {rc}: {first}\n--- first traceback ({log_path}) ---\n{head}\n"
            f"--- last lines ---\n{log[-1500:]}")


# ---------------------------------------------------------------------------------------------
# report


def _median_over_window(records: list[dict], key: str, s: BenchSettings) -> float | None:
    """Median of a per-step record value over the measured steps (ours: input_wait_ms; speculators':
    fetch_ms, the time its loop waited for the DataLoader)."""
    import statistics

    vals = [r[key] for r in records if s.skip_steps < r["step"] <= s.num_steps and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def window_stats(records: list[dict], key: str, s: BenchSettings) -> dict | None:
    """A per-step value over the measured steps: median, mean, p90, max and sum (ms), and the
    steps where it was over 1 ms (a step that waited for its input at all)."""
    import statistics

    vals = sorted(r[key] for r in records if s.skip_steps < r["step"] <= s.num_steps and r.get(key) is not None)
    if not vals:
        return None
    return {"median": statistics.median(vals), "mean": statistics.fmean(vals),
            "p90": vals[min(len(vals) - 1, int(0.9 * len(vals)))], "max": vals[-1], "sum": sum(vals),
            "steps": len(vals), "steps_over_1ms": sum(v > 1.0 for v in vals)}


DIRECT_READ_BYTES = 8 << 30
"""The O_DIRECT read probe reads at most this much of the shards (a long run's 40 GB would take ~25 s)."""


def data_vs_ring(s: BenchSettings, args, ext: dict, num_layers: int, hidden: int) -> dict:
    """Our shards' bytes against our trainer's prefetch ring (eagle3.train.data.pipeline: prefetch_depth
    packed batches of batch_bytes): a data set that fits in the ring is all read ahead during the
    first step's compile, and a measured step then never reads the disk."""
    import torch

    from eagle3.train.data.pipeline import batch_bytes, prefetch_depth
    from eagle3.train.config import DataConfig

    dcfg = DataConfig(micro_batch_tokens=s.micro_batch_tokens,
                      **({} if args.prefetch_batches is None else {"prefetch_batches": args.prefetch_batches}))
    one = batch_bytes(dcfg, num_layers, hidden, torch.bfloat16)
    depth = prefetch_depth(dcfg, num_layers, hidden, torch.bfloat16)
    return {"data_bytes": ext["bytes"], "ring_batches": depth, "ring_bytes": depth * one,
            "data_over_ring": ext["bytes"] / max(1, depth * one)}


# Planning figures (s) from a 1b run on one H200: Ray start, target build, extraction's engine start
# and its disk-bound GB/s, conversion s per GB, each trainer's set-up (Ray Train / torchrun,
# DeepSpeed or DDP, compile, checkpoint, export) and one step.
PLAN_S = {"ray": 11.0, "target": 25.0, "engine_start": 60.0, "extract_gb_s": 1.2, "convert_gb": 5.0,
          "ours_setup": 200.0, "theirs_setup": 160.0, "step": 0.1}


def planned_seconds(s: BenchSettings, args) -> float:
    """The run's wall time on one H200 by PLAN_S, for the 1b shape (other shapes: a rough bound);
    printed at the start so that a run too long for its machine can be cut before it starts."""
    gb = s.num_prompts * s.prompt_len * 16384 / 1e9 * (0.5 if args.hs_dtype == "float8_e4m3fn" else 1.0)
    spec_gb = s.num_prompts * s.prompt_len * 16384 / 1e9  # speculators' files: bf16 either way
    t = PLAN_S["ray"] + PLAN_S["target"] + PLAN_S["engine_start"] + gb / PLAN_S["extract_gb_s"]
    if not args.skip_ours:
        t += min(gb, DIRECT_READ_BYTES / 1e9) / 1.5
        t += args.repeats * (PLAN_S["ray"] + PLAN_S["ours_setup"] + s.num_steps * PLAN_S["step"])
    if not args.skip_speculators:
        t += spec_gb * PLAN_S["convert_gb"]
        t += args.repeats * (PLAN_S["theirs_setup"] + s.num_steps * PLAN_S["step"])
    return t


def check_disk_room(s: BenchSettings, args, work: Path) -> None:
    """Fail before extraction where the work dir's file system cannot hold the run's data (our
    shards unless --shards-dir puts them elsewhere, speculators' bf16 files unless skipped)."""
    per_token = sum(SHAPES_BYTES_PER_TOKEN.get(s.shape, (0, 0)))  # bf16 hidden states + token ids
    need = 0
    if not args.shards_dir:
        need += s.num_prompts * s.prompt_len * per_token * (0.5 if args.hs_dtype == "float8_e4m3fn" else 1.0)
    if not args.skip_speculators:
        need += s.num_prompts * s.prompt_len * per_token
    free = shutil.disk_usage(work).free
    if need > 0.95 * free:
        raise ValueError(f"this run writes ~{need / 1e9:.1f} GB under {work}, which has {free / 1e9:.1f} GB free: "
                         "fewer --num-steps, --hs-dtype float8_e4m3fn, --skip-speculators/--skip-ours (one trainer "
                         "a command), or --shards-dir on another file system (e.g. /dev/shm/...)")


SHAPES_BYTES_PER_TOKEN = {"tiny": (4 * 256 * 2, 16), "1b": (4 * 2048 * 2, 16), "8b": (4 * 4096 * 2, 16)}
"""(hidden-states bytes per token in bf16 (4 captured layers x hidden x 2), ids and mask bytes):
a planning bound, not the exact file size."""


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def markdown(res: dict) -> str:
    s, shape = res["settings"], res["shape"]
    meta = res["meta"]

    def row(name: str, r: dict) -> str:
        if "steady" not in r:
            why = r.get("skipped") or r.get("error", "no steady-state figure").splitlines()[0].replace("|", "/")
            return f"| {name} | - | - | - | - | - | {why} |"
        st = r["steady"]
        whole = f"{r['whole_run_tokens_per_s']:,.0f}" if r.get("whole_run_tokens_per_s") else "-"
        loss = " -> ".join("-" if v is None else f"{v:.3f}" for v in (st["loss_first"], st["loss_last"]))
        return (f"| {name} | **{st['tokens_per_s']:,.0f}** | {st['first_step_measured']}..{s['num_steps']} "
                f"({st['seconds_measured']:.2f} s) | {st['tokens_per_step']} | {whole} | {loss} | "
                f"{r.get('note', '')} |")

    ratio = res.get("ratio_ours_over_theirs")
    fmt = res.get("data_format") or {}
    order = res.get("order") or []
    rows, seen = [], {"ours": 0, "speculators": 0}
    names = {"ours": "ours: DeepSpeed ZeRO-2, Ray Train, 1 worker",
             "speculators": "speculators train: torchrun, DDP, 1 process"}
    for side in order:
        runs = res["ours_runs"] if side == "ours" else res["speculators_runs"]
        if seen[side] < len(runs):
            rows.append(row(f"{names[side]} (run {seen[side] + 1})", runs[seen[side]]))
        seen[side] += 1
    for side, key in (("ours", "ours_runs"), ("speculators", "speculators_runs")):
        if not seen[side]:  # skipped: its reason
            rows.append(row(names[side], (res.get(key) or [{}])[0]))
    ratio_line = ("Ratio ours / speculators: not measured (one trainer skipped or failed: see its rows)" if not ratio else
                  f"**Ratio ours / speculators: median {ratio['median']:.3f}x over {ratio['repeats']} repeat(s), "
                  f"range {ratio['min']:.3f}-{ratio['max']:.3f}x** (per repeat: "
                  + ", ".join(f"{x:.3f}" for x in ratio["per_repeat"]) + ")"
                  + ("" if ratio["same_tokens_per_step"] else "; tokens per step DIFFER between the trainers"))
    lines = [
        f"# Training throughput: ours vs speculators' trainer ({meta['date']})", "",
        f"Machine: {meta['machine']}", "",
        f"Versions: {json.dumps(meta['versions']['packages'])}; commit {meta['versions']['git_commit']}", "",
        f"Target: {s['shape']} Llama (hidden {shape['hidden_size']}, {shape['num_layers']} layers, vocab "
        f"{shape['vocab_size']}), seeded random bf16 weights; captured layers {shape['layer_ids']} (aux, then last). "
        f"Draft: {s['num_draft_layers']} layer, vocab {shape['draft_vocab_size']}, TTT {s['ttt_steps']}, "
        f"{s['loss']}, attention {s['draft_attn_impl']}, lr {s['lr']}.", "",
        f"Data: {s['num_prompts']} random-token prompts x {s['prompt_len']} tokens (hidden states by "
        f"{res['extract']['backend']}); {s['micro_batch_tokens']} tokens per step budget = {s['samples_per_step']} "
        f"samples = {s['samples_per_step'] * (s['prompt_len'] - 1)} tokens per optimizer step; {s['num_steps']} steps "
        f"a run, steady state over steps {s['skip_steps'] + 1}..{s['num_steps']}. Each run's data files were "
        f"{ {'cold': 'dropped from the page cache', 'warm': 'read into the page cache'}.get(res.get('page_cache'), 'left in the page cache as written')} "
        "before it started.", "",
        (f"Data format: ours reads {fmt['ours']}, speculators {fmt['speculators']} ("
         + ("the same dtype on both sides" if fmt["same_dtype"] else "NOT the same dtype: each on its own format")
         + ")." if fmt else ""), "",
        f"Run order: {', '.join(order)}." if order else "", "",
        "| trainer | tokens/s (steady state) | steps (time) | tokens/step | whole run tokens/s "
        "| loss first -> last | note |",
        "|---|---|---|---|---|---|---|",
        *rows, "",
        ratio_line, "",
        "Tokens/s: tokens of the measured steps / time between the step records ending step "
        f"{s['skip_steps']} and step {s['num_steps']} (LogRecord time stamps, both trainers).", "",
        (f"The disk under our shards reads {res['disk_read_gb_s']:.2f} GB/s sequentially with O_DIRECT."
         if res.get("disk_read_gb_s") else "Disk read bandwidth under our shards: not measured."), "",
        (f"Our shards: {res['data_vs_ring']['data_bytes'] / 1e9:.2f} GB = {res['data_vs_ring']['data_over_ring']:.1f}x "
         f"our prefetch ring ({res['data_vs_ring']['ring_batches']} batches, "
         f"{res['data_vs_ring']['ring_bytes'] / 1e9:.2f} GB)." if res.get("data_vs_ring") else ""), "",
        *[f"{who} input wait per measured step (ms): " + ", ".join(f"{k} {v:,.1f}" if isinstance(v, float) else
                                                                     f"{k} {v}" for k, v in st.items())
          for who, st in (("Ours (first run)", res["ours"].get("input_wait_ms_stats")),
                          ("Speculators' DataLoader fetch (first run)", res["speculators"].get("fetch_ms_stats")))
          if st],
        "Phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in res["phases_s"].items()), "",
    ]
    cmd = res["speculators"].get("command")
    if cmd:
        lines += ["speculators' command:", "", "    " + " ".join(cmd), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.train_bench",
                                 description="Training tokens/s: ours against speculators' trainer (see the module docstring)")
    ap.add_argument("--shape", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default: the shape's preset)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="token budget per step (preset)")
    ap.add_argument("--num-steps", type=int, default=None, help="optimizer steps per trainer (preset)")
    ap.add_argument("--skip-steps", type=int, default=None, help="leading steps excluded from the steady state")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each trainer, in ABBA order; the ratio is reported per repeat with its range")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-attn-impl", choices=("auto", "sdpa", "simple_flex_attention", "eager"), default="auto",
                    help="draft attention in both trainers; auto: our trainer's default for the step's token budget "
                         "(eagle3.train.config.resolve_draft_attn_impl: flex attention on a GPU up to 8,192 "
                         "tokens, sdpa above or without one)")
    ap.add_argument("--extract-backend", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--hs-dtype", choices=("bfloat16", "float8_e4m3fn"), default="bfloat16",
                    help="how our shards store hidden states; speculators' files hold them in bf16 either way "
                         "(fp8 shards are dequantised into them), so fp8 gives our trainer half the bytes to read")
    ap.add_argument("--prefetch-batches", type=int, default=None,
                    help="our trainer's train.data.prefetch_batches (default: DataConfig's); 0 = no prefetch")
    ap.add_argument("--profile-steps", type=int, nargs=2, default=None, metavar=("FIRST", "LAST"),
                    help="our trainer's train.profiling.profile_steps: torch.profiler over these steps; its top_ops.txt "
                         "(and trace.json.gz) go to --out. It slows the steps it records: not for a throughput run")
    ap.add_argument("--samples-per-shard", type=int, default=64)
    ap.add_argument("--page-cache", choices=("cold", "warm"), default="cold",
                    help="each trainer's data files before it starts: dropped from the page cache (cold: a data "
                         "set larger than memory, the usual case) or read into it once (warm)")
    ap.add_argument("--skip-ours", action="store_true",
                    help="run speculators' trainer only (a long run splits the trainers into commands of their own)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="before each trainer, also drop the whole page cache (sync; echo 3 > /proc/sys/vm/drop_caches, "
                         "root only; where refused, the result says so and the per-file drop stands)")
    ap.add_argument("--shards-dir", default=None,
                    help="where extraction writes our shards (default: WORK/hidden_states); with --skip-ours they "
                         "are removed once converted, e.g. /dev/shm/x to keep a large speculators' set alone on disk")
    ap.add_argument("--skip-speculators", action="store_true",
                    help="only validate speculators' command line (CPU: its trainer needs an accelerator)")
    ap.add_argument("--speculators-timeout", type=float, default=300.0,
                    help="seconds a speculators run may take")
    ap.add_argument("--work-dir", default=None, help="scratch (default: a new temp dir, removed at the end)")
    ap.add_argument("--keep-work", action="store_true")
    ap.add_argument("--cpu-kv-gib", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/training")
    ap.add_argument("--tag", default="")
    return ap.parse_args(argv)


def start_ray(step_log: Path) -> bool:
    """A local Ray cluster whose workers append our trainer's step records to `step_log`; returns
    whether it has a GPU."""
    import ray

    ray.init(runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                                   os.environ.get("PYTHONPATH")])),
                                       STEP_LOG_ENV: str(step_log)},
                          "worker_process_setup_hook": "benchmarks.train_bench.install_step_clock"},
             include_dashboard=True, log_to_driver=True)
    return ray.cluster_resources().get("GPU", 0) >= 1


def extract_hidden_states(s: BenchSettings, args, work: Path, target_dir: str, vocab: int) -> tuple[dict, list, list]:
    """Step 2: hidden states of the benchmark's random prompts with our extraction; returns
    (run_extract's summary, the prompts, their sample ids)."""
    import pyarrow.parquet as pq

    from benchmarks.common import random_prompts, tokens_table
    from benchmarks.common import STAGE_ONLY
    from eagle3.config import load_job_config
    from ray_jobs.extract import run_extract

    prompts = random_prompts(s.num_prompts, s.prompt_len, vocab, seed=s.seed)
    table = tokens_table(prompts)
    tokens_path = work / "tokens.parquet"
    pq.write_table(table, tokens_path)
    cfg = load_job_config(None, {
        **STAGE_ONLY, "output_dir": str(work), "prepare.max_length": s.prompt_len + 8, "extract.backend": args.extract_backend,
        "extract.samples_per_shard": args.samples_per_shard, "extract.num_replicas": 1, "extract.replicas_per_gpu": 1,
        "extract.hs_dtype": args.hs_dtype,
        "extract.max_num_batched_tokens": max(16384, s.prompt_len + 8), "extract.gpu_memory_utilization": 0.8,
        "extract.cpu_kvcache_space_gib": args.cpu_kv_gib})
    out = Path(args.shards_dir) if args.shards_dir else work / "hidden_states"
    ext = run_extract(cfg, str(tokens_path), target_dir, str(out), progress=False)
    if ext["num_rejected"] or ext["num_samples"] != s.num_prompts:
        raise RuntimeError(f"extraction kept {ext['num_samples']} of {s.num_prompts} prompts "
                           f"({ext['num_rejected']} rejected: see {out / 'rejects.jsonl'})")
    return ext, prompts, table.column("sample_id").to_pylist()


def prepare_speculators_data(s: BenchSettings, work: Path, target_dir: str, ext: dict, prompts: list,
                             sample_ids: list, draft_vocab: int, vocab: int,
                             convert: bool = True) -> tuple[dict, list[str]]:
    """Step 3: the same samples in speculators' layout, the draft vocabulary mapping both trainers
    use (eagle3.train.data.vocab.draft_vocab_mapping, as our trainer computes it), and speculators' flags.
    Returns (the result's "speculators_data" record, the flags). convert False (speculators' trainer
    not run): the flags only, no data written."""
    import numpy as np

    from benchmarks.speculators_data import convert_shards
    from eagle3.train.data.vocab import draft_vocab_mapping

    spec_data = work / "speculators_data"
    conv = convert_shards(ext["files"], spec_data, expected_input_ids=dict(zip(sample_ids, prompts, strict=True))) \
        if convert else {"num_samples": 0, "num_tokens": 0, "hidden_states_bytes": 0}
    d2t_path = t2d_path = None
    d2t, t2d = draft_vocab_mapping(ext["files"], draft_vocab, vocab)
    if d2t is not None:
        d2t_path, t2d_path = str(work / f"d2t-{draft_vocab}.npy"), str(work / f"t2d-{draft_vocab}.npy")
        np.save(d2t_path, d2t.cpu().numpy())
        np.save(t2d_path, t2d.cpu().numpy())
    record = {"dir": str(spec_data), "converted": convert, "num_samples": conv["num_samples"], "num_tokens": conv["num_tokens"],
              "bytes": conv["hidden_states_bytes"], "token_ids_checked": True, "vocab_mapping": d2t_path is not None}
    flags = speculators_flags(s, target_dir=target_dir, data_path=str(spec_data), save_path=str(work / "spec_ckpt"),
                              log_dir=str(work / "spec_logs"), aux_layer_ids=list(ext["layer_ids"])[:-1],
                              draft_vocab_size=draft_vocab, d2t_path=d2t_path, t2d_path=t2d_path)
    return record, flags


def run_ours(s: BenchSettings, args, work: Path, target_dir: str, files: list[str], draft_vocab: int, gpu: bool,
             step_log: Path, name: str = "ours") -> dict:
    """Step 4a: our trainer through Ray Train (actors.trainer.run_training), its steady state read
    from `step_log`. A failure is recorded in the returned dict ("failed"), not raised."""
    from actors.trainer import run_training
    from eagle3.train.config import (CheckpointConfig, DataConfig, DraftConfig, OptimizerConfig, ProfilingConfig,
                                     TrainConfig)

    tcfg = TrainConfig(
        num_workers=1, num_steps=s.num_steps, seed=s.seed,
        optimizer=OptimizerConfig(lr=s.lr, warmup_steps=s.warmup_steps, weight_decay=s.weight_decay, grad_clip=1.0),
        draft=DraftConfig(ttt_steps=s.ttt_steps, ttt_step_loss_decay=1.0, num_draft_layers=s.num_draft_layers,
                          draft_vocab_size=draft_vocab, loss=s.loss, draft_attn_impl=s.draft_attn_impl),
        data=DataConfig(micro_batch_tokens=s.micro_batch_tokens, shuffle_buffer_size=s.samples_per_step,
                        **({} if args.prefetch_batches is None else {"prefetch_batches": args.prefetch_batches})),
        checkpoint=CheckpointConfig(checkpoint_every=s.num_steps, num_checkpoints_to_keep=1),
        profiling=ProfilingConfig(profile_steps=args.profile_steps))
    ours: dict = {"train_config": asdict(tcfg), "use_gpu": gpu}
    try:
        summary = run_training(tcfg, files, target_dir, str(work / name), use_gpu=gpu)
    except Exception as e:  # noqa: BLE001 - recorded and reported; speculators' run still gives its figure
        ours["error"] = f"[ours] run_training failed: {type(e).__name__}: {e}"[:4000]
        ours["failed"] = True
        logger.exception("our trainer failed; going on with speculators' so that this run still measures it")
        return ours
    ours.update({"whole_run_tokens_per_s": summary["tokens_per_s"], "train_seconds": summary["train_seconds"],
                 "steps": summary["steps"]})
    try:
        records = read_step_log(step_log)
        ours["steady"] = steady_state(records, s.skip_steps, s.num_steps)
        ours["input_wait_ms_steady"] = _median_over_window(records, "input_wait_ms", s)
        ours["input_wait_ms_stats"] = window_stats(records, "input_wait_ms", s)
        ours["note"] = (f"steps 2..{s.skip_steps} took {ours['steady']['seconds_skipped_steps']} s; waited for "
                        f"its batches a median {_ms(ours['input_wait_ms_steady'])} a measured step")
    except ValueError as e:
        ours["error"] = (f"no steady-state figure from {step_log}: {e}. The clock reads actors.trainer's "
                         f"'{OUR_STEP_FORMAT}' records through a Ray worker_process_setup_hook; only the "
                         "whole-run figure (first steps included) is reported")
        logger.warning(ours["error"])
    return ours


def run_theirs(s: BenchSettings, args, work: Path, flags: list[str], gpu: bool, phases: dict,
               name: str = "speculators") -> dict:
    """Step 4b: speculators' trainer under torchrun (or only its command line, with
    --skip-speculators); its steady state and its own step profile over the same steps."""
    theirs: dict = {"command": None}
    if args.skip_speculators:
        theirs["skipped"] = ("--skip-speculators: command line validated only" +
                             ("" if gpu else f"; {SPECULATORS_NEEDS_ACCELERATOR}"))
        theirs["command"] = speculators_command(work / "speculators_steps.jsonl", flags)
        return theirs
    if gpu:
        wait_gpu_released("speculators' training")
    spec_files = sorted(str(p) for p in (work / "speculators_data").rglob("*") if p.is_file())
    from benchmarks.common import direct_read_gb_s

    # the disk under its files, O_DIRECT (page cache untouched), over the first DIRECT_READ_BYTES
    theirs["disk_read_gb_s"] = direct_read_gb_s(spec_files, max_bytes=DIRECT_READ_BYTES)
    set_page_cache(spec_files, args.page_cache)
    if args.drop_caches:
        from benchmarks.common import drop_all_caches

        theirs["drop_caches"] = drop_all_caches()
    shutil.rmtree(work / "spec_ckpt", ignore_errors=True)  # each run starts without the last one's checkpoints
    t = time.perf_counter()
    run = run_speculators(flags, work, args.speculators_timeout, name)
    phases[f"{name}_wall"] = time.perf_counter() - t
    theirs.update({k: v for k, v in run.items() if k != "records"})
    records = run["records"]
    try:
        theirs["steady"] = steady_state(records, s.skip_steps, s.num_steps)
        # cross-check: speculators' own step profile over the same steps
        window = [r for r in records if s.skip_steps < r["step"] <= s.num_steps]
        theirs["profile_tokens_per_s"] = (sum(r["tokens"] for r in window) /
                                          (sum(r["step_ms"] for r in window) / 1000.0))
        theirs["fetch_ms_steady"] = _median_over_window(records, "fetch_ms", s)
        theirs["fetch_ms_stats"] = window_stats(records, "fetch_ms", s)
        theirs["note"] = (f"steps 2..{s.skip_steps} took {theirs['steady']['seconds_skipped_steps']} s; its own "
                          f"profile (tokens / sum of step_ms): {theirs['profile_tokens_per_s']:,.0f} tok/s; "
                          f"fetch_ms median {_ms(theirs['fetch_ms_steady'])} a measured step")
    except ValueError as e:
        theirs.setdefault("error", f"no steady-state figure: {e}")
    if "error" in theirs:
        logger.warning("speculators' trainer: %s", theirs["error"])
    return theirs


def run_order(repeats: int, *, ours: bool, theirs: bool) -> list[str]:
    """The trainers' runs in ABBA order (ours, speculators, speculators, ours, ...): over two
    repeats each trainer goes first once and last once. One trainer alone: it, `repeats` times."""
    if repeats < 1:
        raise ValueError(f"--repeats={repeats}: must be >= 1")
    if not (ours and theirs):
        return (["ours"] if ours else ["speculators"] if theirs else []) * repeats
    return [x for i in range(repeats) for x in (("ours", "speculators") if i % 2 == 0 else ("speculators", "ours"))]


def ratio_over_repeats(ours: list[dict], theirs: list[dict]) -> dict | None:
    """Ours over theirs, repeat by repeat (the i-th run of each, neighbours in the ABBA order): each
    repeat's ratio of steady-state tokens/s, their median, min and max; None without a pair."""
    import statistics

    pairs = [(o["steady"], t["steady"]) for o, t in zip(ours, theirs) if "steady" in o and "steady" in t]
    if not pairs:
        return None
    ratios = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in pairs]
    return {"per_repeat": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "repeats": len(ratios),
            "same_tokens_per_step": all(o["tokens_per_step"] == t["tokens_per_step"] for o, t in pairs)}


def data_format(args) -> dict:
    """What each trainer reads: its own on-disk layout, and whether both hold the same dtype."""
    return {"ours": f"Arrow IPC shards, {args.hs_dtype}", "speculators": "safetensors per sample, bfloat16",
            "same_dtype": args.hs_dtype == "bfloat16"}


def write_results(res: dict, args, work: Path) -> str:
    """Step 5: <out>/train[-TAG].json and .md, with every run's step log, speculators' logs and the
    profile (top ops, gzipped trace and its GPU gaps) beside them; returns the markdown."""
    from benchmarks.common import write_result

    md = markdown(res)
    path = write_result(args.out, "train", args.tag, res, md)
    out, name = path.parent, path.stem
    logs = sorted(work.glob("ours-*_steps.jsonl")) + sorted(work.glob("speculators-*"))
    for src in [*logs, work / "ours-0" / "profile" / "top_ops.txt"]:
        if src.is_file():  # the work dir goes away; these explain a surprising figure or a failure
            shutil.copy(src, out / f"{name}-{src.name}")
    trace = work / "ours-0" / "profile" / "trace.json"
    if trace.exists():
        with open(trace, "rb") as f, gzip.open(out / f"{name}-ours_trace.json.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        from benchmarks import trace_gaps

        (out / f"{name}-gaps.md").write_text(trace_gaps.markdown(trace_gaps.gaps(trace_gaps.load(trace)), 5.0))
    return md


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    s = resolve_settings(args)
    plan_s = planned_seconds(s, args)
    print(f"train_bench: planned wall time {plan_s / 60:.1f} min on one H200-class GPU (planned_seconds)",
          flush=True)
    import ray

    from benchmarks.common import direct_read_gb_s, drop_all_caches, result_meta
    from benchmarks.shapes import SHAPES
    from eagle3.train.config import resolve_draft_vocab_size

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="eagle3-train-bench-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    hidden, num_layers, _, _, _, vocab = SHAPES[s.shape]
    draft_vocab = resolve_draft_vocab_size(None, vocab)  # as our trainer resolves it
    phases: dict[str, float] = {}
    res: dict = {"meta": result_meta(args, work_dir=str(work)),
                 "settings": {**asdict(s), "num_prompts": s.num_prompts, "tokens_per_step": s.tokens_per_step,
                              "train_data_ratio": s.train_data_ratio},
                 "shape": {"name": s.shape, "hidden_size": hidden, "num_layers": num_layers, "vocab_size": vocab,
                           "draft_vocab_size": draft_vocab}}

    t = time.perf_counter()
    gpu = start_ray(work / "setup_steps.jsonl")
    phases["ray_init"] = time.perf_counter() - t
    if s.draft_attn_impl == "auto":  # the trainer's own default for this token budget, given to both trainers
        from eagle3.train.config import resolve_draft_attn_impl

        s = replace(s, draft_attn_impl=resolve_draft_attn_impl(None, s.micro_batch_tokens, gpu))
    res["settings"]["draft_attn_impl"] = s.draft_attn_impl

    # 1. target
    t = time.perf_counter()
    target_dir = str(work / "target")
    build = ray.remote(num_gpus=1 if gpu else 0, num_cpus=1)(random_llama)
    res["target"] = {"dir": target_dir, **ray.get(build.remote(s.shape, target_dir, s.seed))}
    phases["build_target"] = time.perf_counter() - t

    # 2. hidden states with our extraction
    check_disk_room(s, args, work)
    t = time.perf_counter()
    ext, prompts, sample_ids = extract_hidden_states(s, args, work, target_dir, vocab)
    res["shape"]["layer_ids"] = list(ext["layer_ids"])
    res["extract"] = {"backend": args.extract_backend, "hs_dtype": args.hs_dtype, "num_samples": ext["num_samples"],
                      "num_tokens": ext["num_tokens"], "bytes": ext["bytes"], "num_shards": len(ext["files"]),
                      "seconds": ext["seconds"]}
    phases["extract"] = time.perf_counter() - t
    ray.shutdown()  # each run of ours starts a cluster of its own, with its own step log

    # 3. the same samples in speculators' layout
    t = time.perf_counter()
    res["speculators_data"], flags = prepare_speculators_data(s, work, target_dir, ext, prompts, sample_ids,
                                                              draft_vocab, vocab, convert=not args.skip_speculators)
    res["speculators_flags_check"] = check_speculators_flags(flags, s)
    phases["convert"] = time.perf_counter() - t
    if args.skip_ours and args.shards_dir:  # converted: free their room (memory, under /dev/shm)
        shutil.rmtree(args.shards_dir, ignore_errors=True)
    res["data_format"] = data_format(args)

    # 4. both trainers, --repeats times each, ABBA order
    res["page_cache"] = args.page_cache
    res["data_vs_ring"] = data_vs_ring(s, args, ext, len(res["shape"]["layer_ids"]), hidden)
    runs: dict[str, list[dict]] = {"ours": [], "speculators": []}
    res["order"] = run_order(args.repeats, ours=not args.skip_ours, theirs=not args.skip_speculators)
    for side in res["order"]:
        i = len(runs[side])
        if side == "speculators":
            runs[side].append(run_theirs(s, args, work, flags, gpu, phases, name=f"speculators-{i}"))
            continue
        if gpu:
            wait_gpu_released("our training")
        # O_DIRECT (leaves the page cache as it is), over the first DIRECT_READ_BYTES of the shards
        res.setdefault("disk_read_gb_s", direct_read_gb_s(ext["files"], max_bytes=DIRECT_READ_BYTES))
        set_page_cache(ext["files"], args.page_cache)
        run: dict = {}
        if args.drop_caches:
            run["drop_caches"] = drop_all_caches()
        step_log = work / f"ours-{i}_steps.jsonl"
        step_log.unlink(missing_ok=True)
        start_ray(step_log)
        t = time.perf_counter()
        run.update(run_ours(s, args, work, target_dir, ext["files"], draft_vocab, gpu, step_log, name=f"ours-{i}"))
        phases[f"ours-{i}_wall"] = time.perf_counter() - t
        ray.shutdown()
        runs[side].append(run)
    if args.skip_speculators:  # its command line, validated only
        runs["speculators"].append(run_theirs(s, args, work, flags, gpu, phases))
    res["ours_runs"] = runs["ours"] or [{"skipped": "--skip-ours"}]
    res["speculators_runs"] = runs["speculators"]
    res["ours"], res["speculators"] = res["ours_runs"][0], res["speculators_runs"][0]  # the first runs' details
    res["ratio_ours_over_theirs"] = ratio_over_repeats(runs["ours"], runs["speculators"])
    res["phases_s"] = phases

    md = write_results(res, args, work)
    print(md, flush=True)
    if not args.keep_work and not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r.get("failed") for r in runs["ours"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())

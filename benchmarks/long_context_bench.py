"""Long context: extraction and training of samples of 8K-32K tokens and longer at
the 8B shape on one GPU, in two parts, each one command:

    python -m benchmarks.long_context_bench --part extract --out DIR --tag h200-8b
    python -m benchmarks.long_context_bench --part train --out DIR --tag h200-8b

and on this CPU, the same code paths at the tiny shape (`--cpu-smoke`: lengths 256-2048).

Part `extract`, per length L of --lengths (8192, 16384, 32768 by default), random-token prompts
of exactly L tokens, --tokens-per-length tokens in all (so ~equal work per length):
  (1) plain vLLM prefill: extract_bench.PlainPrefill (the extraction engine's settings from
      compat.vllm_engine.extraction_engine_kwargs, without the hidden-states method); one engine
      for all lengths (max_model_len: the longest, + 8)
  (3) our extraction into Arrow shards on local disk: extract_bench.disk_extract, the product's
      run_extract loop, one engine per length (engine start excluded), with the same
      max_num_batched_tokens as (1); shard bytes per sample from the manifest
and the ratio (3)/(1) per length. Both sides run --passes passes over a length's prompts in one
engine life and are timed over passes 2..P (extract_bench.window_tok_s): the same start-up rule.

Part `train`: our trainer (eagle3.train.trainer.Eagle3Trainer on eagle3.train.deepspeed_backend, the code
every Ray Train worker runs, actors.trainer.train_loop_per_worker, without Ray Train around it)
at each length of --train-lengths in turn, one sample of L tokens per optimizer step
(micro_batch_tokens = L), each length in its own subprocess: a torch.cuda.OutOfMemoryError (or
a crash) there ends that length only and is recorded with its message (what it tried to
allocate). Lengths are tried shortest first and stop at the first failure, or when the next
length's predicted wall time (the last one's, scaled by the length ratio squared: attention)
would go past --budget-s. Recorded per length: peak GPU memory (allocated and reserved, torch's
counters, reset after the DeepSpeed engine is built, so model + optimizer state are in it),
steady-state tokens/s (common.steady_state over the steps after --skip-steps), input wait.
The training data are synthetic: random bf16 hidden states of the shape extraction writes, in
shard files written with the product's writer (eagle3.extract.shards.write_shard_file), --train-samples
samples per length, read again each epoch. Values do not change a step's memory or time; the
data's disk path at long context is part `extract`'s. The target is the 8B shape's config with
only the tensors the trainer reads from a target (embed_tokens, lm_head, final norm), random.
speculators' trainer is not run here (benchmarks/train_bench.py compares the two at 1K tokens).

Each part prints its planned wall time (planned_seconds) before it starts; the defaults keep
each under ~10 minutes on one H200. Writes
<out>/long-context-<part>[-TAG].json and .md (benchmarks.common.write_result).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

logger = logging.getLogger("eagle3.long_context_bench")

PARTS = ("extract", "train")
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Plan:
    shape: str
    lengths: tuple[int, ...]
    """Part extract: sample lengths (tokens), each measured."""
    tokens_per_length: int
    """Part extract: tokens per length (num prompts = this // L, at least 1)."""
    train_lengths: tuple[int, ...]
    """Part train: lengths tried in turn, shortest first, up to the first that fails."""
    train_steps: int
    skip_steps: int
    train_samples: int
    """Distinct synthetic samples per length (the trainer reads them epoch after epoch)."""
    budget_s: float
    """Part train: stop before a length whose predicted wall time would end past this."""
    engine_start_s: float
    """Planning: one engine's start (dummy weights) at this shape."""
    prefill_tok_s: float
    """Planning: plain prefill tokens/s at 1K tokens at this shape."""
    train_start_s: float
    """Planning: one training subprocess's set-up (imports, data, DeepSpeed, first step's compile)."""
    train_tok_s: float
    """Planning: the draft's training tokens/s at 8K tokens at this shape."""


PLANS = {
    # Planning figures from H200 runs (engine start, plain prefill at 1K, training set-up); the
    # draft's tokens/s at the 8B shape is an assumption, scaled down from the 1B shape's.
    "h200": Plan(shape="8b", lengths=(8192, 16384, 32768), tokens_per_length=262144,
                 train_lengths=(8192, 16384, 32768, 49152, 65536, 98304, 131072), train_steps=8, skip_steps=3,
                 train_samples=2, budget_s=480.0, engine_start_s=60.0, prefill_tok_s=42800.0, train_start_s=60.0,
                 train_tok_s=40000.0),
    # 2-core CPU smoke: the same code paths at the tiny shape
    "cpu-smoke": Plan(shape="tiny", lengths=(256, 512, 1024), tokens_per_length=4096,
                      train_lengths=(256, 512, 1024, 2048), train_steps=4, skip_steps=1, train_samples=2,
                      budget_s=300.0, engine_start_s=25.0, prefill_tok_s=8000.0, train_start_s=25.0,
                      train_tok_s=4000.0),
}


def attention_factor(length: int) -> float:
    """Planning: a length's cost per token relative to 8K tokens (attention grows with the
    length; at 8K it is ~1/3 of an 8B layer's prefill FLOPs)."""
    return (2.0 + length / 8192) / 3.0


def predicted_train_s(plan: Plan, length: int) -> float:
    return plan.train_start_s + plan.train_steps * length * attention_factor(length) / plan.train_tok_s


def planned_seconds(plan: Plan, part: str, passes: int = 2) -> float:
    """Planned wall time of a part (Ray start, engine starts, prefill, shard writes, training
    subprocesses); the train part is bounded by plan.budget_s besides."""
    if part == "extract":
        work = sum(plan.tokens_per_length * attention_factor(n) / plan.prefill_tok_s for n in plan.lengths)
        # (1): one engine; (3): one per length, writer warm-up included in its start
        return 15.0 + plan.engine_start_s * (1 + len(plan.lengths)) + 2 * passes * work + 10.0 * len(plan.lengths)
    if part == "train":
        return 20.0 + min(plan.budget_s, sum(predicted_train_s(plan, n) for n in plan.train_lengths))
    raise ValueError(f"part={part!r}: one of {PARTS}")


def next_length(tried: list[dict], lengths: tuple[int, ...], elapsed_s: float, budget_s: float) -> tuple[int | None, str]:
    """The next length to train, or None and why not: stop at the first failure (a longer sample
    fails too), and before a length whose predicted wall time would end past budget_s. The
    prediction: the last length's set-up (wall_s - fit_s: imports, data, DeepSpeed, compile; the
    first one also builds FusedAdam) again, plus its training time fit_s times the length ratio
    squared (an upper bound: attention's share grows with the length); without fit_s, the whole
    wall times the ratio squared. `tried`: the results so far in order, each {"length", "ok",
    "wall_s", optionally "fit_s"}."""
    if tried and not tried[-1]["ok"]:
        return None, f"stopped: {tried[-1]['length']} tokens failed"
    left = [n for n in lengths if n not in {t["length"] for t in tried}]
    if not left:
        return None, "all lengths tried"
    n = left[0]
    if tried:
        last = tried[-1]
        fit = last.get("fit_s") or last["wall_s"]
        predicted = last["wall_s"] - fit + fit * (n / last["length"]) ** 2
        if elapsed_s + predicted > budget_s:
            return None, (f"stopped before {n} tokens: predicted {predicted:.0f} s (the {last['length']}-token run's "
                          f"set-up {last['wall_s'] - fit:.0f} s + its training {fit:.0f} s x "
                          f"{n / last['length']:.2f}^2) would end at {elapsed_s + predicted:.0f} s, past --budget-s "
                          f"{budget_s:.0f}")
    return n, ""


# ---------------------------------------------------------------------------------------------
# part extract


def part_extract(plan: Plan, args, work: Path, gpu: bool) -> dict:
    import pyarrow.parquet as pq
    import ray

    from benchmarks.common import random_prompts, tokens_table
    from benchmarks.extract_bench import PlainPrefill, disk_extract, window_tok_s
    from benchmarks.shapes import SHAPES, write_shape
    from eagle3.config import ExtractConfig

    longest = max(plan.lengths)
    model_dir = write_shape(plan.shape, work / "model", max_positions=longest + 16)
    vocab = SHAPES[plan.shape][5]
    max_len = longest + 8
    batched = max(16384, max_len + 1)  # chunked prefill off: a step holds the longest prompt and its one output token
    ecfg = ExtractConfig(load_format="dummy", max_num_batched_tokens=batched, gpu_memory_utilization=0.8,
                         cpu_kvcache_space_gib=args.cpu_kv_gib)
    prompts = {n: random_prompts(max(1, plan.tokens_per_length // n), n, vocab, seed=i)
               for i, n in enumerate(plan.lengths)}
    rows: dict[int, dict] = {n: {"length": n, "num_prompts": len(p), "tokens": n * len(p)}
                             for n, p in prompts.items()}

    t = time.perf_counter()
    actor = ray.remote(num_gpus=1 if gpu else 0, num_cpus=1)(PlainPrefill).remote(model_dir, ecfg, max_len)
    for n, p in prompts.items():
        rows[n]["plain_prefill_pass_seconds"] = secs = ray.get(actor.run_passes.remote(p, args.passes))
        rows[n]["plain_prefill_tok_s"] = window_tok_s(rows[n]["tokens"], secs)
        logger.info("plain prefill, %d tokens: %.0f tok/s", n, rows[n]["plain_prefill_tok_s"])
    ray.get(actor.close.remote())  # the engine first, then its actor (extract_bench's order)
    ray.kill(actor)
    phases = {"plain_prefill": time.perf_counter() - t}

    t = time.perf_counter()
    for n, p in prompts.items():
        tpath = work / f"tokens-{n}.parquet"
        pq.write_table(tokens_table(p * args.passes), tpath)  # the same passes as (1): the prompts P times over
        d = disk_extract(model_dir, tpath, Path(args.disk_dir) / f"long-context-{n}", work, max_len=n + 8,
                         hs_dtype=args.hs_dtype, samples_per_shard=args.samples_per_shard, batched=batched,
                         cpu_kv_gib=args.cpu_kv_gib, block_size=None, rows_per_pass=len(p))
        if d["num_rejected"] or d["num_samples"] != len(p) * args.passes:
            raise RuntimeError(f"{n} tokens: extraction kept {d['num_samples']} of {len(p) * args.passes} samples "
                               f"({d['num_rejected']} rejected)")
        rows[n].update({f"arrow_disk_{k}": v for k, v in d.items() if k != "tok_s"})
        rows[n]["arrow_disk_tok_s"] = window_tok_s(rows[n]["tokens"], d["pass_seconds"])
        rows[n]["shard_bytes_per_sample"] = d["bytes"] / d["num_samples"]
        rows[n]["arrow_disk_ratio"] = rows[n]["arrow_disk_tok_s"] / rows[n]["plain_prefill_tok_s"]
        logger.info("ours to disk, %d tokens: %.0f tok/s (%.3fx), %.0f MB per sample", n, d["tok_s"],
                    rows[n]["arrow_disk_ratio"], rows[n]["shard_bytes_per_sample"] / 1e6)
    phases["arrow_disk"] = time.perf_counter() - t
    return {"rows": [rows[n] for n in plan.lengths], "max_num_batched_tokens": batched, "max_model_len": max_len,
            "hs_dtype": args.hs_dtype, "passes": args.passes, "phases_s": phases}


def markdown_extract(res: dict) -> str:
    p, e = res["plan"], res["extract"]
    lines = [f"# Long context: extraction at the {p['shape']} shape ({res['meta']['date']})", "",
             f"Machine: {res['meta']['machine']}", "",
             f"Versions: {json.dumps(res['meta']['versions']['packages'])}; commit "
             f"{res['meta']['versions']['git_commit']}", "",
             f"Dummy weights, random-token prompts of exactly L tokens, ~{p['tokens_per_length']:,} tokens per length; "
             f"max_num_batched_tokens {e['max_num_batched_tokens']} for both (chunked prefill off); ours writes "
             f"{e['hs_dtype']} Arrow shards to local disk. Both sides: {e.get('passes', 1)} passes over the prompts "
             "in one engine life, tokens/s over passes 2..P (pass 1's first-call work left out alike).", "",
             "| L (tokens) | prompts | (1) plain prefill tok/s | (3) ours → disk tok/s | (3)/(1) "
             "| shard bytes per sample | bytes per token | write GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in e["rows"]:
        lines.append(f"| {r['length']:,} | {r['num_prompts']} | {r['plain_prefill_tok_s']:,.0f} | "
                     f"{r['arrow_disk_tok_s']:,.0f} | **{r['arrow_disk_ratio']:.3f}x** | "
                     f"{r['shard_bytes_per_sample'] / 1e6:,.1f} MB | "
                     f"{r['arrow_disk_bytes_per_token']:,.0f} | {r['arrow_disk_write_gb_s']:.2f} |")
    lines += ["", "Phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in e["phases_s"].items()), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# part train


def write_heads_target(shape: str, out_dir: Path, max_positions: int, seed: int = 0) -> str:
    """The shape's config.json and a model.safetensors holding only what the trainer reads from a
    target (compat.speculators_verifier: embed_tokens, lm_head, the final norm), random bf16."""
    import torch
    from safetensors.torch import save_file

    from benchmarks.shapes import SHAPES, write_shape

    hidden, _, _, _, _, vocab = SHAPES[shape]
    write_shape(shape, out_dir, max_positions=max_positions)
    g = torch.Generator().manual_seed(seed)
    save_file({"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16),
               "lm_head.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}, str(out_dir / "model.safetensors"))
    return str(out_dir)


def write_synthetic_shards(out_dir: Path, *, length: int, num_samples: int, layer_ids: list[int], hidden: int,
                           vocab: int, seed: int = 0) -> list[str]:
    """`num_samples` samples of `length` tokens in the extract stage's schema (bf16 hidden states,
    one Arrow IPC shard per sample, written by eagle3.extract.shards.write_shard_file). The hidden states
    repeat one random block of 256 tokens (values do not change a training step's time or memory)."""
    import numpy as np
    import pyarrow as pa
    import torch

    from benchmarks.common import random_prompts
    from eagle3.extract.codec import encode_hidden_states, hidden_states_columns
    from eagle3.schema import hidden_states_schema
    from eagle3.extract.shards import write_shard_file

    out_dir.mkdir(parents=True, exist_ok=True)
    schema = hidden_states_schema(layer_ids=layer_ids, hidden_size=hidden, hs_dtype="bfloat16")
    g = torch.Generator().manual_seed(seed)
    block = torch.randn(256, len(layer_ids), hidden, generator=g).to(torch.bfloat16)
    hs = block.repeat((length + 255) // 256, 1, 1)[:length]
    values, _ = encode_hidden_states(hs, "bfloat16")
    files = []
    for i, ids in enumerate(random_prompts(num_samples, length, vocab, seed=seed)):
        hs_col, scale_col = hidden_states_columns([values], [None], "bfloat16")
        table = pa.Table.from_arrays(
            [pa.array([f"L{length}-{i:04d}"]), pa.array([ids], type=schema.field("input_ids").type),
             pa.array([np.ones(length, dtype=np.int32).tolist()], type=schema.field("loss_mask").type),
             pa.array([length], type=schema.field("num_tokens").type), hs_col, scale_col], schema=schema)
        path = out_dir / f"shard-{i:06d}.arrow"
        write_shard_file(table, path)
        files.append(str(path))
    return files


def train_one(args) -> dict:
    """One length, in this (sub)process: synthetic shards, our trainer for plan.train_steps steps.
    Returns the length's record; a torch.cuda.OutOfMemoryError is recorded ("oom"), not raised."""
    import torch

    from benchmarks.shapes import SHAPES
    from benchmarks.common import steady_state
    from eagle3.train import deepspeed_backend
    from eagle3.config import ExtractConfig
    from eagle3.train.config import (CheckpointConfig, DataConfig, DraftConfig, OptimizerConfig, TrainConfig,
                                     resolve_draft_attn_impl)
    from eagle3.train.trainer import Eagle3Trainer

    plan, n = resolve_plan(args), args.train_one
    if not torch.cuda.is_available():  # as actors.trainer.run_training sets it for a CPU worker
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    hidden, num_layers, _, _, _, vocab = SHAPES[plan.shape]
    layer_ids = ExtractConfig().layer_ids(num_layers)
    gpu = torch.cuda.is_available()
    rec: dict = {"length": n, "ok": False, "gpu": gpu}
    t0 = time.perf_counter()
    trail = progress_path(args.result)
    import faulthandler

    # A crash (a long sample can die of SIGSEGV before its first step ends): every thread's
    # Python stack at the signal, in a file of its own, read back by part_train into the record.
    crash = open(crash_path(args.result), "w")  # noqa: SIM115 - open for the process's life
    faulthandler.enable(file=crash, all_threads=True)
    if args.stack_every:  # where a length runs long: every thread's stack, every N s, beside the trail
        stacks = open(f"{args.result}.stacks.txt", "w")  # noqa: SIM115 - open for the process's life
        faulthandler.dump_traceback_later(args.stack_every, repeat=True, file=stacks)

    def reached(phase: str, **extra) -> None:  # read by part_train if this process is cut off
        with open(trail, "a") as f:
            f.write(json.dumps({"phase": phase, "s": round(time.perf_counter() - t0, 2), **extra}) + "\n")

    files = write_synthetic_shards(Path(args.work_dir) / f"shards-{n}", length=n, num_samples=plan.train_samples,
                                   layer_ids=layer_ids, hidden=hidden, vocab=vocab)
    rec["data_s"] = time.perf_counter() - t0
    reached("data written")
    cfg = TrainConfig(num_workers=1, num_steps=plan.train_steps, seed=0,
                      optimizer=OptimizerConfig(lr=3e-4, warmup_steps=1, weight_decay=0.01, grad_clip=1.0),
                      draft=DraftConfig(ttt_steps=3, ttt_step_loss_decay=1.0, num_draft_layers=1, loss="kl_div",
                                        draft_attn_impl=resolve_draft_attn_impl(
                                            None if args.draft_attn_impl == "auto" else args.draft_attn_impl, n, gpu)),
                      data=DataConfig(micro_batch_tokens=n, shuffle_buffer_size=1),
                      checkpoint=CheckpointConfig(checkpoint_every=plan.train_steps, num_checkpoints_to_keep=1))
    rec["train_config"] = asdict(cfg)
    records: list[dict] = []

    def on_step(m: dict) -> None:
        records.append({"t": time.time(), "step": m["step"], "tokens": m["tokens"], "loss": m["loss"],
                        "input_wait_ms": m["input_wait_s"] * 1e3})
        reached("step", step=m["step"])

    try:
        trainer = Eagle3Trainer(cfg, args.target_dir, files)
        trainer.attach_engine(deepspeed_backend.initialize(trainer.model, cfg, 1, use_gpu=gpu))
        if gpu:
            torch.cuda.synchronize()
            rec["engine_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        reached("engine built")
        t_fit = time.perf_counter()
        try:
            trainer.fit(on_step=on_step)
        finally:
            rec["fit_s"] = time.perf_counter() - t_fit
        rec["ok"] = True
    except Exception as e:  # noqa: BLE001 - recorded; the parent goes on with its report
        # torch.compile (flex attention, the draft's forward) can wrap the OOM in its own error
        rec["oom"] = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
    import resource

    rec["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    if gpu:
        rec["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        rec["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        rec["device_total_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    rec["steps_done"] = len(records)
    rec["step_records"] = records
    if rec["ok"]:
        try:
            rec["steady"] = steady_state(records, plan.skip_steps, plan.train_steps)
            waits = [r["input_wait_ms"] for r in records[plan.skip_steps:]]
            rec["input_wait_ms_max"] = max(waits)
        except ValueError as e:
            rec["ok"], rec["error"] = False, f"no steady-state figure: {e}"
    shutil.rmtree(Path(args.work_dir) / f"shards-{n}", ignore_errors=True)
    return rec


def crash_path(result) -> Path:
    """Where a length's process writes every thread's stack if it dies of a signal (faulthandler)."""
    return Path(f"{result}.crash.txt")


def progress_path(result) -> Path:
    """Where a length's process appends what it has reached (phase, seconds since it started)."""
    return Path(f"{result}.progress.jsonl")


def last_reached(trail: Path) -> str:
    """What a cut-off length's process had reached, in words, from its progress trail."""
    events = [json.loads(line) for line in trail.read_text().splitlines() if line.strip()] if trail.exists() else []
    if not events:
        return "before writing its data"
    last = events[-1]
    steps = [e for e in events if e["phase"] == "step"]
    if steps:
        return f"after step {steps[-1]['step']} at {steps[-1]['s']:.0f} s (step 1 ended at {steps[0]['s']:.0f} s)"
    return f"after '{last['phase']}' at {last['s']:.0f} s, before its first step ended"


def part_train(plan: Plan, args, work: Path) -> dict:
    from benchmarks.shapes import SHAPES

    longest = max(plan.train_lengths)
    t = time.perf_counter()
    target = write_heads_target(plan.shape, work / "target", max_positions=longest + 16)
    phases = {"target": time.perf_counter() - t}
    tried: list[dict] = []
    t_start = time.perf_counter()
    while True:
        n, why = next_length(tried, plan.train_lengths, time.perf_counter() - t_start, plan.budget_s)
        if n is None:
            break
        result = work / f"train-{n}.json"
        cmd = [sys.executable, "-m", "benchmarks.long_context_bench", "--plan", args.plan, "--train-one", str(n),
               "--target-dir", target, "--work-dir", str(work), "--result", str(result)]
        if args.stack_every:
            cmd += ["--stack-every", str(args.stack_every)]
        cmd += ["--draft-attn-impl", args.draft_attn_impl]
        logger.info("training at %d tokens: %s", n, " ".join(cmd))
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=str(REPO_ROOT), capture_output=True, text=True,
                                  timeout=max(60.0, plan.budget_s - (t - t_start)))
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = "timeout", str(e)[-3000:]
        wall = time.perf_counter() - t
        rec = json.loads(result.read_text()) if result.exists() else {
            "length": n, "ok": False, "error": f"the subprocess ended (exit {rc}) without a result, "
                                               f"{last_reached(progress_path(result))}; its last output:\n{tail}"}
        rec.update({"wall_s": wall, "rc": rc})
        crashed = crash_path(result)
        if crashed.exists() and crashed.stat().st_size:  # the stacks at the fatal signal, crashing thread first
            rec["crash_stacks"] = crashed.read_text()[:6000]
        if not rec["ok"]:
            rec["log_tail"] = tail
        tried.append(rec)
        logger.info("%d tokens: %s in %.0f s", n, "ok" if rec["ok"] else rec.get("error", "failed")[:200], wall)
    phases["train"] = time.perf_counter() - t_start
    ok = [r["length"] for r in tried if r["ok"]]
    hidden = SHAPES[plan.shape][0]
    return {"rows": tried, "stop": why, "longest_trained": max(ok) if ok else None, "phases_s": phases,
            "hidden_size": hidden}


def _gib(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def markdown_train(res: dict) -> str:
    p, tr = res["plan"], res["train"]
    zero = next((r["train_config"]["optimizer"]["zero_stage"] for r in tr["rows"] if "train_config" in r), "?")
    lines = [f"# Long context: training our draft at the {p['shape']} shape ({res['meta']['date']})", "",
             f"Machine: {res['meta']['machine']}", "",
             f"Versions: {json.dumps(res['meta']['versions']['packages'])}; commit "
             f"{res['meta']['versions']['git_commit']}", "",
             f"One sample of L tokens per optimizer step (micro_batch_tokens = L), {p['train_steps']} steps, steady "
             f"state over steps {p['skip_steps'] + 1}..{p['train_steps']}; one draft layer, TTT 3, kl_div, DeepSpeed "
             f"ZeRO-{zero}; {p['train_samples']} synthetic samples per length (random bf16 hidden states). Each "
             "length in its own process; peak GPU memory counted from after the DeepSpeed engine was built (its "
             "weights and optimizer state included); peak RSS: the process's host memory.", "",
             "| L (tokens) | result | tokens/s (steady) | peak allocated GiB | peak reserved GiB | peak RSS GiB "
             "| input wait max ms | wall s |", "|---|---|---|---|---|---|---|---|"]
    for r in tr["rows"]:
        if r["ok"]:
            result = "trained"
            tok = f"{r['steady']['tokens_per_s']:,.0f}"
        else:
            result = ("**out of GPU memory**: " if r.get("oom") else "failed: ") + \
                r.get("error", "").splitlines()[0][:300].replace("|", "/")
            tok = "-"
        wait = r.get("input_wait_ms_max")
        lines.append(f"| {r['length']:,} | {result} | {tok} | {_gib(r.get('peak_allocated_gib'))} | "
                     f"{_gib(r.get('peak_reserved_gib'))} | {_gib(r.get('peak_rss_gib'))} | "
                     f"{'-' if wait is None else f'{wait:.1f}'} | "
                     f"{r['wall_s']:.0f} |")
    attn = next((r["train_config"]["draft"]["draft_attn_impl"] for r in tr["rows"] if "train_config" in r), "?")
    lines += ["", f"Draft attention: {attn}."]
    for r in tr["rows"]:
        if r.get("crash_stacks"):  # faulthandler's dump at the fatal signal: the crashing thread first
            lines += ["", f"{r['length']:,} tokens, the process's stacks at the signal (first 40 lines):", "", "```",
                      *r["crash_stacks"].splitlines()[:40], "```"]
    lines += ["", f"Longest sample trained: **{tr['longest_trained']}** tokens. Stop: {tr['stop']}.", "",
              "Phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in tr["phases_s"].items()), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.long_context_bench",
                                 description="Long-context extraction and training (see the module docstring)")
    ap.add_argument("--part", choices=PARTS, default=None)
    ap.add_argument("--plan", choices=sorted(PLANS), default="h200")
    ap.add_argument("--cpu-smoke", action="store_true", help="--plan cpu-smoke: the tiny shape, short lengths")
    ap.add_argument("--lengths", default=None, help="part extract's lengths, comma-separated (default: the plan's)")
    ap.add_argument("--train-lengths", default=None,
                    help="part train's lengths, comma-separated, tried in this order (default: the plan's)")
    ap.add_argument("--budget-s", type=float, default=None, help="part train's wall budget (default: the plan's)")
    ap.add_argument("--hs-dtype", choices=("bfloat16", "float8_e4m3fn"), default="bfloat16")
    ap.add_argument("--passes", type=int, default=2,
                    help="part extract: passes over each length's prompts on both sides; passes 2..P are timed")
    ap.add_argument("--samples-per-shard", type=int, default=64,
                    help="extract.samples_per_shard (lowered by extract.shard_bytes, 1 GiB, for long samples)")
    ap.add_argument("--cpu-kv-gib", type=int, default=2)
    ap.add_argument("--disk-dir", default=tempfile.gettempdir(), help="where part extract's shards go (removed)")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--stack-every", type=float, default=None,
                    help="part train: each length's process writes every thread's stack every N s to "
                         "<work>/train-L.json.stacks.txt (where a length runs long, what it is doing)")
    ap.add_argument("--draft-attn-impl", choices=("auto", "simple_flex_attention", "sdpa", "eager"), default="auto",
                    help="part train: the draft's attention (auto: the trainer's own choice per length, "
                         "eagle3.train.config.resolve_draft_attn_impl)")
    ap.add_argument("--out", default=None,
                    help="default: benchmarks/results/extraction (part extract) or /training (part train)")
    ap.add_argument("--tag", default="")
    # internal: one training length in this process (part train starts these)
    ap.add_argument("--train-one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--target-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.plan = "cpu-smoke"
    if args.train_one is None and args.part is None:
        ap.error("--part is required: extract or train")
    if args.out is None:
        args.out = f"benchmarks/results/{'extraction' if args.part == 'extract' else 'training'}"
    return args


def resolve_plan(args) -> Plan:
    """The named plan with the command line's --lengths, --train-lengths and --budget-s."""
    plan = PLANS[args.plan]

    def lengths(flag: str, text: str) -> tuple[int, ...]:
        try:
            out = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"{flag}={text!r}: expected comma-separated token counts, e.g. 8192,16384") from None
        if not out or min(out) < 16:
            raise ValueError(f"{flag}={text!r}: each length must be >= 16 tokens")
        return out

    if args.lengths:
        plan = replace(plan, lengths=lengths("--lengths", args.lengths))
    if args.train_lengths:
        plan = replace(plan, train_lengths=lengths("--train-lengths", args.train_lengths))
    if args.budget_s is not None:
        plan = replace(plan, budget_s=args.budget_s)
    return plan


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    plan = resolve_plan(args)
    if args.train_one is not None:  # a subprocess of part train
        rec = train_one(args)
        Path(args.result).write_text(json.dumps(rec, indent=1, default=str))
        return 0
    from benchmarks.common import result_meta, write_result

    print(f"long_context_bench --part {args.part} --plan {args.plan}: planned wall time "
          f"{planned_seconds(plan, args.part) / 60:.1f} min", flush=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="eagle3-long-context-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"meta": result_meta(args, work_dir=str(work)), "plan": asdict(plan),
                 "planned_s": planned_seconds(plan, args.part)}
    t = time.perf_counter()
    try:
        if args.part == "extract":
            import ray

            from ray_jobs.cluster import init_ray

            init_ray()  # as extract_bench: the job's runtime env, Ray's default object store
            gpu = ray.cluster_resources().get("GPU", 0) >= 1
            res["extract"] = part_extract(plan, args, work, gpu)
            md = markdown_extract(res)
            ray.shutdown()
        else:
            res["train"] = part_train(plan, args, work)
            md = markdown_train(res)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    res["wall_s"] = time.perf_counter() - t
    md += f"\nWall time {res['wall_s']:.0f} s (planned {res['planned_s']:.0f} s).\n"
    write_result(args.out, f"long-context-{args.part}", args.tag, res, md)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

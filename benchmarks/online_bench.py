"""Online against offline training (issue 17), in one run on one machine, same target, same prompts,
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
Targets (issue 17): online wall <= 0.7x offline's, online steady tokens/s >= 0.95x warm's, 0 bytes
of hidden states written online.

On two H200s (kind nvidia-h200-x2, after the carry of ../shared/gpu/README.md):

    . .gpu3/unpack.sh .gpu3 && python -m benchmarks.online_bench --shape 1b --tag h200x2-1b --out $OUT

(1b preset: 1,600 random-token prompts of 1,024 tokens, 8,192-token micro-batches, 200 steps).
On CPU, to check the plumbing (minutes, no figure to quote):

    python -m benchmarks.online_bench --shape tiny --extract-backend hf --num-prompts 48 --prompt-len 64 \\
        --num-steps 10 --micro-batch-tokens 512 --offline-replicas 1 --offline-workers 1 --out /tmp/ob
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("benchmarks.online_bench")

PRESETS = {"1b": dict(num_prompts=1600, prompt_len=1024, micro_batch_tokens=8192, num_steps=200),
           "tiny": dict(num_prompts=64, prompt_len=64, micro_batch_tokens=512, num_steps=10)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.online_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(PRESETS), default="tiny")
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
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    for k, v in PRESETS[args.shape].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.skip_steps is None:
        args.skip_steps = max(2, args.num_steps // 10)
    return args


def build_target(shape: str, out_dir: str, seed: int) -> str:
    """A Llama of `shape` with seeded random bf16 weights in HF format (the trainer reads the
    verifier's embeddings and lm_head from it, so vLLM's dummy weights are not enough)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.shapes import write_shape

    write_shape(shape, out_dir)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out_dir), dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    return out_dir


def job_config(args, out: Path, target_dir: str, *, replicas: int, workers: int, source: str):
    from eagle3.config import load_job_config

    return load_job_config(None, {
        "output_dir": str(out), "target.model": target_dir, "doctor": False, "eval.enabled": False,
        "stages": ["train"], "prepare.max_length": args.prompt_len + 8,
        "extract.backend": args.extract_backend, "extract.samples_per_shard": args.samples_per_shard,
        "extract.num_replicas": replicas, "extract.max_num_batched_tokens": max(16384, args.prompt_len + 8),
        "extract.gpu_memory_utilization": 0.8, "extract.cpu_kvcache_space_gib": args.cpu_kv_gib,
        "train.num_workers": workers, "train.num_steps": args.num_steps, "train.seed": args.seed,
        "train.source": source, "train.data.micro_batch_tokens": args.micro_batch_tokens,
        "train.checkpoint.checkpoint_every": args.num_steps, "train.checkpoint.num_checkpoints_to_keep": 1,
        "train.online.max_inflight_bytes": int(args.max_inflight_gib * (1 << 30))})


def steady_tokens_per_s(metrics_path: Path, skip_steps: int) -> float | None:
    """Median of rank 0's per-step tokens/s (metrics.jsonl) over the steps after `skip_steps`."""
    rates = [r["tokens_per_s"] for r in map(json.loads, metrics_path.read_text().splitlines())
             if r["step"] > skip_steps]
    return statistics.median(rates) if rates else None


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def run(args) -> dict:
    import pyarrow.parquet as pq
    import ray

    from actors.trainer import run_training
    from benchmarks.common import random_prompts, result_meta, tokens_table
    from benchmarks.shapes import SHAPES
    from ray_jobs.cluster import init_ray
    from ray_jobs.extract import run_extract
    from ray_jobs.online import run_online

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="online-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    init_ray()
    gpu = ray.cluster_resources().get("GPU", 0) >= 1
    # max_calls=1: the task's process exits after it, and its CUDA context with it
    target_dir = ray.get(ray.remote(max_calls=1)(build_target).options(num_gpus=1 if gpu else 0).remote(
        args.shape, str(work / "target"), args.seed))
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
    summary = run_online(cfg, str(tokens_path), target_dir, out)
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


def main(argv=None) -> int:
    from benchmarks.common import write_result

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    res = run(args)
    md = markdown(res)
    path = write_result(args.out, "online", args.tag, res, md)
    print(md)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Extraction with N engine replicas against one, same prompts, the product's run_extract loop
(engine start excluded: `loop_s`), into Arrow under --disk-dir (local disk, or /dev/shm to take
the disk out); whole-loop and steady-state (first to last shard commit) tokens/s.

    python -m benchmarks.replica_bench --shape 1b --replicas 1,2 --num-prompts 1024 --out DIR

--replicas-per-gpu 1,2,4 instead: on one GPU, 1, 2 and 4 replicas sharing it (extract.replicas_per_gpu:
fractional GPU bundles, each engine gpu_memory_utilization / n of the memory and a KV cache of
--kv-cache-gib), against plain vLLM prefill of the same prompts on the whole GPU in the same run
(extract_bench's PlainPrefill: the extraction engine without the hidden-states method):

    python -m benchmarks.replica_bench --shape smol --replicas-per-gpu 1,2,4 --num-prompts 1024 \
        --prompt-len 1024 --samples-per-shard 64 --disk-dir /dev/shm --tag h200-smol
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.replica_bench")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--replicas-per-gpu", default=None,
                    help="e.g. 1,2,4: replicas sharing each GPU instead of --replicas, with a plain prefill baseline")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0,
                    help="with --replicas-per-gpu: each engine's KV cache (set, not profiled: engines start together)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--samples-per-shard", type=int, default=64)
    ap.add_argument("--hs-dtype", default="bfloat16")
    ap.add_argument("--disk-dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default="benchmarks/results/extraction")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)

    import pyarrow.parquet as pq

    from benchmarks.common import random_prompts, result_meta, steady_tok_s, tokens_table, write_result
    from benchmarks.shapes import SHAPES, write_shape
    from benchmarks.common import STAGE_ONLY
    from eagle3.config import load_job_config
    from eagle3.extract.manifest import Manifest
    from ray_jobs.cluster import init_ray
    from ray_jobs.extract import run_extract

    init_ray()
    work = Path(tempfile.mkdtemp(prefix="eagle3-replicas-"))
    model_dir = write_shape(args.shape, work / "model")
    prompts = random_prompts(args.num_prompts, args.prompt_len, SHAPES[args.shape][5])
    tokens = sum(map(len, prompts))
    pq.write_table(tokens_table(prompts), work / "tokens.parquet")
    per_gpu = args.replicas_per_gpu is not None
    base_settings = {**STAGE_ONLY, "output_dir": str(work), "prepare.max_length": args.prompt_len + 8,
                     "extract.load_format": "dummy", "extract.samples_per_shard": args.samples_per_shard,
                     "extract.hs_dtype": args.hs_dtype, "extract.max_num_batched_tokens": max(16384, args.prompt_len + 9),
                     "extract.gpu_memory_utilization": 0.8}
    plain_tok_s = None
    if per_gpu:
        plain_tok_s = tokens / plain_prefill_s(load_job_config(None, base_settings).extract, model_dir, prompts,
                                               args.prompt_len + 9)
        print(json.dumps({"plain_prefill_tok_s": plain_tok_s}), flush=True)
    rows = []
    for n in [int(x) for x in (args.replicas_per_gpu or args.replicas).split(",")]:
        out = Path(args.disk_dir) / f"replicas-{n}"
        shutil.rmtree(out, ignore_errors=True)
        layout = ({"extract.replicas_per_gpu": n, "extract.num_replicas": n,
                   "extract.kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)} if per_gpu
                  else {"extract.num_replicas": n, "extract.replicas_per_gpu": 1})
        cfg = load_job_config(None, {**base_settings, **layout})
        s = run_extract(cfg, str(work / "tokens.parquet"), model_dir, str(out), progress=False)
        records = list(Manifest(out, cfg.extract.file_format).committed().values())
        rows.append({"replicas": n, "tok_s": tokens / s["loop_s"], "loop_s": s["loop_s"],
                     "steady_tok_s": steady_tok_s(records), "per_replica": s["replicas"], "bytes": s["bytes"],
                     "engine_starts": s.get("engine_starts"),
                     "vs_plain": tokens / s["loop_s"] / plain_tok_s if plain_tok_s else None})
        shutil.rmtree(out, ignore_errors=True)
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    for r in rows:
        r["speedup"] = r["tok_s"] / base["tok_s"]
        r["steady_speedup"] = (r["steady_tok_s"] / base["steady_tok_s"]
                               if r["steady_tok_s"] and base["steady_tok_s"] else None)
    meta = result_meta(args, tokens=tokens, plain_prefill_tok_s=plain_tok_s)
    md = [f"# Extraction replicas ({meta['date']})", "", f"Machine: {meta['machine']}", "",
          f"Shape {args.shape}, {args.num_prompts} prompts x {args.prompt_len} tokens, {args.hs_dtype}, Arrow on {args.disk_dir}"
          + (f"; replicas sharing one GPU, KV cache {args.kv_cache_gib} GiB each; plain vLLM prefill on the whole "
             f"GPU: {plain_tok_s:,.0f} tokens/s" if per_gpu else ""), "",
          f"| {'replicas on one GPU' if per_gpu else 'replicas'} | tokens/s, whole loop | speedup vs 1 | tokens/s, steady "
          f"| speedup vs 1 |{' vs plain prefill |' if per_gpu else ''} shards per replica | engine starts (s) |",
          "|---|---|---|---|---|---|---|" + ("---|" if per_gpu else "")]
    for r in rows:
        steady = (f"{r['steady_tok_s']:,.0f} | {r['steady_speedup']:.2f}x" if r["steady_speedup"] else "- | -")
        plain = f" {r['vs_plain']:.2f}x |" if per_gpu else ""
        starts = ", ".join(f"{x['startup_s']:.0f}" for x in r["engine_starts"] or [])
        md.append(f"| {r['replicas']} | {r['tok_s']:,.0f} | {r['speedup']:.2f}x | {steady} |{plain} "
                  f"{[len(p['shards']) for p in r['per_replica']]} | {starts} |")
    md += ["", "Whole loop: all tokens / the loop's time (engine start excluded). Steady: tokens committed after "
           "the first shard / the time from the first shard's commit to the last's (the pipeline's fill and the "
           "last shard's write left out, as in extract_bench)."]
    write_result(args.out, "replicas", args.tag, {"meta": meta, "results": rows}, "\n".join(md) + "\n")
    print("\n".join(md))
    shutil.rmtree(work, ignore_errors=True)
    return 0


def plain_prefill_s(ecfg, model_dir: str, prompts: list[list[int]], max_len: int) -> float:
    """Seconds of plain vLLM prefill of `prompts` (warm-up excluded) on one whole GPU (or a CPU),
    in an actor, the engine released before it returns."""
    import ray

    from benchmarks.extract_bench import PlainPrefill

    gpu = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    actor = ray.remote(num_gpus=gpu, num_cpus=1)(PlainPrefill).remote(model_dir, ecfg, max_len)
    try:
        return ray.get(actor.run.remote(prompts))
    finally:
        ray.get(actor.close.remote())
        ray.kill(actor)


if __name__ == "__main__":
    raise SystemExit(main())

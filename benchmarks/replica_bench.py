"""Extraction with N engine replicas against one, same prompts, the product's run_extract loop
(engine start excluded: `loop_s`), into Arrow under --disk-dir (local disk, or /dev/shm to take
the disk out); whole-loop and steady-state (first to last shard commit) tokens/s.

    python -m benchmarks.replica_bench --shape 1b --replicas 1,2 --num-prompts 1024 --out DIR
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
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--samples-per-shard", type=int, default=64)
    ap.add_argument("--hs-dtype", default="bfloat16")
    ap.add_argument("--disk-dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)

    import pyarrow.parquet as pq

    from benchmarks.common import random_prompts, result_meta, steady_tok_s, tokens_table, write_result
    from benchmarks.shapes import SHAPES, write_shape
    from eagle3.config import load_job_config
    from eagle3.manifest import Manifest
    from ray_jobs.cluster import init_ray
    from ray_jobs.extract import run_extract

    init_ray()
    work = Path(tempfile.mkdtemp(prefix="eagle3-replicas-"))
    model_dir = write_shape(args.shape, work / "model")
    prompts = random_prompts(args.num_prompts, args.prompt_len, SHAPES[args.shape][5])
    tokens = sum(map(len, prompts))
    pq.write_table(tokens_table(prompts), work / "tokens.parquet")
    rows = []
    for n in [int(x) for x in args.replicas.split(",")]:
        out = Path(args.disk_dir) / f"replicas-{n}"
        shutil.rmtree(out, ignore_errors=True)
        cfg = load_job_config(None, {"output_dir": str(work), "prepare.max_length": args.prompt_len + 8,
                                     "extract.load_format": "dummy", "extract.num_replicas": n,
                                     "extract.samples_per_shard": args.samples_per_shard,
                                     "extract.hs_dtype": args.hs_dtype,
                                     "extract.max_num_batched_tokens": max(16384, args.prompt_len),
                                     "extract.gpu_memory_utilization": 0.8})
        s = run_extract(cfg, str(work / "tokens.parquet"), model_dir, str(out), progress=False)
        records = list(Manifest(out, cfg.extract.file_format).committed().values())
        rows.append({"replicas": n, "tok_s": tokens / s["loop_s"], "loop_s": s["loop_s"],
                     "steady_tok_s": steady_tok_s(records), "per_replica": s["replicas"], "bytes": s["bytes"]})
        shutil.rmtree(out, ignore_errors=True)
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    for r in rows:
        r["speedup"] = r["tok_s"] / base["tok_s"]
        r["steady_speedup"] = (r["steady_tok_s"] / base["steady_tok_s"]
                               if r["steady_tok_s"] and base["steady_tok_s"] else None)
    meta = result_meta(args, tokens=tokens)
    md = [f"# Extraction replicas ({meta['date']})", "", f"Machine: {meta['machine']}", "",
          f"Shape {args.shape}, {args.num_prompts} prompts x {args.prompt_len} tokens, {args.hs_dtype}, Arrow on {args.disk_dir}", "",
          "| replicas | tokens/s, whole loop | speedup vs 1 | tokens/s, steady | speedup vs 1 | shards per replica |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        steady = (f"{r['steady_tok_s']:,.0f} | {r['steady_speedup']:.2f}x" if r["steady_speedup"] else "- | -")
        md.append(f"| {r['replicas']} | {r['tok_s']:,.0f} | {r['speedup']:.2f}x | {steady} | "
                  f"{[len(p['shards']) for p in r['per_replica']]} |")
    md += ["", "Whole loop: all tokens / the loop's time (engine start excluded). Steady: tokens committed after "
           "the first shard / the time from the first shard's commit to the last's (the pipeline's fill and the "
           "last shard's write left out, as in extract_bench)."]
    write_result(args.out, "replicas", args.tag, {"meta": meta, "results": rows}, "\n".join(md) + "\n")
    print("\n".join(md))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

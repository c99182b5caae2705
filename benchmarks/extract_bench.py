"""Extraction throughput side by side, in one run, with the same engine settings and prompts.

    python -m benchmarks.extract_bench --shapes 1b,8b --num-prompts 512 --prompt-len 1024 --out DIR

Per shape (dummy-weight Llama, random token prompts, seeded):
  (1) plain vLLM prefill, max_tokens=1                      -> the reference
  (2) our extraction into the Ray object store: the product's ExtractorActor, at most
      extract.max_inflight_shards shards in flight, each table dropped once sealed in the
      store (as the product's writer tasks free them), nothing written
      (2e) breakdown, same engine: the engine + connector + copy to host alone, no Arrow
      table and no object store
  (3) our extraction into Arrow/Parquet on local disk: the product's run_extract loop
      (replica + writer tasks + fsync + manifest commit), engine start excluded
  (3b) the same with fp8 (e4m3 + per-token scale) storage
  (4) transformers output_hidden_states + copy to host (batched, equal lengths)
  (5) the disk's raw sequential write bandwidth (dd, direct I/O)
and the ratios to (1). With --diagnose, two more engines that locate a bound:
  (1i) plain prefill with the engine in the calling process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
       as our memory sink runs it) and (2s) extraction into the object store through the
       "shm" sink (multiprocess engine, files in /dev/shm); and, without an engine, (2c) the
       copy into the object store alone (tables of the same size returned by an actor).
Each engine is started by the product's path (compat.vllm_engine: the extraction engine's
settings, Engine) in its own Ray actor (its own process), one after the other, and released
(Engine.close) before its actor is killed, so GPU memory is returned between them. Writes JSON
and a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import random_prompts, result_meta, steady_tok_s, tokens_table, write_result


class PlainPrefill:
    """(1): the extraction engine of (2), same ExtractConfig and the same product path
    (compat.vllm_engine.extraction_engine_kwargs, started and released by compat.vllm_engine.Engine),
    without the hidden-states method: no speculative_config, no KV connector."""

    def __init__(self, model_dir: str, cfg, max_len: int, in_process: bool = False):
        from compat.vllm_engine import Engine, engine_env, extraction_engine_kwargs

        os.environ.update(engine_env(in_process=in_process, cpu_kvcache_space_gib=cfg.cpu_kvcache_space_gib))
        # layer_ids, sink and storage_path configure only the hidden-states method, removed below
        kwargs = extraction_engine_kwargs(
            model=model_dir, layer_ids=[], max_model_len=max_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
            sink="memory", storage_path="", dtype="bfloat16", tensor_parallel_size=cfg.tensor_parallel_size,
            pipeline_parallel_size=cfg.pipeline_parallel_size, max_num_seqs=cfg.max_num_seqs,
            gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
            load_format=cfg.load_format, block_size=cfg.block_size)
        del kwargs["speculative_config"], kwargs["kv_transfer_config"]  # the hidden-states method
        self.engine = Engine(**kwargs)

    def run(self, prompts: list[list[int]]) -> float:
        from compat.vllm_engine import run_prefill

        run_prefill(self.engine.llm, prompts[: min(8, len(prompts))], capture=False)  # warm-up
        t0 = time.perf_counter()
        run_prefill(self.engine.llm, prompts, capture=False)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.engine.close()


class ObjectStoreExtract:
    """(2): the product's ExtractorActor work (engine + encode into an Arrow table) with the
    table returned to the object store by the actor call; nothing written."""

    def __init__(self, model_dir: str, cfg, max_len: int):
        from actors.extractor import ExtractorActor

        self.inner = ExtractorActor(model_dir, cfg, max_length=max_len, dtype="bfloat16", trust_remote_code=False,
                                    replica=0)

    def extract_shard(self, shard, tokens):
        return self.inner.extract_shard(shard, tokens)

    def engine_only(self, prompts: list[list[int]], shard: int) -> float:
        """(2e): the engine, the connector and the copy to host, shard by shard, results dropped."""
        backend = self.inner.extractor.backend
        t0 = time.perf_counter()
        for i in range(0, len(prompts), shard):
            backend.hidden_states(prompts[i:i + shard])
        return time.perf_counter() - t0

    def close(self) -> None:
        self.inner.shutdown()


class StoreOnly:
    """(2c): the object store's side of (2) alone, no engine: the actor returns, per shard, a
    hidden-states table of the size the engine would make, from host memory filled once (pinned,
    where there is CUDA, as the connector's), so each call costs only the copy into the store."""

    def __init__(self, hidden_size: int, num_layers: int, prompt_len: int, shard: int):
        import pyarrow as pa
        import torch

        from eagle3.extract.codec import binary_value

        pin = torch.cuda.is_available()
        chunks = []
        for _ in range(shard):
            t = torch.empty(prompt_len * num_layers * hidden_size, dtype=torch.uint16, pin_memory=pin)
            t.fill_(1)
            chunks.append(binary_value(t.numpy()))  # the Arrow buffer keeps the tensor alive
        self.table = pa.table({"hidden_states": pa.chunked_array(chunks)})

    def extract_shard(self, shard, tokens):
        return self.table.slice(0, len(tokens)), {"shard": shard}


def _object_store_run(actor, table, shard: int, window: int, passes: int = 1) -> list[float]:
    """The product's flow into the object store: at most `window` shards in flight; each table
    is dropped once sealed (in the product a writer task frees it), so the store reuses memory.
    Seconds of each of `passes` passes over the table. The first pass writes into store memory
    no process has touched yet: every page faults on its first write (3.0 GB/s from one actor on
    the H200 host, against ~4x that into reused pages on the CI machine). A long extraction cycles
    the store many times over, so a later pass, once the store has wrapped, is its steady state."""
    import ray

    ray.get(actor.extract_shard.options(num_returns=2).remote(-1, table.slice(0, 8))[1])  # warm-up
    secs = []
    for _ in range(passes):
        todo = list(range(-(-len(table) // shard)))
        inflight: dict = {}
        t0 = time.perf_counter()
        while todo or inflight:
            while todo and len(inflight) < window:
                i = todo.pop(0)
                table_ref, stats_ref = actor.extract_shard.options(num_returns=2).remote(i, table.slice(i * shard, shard))
                inflight[table_ref] = stats_ref
            done, _ = ray.wait(list(inflight), num_returns=1, fetch_local=False)  # sealed in the store
            ray.get(inflight.pop(done[0]))
        secs.append(time.perf_counter() - t0)
    return secs


def bench_shape(shape: str, args, gpu: int, work: Path) -> dict:
    import pyarrow.parquet as pq
    import ray

    from benchmarks.shapes import SHAPES, write_shape
    from eagle3.config import load_job_config

    model_dir = write_shape(shape, work / f"model-{shape}")
    prompts = random_prompts(args.num_prompts, args.prompt_len, SHAPES[shape][5])
    tokens = sum(len(p) for p in prompts)
    max_len = args.prompt_len + 8
    batched = max(16384, max_len + 1)  # chunked prefill off: a step holds a sample and its one output token
    res: dict = {"shape": shape, "hidden_size": SHAPES[shape][0], "num_layers": SHAPES[shape][1],
                 "num_prompts": len(prompts), "prompt_len": args.prompt_len, "tokens": tokens}

    def in_actor(cls, *a, concurrency=1):
        return ray.remote(num_gpus=gpu, num_cpus=1, max_concurrency=concurrency)(cls).remote(*a)

    def release(actor) -> None:
        # the engine first (Engine.close ends its engine-core process), then the actor: killing
        # only the actor can leave a multiprocess engine's core holding the GPU
        ray.get(actor.close.remote())
        ray.kill(actor)

    from actors.extractor import max_concurrency
    from eagle3.config import ExtractConfig
    from eagle3.extract.manifest import ShardPlan
    from eagle3.schema import stored_bytes_per_token

    table = tokens_table(prompts)
    defaults = ExtractConfig()
    layer_ids = defaults.layer_ids(SHAPES[shape][1])
    bytes_per_token = stored_bytes_per_token(num_layers=len(layer_ids), hidden_size=SHAPES[shape][0],
                                             hs_dtype="bfloat16")
    # the product's shard plan: --samples-per-shard, lowered to fit extract.shard_bytes
    shard = ShardPlan.sized([len(p) for p in prompts], args.samples_per_shard, bytes_per_token,
                            defaults.shard_bytes).samples_per_shard
    res["samples_per_shard"] = shard
    # the engine settings of (1) and (2)
    ecfg = ExtractConfig(load_format="dummy", max_num_batched_tokens=batched, gpu_memory_utilization=0.8,
                         cpu_kvcache_space_gib=args.cpu_kv_gib, samples_per_shard=shard, block_size=args.block_size)

    # (1) plain prefill; (1i) the same with the engine in the calling process
    for key, in_process in (("plain_prefill", False), ("plain_inproc", True)):
        if in_process and not args.diagnose:
            continue
        actor = in_actor(PlainPrefill, model_dir, ecfg, max_len, in_process)
        secs = ray.get(actor.run.remote(prompts))
        release(actor)
        res[f"{key}_tok_s"] = tokens / secs

    # (2) extraction into the object store, (2e) its engine part; (2s) through the shm sink
    for key, sink in (("object_store", "auto"), ("object_store_shm", "shm")):
        if (sink == "shm" and not args.diagnose) or args.skip_object_store:
            continue
        scfg = dataclasses.replace(ecfg, sink=sink)
        actor = in_actor(ObjectStoreExtract, model_dir, scfg, max_len, concurrency=max_concurrency(scfg))
        secs = _object_store_run(actor, table, shard, scfg.max_inflight_shards, args.store_passes)
        res[f"{key}_tok_s"] = tokens / secs[-1]
        res[f"{key}_passes_tok_s"] = [tokens / x for x in secs]
        if sink == "auto":
            res["object_store_inflight"] = scfg.max_inflight_shards
            res["engine_only_tok_s"] = tokens / ray.get(actor.engine_only.remote(prompts, shard))
        release(actor)
    if args.diagnose and not args.skip_object_store:
        actor = in_actor(StoreOnly, SHAPES[shape][0], len(layer_ids), args.prompt_len, shard,
                         concurrency=max_concurrency(defaults))
        secs = _object_store_run(actor, table, shard, defaults.max_inflight_shards, args.store_passes)
        ray.kill(actor)
        res["store_only_tok_s"] = tokens / secs[-1]
        res["store_only_gb_s"] = tokens * bytes_per_token / secs[-1] / 1e9
        res["store_only_passes_gb_s"] = [tokens * bytes_per_token / x / 1e9 for x in secs]

    # (3) Arrow on local disk through the product's loop; (3b) fp8
    tpath = work / f"tokens-{shape}.parquet"
    pq.write_table(table, tpath)
    for key, dt in (("arrow_disk", "bfloat16"), ("arrow_disk_fp8", "float8_e4m3fn")):
        if key == "arrow_disk_fp8" and args.skip_fp8:
            continue
        disk = disk_extract(model_dir, tpath, Path(args.disk_dir) / f"bench-{shape}-{dt}", work, max_len=max_len,
                            hs_dtype=dt, samples_per_shard=args.samples_per_shard, batched=batched,
                            cpu_kv_gib=args.cpu_kv_gib, block_size=args.block_size)
        res.update({f"{key}_{k}": v for k, v in disk.items() if k not in ("num_samples", "seconds")})

    # (4) transformers output_hidden_states + copy to host
    if not args.skip_hf:
        from eagle3.extract.extractor import HFBackend

        class HF:
            def __init__(self):
                ids = load_job_config(None).extract.layer_ids(SHAPES[shape][1])
                self.b = HFBackend(model_dir, ids, batch_size=args.hf_batch, random_weights=True)

            def run(self, ps):
                self.b.hidden_states(ps[: args.hf_batch])
                t = time.perf_counter()
                self.b.hidden_states(ps)
                return time.perf_counter() - t

        n_hf = min(len(prompts), args.hf_prompts)
        actor = in_actor(HF)
        secs = ray.get(actor.run.remote(prompts[:n_hf]))
        ray.kill(actor)
        res["hf_tok_s"] = n_hf * args.prompt_len / secs
        res["hf_batch"] = args.hf_batch

    base = res["plain_prefill_tok_s"]
    for k in ("plain_inproc", "object_store", "engine_only", "store_only", "object_store_shm", "arrow_disk",
              "arrow_disk_steady", "arrow_disk_fp8", "arrow_disk_fp8_steady", "hf"):
        if res.get(f"{k}_tok_s"):
            res[f"{k}_ratio"] = res[f"{k}_tok_s"] / base
    return res


def disk_extract_config(work: Path, *, max_len: int, hs_dtype: str, samples_per_shard: int, batched: int,
                        cpu_kv_gib: int, block_size: int | None):
    """disk_extract's job config: the extract stage alone, so a max_len past the default
    train.data.micro_batch_tokens (long context) is no training limit here (JobConfig checks
    micro_batch_tokens only when training runs; session 10's 8K-32K run failed on it)."""
    from eagle3.config import load_job_config

    return load_job_config(None, {"output_dir": str(work), "stages": ["extract"], "prepare.max_length": max_len,
                                  "extract.load_format": "dummy", "extract.hs_dtype": hs_dtype,
                                  "extract.samples_per_shard": samples_per_shard, "extract.num_replicas": 1, "extract.replicas_per_gpu": 1,
                                  "extract.max_num_batched_tokens": batched,
                                  "extract.gpu_memory_utilization": 0.8,
                                  "extract.cpu_kvcache_space_gib": cpu_kv_gib,
                                  "extract.block_size": block_size})


def disk_extract(model_dir: str, tokens_path: Path, out: Path, work: Path, *, max_len: int, hs_dtype: str,
                 samples_per_shard: int, batched: int, cpu_kv_gib: int, block_size: int | None) -> dict:
    """(3): the product's run_extract loop (dummy weights, one replica) from a tokens file into
    Arrow shards in `out` (emptied before, removed after). Returns tok_s (whole loop, engine start
    excluded), steady_tok_s (common.steady_tok_s), writer_task_gb_s (each shard's, sorted),
    samples_per_shard, bytes, bytes_per_token, write_gb_s, num_samples, shard_file_bytes (sorted)."""
    from eagle3.extract.manifest import Manifest
    from ray_jobs.extract import run_extract

    shutil.rmtree(out, ignore_errors=True)
    cfg = disk_extract_config(work, max_len=max_len, hs_dtype=hs_dtype, samples_per_shard=samples_per_shard,
                              batched=batched, cpu_kv_gib=cpu_kv_gib, block_size=block_size)
    try:
        summary = run_extract(cfg, str(tokens_path), model_dir, str(out), progress=False)
        records = list(Manifest(out, cfg.extract.file_format).committed().values())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"writer_task_gb_s": sorted(r["bytes"] / r["write_s"] / 1e9 for r in records),
            "tok_s": summary["num_tokens"] / summary["loop_s"], "steady_tok_s": steady_tok_s(records),
            "samples_per_shard": summary["samples_per_shard"], "bytes": summary["bytes"],
            "bytes_per_token": summary["bytes_per_token"], "write_gb_s": summary["bytes"] / summary["loop_s"] / 1e9,
            "num_samples": summary["num_samples"], "num_rejected": summary["num_rejected"],
            "shard_file_bytes": sorted(r["bytes"] for r in records)}


def disk_bandwidth(path: str, gib: int) -> float | None:
    """dd with direct I/O: GB/s of raw sequential writes where the shards go."""
    target = Path(path) / "dd.bench"
    try:
        out = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={gib * 64}", "oflag=direct"],
                             capture_output=True, text=True, timeout=600)
    finally:
        target.unlink(missing_ok=True)
    for line in out.stderr.splitlines():
        if "copied" in line:  # "... bytes (...) copied, 2.5 s, 1.7 GB/s"
            nbytes = int(line.split()[0])
            secs = float(line.split("copied,")[1].split()[0])
            return nbytes / secs / 1e9
    return None


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# Extraction benchmark ({meta['date']})", "", f"Machine: {meta['machine']}", "",
             f"Versions: {json.dumps(meta['versions']['packages'])}; commit {meta['versions']['git_commit']}", "",
             f"Disk raw sequential write (dd, direct I/O, {meta['dd_gib']} GiB): "
             f"{meta['disk_gb_s']:.2f} GB/s" if meta.get("disk_gb_s") else "Disk bandwidth: not measured", "",
             f"Object store: {meta.get('object_store_gib') or 0:.1f} GiB. (2) and (2c) are their last pass over the "
             "prompts (the first pass is shown too); steady = tokens/s from the first to the last shard commit.", "",
             "| shape | prompts x len | (1) plain prefill tok/s | (2) object store | (3) Arrow on disk | (3b) fp8 on disk | (4) transformers | Arrow write GB/s (vs dd) | bytes/token bf16 / fp8 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        def cell(k):
            if not r.get(k + "_tok_s"):
                return "-"
            text = f"{r[k + '_tok_s']:,.0f} ({r[k + '_ratio']:.3f}x)"
            passes = r.get(k + "_passes_tok_s") or []
            if len(passes) > 1:
                text += f"; first pass {passes[0] / r['plain_prefill_tok_s']:.3f}x"
            if r.get(k + "_steady_ratio"):
                text += f"; steady {r[k + '_steady_ratio']:.3f}x"
            return text
        wr = r.get("arrow_disk_write_gb_s")
        dd = meta.get("disk_gb_s")
        lines.append(f"| {r['shape']} (hidden {r['hidden_size']}, {r['num_layers']} layers) | {r['num_prompts']} x {r['prompt_len']} | "
                     f"{r['plain_prefill_tok_s']:,.0f} | {cell('object_store')} | {cell('arrow_disk')} | {cell('arrow_disk_fp8')} | "
                     f"{cell('hf')} | " + ("-" if wr is None else f"{wr:.2f}" + (f" ({wr / dd:.2f}x)" if dd else "")) + " | "
                     f"{r.get('arrow_disk_bytes_per_token', 0):,.0f} / {r.get('arrow_disk_fp8_bytes_per_token', 0):,.0f} |")
    lines += ["", "Breakdown (same prompts; ratios to (1)):", "",
              "| shape | (2e) engine + connector + copy to host, no table | (2c) copy into the object store alone, no engine | "
              "(1i) plain prefill, engine in process | (2s) object store via shm sink | writer task GB/s, median (bf16 / fp8) |",
              "|---|---|---|---|---|---|"]
    for r in results:
        def cell(k):
            return f"{r[k + '_tok_s']:,.0f} ({r[k + '_ratio']:.3f}x)" if k + "_tok_s" in r else "-"

        def median(k):
            v = r.get(k + "_writer_task_gb_s")
            return f"{v[len(v) // 2]:.2f}" if v else "-"
        store = cell("store_only") + (f", {r['store_only_gb_s']:.2f} GB/s" if "store_only_gb_s" in r else "")
        lines.append(f"| {r['shape']} | {cell('engine_only')} | {store} | {cell('plain_inproc')} | {cell('object_store_shm')} | "
                     f"{median('arrow_disk')} / {median('arrow_disk_fp8')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.extract_bench")
    ap.add_argument("--shapes", default="tiny")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--samples-per-shard", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--hf-prompts", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-fp8", action="store_true")
    ap.add_argument("--skip-object-store", action="store_true", help="leave out (2) and (2e)")
    ap.add_argument("--diagnose", action="store_true", help="also (1i) and (2s): two more engine starts")
    ap.add_argument("--disk-dir", default=tempfile.gettempdir(), help="where (3) writes: the machine's local disk")
    ap.add_argument("--dd-gib", type=int, default=4)
    ap.add_argument("--cpu-kv-gib", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM block_size for every engine of the run (default: vLLM's)")
    ap.add_argument("--store-passes", type=int, default=2,
                    help="passes of (2) and (2c) over the prompts; the last is reported, all are kept")
    ap.add_argument("--object-store-gib", type=float, default=None,
                    help="object store of the local Ray instance (default: Ray's, 30%% of memory); smaller than "
                         "one pass's bytes, the last pass of (2) sees the store's steady state")
    ap.add_argument("--out", default="benchmarks/results/extraction")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)

    import ray

    from ray_jobs.cluster import init_ray

    init_ray(object_store_memory=int(args.object_store_gib * 2**30) if args.object_store_gib else None)
    gpu = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    work = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    meta = result_meta(args, dd_gib=args.dd_gib,
                       object_store_gib=ray.cluster_resources().get("object_store_memory", 0) / 2**30)
    meta["disk_gb_s"] = disk_bandwidth(args.disk_dir, args.dd_gib) if args.dd_gib else None
    results = []
    for shape in args.shapes.split(","):
        results.append(bench_shape(shape, args, gpu, work))
        print(json.dumps(results[-1]), flush=True)
    write_result(args.out, "extract", args.tag, {"meta": meta, "results": results}, markdown(results, meta))
    print(markdown(results, meta))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

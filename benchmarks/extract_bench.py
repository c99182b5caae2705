"""Extraction throughput against plain vLLM prefill, in one command, same engine settings and prompts.

    python -m benchmarks.extract_bench --shapes 1b --num-prompts 256 --prompt-len 1024 --out DIR

Per shape (dummy-weight Llama, random token prompts, seeded), the measured sides:
  (1) plain vLLM prefill, max_tokens=1                      -> the reference
  (2) our extraction into the Ray object store: the product's ExtractorActor, at most
      extract.max_inflight_shards shards in flight, each table dropped once sealed, nothing written
  (3) our extraction into Arrow shards on local disk: the product's run_extract loop (replica +
      writer tasks + fsync + manifest commit), engine start excluded
  (3b) the same with fp8 (e4m3 + per-token scale) storage (unless --skip-fp8)
Every side runs --passes passes over the prompts in one engine life, and every side's tokens/s
is taken over passes 2..P (pass 1 holds each side's first-call work, left out alike); (3) gets
its passes as one run over the prompts repeated P times, its pass boundaries read from the
shards' commit times. The sides run --repeats times, the order reversed every other repeat
((1) (2) (3), then (3) (2) (1)); each ratio to (1) pairs a side with (1) of the same repeat, and
the result gives the median and the range over repeats.
Single measurements beside them (tokens/s, no ratio): (2e) the engine + connector + copy to host
alone, (4) transformers output_hidden_states, (5) the disk's raw sequential write bandwidth (dd),
and with --diagnose (1i) plain prefill with the engine in the calling process, (2s) the object
store through the "shm" sink and (2c) the copy into the object store alone, no engine.
Each engine runs in its own Ray actor and is released (Engine.close) before the next starts.
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

from benchmarks.common import random_prompts, result_meta, tokens_table, write_result


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

    def run_passes(self, prompts: list[list[int]], passes: int) -> list[float]:
        """Seconds of each of `passes` back-to-back passes over the prompts, after run's warm-up."""
        from compat.vllm_engine import run_prefill

        run_prefill(self.engine.llm, prompts[: min(8, len(prompts))], capture=False)  # warm-up
        secs = []
        for _ in range(passes):
            t0 = time.perf_counter()
            run_prefill(self.engine.llm, prompts, capture=False)
            secs.append(time.perf_counter() - t0)
        return secs

    def close(self) -> None:
        self.engine.close()


def window_tok_s(tokens_per_pass: int, secs: list[float]) -> float:
    """Tokens/s over passes 2..P (pass 1 holds first-call work), or over the one pass there is:
    the rule every side of extract_bench and long_context_bench is measured by."""
    timed = secs[1:] if len(secs) > 1 else secs
    return tokens_per_pass * len(timed) / sum(timed)


def rotated(sides: list[str], repeat: int) -> list[str]:
    """The sides' order in a repeat: as given in even repeats, reversed in odd ones."""
    return list(sides) if repeat % 2 == 0 else list(reversed(sides))


def over_repeats(values: list[float]) -> dict:
    """Median, min and max of one figure over the repeats, and the repeats it came from."""
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values), "per_repeat": values}


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
    from benchmarks.common import STAGE_ONLY
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

    tpath = work / f"tokens-{shape}.parquet"
    pq.write_table(tokens_table(prompts * args.passes), tpath)  # (3)'s passes: the prompts P times over
    passes = args.passes

    def plain_prefill() -> list[float]:
        actor = in_actor(PlainPrefill, model_dir, ecfg, max_len)
        secs = ray.get(actor.run_passes.remote(prompts, passes))
        release(actor)
        return secs

    def object_store() -> list[float]:
        actor = in_actor(ObjectStoreExtract, model_dir, ecfg, max_len, concurrency=max_concurrency(ecfg))
        secs = _object_store_run(actor, table, shard, ecfg.max_inflight_shards, passes)
        if "engine_only_tok_s" not in res:  # (2e), once, on the same engine
            res["engine_only_tok_s"] = tokens / ray.get(actor.engine_only.remote(prompts, shard))
        release(actor)
        return secs

    def arrow_disk(dt: str) -> list[float]:
        disk = disk_extract(model_dir, tpath, Path(args.disk_dir) / f"bench-{shape}-{dt}", work, max_len=max_len,
                            hs_dtype=dt, samples_per_shard=args.samples_per_shard, batched=batched,
                            cpu_kv_gib=args.cpu_kv_gib, block_size=args.block_size, rows_per_pass=len(prompts))
        key = "arrow_disk" if dt == "bfloat16" else "arrow_disk_fp8"
        if disk["num_samples"] != len(prompts) * passes:
            raise RuntimeError(f"{key}: extraction kept {disk['num_samples']} of {len(prompts) * passes} samples")
        res.update({f"{key}_{k}": v for k, v in disk.items()
                    if k in ("bytes_per_token", "write_gb_s", "writer_task_gb_s", "samples_per_shard")})
        return disk["pass_seconds"]

    sides = {"plain_prefill": plain_prefill, "arrow_disk": lambda: arrow_disk("bfloat16")}
    if not args.skip_object_store:
        sides = {"plain_prefill": plain_prefill, "object_store": object_store, "arrow_disk": sides["arrow_disk"]}
    if not args.skip_fp8:
        sides["arrow_disk_fp8"] = lambda: arrow_disk("float8_e4m3fn")
    res["object_store_inflight"] = ecfg.max_inflight_shards
    res["passes"], res["repeats"] = passes, args.repeats
    res["order"], res["pass_seconds"] = [], {k: [] for k in sides}
    for repeat in range(args.repeats):
        order = rotated(list(sides), repeat)
        res["order"].append(order)
        for key in order:
            secs = sides[key]()
            res["pass_seconds"][key].append(secs)
            print(f"{shape} repeat {repeat + 1}: {key} {window_tok_s(tokens, secs):,.0f} tok/s "
                  f"(passes: {', '.join(f'{x:.2f}' for x in secs)} s)", flush=True)
    for key, by_repeat in res["pass_seconds"].items():
        rates = [window_tok_s(tokens, secs) for secs in by_repeat]
        res[f"{key}_tok_s"] = over_repeats(rates)["median"]
        if key != "plain_prefill":
            base = [window_tok_s(tokens, secs) for secs in res["pass_seconds"]["plain_prefill"]]
            res[f"{key}_ratio_over_repeats"] = over_repeats([r / b for r, b in zip(rates, base, strict=True)])
            res[f"{key}_ratio"] = res[f"{key}_ratio_over_repeats"]["median"]

    # diagnostics, each measured once: tokens/s only
    if args.diagnose:
        actor = in_actor(PlainPrefill, model_dir, ecfg, max_len, True)
        res["plain_inproc_tok_s"] = window_tok_s(tokens, ray.get(actor.run_passes.remote(prompts, passes)))
        release(actor)
        if not args.skip_object_store:
            scfg = dataclasses.replace(ecfg, sink="shm")
            actor = in_actor(ObjectStoreExtract, model_dir, scfg, max_len, concurrency=max_concurrency(scfg))
            res["object_store_shm_tok_s"] = window_tok_s(
                tokens, _object_store_run(actor, table, shard, scfg.max_inflight_shards, passes))
            release(actor)
            actor = in_actor(StoreOnly, SHAPES[shape][0], len(layer_ids), args.prompt_len, shard,
                             concurrency=max_concurrency(defaults))
            secs = _object_store_run(actor, table, shard, defaults.max_inflight_shards, passes)
            ray.kill(actor)
            res["store_only_tok_s"] = window_tok_s(tokens, secs)
            res["store_only_gb_s"] = res["store_only_tok_s"] * bytes_per_token / 1e9

    # (4) transformers output_hidden_states + copy to host
    if not args.skip_hf:
        from eagle3.extract.extractor import HFBackend

        class HF:
            def __init__(self):
                ids = load_job_config(None, STAGE_ONLY).extract.layer_ids(SHAPES[shape][1])
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
    return res


def disk_extract_config(work: Path, *, max_len: int, hs_dtype: str, samples_per_shard: int, batched: int,
                        cpu_kv_gib: int, block_size: int | None):
    """disk_extract's job config: the extract stage alone, so a max_len past the default
    train.data.micro_batch_tokens (long context) is no training limit here (JobConfig checks
    micro_batch_tokens only when training runs)."""
    from benchmarks.common import STAGE_ONLY
    from eagle3.config import load_job_config

    return load_job_config(None, {**STAGE_ONLY, "output_dir": str(work), "stages": ["extract"], "prepare.max_length": max_len,
                                  "extract.load_format": "dummy", "extract.hs_dtype": hs_dtype,
                                  "extract.samples_per_shard": samples_per_shard, "extract.num_replicas": 1, "extract.replicas_per_gpu": 1,
                                  "extract.max_num_batched_tokens": batched,
                                  "extract.gpu_memory_utilization": 0.8,
                                  "extract.cpu_kvcache_space_gib": cpu_kv_gib,
                                  "extract.block_size": block_size})


def disk_extract(model_dir: str, tokens_path: Path, out: Path, work: Path, *, max_len: int, hs_dtype: str,
                 samples_per_shard: int, batched: int, cpu_kv_gib: int, block_size: int | None,
                 rows_per_pass: int | None = None) -> dict:
    """(3): the product's run_extract loop (dummy weights, one replica) from a tokens file into
    Arrow shards in `out` (emptied before, removed after). rows_per_pass: the file holds the same
    prompts several times over, that many rows each; pass_seconds gives each pass's seconds, from
    the commit of the last shard of one pass to that of the next (pass 1: from the loop's start,
    engine start excluded). Also tok_s (whole loop), writer_task_gb_s (each shard's, sorted),
    samples_per_shard, bytes, bytes_per_token, write_gb_s, num_samples, shard_file_bytes (sorted)."""
    from eagle3.extract.manifest import Manifest
    from ray_jobs.extract import run_extract

    shutil.rmtree(out, ignore_errors=True)
    cfg = disk_extract_config(work, max_len=max_len, hs_dtype=hs_dtype, samples_per_shard=samples_per_shard,
                              batched=batched, cpu_kv_gib=cpu_kv_gib, block_size=block_size)
    try:
        summary = run_extract(cfg, str(tokens_path), model_dir, str(out), progress=False)
        committed = Manifest(out, cfg.extract.file_format).committed()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    records = list(committed.values())
    n = summary["num_samples"] + summary["num_rejected"]
    ends = pass_ends(committed, summary["samples_per_shard"], rows_per_pass or n, n)
    secs = [summary["loop_s"] - (ends[-1] - ends[0])] + [b - a for a, b in zip(ends, ends[1:])]
    return {"writer_task_gb_s": sorted(r["bytes"] / r["write_s"] / 1e9 for r in records),
            "tok_s": summary["num_tokens"] / summary["loop_s"], "pass_seconds": secs,
            "samples_per_shard": summary["samples_per_shard"], "bytes": summary["bytes"],
            "bytes_per_token": summary["bytes_per_token"], "write_gb_s": summary["bytes"] / summary["loop_s"] / 1e9,
            "num_samples": summary["num_samples"], "num_rejected": summary["num_rejected"],
            "shard_file_bytes": sorted(r["bytes"] for r in records)}


def pass_ends(committed: dict[int, dict], samples_per_shard: int, rows_per_pass: int, rows: int) -> list[float]:
    """Commit time at which each pass over the prompts was done: the latest commit among the shards
    up to the one holding the pass's last row (shards commit out of order; one that straddles two
    passes counts with the later pass)."""
    ends = []
    for last_row in range(rows_per_pass - 1, rows, rows_per_pass):
        last_shard = last_row // samples_per_shard
        ends.append(max(r["committed_at"] for s, r in committed.items() if s <= last_shard))
    return ends


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
             f"Object store: {meta.get('object_store_gib') or 0:.1f} GiB. Every side: tokens/s over passes 2..P of "
             "P passes in one engine life, median over the repeats (order reversed every other repeat); "
             "ratio to (1): paired per repeat, median [min-max].", "",
             "| shape | prompts x len | passes x repeats | (1) plain prefill tok/s | (2) object store | (3) Arrow on disk "
             "| (3b) fp8 on disk | Arrow write GB/s (vs dd) | bytes/token bf16 / fp8 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        def cell(k):
            if not r.get(k + "_tok_s"):
                return "-"
            ratio = r.get(k + "_ratio")
            q = r.get(k + "_ratio_over_repeats") or {"median": ratio, "min": ratio, "max": ratio}
            return f"{r[k + '_tok_s']:,.0f} ({q['median']:.3f}x [{q['min']:.3f}-{q['max']:.3f}])"
        wr = r.get("arrow_disk_write_gb_s")
        dd = meta.get("disk_gb_s")
        lines.append(f"| {r['shape']} (hidden {r['hidden_size']}, {r['num_layers']} layers) | {r['num_prompts']} x "
                     f"{r['prompt_len']} | {r.get('passes', 1)} x {r.get('repeats', 1)} | {r['plain_prefill_tok_s']:,.0f} | "
                     f"{cell('object_store')} | {cell('arrow_disk')} | {cell('arrow_disk_fp8')} | "
                     + ("-" if wr is None else f"{wr:.2f}" + (f" ({wr / dd:.2f}x)" if dd else "")) + " | "
                     f"{r.get('arrow_disk_bytes_per_token', 0):,.0f} / {r.get('arrow_disk_fp8_bytes_per_token', 0):,.0f} |")
    lines += ["", "Single measurements beside them (tokens/s, measured once: no ratio):", "",
              "| shape | (2e) engine + connector + copy to host | (2c) copy into the object store alone | "
              "(1i) plain prefill, engine in process | (2s) object store via shm sink | (4) transformers |",
              "|---|---|---|---|---|---|"]
    for r in results:
        def one(k):
            return f"{r[k + '_tok_s']:,.0f}" if k + "_tok_s" in r else "-"
        store = one("store_only") + (f", {r['store_only_gb_s']:.2f} GB/s" if "store_only_gb_s" in r else "")
        lines.append(f"| {r['shape']} | {one('engine_only')} | {store} | {one('plain_inproc')} | "
                     f"{one('object_store_shm')} | {one('hf')} |")
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
    ap.add_argument("--passes", type=int, default=3,
                    help="passes over the prompts of every side in one engine life; passes 2..P are timed")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of every side, the order reversed every other repeat; ratios are paired per repeat")
    ap.add_argument("--object-store-gib", type=float, default=None,
                    help="object store of the local Ray instance (default: Ray's, 30%% of memory)")
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

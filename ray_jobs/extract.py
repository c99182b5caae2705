"""Extraction driver: engine replicas on placement groups, shards handed out dynamically,
tables written (Arrow IPC or Parquet) by a writer actor next to their engine, each shard committed exactly once.

What crosses this process is small: shard numbers, tokens slices (kilobytes), stats and
object refs. Hidden states go engine actor -> object store -> the node's writer actor -> shard file.
Which shard goes where, what is redone after a loss and when to give up are decided by
eagle3.extract.schedule.ShardScheduler; this module does the Ray side of it: how many replicas of what size
(replica_layout), calling them and writing what they return. Placing and starting them and
classifying failures is actors/replica_pool.py's (also used by the regenerate stage and the online
feed; its names are importable from here too).
Backpressure: a replica holds at most `max_inflight_shards` shards that are extracted
but not yet written, so the object store holds a bounded number of tables.
Failures: a shard whose replica or writer died is handed out again (the run stops once one
shard has been lost max_attempts times: eagle3.extract.schedule); a dead replica is replaced if the
cluster still has room, and the job goes on with the others if not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from actors.replica_pool import ReplicaPool, failure_reason, is_system_failure
from eagle3.config import ExtractConfig, JobConfig
from eagle3.doctor import check_disk, estimate_dataset_bytes, free_bytes, size_text
from eagle3.extract.manifest import Manifest, ShardPlan, tokens_fingerprint
from eagle3.extract.schedule import ShardScheduler
from ray_jobs.metrics import extract_metrics

log = logging.getLogger("eagle3.extract")


def replica_layout(ecfg: ExtractConfig, num_shards_to_do: int, *, engine: bool = True) -> tuple[dict, int]:
    """(bundle of one replica, number of replicas): tensor_parallel_size * pipeline_parallel_size GPUs
    of one node each, or 1 / replicas_per_gpu of one GPU; as many as the cluster's GPUs allow unless
    num_replicas is set, never more than there are shards to do; one CPU each on a CPU-only cluster
    (or for the hf backend: engine=False)."""
    import ray

    gpus_per_replica = ecfg.tensor_parallel_size * ecfg.pipeline_parallel_size
    cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
    use_gpu = cluster_gpus > 0 and engine
    share = gpus_per_replica if ecfg.per_gpu == 1 else gpu_share(ecfg.per_gpu)
    bundle = {"CPU": 1, "GPU": share} if use_gpu else {"CPU": 1}
    num_replicas = ecfg.num_replicas or (
        max(1, cluster_gpus // gpus_per_replica * ecfg.per_gpu) if use_gpu else 1)
    return bundle, min(num_replicas, max(1, num_shards_to_do))


# extract.replicas_per_gpu "auto": a target this small gets AUTO_REPLICAS_PER_GPU engines a GPU, each with
# a KV cache of AUTO_KV_CACHE_BYTES unless kv_cache_memory_bytes is set (the settings chosen in
# benchmarks/results/extraction/replicas-one-gpu-smollm2-shape-h200-2026-12-02.md).
AUTO_REPLICAS_MAX_PARAMS = 500_000_000
AUTO_REPLICAS_PER_GPU = 4
AUTO_KV_CACHE_BYTES = 4 << 30


def given_kv_cache_bytes(ecfg: ExtractConfig) -> int:
    """The KV cache of an engine that shares its GPU with something starting beside it (other replicas,
    online mode's trainer), whose memory profiling would read the other's allocations:
    extract.kv_cache_memory_bytes, or AUTO_KV_CACHE_BYTES where it is null."""
    return ecfg.kv_cache_memory_bytes or AUTO_KV_CACHE_BYTES


def one_gpu_engines(ecfg: ExtractConfig) -> bool:
    """Whether each engine is a vLLM engine of one GPU (no tensor or pipeline parallelism)."""
    return ecfg.backend == "vllm" and ecfg.tensor_parallel_size * ecfg.pipeline_parallel_size == 1


def small_target(ecfg: ExtractConfig, text_cfg: dict, *, gpu: bool) -> tuple[bool, str]:
    """(whether engines of this target share a GPU, why): a target of fewer than
    AUTO_REPLICAS_MAX_PARAMS parameters whose vLLM engines take one GPU each leaves most of a GPU
    idle, so the job starts several of its
    engines a GPU: extraction's and regeneration's replicas (replicas_per_gpu 'auto'), the eval
    stage's engines side by side (eval.engines_at_once 'auto')."""
    if not gpu or not one_gpu_engines(ecfg):
        return False, "engines of whole GPUs, or no GPU"
    params = approx_num_params(text_cfg)
    if params >= AUTO_REPLICAS_MAX_PARAMS:
        return False, f"a {params / 1e9:.2f}B-parameter target keeps one engine busy"
    return True, (f"a {params / 1e9:.2f}B-parameter target, under {AUTO_REPLICAS_MAX_PARAMS / 1e9:.1f}B: one "
                  "engine leaves the GPU idle")


def resolve_replicas_per_gpu(ecfg: ExtractConfig, text_cfg: dict, *, cluster_gpus: int) -> tuple[ExtractConfig, str]:
    """(the extract config with replicas_per_gpu a number, why): 'auto' becomes AUTO_REPLICAS_PER_GPU
    for a small_target on a GPU cluster, else 1; a number stays as given."""
    if ecfg.replicas_per_gpu != "auto":
        return ecfg, "set"
    small, why = small_target(ecfg, text_cfg, gpu=cluster_gpus > 0)
    if not small:
        return dataclasses.replace(ecfg, replicas_per_gpu=1), f"auto: 1 ({why})"
    kv = given_kv_cache_bytes(ecfg)
    return (dataclasses.replace(ecfg, replicas_per_gpu=AUTO_REPLICAS_PER_GPU, kv_cache_memory_bytes=kv),
            f"auto: {AUTO_REPLICAS_PER_GPU} ({why}; KV cache {kv / (1 << 30):.1f} GiB each)")


def approx_num_params(text_cfg: dict) -> int:
    """The language model's parameter count from its config: attention and MLP weights per layer
    (an MoE layer's experts all counted) and the embeddings (twice when untied)."""
    h, layers = text_cfg["hidden_size"], text_cfg["num_hidden_layers"]
    heads = text_cfg.get("num_attention_heads") or 1
    head_dim = text_cfg.get("head_dim") or h // heads
    kv_heads = text_cfg.get("num_key_value_heads") or heads
    attn = h * head_dim * (2 * heads + 2 * kv_heads)
    experts = text_cfg.get("n_routed_experts") or text_cfg.get("num_experts") or text_cfg.get("num_local_experts") or 0
    ffn = (text_cfg.get("moe_intermediate_size") if experts else None) or text_cfg.get("intermediate_size") or 4 * h
    mlp = 3 * h * ffn * max(1, experts)
    embed = text_cfg.get("vocab_size", 0) * h * (1 if text_cfg.get("tie_word_embeddings") else 2)
    return layers * (attn + mlp) + embed


def gpu_share(n: float) -> float:
    """One of n equal shares of a GPU as a Ray resource, rounded down to Ray's 0.0001 granularity
    (n of them must fit in 1: 3 x 0.3333; n = 4 engines / 0.5 of the GPU gives each 1/8)."""
    return int(10_000 / n) / 10_000


def extraction_plan(ecfg, target_dir: str, tokens, tokens_source: str = "prepared"):
    """(ShardPlan, captured layer ids, hidden size, output fingerprint) of extracting `tokens` (a
    table with sample_id and num_tokens). One definition for the extract stage and online mode
    (ray_jobs/online.py): online ranks compute their order from this plan, and online `keep`
    shards must resume as offline ones. tokens_source names where the tokens came from
    ('prepared', or 'regenerated'); it is part of the fingerprint, so a resume never mixes the two."""
    from eagle3.extract.extractor import target_text_config
    from eagle3.schema import stored_bytes_per_token

    text_cfg = target_text_config(target_dir)
    layer_ids = ecfg.layer_ids(text_cfg["num_hidden_layers"])
    plan = ShardPlan.sized(tokens.column("num_tokens").to_pylist(), ecfg.samples_per_shard,
                           stored_bytes_per_token(num_layers=len(layer_ids), hidden_size=text_cfg["hidden_size"],
                                                  hs_dtype=ecfg.hs_dtype), ecfg.shard_bytes)
    fingerprint = tokens_fingerprint(tokens.column("sample_id").to_pylist(), plan.samples_per_shard, layer_ids,
                                     ecfg.hs_dtype, ecfg.file_format)
    if tokens_source != "prepared":  # absent for prepared tokens: outputs written before this key resume
        fingerprint["tokens_source"] = tokens_source
    return plan, layer_ids, text_cfg["hidden_size"], fingerprint


def run_extract(cfg: JobConfig, tokens_path: str, target_dir: str, out_dir: str, *, progress: bool = True,
                tokens_source: str = "prepared") -> dict:
    """Extract hidden states of every sample of tokens_path into out_dir's shards; returns the summary.
    tokens_source names where the tokens came from ('prepared', or 'regenerated' by the regenerate
    stage); it is part of the output's fingerprint, so a resume never mixes the two."""
    import pyarrow.parquet as pq
    import ray

    from actors.extractor import ExtractorActor, max_concurrency
    from actors.writer import Writers
    from eagle3.schema import check_schema

    ecfg = cfg.extract
    t_start = time.perf_counter()
    tokens = pq.read_table(tokens_path)
    check_schema(tokens.schema, "tokens")
    plan, layer_ids, hidden_size, fingerprint = extraction_plan(ecfg, target_dir, tokens, tokens_source)
    manifest = Manifest(Path(out_dir), ecfg.file_format)
    grown = manifest.open(fingerprint, sample_ids=tokens.column("sample_id").to_pylist())
    if grown is not None:
        log.info("extract: the input grew from %d to %d samples (the old ones first, in order): the shards full in "
                 "both plans stay committed%s", grown.num_samples, tokens.num_rows,
                 f"; shard(s) {grown.dropped} dropped, to be done again" if grown.dropped else "")
    committed = manifest.committed()
    sched = ShardScheduler(plan.num_shards, committed, max_inflight_per_replica=ecfg.max_inflight_shards)
    log.info("%s (shards of up to %d samples)", sched.describe_resume("extract"), plan.samples_per_shard)
    num_tokens = tokens.column("num_tokens").to_pylist()
    if left := sum(sum(num_tokens[slice(*plan.rows(s))]) for s in sched.todo):
        need, free = check_room(out_dir, left, len(layer_ids), hidden_size, ecfg.hs_dtype)
        log.info("extract: %d tokens left to extract: %s bytes of hidden states (~%s), %s free at %s", left,
                 f"{need:,}", size_text(need), size_text(free), out_dir)

    summary = {"num_shards": plan.num_shards, "samples_per_shard": plan.samples_per_shard,
               "shards_skipped": len(sched.skipped), "grown": grown._asdict() if grown else None,
               "layer_ids": layer_ids}
    if not sched.finished:
        from eagle3.extract.extractor import target_text_config

        ecfg, why = resolve_replicas_per_gpu(ecfg, target_text_config(target_dir),
                                             cluster_gpus=int(ray.cluster_resources().get("GPU", 0)))
        bundle, num_replicas = replica_layout(ecfg, len(sched.todo), engine=ecfg.backend == "vllm")
        summary["placement"] = {"num_replicas": num_replicas, "bundle": bundle, "replicas_per_gpu": ecfg.per_gpu,
                                "why": why}
        log.info("extract: %d replica(s), each %s; replicas_per_gpu %d (%s)", num_replicas, bundle, ecfg.per_gpu, why)

        writers = Writers(max_concurrency=ecfg.max_inflight_shards * num_replicas)
        pool = ReplicaPool(sched, ExtractorActor, lambda index: ((target_dir, ecfg), dict(
            max_length=cfg.prepare.max_length, dtype=cfg.target.dtype,
            trust_remote_code=cfg.target.trust_remote_code, replica=index)), bundle,
            max_concurrency=max_concurrency(ecfg), what="extraction replica", warm=writers.warm)
        finished = False
        try:
            pool.start(num_replicas, ecfg.placement_timeout_s)
            summary["loop_s"] = _extract_loop(sched, pool, plan, tokens, manifest, committed, ecfg, progress,
                                              writers)
            finished = True
        finally:
            pool.shutdown(graceful=finished)  # after an error, no waiting on engines that may be gone
            if finished:  # after an error, writes in flight finish as before (and end with the driver)
                writers.shutdown()
        summary["replicas"] = pool.summary()
        summary["engine_starts"] = pool.starts
    summary.update(_totals(manifest, plan))
    summary["seconds"] = time.perf_counter() - t_start
    return summary


# The extract stage's own disk check counts the exact tokens: its margin only covers the files' framing.
EXACT_MARGIN = 1.05


def check_room(out_dir: str, num_tokens: int, num_layers: int, hidden_size: int, hs_dtype: str) -> tuple[int, int]:
    """(bytes the hidden states of the num_tokens tokens left to extract take, bytes free under
    out_dir); ValueError, before any engine starts, when they do not fit. The doctor's check beside
    prepare can only estimate them (eagle3.doctor.check_disk, rough); here the tokens are the ones
    extraction reads."""
    need = estimate_dataset_bytes(num_tokens, num_layers, hidden_size, hs_dtype)
    row = check_disk(out_dir, need, EXACT_MARGIN)
    if not row.ok:
        raise ValueError(f"extract: no room for the hidden states of {num_tokens} tokens: {row.detail}; {row.fix}. "
                         "Nothing was extracted; committed shards stay, and a resubmitted job resumes")
    return need, free_bytes(out_dir)


def _extract_loop(sched: ShardScheduler, pool: ReplicaPool, plan: ShardPlan, tokens, manifest: Manifest,
                  committed: dict, ecfg: ExtractConfig, progress: bool, writers) -> float:
    """Dispatch, wait, write, commit, until every shard is committed; returns the loop's seconds
    (the engines' start and shutdown are not extraction)."""
    import ray

    metrics = extract_metrics(plan.num_samples)
    bar = _progress(plan, committed, progress)
    extracting: dict = {}  # stats ref -> (shard, table ref)
    writing: dict = {}  # write ref -> (shard, extract stats)
    tokens_done = 0
    t_loop = time.perf_counter()

    def dispatch():
        for index, shard in sched.assign():
            lo, hi = plan.rows(shard)
            actor = pool.replicas[index].actor
            table_ref, stats_ref = actor.extract_shard.options(num_returns=2).remote(shard, tokens.slice(lo, hi - lo))
            extracting[stats_ref] = (shard, table_ref)

    def lose(shard: int, exc: BaseException, *, replica_died: bool):
        log.warning("shard %d lost (%s); handing it out again", shard, failure_reason(exc))
        index = sched.inflight[shard]
        if sched.lose(shard, failure_reason(exc), replica_died=replica_died):
            pool.replica_lost(index, min(30.0, ecfg.placement_timeout_s))

    dispatch()
    while extracting or writing:
        ready, _ = ray.wait(list(extracting) + list(writing), num_returns=1)
        ref = ready[0]
        if ref in extracting:
            shard, table_ref = extracting.pop(ref)
            try:
                stats = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - classified below, user errors re-raised
                if not is_system_failure(exc):
                    raise
                lose(shard, exc, replica_died=True)
            else:
                writing[writers.write(stats["node_id"], table_ref, str(manifest.data_path(shard)), ecfg.compression,
                                      ecfg.direct_io)] = (shard, stats)
        else:
            shard, stats = writing.pop(ref)
            try:
                wstats = ray.get(ref)
            except Exception as exc:  # noqa: BLE001
                if not is_system_failure(exc):
                    # The writer's own exception (e.g. eagle3.extract.shards.disk_full_error), not Ray's wrapper of it.
                    cause = getattr(exc, "cause", None) or exc
                    raise RuntimeError(f"writing shard {shard} to {manifest.data_path(shard)} failed: {cause}") from exc
                lose(shard, exc, replica_died=False)
            else:
                manifest.commit(shard, {**stats, **wstats, "committed_at": time.time()})
                r = pool.replicas[sched.commit(shard)]
                r.num_tokens += stats["num_tokens"]
                r.busy_s += stats["seconds"]
                tokens_done += stats["num_tokens"]
                metrics.add(samples_done=stats["num_samples"] + stats["num_rejected"], tokens=stats["num_tokens"],
                            bytes_written=wstats["bytes"])
                rate = tokens_done / max(time.perf_counter() - t_loop, 1e-9)
                metrics.rate.set(rate)
                if bar is not None:
                    bar.update(stats["num_samples"] + stats["num_rejected"])
                    bar.set_postfix(tok_s=f"{rate:,.0f}", shards=len(sched.committed))
        pool.ensure_one(ecfg.placement_timeout_s)
        dispatch()
    if bar is not None:
        bar.close()
    return time.perf_counter() - t_loop


def _totals(manifest: Manifest, plan: ShardPlan) -> dict:
    stale = manifest.remove_temp_files()  # every writer has returned or died by now
    if stale:
        log.info("extract: removed %d unfinished temporary files of lost writes (%s)", len(stale), ", ".join(stale[:3]))
    records = manifest.committed()
    if len(records) != plan.num_shards:
        missing = sorted(set(range(plan.num_shards)) - set(records))
        raise RuntimeError(f"extraction ended with shards {missing[:10]} uncommitted")
    rejects = [rej for rec in records.values() for rej in rec.get("rejects", [])]
    (manifest.root / "rejects.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rejects))
    num_tokens = sum(r["num_tokens"] for r in records.values())
    num_bytes = sum(r["bytes"] for r in records.values())
    return {"num_samples": sum(r["num_samples"] for r in records.values()), "num_rejected": len(rejects),
            "num_tokens": num_tokens, "bytes": num_bytes, "bytes_per_token": num_bytes / max(num_tokens, 1),
            "files": manifest.committed_files()}


def _progress(plan: ShardPlan, committed: dict, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    done = sum(r["num_samples"] + r["num_rejected"] for r in committed.values())
    return tqdm(total=plan.num_samples, initial=done, desc="extract", unit="sample", mininterval=2.0)

"""Extraction driver: engine replicas on placement groups, shards handed out dynamically,
tables written (Arrow IPC or Parquet) by tasks next to their engine, each shard committed exactly once.

What crosses this process is small: shard numbers, tokens slices (kilobytes), stats and
object refs. Hidden states go engine actor -> object store -> writer task -> shard file.
Backpressure: a replica holds at most `max_inflight_shards` shards that are extracted
but not yet written, so the object store holds a bounded number of tables.
Failures: a shard whose replica or writer died is handed out again; a dead replica is
replaced if the cluster still has room, and the job goes on with the others if not.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.config import JobConfig
from eagle3.manifest import Manifest, ShardPlan, tokens_fingerprint

log = logging.getLogger("eagle3.extract")


@dataclass
class _Replica:
    index: int
    pg: object
    actor: object
    node_id: str
    alive: bool = True
    load: int = 0
    num_tokens: int = 0
    busy_s: float = 0.0
    shards: list = field(default_factory=list)


class _Metrics:
    def __init__(self, total: int):
        from ray.util.metrics import Counter, Gauge

        self.samples = Counter("eagle3_extract_samples_done", "Samples extracted and committed")
        self.tokens = Counter("eagle3_extract_tokens", "Tokens extracted and committed")
        self.bytes = Counter("eagle3_extract_bytes_written", "Parquet bytes written")
        self.total = Gauge("eagle3_extract_samples_total", "Samples this extraction has to do")
        self.rate = Gauge("eagle3_extract_tokens_per_s_total", "Extraction tokens/s over all replicas")
        self.total.set(total)

    def add(self, samples: int, tokens: int, nbytes: int) -> None:
        for counter, value in ((self.samples, samples), (self.tokens, tokens), (self.bytes, nbytes)):
            if value > 0:  # Ray counters refuse 0
                counter.inc(value)


def _is_system_failure(exc: BaseException) -> bool:
    import ray.exceptions as rex

    kinds = tuple(getattr(rex, n) for n in ("RayActorError", "ActorDiedError", "ActorUnavailableError",
                                              "WorkerCrashedError", "ObjectLostError", "OwnerDiedError",
                                              "NodeDiedError", "ObjectReconstructionFailedError") if hasattr(rex, n))
    return isinstance(exc, kinds)


def run_extract(cfg: JobConfig, tokens_path: str, target_dir: str, out_dir: str, *, progress: bool = True) -> dict:
    import pyarrow.parquet as pq
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    from actors.extractor import ExtractorActor, max_concurrency
    from actors.writer import warm_writer, write_shard
    from eagle3.extract import target_text_config
    from eagle3.schema import check_schema, stored_bytes_per_token
    from ray_jobs.cluster import node_of, wait_placement_groups

    ecfg = cfg.extract
    t_start = time.perf_counter()
    tokens = pq.read_table(tokens_path)
    check_schema(tokens.schema, "tokens")
    text_cfg = target_text_config(target_dir)
    layer_ids = ecfg.layer_ids(text_cfg["num_hidden_layers"])
    plan = ShardPlan.sized(tokens.column("num_tokens").to_pylist(), ecfg.samples_per_shard,
                           stored_bytes_per_token(num_layers=len(layer_ids), hidden_size=text_cfg["hidden_size"],
                                                  hs_dtype=ecfg.hs_dtype), ecfg.shard_bytes)
    manifest = Manifest(Path(out_dir), ecfg.file_format)
    manifest.open(tokens_fingerprint(tokens.column("sample_id").to_pylist(), plan.samples_per_shard, layer_ids,
                                     ecfg.hs_dtype, ecfg.file_format))
    committed = manifest.committed()
    todo = deque(s for s in range(plan.num_shards) if s not in committed)
    skipped = len(committed)
    log.info("extract: %d shards of up to %d samples, %d already committed, %d to do", plan.num_shards,
             plan.samples_per_shard, skipped, len(todo))

    gpus_per_replica = ecfg.tensor_parallel_size * ecfg.pipeline_parallel_size
    cluster_gpus = int(ray.cluster_resources().get("GPU", 0))
    use_gpu = cluster_gpus > 0 and ecfg.backend == "vllm"
    bundle = {"CPU": 1, "GPU": gpus_per_replica} if use_gpu else {"CPU": 1}
    num_replicas = ecfg.num_replicas or (max(1, cluster_gpus // gpus_per_replica) if use_gpu else 1)
    num_replicas = min(num_replicas, max(1, len(todo)))
    actor_cls = ray.remote(ExtractorActor)
    replicas: list[_Replica] = []

    def start_replicas(n: int, timeout_s: float) -> list[_Replica]:
        pgs = [placement_group([bundle], strategy="STRICT_PACK") for _ in range(n)]
        ready = wait_placement_groups(pgs, timeout_s, "extraction replica", bundle)
        for pg in pgs:
            if pg not in ready:
                ray.util.remove_placement_group(pg)
        ready.sort(key=node_of)  # replicas ordered by node
        new = []
        for pg in ready:
            index = len(replicas) + len(new)
            actor = actor_cls.options(
                num_cpus=1, num_gpus=bundle.get("GPU", 0), max_restarts=0, max_concurrency=max_concurrency(ecfg),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            ).remote(target_dir, ecfg, max_length=cfg.prepare.max_length, dtype=cfg.target.dtype,
                     trust_remote_code=cfg.target.trust_remote_code, replica=index)
            new.append(_Replica(index, pg, actor, node_of(pg)))
        warm = [ray.remote(warm_writer).options(
                    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True)).remote()
                for node in {r.node_id for r in new} for _ in range(ecfg.max_inflight_shards)]
        infos = ray.get([r.actor.info.remote() for r in new])  # engine start errors surface here
        ray.get(warm)
        for info in infos:
            log.info("replica %(replica)d on %(host)s (node %(node_id)s): engine up in %(startup_s).1fs", info)
        return new

    summary = {"num_shards": plan.num_shards, "samples_per_shard": plan.samples_per_shard, "shards_skipped": skipped,
               "layer_ids": layer_ids}
    if todo:
        replicas.extend(start_replicas(num_replicas, ecfg.placement_timeout_s))
        metrics = _Metrics(plan.num_samples)
        bar = _progress(plan, committed, progress)
        writer = ray.remote(write_shard)
        extracting: dict = {}  # stats ref -> (replica, shard, table ref)
        writing: dict = {}  # write ref -> (replica, shard, extract stats)
        tokens_done = 0
        num_committed = skipped
        t_loop = time.perf_counter()

        def feed():
            for r in replicas:
                while r.alive and r.load < ecfg.max_inflight_shards and todo:
                    shard = todo.popleft()
                    lo, hi = plan.rows(shard)
                    table_ref, stats_ref = r.actor.extract_shard.options(num_returns=2).remote(shard, tokens.slice(lo, hi - lo))
                    extracting[stats_ref] = (r, shard, table_ref)
                    r.load += 1

        def lose(r: _Replica, shard: int, exc: BaseException, *, replica_died: bool):
            log.warning("shard %d lost (%s: %s); handing it out again", shard, type(exc).__name__, str(exc)[:200])
            todo.appendleft(shard)
            r.load -= 1
            if replica_died and r.alive:
                r.alive = False
                ray.util.remove_placement_group(r.pg)
                try:
                    replicas.extend(start_replicas(1, min(30.0, ecfg.placement_timeout_s)))
                except ValueError as e:
                    log.warning("replica %d not replaced: %s", r.index, e)

        feed()
        while extracting or writing:
            ready, _ = ray.wait(list(extracting) + list(writing), num_returns=1)
            ref = ready[0]
            if ref in extracting:
                r, shard, table_ref = extracting.pop(ref)
                try:
                    stats = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - classified below, user errors re-raised
                    if not _is_system_failure(exc):
                        raise
                    lose(r, shard, exc, replica_died=True)
                else:
                    w = writer.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(stats["node_id"], soft=True))
                    writing[w.remote(table_ref, str(manifest.data_path(shard)), ecfg.compression, ecfg.direct_io)] = (r, shard, stats)
            else:
                r, shard, stats = writing.pop(ref)
                try:
                    wstats = ray.get(ref)
                except Exception as exc:  # noqa: BLE001
                    if not _is_system_failure(exc):
                        raise RuntimeError(f"writing shard {shard} to {manifest.data_path(shard)} failed: {exc}") from exc
                    lose(r, shard, exc, replica_died=False)
                else:
                    manifest.commit(shard, {**stats, **wstats, "committed_at": time.time()})
                    num_committed += 1
                    r.load -= 1
                    r.num_tokens += stats["num_tokens"]
                    r.busy_s += stats["seconds"]
                    r.shards.append(shard)
                    tokens_done += stats["num_tokens"]
                    metrics.add(stats["num_samples"] + stats["num_rejected"], stats["num_tokens"], wstats["bytes"])
                    rate = tokens_done / max(time.perf_counter() - t_loop, 1e-9)
                    metrics.rate.set(rate)
                    if bar is not None:
                        bar.update(stats["num_samples"] + stats["num_rejected"])
                        bar.set_postfix(tok_s=f"{rate:,.0f}", shards=num_committed)
            if todo and not any(r.alive for r in replicas):
                replicas.extend(start_replicas(1, ecfg.placement_timeout_s))
            feed()
        summary["loop_s"] = time.perf_counter() - t_loop  # the engines' shutdown is not extraction
        if bar is not None:
            bar.close()
        for r in replicas:
            if r.alive:
                ray.get(r.actor.shutdown.remote())
                ray.kill(r.actor)
                ray.util.remove_placement_group(r.pg)
        summary["replicas"] = [{"replica": r.index, "node_id": r.node_id, "alive": r.alive, "shards": r.shards,
                                "num_tokens": r.num_tokens,
                                "tokens_per_s": r.num_tokens / r.busy_s if r.busy_s else None} for r in replicas]
    summary.update(_totals(manifest, plan))
    summary["seconds"] = time.perf_counter() - t_start
    return summary


def _totals(manifest: Manifest, plan: ShardPlan) -> dict:
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

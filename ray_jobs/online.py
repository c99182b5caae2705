"""Online driver (`train.source: online`): extraction and training at the same time; hidden
states go from the engines to the training ranks through the Ray object store, not the disk.

    python -m ray_jobs.run --config configs/demo.yaml --set train.source=online

Places the engine replicas first (actors/online_feed.OnlineFeed starts them on their own
placement groups), then the Ray Train (DeepSpeed) worker group on the resources left, and waits
for training; the feed stops with it. Replicas: extract.num_replicas, or by default on a GPU
cluster the GPUs training leaves, (GPUs - train.num_workers) // GPUs per replica; on a CPU
cluster one. The shard plan is the extract stage's (same samples per shard), so a rank's order
is the offline order of the same shards. A resubmitted job resumes training from its last
checkpoint and asks the engines for the samples after it (train.online.epochs: keep, also
reuses the shards committed under hidden_states/).
What crosses this process: configs, counts, one actor handle. Imports neither torch, vllm nor deepspeed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from eagle3.config import JobConfig

log = logging.getLogger("eagle3.online")


def online_replicas(cfg: JobConfig, cluster_gpus: int) -> int:
    """How many engine replicas run next to training (see the module docstring)."""
    e = cfg.extract
    if e.num_replicas is not None:
        return e.num_replicas
    if not cluster_gpus or e.backend != "vllm":
        return 1
    per = e.tensor_parallel_size * e.pipeline_parallel_size
    n = (cluster_gpus - cfg.train.num_workers) // per
    if n < 1:
        raise ValueError(f"train.source=online: the cluster has {cluster_gpus} GPUs, train.num_workers="
                         f"{cfg.train.num_workers} take {cfg.train.num_workers} and an engine replica needs {per}; "
                         "lower train.num_workers, or use train.source=offline (engine and trainer in turn)")
    return n


def run_online(cfg: JobConfig, tokens_path: str, target_dir: str, out: Path, *,
               tokens_source: str = "prepared") -> dict:
    """Extract and train at once; returns the training summary with an `online` section (the
    feed's: extractions, lost and redone shards, peak bytes in flight, who waited how long)."""
    import pyarrow.parquet as pq
    import ray

    from actors.online_feed import OnlineFeed
    from actors.trainer import run_training
    from eagle3.schema import check_schema
    from ray_jobs.extract import extraction_plan, replica_layout

    ecfg = cfg.extract
    tokens = pq.read_table(tokens_path, columns=["sample_id", "num_tokens"])
    check_schema(pq.read_schema(tokens_path), "tokens")
    plan, layer_ids, hidden_size, fingerprint = extraction_plan(ecfg, target_dir, tokens, tokens_source)
    n = online_replicas(cfg, int(ray.cluster_resources().get("GPU", 0)))
    bundle, n = replica_layout(dataclasses.replace(ecfg, num_replicas=n), plan.num_shards,
                               engine=ecfg.backend == "vllm")
    feed = ray.remote(OnlineFeed).options(num_cpus=0, max_concurrency=16 + 4 * cfg.train.num_workers).remote(
        str(Path(tokens_path).resolve()), target_dir, cfg, plan.samples_per_shard, cfg.train.num_workers,
        str(out / "hidden_states"), fingerprint)
    t0 = time.perf_counter()
    ray.get(feed.start.remote(n, bundle))
    online = {"feed": feed, "tokens_path": str(Path(tokens_path).resolve()),
              "samples_per_shard": plan.samples_per_shard,
              "layout": (layer_ids, hidden_size, ecfg.hs_dtype)}
    finished = False
    try:
        summary = run_training(cfg.train, None, target_dir, str(out / "train"), str(out / "draft"), online=online)
        finished = True
    finally:
        try:
            feed_summary = ray.get(feed.stop.remote())
        except Exception:
            if finished:  # the feed's own error; after a training error, that one is the one to see
                raise
            log.exception("online: the feed failed too")
            feed_summary = None
        ray.kill(feed)
    summary["online"] = {**feed_summary, "seconds": round(time.perf_counter() - t0, 2),
                         "samples_per_shard": plan.samples_per_shard, "num_shards": plan.num_shards}
    log.info("online: done; %s", {k: v for k, v in summary["online"].items() if k != "replicas"})
    return summary

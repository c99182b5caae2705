"""Online driver (`train.source: online`): extraction and training at the same time; hidden
states go from the engines to the training ranks through the Ray object store, not the disk.

    python -m ray_jobs.run --config configs/demo.yaml --set train.source=online

Places the engine replicas first (actors/online_feed.OnlineFeed, each on its own placement
group), then the Ray Train (DeepSpeed) worker group on the resources left, while the engines load:
the two start-ups overlap, and the trainer's first batch waits for the engines. The feed stops
with training. How the GPUs are divided is train.online.gpu_split
(split_gpus): 'separate', whole GPUs each (replicas: extract.num_replicas, or the GPUs training
leaves, (GPUs - train.num_workers) // GPUs per replica), or 'shared', one replica on every GPU
taking 1 - train.online.trainer_gpu_fraction of it in its placement-group bundle and the training
workers trainer_gpu_fraction each (Ray Train resources_per_worker): Ray's fractional GPU
resources do the placing. 'auto' picks separate where it fits. On a CPU cluster one replica.
The shard plan is the extract stage's (same samples per shard), so a rank's order is the offline
order of the same shards. The held-out split (prepare.heldout_fraction) is measured as offline: the
plan (and so train.online.epochs keep's shards, offline's layout) holds it, the ranks skip its rows
as offline training does, and the feed's engines extract it first, once more, into shards of its
own under hidden_states_heldout/ (a few seconds of prefill, 2% of the data by default), which every
rank reads at each evaluation: an object-store table reaches one rank once, so it could not be
re-read. A resubmitted job resumes training from its last
checkpoint and asks the engines for the samples after it (train.online.epochs: keep, also
reuses the shards committed under hidden_states/).
What crosses this process: configs, counts, one actor handle. Imports neither torch, vllm nor deepspeed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import JobConfig, check_gpu_sharing

log = logging.getLogger("eagle3.online")


@dataclass(frozen=True)
class GpuSplit:
    """How online mode divides the cluster (split_gpus): the replicas' count and Ray GPU resource,
    each training worker's Ray GPU resource."""

    mode: str
    """'separate' (whole GPUs each), 'shared' (each GPU: one replica and room for one training
    worker) or 'none' (the engines use no GPU: a CPU cluster or the hf backend)."""
    num_replicas: int
    engine_gpus: float
    """Ray GPU resource of one engine replica (0: on CPUs)."""
    trainer_gpus: float
    """Ray GPU resource of one training worker (0: on CPUs)."""

    @property
    def engine_bundle(self) -> dict:
        """The placement-group bundle of one replica (actors.replica_pool.ReplicaPool)."""
        return {"CPU": 1, "GPU": self.engine_gpus} if self.engine_gpus else {"CPU": 1}


def split_gpus(cfg: JobConfig, cluster_gpus: int) -> GpuSplit:
    """The split of train.online.gpu_split on a cluster of cluster_gpus GPUs (its docstring says
    why 'auto' decides as it does). Raises ValueError naming the fields when the split cannot be
    placed or the engine's memory leaves the trainer no room: before any engine starts."""
    e, t = cfg.extract, cfg.train
    mode = t.online.gpu_split
    if not cluster_gpus or e.backend != "vllm":
        if mode == "shared":
            log.warning("train.online.gpu_split=shared is ignored: the engines use no GPU (%s)",
                        "the cluster has none" if not cluster_gpus else f"extract.backend={e.backend}")
        return GpuSplit("none", e.num_replicas or 1, 0.0, 1.0 if cluster_gpus else 0.0)
    per = e.tensor_parallel_size * e.pipeline_parallel_size
    if mode == "auto":
        mode = "separate" if cluster_gpus >= t.num_workers + per else "shared"
        if mode == "shared":
            log.info("online: the cluster's %d GPU(s) cannot hold train.num_workers=%d and a replica of %d GPU(s) "
                     "apart: engine and trainer share each GPU (train.online.gpu_split: auto)",
                     cluster_gpus, t.num_workers, per)
    where = f"train.online.gpu_split={t.online.gpu_split!r} ({mode} on {cluster_gpus} GPUs)"
    if mode == "separate":
        n = e.num_replicas or (cluster_gpus - t.num_workers) // per
        if n < 1 or n * per + t.num_workers > cluster_gpus:
            raise ValueError(f"{where}: the cluster has {cluster_gpus} GPUs, train.num_workers={t.num_workers} take "
                             f"{t.num_workers} and {max(n, 1)} engine replica(s) need {per} each; lower "
                             "train.num_workers or extract.num_replicas, set train.online.gpu_split: shared (engine "
                             "and trainer on the same GPUs), or use train.source=offline (engine and trainer in turn)")
        return GpuSplit("separate", n, float(per), 1.0)
    try:
        check_gpu_sharing(e, t)
    except ValueError as err:
        raise ValueError(f"{err} [{where}]") from None
    if t.num_workers > cluster_gpus:
        raise ValueError(f"{where}: train.num_workers={t.num_workers} is more than the {cluster_gpus} GPUs; sharing "
                         "places at most one training worker per GPU (NCCL refuses two ranks on one GPU): lower it")
    if e.num_replicas not in (None, cluster_gpus):
        # A GPU without its replica would have room for two training workers in Ray's accounting.
        raise ValueError(f"{where}: extract.num_replicas={e.num_replicas}: sharing places one engine replica on "
                         f"every GPU; set it to null or {cluster_gpus}")
    frac = t.online.trainer_gpu_fraction
    return GpuSplit("shared", cluster_gpus, round(1 - frac, 4), frac)


def shared_engine_config(cfg: JobConfig, split: GpuSplit) -> JobConfig:
    """The job config the engines start with. Shared GPUs: the training worker sets up on the same GPU
    while the engine starts (run_online overlaps the two), and vLLM's memory profiling reads the
    device's free memory, which the trainer changes meanwhile (vLLM 0.26 asserts when it grows, and
    counts the trainer's allocations as its own); so the engine's KV cache is given, not profiled:
    ray_jobs.extract.given_kv_cache_bytes (prefill-only extraction holds max_num_batched_tokens tokens
    at a time)."""
    from ray_jobs.extract import given_kv_cache_bytes

    if split.mode != "shared" or cfg.extract.kv_cache_memory_bytes is not None:
        return cfg
    kv = given_kv_cache_bytes(cfg.extract)
    log.info("online: the engine's KV cache is %.1f GiB, not profiled (the trainer sets up on the same GPU "
             "meanwhile); extract.kv_cache_memory_bytes sets it", kv / (1 << 30))
    return dataclasses.replace(cfg, extract=dataclasses.replace(cfg.extract, kv_cache_memory_bytes=kv))


def run_online(cfg: JobConfig, tokens_path: str, target_dir: str, out: Path, split: GpuSplit, *,
               tokens_source: str = "prepared") -> dict:
    """Extract and train at once on the cluster divided as `split` says (split_gpus, which the job
    calls once, before any model loads); returns the training summary with an `online` section (the
    feed's: extractions, lost and redone shards, peak bytes in flight, who waited how long)."""
    import pyarrow.parquet as pq
    import ray

    from actors.online_feed import OnlineFeed
    from actors.trainer import run_training
    from eagle3.prepare.heldout import heldout_rows, training_threshold
    from eagle3.schema import check_schema
    from ray_jobs.extract import extraction_plan

    cfg = shared_engine_config(cfg, split)
    ecfg = cfg.extract
    tokens = pq.read_table(tokens_path, columns=["sample_id", "num_tokens"])
    check_schema(pq.read_schema(tokens_path), "tokens")
    plan, layer_ids, hidden_size, fingerprint = extraction_plan(ecfg, target_dir, tokens, tokens_source)
    threshold, heldout = training_threshold(out / "prepared"), None
    held = heldout_rows(tokens, threshold)
    if held.num_rows:
        heldout = {"threshold": threshold, "dir": str(out / "hidden_states_heldout"),
                   "fingerprint": extraction_plan(ecfg, target_dir, held, tokens_source)[3]}
        log.info("online: %d held-out samples (prepare.heldout_fraction) left out of training and extracted first "
                 "into %s, for the held-out accuracy", held.num_rows, heldout["dir"])
    bundle = split.engine_bundle
    # Shared: one replica on every GPU whatever the shard count (split_gpus says why); else no more than shards.
    n = split.num_replicas if split.mode == "shared" else min(split.num_replicas, max(1, plan.num_shards))
    log.info("online: GPU split %s: %d engine replica(s) of %s, %d training worker(s) of %s GPU", split.mode, n,
             bundle, cfg.train.num_workers, split.trainer_gpus)
    feed = ray.remote(OnlineFeed).options(num_cpus=0, max_concurrency=16 + 4 * cfg.train.num_workers).remote(
        str(Path(tokens_path).resolve()), target_dir, cfg, plan.samples_per_shard, cfg.train.num_workers,
        str(out / "hidden_states"), fingerprint, heldout)
    t0 = time.perf_counter()
    ray.get(feed.start.remote(n, bundle))  # placed, still loading: the trainer sets up meanwhile
    online = {"feed": feed, "tokens_path": str(Path(tokens_path).resolve()),
              "samples_per_shard": plan.samples_per_shard, "heldout_threshold": threshold if heldout else 0,
              "layout": (layer_ids, hidden_size, ecfg.hs_dtype)}
    finished = False
    try:
        summary = run_training(cfg.train_config, None, target_dir, str(out / "train"), str(out / "draft"), online=online,
                               gpus_per_worker=split.trainer_gpus or 1.0,
                               heldout_threshold=threshold if heldout is not None else 0)
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
                         "samples_per_shard": plan.samples_per_shard, "num_shards": plan.num_shards,
                         "gpu_split": {**dataclasses.asdict(split), "engine_bundle": bundle, "num_replicas": n}}
    log.info("online: done; %s", {k: v for k, v in summary["online"].items() if k != "replicas"})
    return summary

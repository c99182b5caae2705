"""Regenerate driver: the target rewrites every assistant turn of the prepared conversations
(eagle3/prepare/regenerate.py says how), on engine replicas placed as extraction's are (several a
GPU for a small target: extract.replicas_per_gpu, ray_jobs.extract.small_target), each shard
committed exactly once; then regenerated/tokens.parquet for extraction.

What crosses this process: sample ids, each shard's source messages (text, kilobytes per
conversation) and stats; each replica writes its shard's file itself, and the driver commits
it (eagle3.extract.manifest's protocol, so a crashed run resumes at the first uncommitted shard).
Scheduling and failures as in extraction (eagle3.extract.schedule.ShardScheduler, with
actors.replica_pool.ReplicaPool): a shard whose replica died is handed out again. Progress and
generated tokens/s go to the job log, a progress bar and Ray metrics.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from eagle3.config import JobConfig
from eagle3.extract.manifest import Manifest, ShardPlan
from eagle3.extract.schedule import ShardScheduler
from ray_jobs.metrics import regenerate_metrics

log = logging.getLogger("eagle3.regenerate")

# Shards in flight per replica, all generating at once in its engine (actors/regenerator.py): as
# one shard's last conversations finish, the next ones' fill the engine, and a replica never idles
# while the driver commits and hands out work.
INFLIGHT_PER_REPLICA = 3


def run_regenerate(cfg: JobConfig, tokens_path: str, target_dir: str, out_dir: str, *, progress: bool = True) -> dict:
    """Regenerate the samples of tokens_path (prepare's output) into out_dir; returns the summary,
    whose "tokens" is the regenerated tokens.parquet."""
    import pyarrow.parquet as pq
    import ray

    from actors.regenerator import RegeneratorActor
    from eagle3.prepare.regenerate import (REJECTS_FILE, TOKENS_FILE, conversation_ids, cut_warning, fallback_warning,
                                           finalize, regenerate_fingerprint, reject_warning, resolve_sampling,
                                           sampling_fallbacks, source_messages)
    from actors.replica_pool import ReplicaPool, failure_reason, is_system_failure
    from eagle3.extract.extractor import target_text_config
    from ray_jobs.extract import replica_layout, resolve_replicas_per_gpu

    rcfg, ecfg = cfg.regenerate, cfg.extract
    t_start = time.perf_counter()
    ids = conversation_ids(pq.read_table(tokens_path, columns=["sample_id"]).column("sample_id").to_pylist())
    sampling = resolve_sampling(rcfg, target_dir)
    fallbacks = sampling_fallbacks(rcfg, target_dir)
    plan = ShardPlan(len(ids), rcfg.samples_per_shard)
    manifest = Manifest(Path(out_dir), "parquet")
    grown = manifest.open(regenerate_fingerprint(ids, plan.samples_per_shard, sampling, target=target_dir,
                                                 max_length=cfg.prepare.max_length,
                                                 assistant_only_loss=cfg.prepare.assistant_only_loss,
                                                 chat_template_kwargs=cfg.prepare.chat_template_kwargs, cut=rcfg.cut),
                          sample_ids=ids)
    if grown is not None:  # the input grew: the full shards stay, the finished run's outputs are stale
        for name in (TOKENS_FILE, REJECTS_FILE):
            (Path(out_dir) / name).unlink(missing_ok=True)
        log.info("regenerate: the input grew from %d to %d conversations (the old ones first, in order): the "
                 "shards full in both plans stay committed%s", grown.num_samples, len(ids),
                 f"; shard(s) {grown.dropped} dropped, to be done again" if grown.dropped else "")
    committed = manifest.committed()
    sched = ShardScheduler(plan.num_shards, committed, max_inflight_per_replica=INFLIGHT_PER_REPLICA)
    log.info("%s (up to %d conversations each; temperature %g, top_p %g, max_tokens %d, seed %s)",
             sched.describe_resume("regenerate"), plan.samples_per_shard, sampling.temperature, sampling.top_p,
             sampling.max_tokens, sampling.seed)
    summary = {"num_shards": plan.num_shards, "samples_per_shard": plan.samples_per_shard,
               "shards_skipped": len(sched.skipped), "grown": grown._asdict() if grown else None,
               "sampling": vars(sampling), "sampling_fallbacks": fallbacks}
    warned = False
    if (msg := fallback_warning(fallbacks, sampling)) and not sched.finished:
        log.warning(msg)
    turns = [sum(r.get("num_turns", 0) for r in committed.values()),
             sum(r.get("num_turns_cut_at_max_tokens", 0) for r in committed.values())]
    if not sched.finished:
        wanted = {ids[j] for s in sched.todo for j in range(*plan.rows(s))}
        messages = source_messages(cfg.prepare.conversations, cfg.prepare.max_samples, wanted,
                                   leading_assistant=cfg.prepare.leading_assistant)
        ecfg, why = resolve_replicas_per_gpu(ecfg, target_text_config(target_dir),
                                             cluster_gpus=int(ray.cluster_resources().get("GPU", 0)))
        bundle, num_replicas = replica_layout(ecfg, len(sched.todo))
        summary["placement"] = {"num_replicas": num_replicas, "bundle": bundle, "replicas_per_gpu": ecfg.per_gpu,
                                "why": why}
        log.info("regenerate: %d replica(s), each %s; replicas_per_gpu %d (extract.replicas_per_gpu %s)",
                 num_replicas, bundle, ecfg.per_gpu, why)
        pool = ReplicaPool(sched, RegeneratorActor, lambda index: ((target_dir, rcfg, ecfg, sampling), dict(
            max_length=cfg.prepare.max_length, dtype=cfg.target.dtype, trust_remote_code=cfg.target.trust_remote_code,
            assistant_only_loss=cfg.prepare.assistant_only_loss, replica=index,
            chat_template_kwargs=cfg.prepare.chat_template_kwargs)), bundle,
            max_concurrency=INFLIGHT_PER_REPLICA + 1, what="regeneration replica")
        metrics = regenerate_metrics(plan.num_samples)
        bar = None
        if progress:
            from tqdm import tqdm

            done = sum(r["num_samples"] + r["num_rejected"] for r in committed.values())
            bar = tqdm(total=plan.num_samples, initial=done, desc="regenerate", unit="conv", mininterval=2.0)
        pending: dict = {}  # stats ref -> shard
        gen_tokens = 0
        finished = False

        def dispatch():
            for index, shard in sched.assign():
                lo, hi = plan.rows(shard)
                batch = [(ids[j], messages[ids[j]]) for j in range(lo, hi)]
                ref = pool.replicas[index].actor.regenerate_shard.remote(shard, batch, str(manifest.data_path(shard)))
                pending[ref] = shard

        try:
            pool.start(num_replicas, ecfg.placement_timeout_s)
            t_loop = time.perf_counter()
            dispatch()
            while pending:
                [ref], _ = ray.wait(list(pending), num_returns=1)
                shard = pending.pop(ref)
                try:
                    stats = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - classified below, errors in the work re-raised
                    if not is_system_failure(exc):
                        raise
                    log.warning("regenerate: shard %d lost (%s); handing it out again", shard, failure_reason(exc))
                    index = sched.inflight[shard]
                    if sched.lose(shard, failure_reason(exc), replica_died=True):
                        pool.replica_lost(index, min(30.0, ecfg.placement_timeout_s))
                else:
                    manifest.commit(shard, {**stats, "committed_at": time.time()})
                    r = pool.replicas[sched.commit(shard)]
                    r.num_tokens += stats["num_generated_tokens"]
                    r.busy_s = max(r.busy_s, stats["replica_busy_s"])  # the replica's engine time so far
                    gen_tokens += stats["num_generated_tokens"]
                    turns[0] += stats["num_turns"]
                    turns[1] += stats["num_turns_cut_at_max_tokens"]
                    if not warned and (msg := cut_warning(*turns, sampling, fallbacks)):
                        log.warning(msg)
                        warned = True
                    rate = gen_tokens / max(time.perf_counter() - t_loop, 1e-9)
                    metrics.add(samples_done=stats["num_samples"] + stats["num_rejected"], tokens=stats["num_generated_tokens"])
                    metrics.rate.set(rate)
                    log.info("regenerate: shard %d committed (%d of %d): %d conversations kept, %d rejected, "
                             "%d tokens generated; %.0f generated tokens/s over all replicas", shard,
                             len(sched.committed), plan.num_shards, stats["num_samples"], stats["num_rejected"],
                             stats["num_generated_tokens"], rate)
                    if bar is not None:
                        bar.update(stats["num_samples"] + stats["num_rejected"])
                        bar.set_postfix(tok_s=f"{rate:,.0f}", shards=len(sched.committed))
                pool.ensure_one(ecfg.placement_timeout_s)
                dispatch()
            summary["loop_s"] = time.perf_counter() - t_loop
            finished = True
        finally:
            if bar is not None:
                bar.close()
            pool.shutdown(graceful=finished)
        summary["replicas"] = pool.summary()
        rates = [r["tokens_per_s"] for r in summary["replicas"] if r["tokens_per_s"]]
        summary["tokens_per_s"] = gen_tokens / summary["loop_s"] if summary["loop_s"] else None
        summary["tokens_per_s_per_replica"] = sum(rates) / len(rates) if rates else None
        summary["engine_starts"] = pool.starts
    done = finalize(manifest, plan.num_shards)
    rejects = done.pop("rejects")  # for the warning below; rejects.jsonl holds them
    summary.update(done)
    if not warned and (msg := cut_warning(summary["num_turns"], summary["num_turns_cut_at_max_tokens"], sampling,
                                          fallbacks, final=True)):
        log.warning(msg)
    summary["untrusted"] = [m for m in (fallback_warning(fallbacks, sampling),
                                        cut_warning(summary["num_turns"], summary["num_turns_cut_at_max_tokens"],
                                                    sampling, fallbacks, final=True)) if m]
    if msg := reject_warning(rejects, plan.num_samples, rcfg.cut, sampling.max_tokens,
                             str(Path(out_dir) / "rejects.jsonl")):
        log.warning(msg)
    summary["seconds"] = time.perf_counter() - t_start
    return summary

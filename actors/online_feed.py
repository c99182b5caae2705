"""Ray actor that feeds online training (`train.source: online`): it owns the engine replicas
and hands each hidden-states table's object ref, never the table, to the training rank that
asked for it.

Started by ray_jobs/online.py (num_cpus=0, threaded: the training ranks' calls wait on a
condition while a loop thread dispatches). The decisions (what is asked for, admitted under the
byte budget, dropped after a restart, handed out again after a lost engine) are
eagle3.train.online_feed.FeedState's; this actor does the Ray side: engine replicas on placement groups
(actors.replica_pool.ReplicaPool, as the extract stage), calls, waits, failure classification,
reading committed shards back (train.online.epochs: keep) and writing them in the background,
the held-out split's own shards (extracted once, before any training shard: ray_jobs/online.py says
why), the job log's "who waits for whom" line and the Ray gauges.
Why an actor and not Ray Data: see eagle3/train/online_feed.py.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

log = logging.getLogger("eagle3.online")


class ShardReader:
    """Reads committed shard files back into the object store (train.online.epochs: keep): one
    process, a few reads at a time (threads; Arrow's reads release the GIL), for every read of the
    run. A task per read would start a new worker process nearly every time on a small node, where
    Ray stops idle workers above its soft limit (the node's CPUs) within a second."""

    def read(self, path: str):
        from eagle3.extract.shards import read_shards

        return read_shards([path])


class OnlineFeed:
    def __init__(self, tokens_path: str, target_dir: str, cfg, samples_per_shard: int, num_ranks: int,
                 hidden_states_dir: str, fingerprint: dict, heldout: dict | None = None):
        """cfg: the JobConfig (extract for the engines, prepare.max_length, target, train.online).
        heldout: {'threshold', 'dir', 'fingerprint'} of the held-out split, or None (no split)."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.cfg = cfg
        self.target_dir = target_dir
        self.tokens_path = tokens_path
        self.samples_per_shard = samples_per_shard
        self.num_ranks = num_ranks
        self.hidden_states_dir = hidden_states_dir
        self.fingerprint = fingerprint
        self.lock = threading.Condition()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.state = None
        self.pool = None
        self.heldout = heldout
        self._heldout_files: list[str] | None = None if heldout else []
        self._heldout_summary: dict | None = None

    # -- set-up ---------------------------------------------------------------------------------
    def start(self, num_replicas: int, bundle: dict) -> dict:
        """Place the engines, then start the feed's thread: it waits for the engines to come up, then
        runs the dispatch loop. Returns once the engines are placed, not up: the training worker
        group, placed next around them, sets up while the engines load, and the ranks' first `take`
        waits for them (an engine that fails to start fails that `take`)."""
        import pyarrow.parquet as pq
        import ray

        from actors.extractor import ExtractorActor, max_concurrency
        from actors.replica_pool import ReplicaPool
        from actors.writer import Writers
        from eagle3.extract.extractor import target_text_config
        from eagle3.extract.manifest import Manifest, ShardPlan
        from eagle3.train.online_feed import FeedState
        from eagle3.schema import stored_bytes_per_token

        ecfg, ocfg = self.cfg.extract, self.cfg.train.online
        self.tokens = pq.read_table(self.tokens_path)
        text_cfg = target_text_config(self.target_dir)
        layer_ids = ecfg.layer_ids(text_cfg["num_hidden_layers"])
        bpt = stored_bytes_per_token(num_layers=len(layer_ids), hidden_size=text_cfg["hidden_size"],
                                     hs_dtype=ecfg.hs_dtype)
        num_tokens = self.tokens.column("num_tokens").to_pylist()
        self.plan = ShardPlan(len(num_tokens), self.samples_per_shard)
        shard_bytes = [bpt * sum(num_tokens[lo:hi]) for lo, hi in map(self.plan.rows, range(self.plan.num_shards))]
        self.manifest = None
        on_disk: set[int] = set()
        if ocfg.epochs == "keep":
            self.manifest = Manifest(Path(self.hidden_states_dir), ecfg.file_format)
            self.manifest.open(self.fingerprint)
            on_disk = set(self.manifest.committed())
        self.state = FeedState(shard_bytes, self.num_ranks, max_inflight_bytes=ocfg.max_inflight_bytes,
                               max_inflight_per_replica=ecfg.max_inflight_shards, keep=ocfg.epochs == "keep",
                               on_disk=on_disk)
        self.pool = ReplicaPool(self.state.sched, ExtractorActor, lambda index: ((self.target_dir, ecfg), dict(
            max_length=self.cfg.prepare.max_length, dtype=self.cfg.target.dtype,
            trust_remote_code=self.cfg.target.trust_remote_code, replica=index)), bundle,
            max_concurrency=max_concurrency(ecfg), what="online extraction replica")
        placed = self.pool.place(num_replicas, ecfg.placement_timeout_s)
        self._reader = None  # a ShardReader, once the first shard is read back from disk
        # A ShardWriter per engine node, once its first shard is written (keep, the held-out split); like the
        # reader, it ends with this actor.
        self._writers = Writers(max_concurrency=ecfg.max_inflight_shards * len(placed))
        self._gauges = _Gauges()
        self._thread = threading.Thread(target=self._run, args=(placed,), name="online-feed", daemon=True)
        self._thread.start()
        log.info("online: %d engine replica(s) placed, starting; %d shards of up to %d samples per epoch, %d on "
                 "disk; bound %.1f MB of hidden states waiting in the object store (%.1f MB per training rank)",
                 len(placed), self.plan.num_shards, self.samples_per_shard, len(on_disk),
                 ocfg.max_inflight_bytes / 1e6, self.state.rank_budget / 1e6)
        return {"replicas": [r.index for r in placed], "num_shards": self.plan.num_shards}

    def stop(self) -> dict:
        """Stop the loop and the engines; returns the summary (raises the loop's error, if any)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.pool is not None:
            self.pool.shutdown(graceful=self.error is None)
        if self.manifest is not None:
            self.manifest.remove_temp_files()
        if self.error is not None:
            raise self.error
        return {**self.state.summary(), "replicas": self.pool.summary(), "engine_starts": self.pool.starts,
                "num_shards_on_disk": len(self.state.on_disk), "heldout": self._heldout_summary}

    def ping(self) -> bool:
        return True

    # -- the training ranks' calls --------------------------------------------------------------
    def want(self, rank: int, session: str, epoch: int, shards: list[int]) -> None:
        with self.lock:
            self._raise()
            self.state.want(rank, session, epoch, shards)
            log.info("online: rank %d asks for %d shards of epoch %d", rank, len(shards), epoch)
            self.lock.notify_all()

    def take(self, rank: int, session: str, shard: int, timeout_s: float):
        """('ready', [table ref]) | ('wait', None) after timeout_s | ('cancelled', None)."""
        def poll():
            status, ref = self.state.take(rank, session, shard, time.monotonic())
            return None if status == "wait" else (status, [ref] if ref is not None else None)

        return self._wait(poll, timeout_s)

    def heldout_files(self, timeout_s: float):
        """('ready', the held-out split's committed shard files) | ('wait', None) after timeout_s."""
        return self._wait(lambda: None if self._heldout_files is None else ("ready", self._heldout_files), timeout_s)

    def _wait(self, poll, timeout_s: float):
        """poll()'s answer, called under the lock each time the loop notifies, once it is not None;
        ('wait', None) after timeout_s; the loop's error, raised, if it fails meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while True:
                self._raise()
                if (answer := poll()) is not None:
                    return answer
                left = deadline - time.monotonic()
                if left <= 0:
                    return "wait", None
                self.lock.wait(left)

    def release(self, rank: int, session: str, shard: int) -> None:
        with self.lock:
            self.state.release(rank, session, shard)

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"[online feed] extraction failed: {self.error}") from self.error

    # -- the loop ---------------------------------------------------------------------------------
    def _run(self, placed: list) -> None:
        try:
            for r in self.pool.wait_up(placed):
                log.info("online: engine replica %d is pid %d on %s", r.info["replica"], r.info["pid"], r.info["host"])
            if self.heldout:
                self._extract_heldout()
            self._loop()
        except BaseException as e:  # noqa: BLE001 - handed to every caller (take, stop)
            log.exception("online: the feed's loop failed")
            with self.lock:
                self.error = e
                self.lock.notify_all()

    def _extract_heldout(self) -> None:
        """The held-out split into committed shards of its own under heldout['dir'] (those a resumed job
        committed before are kept), on the live replicas in turn, before the first training shard:
        every rank's first evaluation reads them. An engine lost meanwhile fails the job (a resubmit
        resumes), as the split is a few seconds of prefill."""
        import ray

        from eagle3.extract.manifest import Manifest, ShardPlan
        from eagle3.prepare.heldout import heldout_rows

        t0 = time.perf_counter()
        ecfg = self.cfg.extract
        tokens = heldout_rows(self.tokens, self.heldout["threshold"])
        plan = ShardPlan(tokens.num_rows, self.samples_per_shard)
        manifest = Manifest(Path(self.heldout["dir"]), ecfg.file_format)
        manifest.open(self.heldout["fingerprint"], sample_ids=tokens.column("sample_id").to_pylist())
        done = manifest.committed()
        live = self.pool.live()
        pending = []
        for i, shard in enumerate(s for s in range(plan.num_shards) if s not in done):
            lo, hi = plan.rows(shard)
            r = live[i % len(live)]
            table_ref, stats_ref = r.actor.extract_shard.options(num_returns=2).remote(shard, tokens.slice(lo, hi - lo))
            write_ref = self._writers.write(r.node_id, table_ref, str(manifest.data_path(shard)), ecfg.compression,
                                            ecfg.direct_io)
            pending.append((shard, r, stats_ref, write_ref))
        num_tokens = 0
        for shard, r, stats_ref, write_ref in pending:
            stats, wstats = ray.get([stats_ref, write_ref])
            r.num_tokens += stats["num_tokens"]
            r.busy_s += stats["seconds"]
            num_tokens += stats["num_tokens"]
            manifest.commit(shard, {**{k: v for k, v in stats.items() if k != "replica"}, **wstats,
                                    "committed_at": time.time()})
        files = manifest.committed_files()
        self._heldout_summary = {"num_samples": tokens.num_rows, "num_shards": plan.num_shards,
                                 "num_extracted": len(pending), "num_tokens": num_tokens,
                                 "seconds": round(time.perf_counter() - t0, 2), "dir": self.heldout["dir"]}
        log.info("online: the held-out split (%d samples) in %d shard(s) under %s (%d extracted now), %.1f s",
                 tokens.num_rows, plan.num_shards, self.heldout["dir"], len(pending), time.perf_counter() - t0)
        with self.lock:
            self._heldout_files = files
            self.lock.notify_all()

    def _loop(self) -> None:
        import ray

        from actors.replica_pool import failure_reason, is_system_failure
        from actors.writer import shard_io_actor

        ecfg, ocfg = self.cfg.extract, self.cfg.train.online
        extracting: dict = {}  # stats ref -> (job id, table ref)
        reading: dict = {}  # table ref -> job id
        writing: dict = {}  # write ref -> (shard, stats)
        being_written: set[int] = set()
        t_last = t_log = time.monotonic()
        while not self._stop.is_set():
            with self.lock:
                self.state.admit()
                work = self.state.assign()
                reads = self.state.reads()
            for index, job in work:
                lo, hi = self.plan.rows(job.shard)
                actor = self.pool.replicas[index].actor
                table_ref, stats_ref = actor.extract_shard.options(num_returns=2).remote(
                    job.shard, self.tokens.slice(lo, hi - lo))
                extracting[stats_ref] = (job.id, table_ref)
            if reads and self._reader is None:
                self._reader = shard_io_actor(ShardReader, max_concurrency=4)
            for job in reads:
                reading[self._reader.read.remote(str(self.manifest.data_path(job.shard)))] = job.id
            refs = list(extracting) + list(reading) + list(writing)
            ready = ray.wait(refs, num_returns=1, timeout=0.05)[0] if refs else []
            if not refs:
                time.sleep(0.05)
            for ref in ready:
                if ref in extracting:
                    job_id, table_ref = extracting.pop(ref)
                    try:
                        stats = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - classified below, user errors re-raised
                        if not is_system_failure(exc):
                            raise
                        with self.lock:
                            index = self.state.sched.inflight[job_id]
                            log.warning("online: shard of request %d lost on replica %d (%s); handing it out again",
                                        job_id, index, failure_reason(exc))
                            newly_dead = self.state.lost(job_id, failure_reason(exc), replica_died=True)
                        if newly_dead:
                            self.pool.replica_lost(index, min(30.0, ecfg.placement_timeout_s))
                        continue
                    with self.lock:
                        job = self.state.extracted(job_id, table_ref)
                        self.lock.notify_all()
                    r = self.pool.replicas[stats["replica"]]
                    r.num_tokens += stats["num_tokens"]
                    r.busy_s += stats["seconds"]
                    if self.manifest is not None and job.shard not in self.state.on_disk \
                            and job.shard not in being_written:
                        being_written.add(job.shard)
                        write_ref = self._writers.write(stats["node_id"], table_ref,
                                                        str(self.manifest.data_path(job.shard)), ecfg.compression,
                                                        ecfg.direct_io)
                        writing[write_ref] = (job.shard, stats)
                elif ref in reading:
                    job_id = reading.pop(ref)
                    with self.lock:
                        self.state.extracted(job_id, ref)
                        self.lock.notify_all()
                else:
                    shard, stats = writing.pop(ref)
                    being_written.discard(shard)
                    try:
                        wstats = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - a lost write is written again with the next extraction
                        if not is_system_failure(exc):
                            raise
                        log.warning("online: writing shard %d lost (%s)", shard, failure_reason(exc))
                        with self.lock:
                            self.state.written(shard, ok=False)
                        continue
                    self.manifest.commit(shard, {**{k: v for k, v in stats.items() if k != "replica"}, **wstats,
                                                 "committed_at": time.time()})
                    with self.lock:
                        self.state.written(shard, ok=True)
                        self.lock.notify_all()
            self.pool.ensure_one(ecfg.placement_timeout_s)
            now = time.monotonic()
            with self.lock:
                idle = sum(1 for r in self.state.sched.alive() if r.load == 0)
                self.state.tick(now - t_last, idle)
                self._gauges.set(self.state)
            t_last = now
            if now - t_log >= ocfg.log_every_s:
                t_log = now
                log.info("online: %s", self.describe())

    def describe(self) -> str:
        """One line for the job log: who waits for whom."""
        s = self.state
        return (f"{s.bytes_in_flight / 1e6:.1f} MB waiting in the object store (bound {s.max_inflight_bytes / 1e6:.1f}"
                f" MB, peak {s.peak_bytes / 1e6:.1f}), {s.bytes_held / 1e6:.1f} MB held by training ranks; "
                f"engines idle {s.engine_idle_budget_s:.1f}s waiting for the trainer (bound reached), "
                f"{s.engine_idle_no_request_s:.1f}s with nothing asked; trainer ranks waited "
                f"{', '.join(f'{w:.1f}s' for w in s.trainer_wait_s)} for engines; "
                f"{sum(s.extractions.values())} shard extractions, {s.num_lost} lost")


class _Gauges:
    def __init__(self):
        from ray.util.metrics import Gauge

        self.inflight = Gauge("eagle3_online_bytes_in_flight", "Hidden-state bytes extracting or waiting for a rank")
        self.held = Gauge("eagle3_online_bytes_held", "Hidden-state bytes taken by training ranks and still in use")
        self.idle_budget = Gauge("eagle3_online_engine_idle_budget_s",
                                 "Engine-seconds idle because the trainer is behind (bound reached)")
        self.idle_none = Gauge("eagle3_online_engine_idle_no_request_s", "Engine-seconds idle with nothing asked for")
        self.wait = Gauge("eagle3_online_trainer_wait_s", "Seconds a training rank waited for an engine",
                          tag_keys=("rank",))

    def set(self, s) -> None:
        self.inflight.set(s.bytes_in_flight)
        self.held.set(s.bytes_held)
        self.idle_budget.set(s.engine_idle_budget_s)
        self.idle_none.set(s.engine_idle_no_request_s)
        for rank, w in enumerate(s.trainer_wait_s):
            self.wait.set(w, tags={"rank": str(rank)})

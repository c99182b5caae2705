"""Online mode's bookkeeping (`train.source: online`): which hidden-states tables the training
ranks asked for, which of them the engines extract now, which wait in the object store, and the
back-pressure between the two; kept apart from Ray so that it is tested without a cluster.

How online mode runs: the coordinator actor (actors/online_feed.py) holds one FeedState and the
engine replicas; each training rank (eagle3.train.data.online.OnlineDataset) computes its own order of
an epoch from the prepared tokens alone (the offline order: eagle3.train.data.rows), asks for the
shards it still needs in that order (`want`), and takes each table's object ref (`take`) when it
reaches it; the table never crosses the coordinator, only its ref does.

Why not Ray Data (`ds.map_batches(engine, ActorPoolStrategy) -> streaming_split(n)` into Ray
Train), which streams Arrow blocks with a bounded object-store budget: it does not give what the
training side needs here.
- Exactly once across a restart: Ray Train restarts the worker group from its last checkpoint,
  and a streaming_split iterator has no position to resume from; it restarts its epoch, so the
  samples trained before the checkpoint would be trained twice, or those after it lost. Here a
  rank's checkpoint holds (epoch, samples_seen) and the rank asks again for exactly the shards
  that still hold samples after that position.
- A seeded order: streaming_split hands blocks to whichever split asks first, in the order
  engines finish; the order would depend on timing. Here the order is a function of (seed,
  epoch, rank), the same as offline training's, so a rerun trains the same batches.
- Per-rank budgets: data-parallel ranks step together (a collective per step), so one rank's
  unread tables must not take the budget the other rank waits on; Ray Data's budget is global.
What Ray does here: the object store carries every table from engine to rank (zero-copy reads on
the rank's node), ownership-based reference counting frees a table once its rank drops it, and
actor failures are reported as errors on the refs (a lost extraction is handed out again).

Back-pressure: each rank may have at most max_inflight_bytes / num_ranks of hidden states
extracting or extracted-and-not-taken; a rank with nothing in flight always gets its next shard
(a shard larger than the budget still moves). Engines with no shard wait: that time is counted
as `engine_idle_budget_s` when requests wait for budget (the trainer is behind), as
`engine_idle_no_request_s` otherwise; ranks waiting for a table count `trainer_wait_s`.
Does not own: Ray actors and refs (actors/online_feed.py treats refs as opaque values here), the
order of a rank's samples (eagle3.train.data.online), the dispatch rules to replicas
(eagle3.extract.schedule.ShardScheduler: a unit of work there is one request here, a `Job`).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from eagle3.extract.schedule import ShardScheduler

QUEUED, ADMITTED, READY, TAKEN, DROPPED = "queued", "admitted", "ready", "taken", "dropped"


@dataclass
class Job:
    """One rank's request for one shard's table in one epoch."""

    id: int
    rank: int
    session: str
    epoch: int
    shard: int
    bytes: int
    state: str = QUEUED
    from_disk: bool = False
    waited_for_budget: bool = False
    ref: Any = None


class FeedState:
    def __init__(self, shard_bytes: list[int], num_ranks: int, *, max_inflight_bytes: int,
                 max_inflight_per_replica: int, max_attempts: int = 3, keep: bool = False,
                 on_disk: set[int] | None = None):
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks}: must be >= 1")
        self.shard_bytes = list(shard_bytes)
        self.num_ranks = num_ranks
        self.max_inflight_bytes = max_inflight_bytes
        self.rank_budget = max(1, max_inflight_bytes // num_ranks)
        self.sched = ShardScheduler(0, max_inflight_per_replica=max_inflight_per_replica, max_attempts=max_attempts)
        self.on_disk: set[int] = set(on_disk or ())
        """Shards committed on disk (train.online.epochs: keep): served by reading the file."""
        self.keep = keep
        self.pending_disk: set[int] = set()
        """keep: shards being extracted or written; another request for one waits for its file
        rather than extract it twice."""
        self.jobs: dict[int, Job] = {}
        self.sessions: dict[int, str] = {}
        self.queued: dict[int, deque[int]] = {r: deque() for r in range(num_ranks)}
        self.to_read: deque[int] = deque()
        self.rank_bytes = [0] * num_ranks  # admitted + ready, per rank
        self.held: dict[int, dict[int, int]] = {r: {} for r in range(num_ranks)}  # rank -> {shard: bytes taken}
        self.peak_bytes = 0
        self.extractions: Counter = Counter()  # (epoch, shard) -> times extracted by an engine
        self.num_lost = 0
        self.num_reserved = 0  # requests of a new session served by a table asked for before
        self.num_budget_waits = 0  # requests that waited for their rank's budget (the trainer was behind)
        self.engine_idle_budget_s = 0.0
        self.engine_idle_no_request_s = 0.0
        self.trainer_wait_s = [0.0] * num_ranks
        self._waiting_since: dict[int, float] = {}
        self._next_id = 0

    # -- what the training ranks call -------------------------------------------------------------
    def want(self, rank: int, session: str, epoch: int, shards: list[int]) -> None:
        """Rank `rank` starts reading `epoch` (a new session: a fresh start, a resume, a restart)
        and needs `shards` in this order. Requests of its earlier sessions are cancelled; one for
        the same (epoch, shard) that is extracting or waiting is kept for the new session."""
        self._check_rank(rank)
        old = [j for j in self.jobs.values() if j.rank == rank and j.state in (QUEUED, ADMITTED, READY)]
        by_key = {(j.epoch, j.shard): j for j in old}
        self.sessions[rank] = session
        self.queued[rank].clear()
        self.held[rank].clear()  # what an earlier session of this rank took is gone with it
        self._waiting_since.pop(rank, None)
        kept = set()
        for shard in shards:
            job = by_key.pop((epoch, shard), None)
            if job is not None and job.state in (ADMITTED, READY):
                job.session = session
                kept.add(job.id)
                self.num_reserved += 1
                continue
            self._new_job(rank, session, epoch, shard)
        for job in by_key.values():
            self._drop(job)

    def take(self, rank: int, session: str, shard: int, now: float) -> tuple[str, Any]:
        """('ready', table ref) and the rank holds the table from now on; ('wait', None) while it is
        not extracted yet; ('cancelled', None) when a newer session of the rank replaced this one."""
        self._check_rank(rank)
        if self.sessions.get(rank) != session:
            return "cancelled", None
        job = next((j for j in self.jobs.values() if j.rank == rank and j.session == session and j.shard == shard
                    and j.state in (QUEUED, ADMITTED, READY)), None)
        if job is None:
            raise AssertionError(f"rank {rank} takes shard {shard}, which its session {session} did not ask for")
        if job.state != READY:
            self._waiting_since.setdefault(rank, now)
            return "wait", None
        since = self._waiting_since.pop(rank, None)
        if since is not None:
            self.trainer_wait_s[rank] += now - since
        ref, job.ref, job.state = job.ref, None, TAKEN
        self.rank_bytes[rank] -= job.bytes
        self.held[rank][shard] = job.bytes
        del self.jobs[job.id]
        return "ready", ref

    def release(self, rank: int, session: str, shard: int) -> None:
        """The rank has emitted the last row it needed of the shard and dropped the table."""
        if self.sessions.get(rank) == session:
            self.held[rank].pop(shard, None)

    # -- what the coordinator's loop calls ------------------------------------------------------
    def admit(self) -> None:
        """Move queued requests into work while each rank's budget allows, ranks in turn."""
        moved = True
        while moved:
            moved = False
            for rank in range(self.num_ranks):
                q = self.queued[rank]
                if not q:
                    continue
                job = self.jobs[q[0]]
                if self.rank_bytes[rank] and self.rank_bytes[rank] + job.bytes > self.rank_budget:
                    if not job.waited_for_budget:
                        job.waited_for_budget = True
                        self.num_budget_waits += 1
                    continue
                if self.keep and job.shard not in self.on_disk:
                    if job.shard in self.pending_disk:
                        continue  # its file is on the way
                    self.pending_disk.add(job.shard)
                q.popleft()
                job.state = ADMITTED
                self.rank_bytes[rank] += job.bytes
                if job.shard in self.on_disk:
                    job.from_disk = True
                    self.to_read.append(job.id)
                else:
                    self.sched.add([job.id])
                moved = True
        self.peak_bytes = max(self.peak_bytes, self.bytes_in_flight)

    def assign(self) -> list[tuple[int, Job]]:
        """(replica, job) pairs to hand to engines now."""
        return [(replica, self.jobs[job_id]) for replica, job_id in self.sched.assign()]

    def reads(self) -> list[Job]:
        """Admitted requests for shards on disk, to be read into the object store."""
        out = [self.jobs[i] for i in self.to_read]
        self.to_read.clear()
        return out

    def extracted(self, job_id: int, ref: Any) -> Job:
        """An engine (or a read of a shard on disk) delivered the table; returns the job (state
        DROPPED when no session wants it any more: the caller lets the ref go)."""
        job = self.jobs[job_id]
        if not job.from_disk:
            self.sched.commit(job_id)
            self.extractions[(job.epoch, job.shard)] += 1
        if job.state == DROPPED:
            del self.jobs[job_id]
            return job
        job.state, job.ref = READY, ref
        return job

    def lost(self, job_id: int, reason: str, *, replica_died: bool) -> bool:
        """The extraction failed for the cluster's reasons: hand it out again (eagle3.extract.schedule's
        rules, ShardFailed after max_attempts). True when its replica is newly dead."""
        self.num_lost += 1
        job = self.jobs[job_id]
        newly_dead = self.sched.lose(job_id, reason, replica_died=replica_died)
        if job.state == DROPPED:  # nobody wants it: do not redo it
            self.sched.todo.remove(job_id)
            del self.jobs[job_id]
            self.pending_disk.discard(job.shard)
        return newly_dead

    def written(self, shard: int, ok: bool) -> None:
        """keep: the shard's file is committed (ok), or its write was lost (extract it again when asked)."""
        self.pending_disk.discard(shard)
        if ok:
            self.on_disk.add(shard)

    def tick(self, dt: float, idle_replicas: int) -> None:
        """`dt` seconds passed with `idle_replicas` alive replicas holding no work."""
        if idle_replicas:
            waiting = any(self.queued[r] for r in range(self.num_ranks))
            if waiting:
                self.engine_idle_budget_s += dt * idle_replicas
            else:
                self.engine_idle_no_request_s += dt * idle_replicas

    # -- figures --------------------------------------------------------------------------------
    @property
    def bytes_in_flight(self) -> int:
        """Hidden-state bytes extracting, or extracted and not yet taken by their rank."""
        return sum(self.rank_bytes)

    @property
    def bytes_held(self) -> int:
        return sum(sum(h.values()) for h in self.held.values())

    def summary(self) -> dict:
        total = sum(self.extractions.values())
        return {"num_extractions": total, "num_shard_epochs": len(self.extractions),
                "num_reextracted": total - len(self.extractions), "num_lost": self.num_lost,
                "num_reserved": self.num_reserved, "num_budget_waits": self.num_budget_waits,
                "peak_bytes_in_flight": self.peak_bytes,
                "max_inflight_bytes": self.max_inflight_bytes,
                "engine_idle_budget_s": round(self.engine_idle_budget_s, 3),
                "engine_idle_no_request_s": round(self.engine_idle_no_request_s, 3),
                "trainer_wait_s": [round(w, 3) for w in self.trainer_wait_s]}

    # -- internals ------------------------------------------------------------------------------
    def _new_job(self, rank: int, session: str, epoch: int, shard: int) -> Job:
        if not 0 <= shard < len(self.shard_bytes):
            raise ValueError(f"rank {rank} asks for shard {shard}; the plan has {len(self.shard_bytes)} shards")
        job = Job(self._next_id, rank, session, epoch, shard, self.shard_bytes[shard])
        self._next_id += 1
        self.jobs[job.id] = job
        self.queued[rank].append(job.id)
        return job

    def _drop(self, job: Job) -> None:
        if job.state == QUEUED:
            del self.jobs[job.id]
            return
        self.rank_bytes[job.rank] -= job.bytes  # ADMITTED or READY held budget
        if job.state == READY:  # its ref goes with it
            del self.jobs[job.id]
            return
        # ADMITTED: forgotten if nothing has started it, else its result is dropped when it arrives
        if job.from_disk and job.id in self.to_read:
            self.to_read.remove(job.id)
            del self.jobs[job.id]
        elif not job.from_disk and job.id in self.sched.todo:
            self.sched.todo.remove(job.id)
            del self.jobs[job.id]
            self.pending_disk.discard(job.shard)
        else:
            job.state = DROPPED

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank}: the feed serves ranks 0..{self.num_ranks - 1}")

"""Which shard goes to which engine replica next, and what happens when one is lost: the
decisions of a sharded stage (extraction, regeneration), kept apart from Ray so that they can
be tested without a cluster.

Owns: the state of a run over a shard plan (shards to do, in flight on which replica,
committed, failures per shard), the state of each replica (alive, its shards in flight, its
shards done) and these rules:
- dispatch: replicas in the order they joined, each filled up to `max_inflight_per_replica`
  shards; shards in ascending order, a shard handed back first;
- a shard lost with its replica, or whose write failed, goes back to the front of the queue
  and is handed out again; its replica, when it died, gets no more work;
- give up (ShardFailed) when one shard has been lost `max_attempts` times: it is then most
  likely the shard that kills its engine (a sample that runs it out of memory), and handing
  it out again would take down every replica in turn;
- `needs_replica`: shards remain and no replica is alive; the driver must place a new one,
  or end the run (it gives up when none can be placed).
Shards committed before this run (a resume) are never handed out.
Does not own: actors, placement groups, object refs and what a shard's work is (ray_jobs/),
the files and the commit protocol (eagle3.extract.manifest).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable


class ShardFailed(RuntimeError):
    """A shard was lost too many times; the run stops rather than retry it forever."""


@dataclass
class ReplicaState:
    index: int
    alive: bool = True
    inflight: set[int] = field(default_factory=set)
    """Shards handed to this replica and neither committed nor lost yet."""
    done: list[int] = field(default_factory=list)
    """Shards this replica committed, in commit order."""

    @property
    def load(self) -> int:
        return len(self.inflight)


class ShardScheduler:
    def __init__(self, num_shards: int, committed: Iterable[int] = (), *, max_inflight_per_replica: int,
                 max_attempts: int = 3):
        if max_inflight_per_replica < 1:
            raise ValueError(f"max_inflight_per_replica={max_inflight_per_replica}: must be >= 1, or no shard "
                             "is ever handed out")
        if max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts}: must be >= 1")
        self.num_shards = num_shards
        self.max_inflight = max_inflight_per_replica
        self.max_attempts = max_attempts
        self.skipped = sorted(s for s in set(committed) if 0 <= s < num_shards)
        """Shards committed before this run started."""
        self.committed: set[int] = set(self.skipped)
        self.todo: deque[int] = deque(s for s in range(num_shards) if s not in self.committed)
        self.inflight: dict[int, int] = {}
        """shard -> index of the replica it was handed to."""
        self.failures: dict[int, list[str]] = {}
        """shard -> why each of its lost attempts was lost."""
        self.replicas: dict[int, ReplicaState] = {}

    # Replicas -----------------------------------------------------------------------------------
    def add_replica(self) -> int:
        """A new replica joins; returns its index (replicas are numbered in joining order)."""
        index = len(self.replicas)
        self.replicas[index] = ReplicaState(index)
        return index

    def alive(self) -> list[ReplicaState]:
        return [r for r in self.replicas.values() if r.alive]

    def needs_replica(self) -> bool:
        """Work is left that no replica can take: the driver places a new replica or gives up."""
        return bool(self.todo) and not self.alive()

    # Shards -------------------------------------------------------------------------------------
    def add(self, shards: Iterable[int]) -> None:
        """Work that arrives while the run goes on, queued after what is there (online mode: a unit is
        one training rank's request for a shard, numbered by the caller, eagle3.train.online_feed.FeedState)."""
        for s in shards:
            if s in self.committed or s in self.inflight or s in self.todo:
                raise AssertionError(f"work {s} is already queued, in flight or committed")
            self.todo.append(s)
            self.num_shards = max(self.num_shards, s + 1)

    def assign(self) -> list[tuple[int, int]]:
        """(replica, shard) pairs to dispatch now; they count as in flight from here on. Round-robin,
        one shard a replica a pass: when there are fewer shards than slots (4 replicas with 3 slots
        each, 9 shards), every replica gets work (3, 2, 2, 2), not the first ones all of it."""
        out = []
        while self.todo:
            open_ = [r for r in self.replicas.values() if r.alive and r.load < self.max_inflight]
            if not open_:
                break
            for r in open_:
                if not self.todo:
                    break
                shard = self.todo.popleft()
                r.inflight.add(shard)
                self.inflight[shard] = r.index
                out.append((r.index, shard))
        return out

    def commit(self, shard: int) -> int:
        """The shard's commit record is written; returns the replica that did it."""
        replica = self._release(shard)
        self.committed.add(shard)
        self.replicas[replica].done.append(shard)
        return replica

    def lose(self, shard: int, reason: str, *, replica_died: bool) -> bool:
        """The shard's work is lost (its replica died, or writing it failed): hand it out again.
        Returns True when this marks its replica dead for the first time (the driver then frees
        the replica's resources and may place a replacement). Raises ShardFailed once the shard
        has been lost max_attempts times."""
        replica = self._release(shard)
        self.failures.setdefault(shard, []).append(reason)
        newly_dead = replica_died and self.replicas[replica].alive
        if newly_dead:
            self.replicas[replica].alive = False
        if len(self.failures[shard]) >= self.max_attempts:
            raise ShardFailed(
                f"shard {shard} was lost {len(self.failures[shard])} times (max_attempts={self.max_attempts}), "
                f"giving up; why each time: {self.failures[shard]}. A shard that keeps killing its engine "
                "usually holds a sample it cannot take (memory): look at the replicas' logs")
        self.todo.appendleft(shard)
        return newly_dead

    def _release(self, shard: int) -> int:
        if shard not in self.inflight:
            raise AssertionError(f"shard {shard} is not in flight (in flight: {sorted(self.inflight)})")
        replica = self.inflight.pop(shard)
        self.replicas[replica].inflight.discard(shard)
        return replica

    @property
    def finished(self) -> bool:
        return not self.todo and not self.inflight

    def describe_resume(self, what: str) -> str:
        """One line for the job log: what a resumed run skips."""
        return (f"{what}: {len(self.skipped)} of {self.num_shards} shards already committed, "
                f"{self.num_shards - len(self.skipped)} to do")

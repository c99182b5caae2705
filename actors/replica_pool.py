"""Engine replicas on placement groups, and how their failures are classified: the Ray side that
the extract and regenerate drivers (ray_jobs/extract.py, ray_jobs/regenerate.py) and the online
feed actor (actors/online_feed.py) share.

Owns: placing each replica alone on a STRICT_PACK placement group of one bundle, with a timeout
that explains itself (`wait_placement_groups`), starting, replacing and shutting down its actor
(`ReplicaPool`), and telling a lost actor, node or object from an error in the work
(`is_system_failure`). Does not own: which shard goes where, what is redone and when to give up
(eagle3.extract.schedule.ShardScheduler), how many replicas of what size (ray_jobs.extract.replica_layout).
Here rather than in ray_jobs/ because an actor (the online feed) runs a pool, and actors/ imports
no driver (tests/test_layering.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from eagle3.extract.schedule import ShardScheduler

log = logging.getLogger("eagle3.extract")  # the extract stage's logger, as before the move


@dataclass
class Replica:
    """The Ray side of one engine replica (its scheduling state is the scheduler's)."""

    index: int
    pg: object
    actor: object
    node_id: str
    num_tokens: int = 0
    busy_s: float = 0.0
    info: dict | None = None
    """The actor's info() once its engine is up (wait_up)."""


class ReplicaPool:
    """Engine actors, each alone on a STRICT_PACK placement group of one bundle, numbered by the
    scheduler. `start` raises the ValueError of wait_placement_groups when no replica can be
    placed in time: that is how a run with no replica left gives up."""

    def __init__(self, sched: ShardScheduler, actor_cls: type, actor_args: Callable[[int], tuple[tuple, dict]],
                 bundle: dict, *, max_concurrency: int, what: str, warm: Callable[[set], list] | None = None):
        import ray

        self.sched = sched
        self.actor_cls = ray.remote(actor_cls)
        self.actor_args = actor_args  # replica index -> (args, kwargs) of the actor's constructor
        self.bundle = bundle
        self.max_concurrency = max_concurrency
        self.what = what
        self.warm = warm  # new replicas' node ids -> refs of tasks to wait for along with the engines
        self.replicas: dict[int, Replica] = {}
        self.starts: list[dict] = []  # each engine start: replica, host, startup_s, dtype (the job's summary)
        # and, where the actor says, enforce_eager and in_process (its engine core in the actor's process);
        # placement_s: how long its placement group waited for the cluster (an earlier stage's engines to end)
        self.placement_s = 0.0

    def start(self, n: int, timeout_s: float) -> list[Replica]:
        """Place up to n replicas (`place`) and wait for their engines (`wait_up`)."""
        return self.wait_up(self.place(n, timeout_s))

    def place(self, n: int, timeout_s: float) -> list[Replica]:
        """Reserve up to n placement groups and create an actor on each; returns once the groups
        are placed, while the engines are still loading (`wait_up` waits for them). Whatever the
        cluster places after this call places around these replicas' resources."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pgs = [placement_group([self.bundle], strategy="STRICT_PACK") for _ in range(n)]
        t = time.perf_counter()
        ready = wait_placement_groups(pgs, timeout_s, self.what, self.bundle)
        self.placement_s = time.perf_counter() - t  # the wait for the cluster to free the bundles
        for pg in pgs:
            if pg not in ready:
                ray.util.remove_placement_group(pg)
        ready.sort(key=node_of)  # replicas ordered by node
        new = []
        for pg in ready:
            index = self.sched.add_replica()
            args, kwargs = self.actor_args(index)
            actor = self.actor_cls.options(
                num_cpus=1, num_gpus=self.bundle.get("GPU", 0), max_restarts=0, max_concurrency=self.max_concurrency,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            ).remote(*args, **kwargs)
            new.append(Replica(index, pg, actor, node_of(pg)))
            self.replicas[index] = new[-1]
        return new

    def wait_up(self, new: list[Replica]) -> list[Replica]:
        """Wait for placed replicas' engines (an engine's start error is raised here); records
        each start in `starts`."""
        import ray

        warm = self.warm({r.node_id for r in new}) if self.warm else []
        infos = ray.get([r.actor.info.remote() for r in new])  # engine start errors surface here
        ray.get(warm)
        for r, info in zip(new, infos):
            r.info = info
            log.info("%s %d on %s (node %s): engine up in %.1fs, computing in %s", self.what, info["replica"],
                     info["host"], info["node_id"], info["startup_s"], info.get("dtype"))
            self.starts.append({k: info.get(k) for k in ("replica", "host", "startup_s", "dtype")}
                               | {k: info[k] for k in ("enforce_eager", "in_process") if k in info}
                               | {"placement_s": round(self.placement_s, 2)})
        return new

    def replica_lost(self, index: int, timeout_s: float) -> None:
        """Free a dead replica's placement group and try to place a replacement within timeout_s
        (keep it short: the run goes on with the others when the cluster has no room)."""
        import ray

        ray.util.remove_placement_group(self.replicas[index].pg)
        try:
            self.start(1, timeout_s)
        except ValueError as e:
            log.warning("%s %d not replaced: %s", self.what, index, e)

    def ensure_one(self, timeout_s: float) -> None:
        """Shards are left and no replica is alive: place one, or give up (ValueError)."""
        if self.sched.needs_replica():
            self.start(1, timeout_s)

    def live(self) -> list[Replica]:
        """The replicas whose engines the scheduler counts alive."""
        return [r for r in self.replicas.values() if self.sched.replicas[r.index].alive]

    def shutdown(self, graceful: bool = True) -> None:
        """Release every live replica. graceful: each engine first ends its own processes (its
        `shutdown`), all of them at once: an engine core takes seconds to stop, so stopping replicas one
        after the other delays the stage's end by as many stops."""
        import ray

        live = self.live()
        try:
            if graceful:
                ray.get([r.actor.shutdown.remote() for r in live])
        finally:
            for r in live:
                ray.kill(r.actor)
                ray.util.remove_placement_group(r.pg)

    def summary(self) -> list[dict]:
        return [{"replica": r.index, "node_id": r.node_id, "alive": self.sched.replicas[r.index].alive,
                 "shards": self.sched.replicas[r.index].done, "num_tokens": r.num_tokens,
                 "tokens_per_s": r.num_tokens / r.busy_s if r.busy_s else None} for r in self.replicas.values()]


def wait_placement_groups(pgs: list, timeout_s: float, what: str, bundle: dict) -> list:
    """Wait for placement groups; return those ready. None ready in time: a ValueError that says
    what was asked, what the cluster has, and what to check."""
    import ray

    refs = {pg.ready(): pg for pg in pgs}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    got = [refs[r] for r in ready]
    if not got:
        total = ray.cluster_resources()
        avail = ray.available_resources()
        for pg in pgs:
            ray.util.remove_placement_group(pg)
        raise ValueError(
            f"no {what} could be placed within {timeout_s:.0f}s: each needs {bundle} on ONE node; "
            f"cluster total {_fmt(total)}, available now {_fmt(avail)}. Check `ray status` (are the GPU nodes up? "
            "does one node have tensor_parallel_size * pipeline_parallel_size GPUs?), other jobs holding GPUs, "
            "or raise the timeout (extract.placement_timeout_s)")
    return got


def node_of(pg) -> str:
    import ray

    table = ray.util.placement_group_table(pg)
    return next(iter(table["bundles_to_node_id"].values()))


def _fmt(res: dict) -> str:
    keep = {k: v for k, v in res.items() if k in ("CPU", "GPU", "memory") or not k.startswith("node:")}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items()) if k != "memory") + "}"


def is_system_failure(exc: BaseException) -> bool:
    """A failure of the cluster (an actor, a node, an object lost), after which the work is redone;
    anything else is an error in the work itself and ends the run."""
    import ray.exceptions as rex

    kinds = tuple(getattr(rex, n) for n in ("RayActorError", "ActorDiedError", "ActorUnavailableError",
                                              "WorkerCrashedError", "ObjectLostError", "OwnerDiedError",
                                              "NodeDiedError", "ObjectReconstructionFailedError") if hasattr(rex, n))
    return isinstance(exc, kinds)


def failure_reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"

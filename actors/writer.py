"""Writes extracted shards (Arrow IPC or Parquet: eagle3.extract.shards) in one ShardWriter actor per
node, next to the engines that made the tables (node affinity), so a table crosses no network; the
caller commits a shard in the manifest once its write returns. Used by the extract stage
(ray_jobs/extract.py) and the online feed (actors/online_feed.py)."""

from __future__ import annotations

import os
import time


def write_shard(table, path: str, compression: str | None, direct_io: bool = True) -> dict:
    """Stats of the write, committed with the shard; writer_pid is the pid a lost write's temporary file names."""
    from eagle3.extract.shards import write_shard_file

    t0 = time.perf_counter()
    size = write_shard_file(table, path, compression, direct_io)
    return {"bytes": size, "write_s": time.perf_counter() - t0, "rows": len(table),
            "hs_bytes": table.column("hidden_states").nbytes, "writer_pid": os.getpid()}


class ShardWriter:
    """Every write of a run on one node, in one process, several at a time (threads: Arrow's writes,
    the copies into DirectFile's buffers and pwrite release the GIL). A task per write would start a
    new worker process nearly every time on a small node, where Ray stops idle workers above its soft
    limit (the node's CPUs) within a second, so workers warmed while the engines load are gone by the
    first write."""

    def ready(self) -> None:
        """Imports what a write needs, called while the engines load: the first shards' writes then
        wait for no process start or import inside the extraction loop."""
        import eagle3.extract.shards  # noqa: F401 - the import is the point

    def write(self, table, path: str, compression: str | None, direct_io: bool = True) -> dict:
        return write_shard(table, path, compression, direct_io)


def shard_io_actor(cls, *, max_concurrency: int, node_id: str | None = None):
    """An actor of `cls` for shard files (ShardWriter, the online feed's ShardReader): no CPU of its
    own (it waits on the disk), `max_concurrency` calls at a time (threads), and restarted where its
    process dies, the calls in flight then run again (as Ray retries a task). On node_id where given
    (soft: one whose node is gone restarts on another)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    placement = {} if node_id is None else {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=True)}
    return ray.remote(cls).options(num_cpus=0, max_concurrency=max_concurrency, max_restarts=-1, max_task_retries=3,
                                   **placement).remote()


class Writers:
    """The run's ShardWriters, one per node, each created on the first write (or `warm`) for its
    node. max_concurrency: threads of each, at least the writes that can be in flight on one node
    (shards in flight per replica x replicas). A writer's process that dies is restarted and its
    writes in flight are written again, as Ray retried a task: every write in flight on that node is
    lost at once, each leaving its temporary file (a writer's pid in its name), which the end of the
    run removes."""

    def __init__(self, max_concurrency: int):
        self.max_concurrency = max_concurrency
        self.actors: dict[str, object] = {}  # node id -> ShardWriter actor

    def on(self, node_id: str):
        if node_id not in self.actors:
            # A writer whose node is gone restarts on another; the tables it was writing went with the node,
            # so those writes fail as lost and their shards are handed out again.
            self.actors[node_id] = shard_io_actor(ShardWriter, max_concurrency=self.max_concurrency, node_id=node_id)
        return self.actors[node_id]

    def warm(self, nodes: set) -> list:
        """Refs that are ready once each node's writer has started and imported (ReplicaPool's `warm`)."""
        return [self.on(node).ready.remote() for node in nodes]

    def write(self, node_id: str, table_ref, path: str, compression: str | None, direct_io: bool):
        """The ref of write_shard's stats, written on node_id's writer."""
        return self.on(node_id).write.remote(table_ref, path, compression, direct_io)

    def shutdown(self) -> None:
        """Only once every write has returned: a write in flight would leave its temporary file."""
        import ray

        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()

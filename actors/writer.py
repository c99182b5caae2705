"""Writes one extracted shard (Arrow IPC or Parquet: eagle3.extract.shards). Runs as a Ray task next
to the engine that made the table (node affinity), so the table crosses no network; the
caller commits the shard in the manifest once this returns."""

from __future__ import annotations

import time


def write_shard(table, path: str, compression: str | None, direct_io: bool = True) -> dict:
    from eagle3.extract.shards import write_shard_file

    t0 = time.perf_counter()
    size = write_shard_file(table, path, compression, direct_io)
    return {"bytes": size, "write_s": time.perf_counter() - t0, "rows": len(table),
            "hs_bytes": table.column("hidden_states").nbytes}


def warm_writer(hold_s: float = 1.0) -> None:
    """Started once per shard in flight on each engine's node while the engines load: Ray starts
    a worker process per concurrent task, and this one imports what write_shard needs, so the
    first shards' writes do not wait for worker start-up inside the extraction loop. Holding
    `hold_s` keeps the tasks concurrent (one worker each)."""
    import eagle3.extract.shards  # noqa: F401 - the import is the point

    time.sleep(hold_s)

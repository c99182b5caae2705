"""Writes one extracted shard to Parquet. Runs as a Ray task next to the engine that made
the table (node affinity), so the table crosses no network; the caller commits the shard
in the manifest once this returns."""

from __future__ import annotations

import os
import time
from pathlib import Path

ROW_GROUP_BYTES = 128 << 20


def write_shard(table, path: str, compression: str | None) -> dict:
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    # Row groups of ~128 MB: a reader holds a whole row group's hidden states in memory.
    per_row = max(1, table.nbytes // max(len(table), 1))
    pq.write_table(table, tmp, compression=compression or "none", row_group_size=max(1, ROW_GROUP_BYTES // per_row),
                   use_dictionary=["sample_id"], write_statistics=["sample_id", "num_tokens"])
    # fsync before the rename: the manifest commit that follows must never point at bytes that a
    # crash could still lose from the page cache.
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    return {"bytes": final.stat().st_size, "write_s": time.perf_counter() - t0, "rows": len(table),
            "hs_bytes": table.column("hidden_states").nbytes}

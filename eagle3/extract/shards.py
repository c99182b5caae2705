"""Reading and writing hidden-states shard files, in either of the two formats.

- "arrow" (default): Arrow IPC files (Feather v2). Written buffer by buffer with direct I/O
  (DirectFile: the page cache's writeback, not the disk, bounds buffered writes) and
  read through a memory map: a record batch's hidden states are views of the page cache, no
  decode and no copy. Optional lz4/zstd buffer compression.
- "parquet": Parquet files; smaller with compression, but every value is copied into
  Parquet pages on write (slower than IPC) and decoded on read.
A reader picks the format from the file suffix. "Batches" below are IPC record batches or
Parquet row groups: the unit a reader holds in memory (~128 MB when we write them).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa

SUFFIX = {"arrow": ".arrow", "parquet": ".parquet"}
BATCH_BYTES = 128 << 20


def format_of(path: str | Path) -> str:
    suffix = Path(path).suffix
    for fmt, s in SUFFIX.items():
        if suffix == s:
            return fmt
    raise ValueError(f"{path}: not a shard file (expected a {' or '.join(SUFFIX.values())} suffix)")


class DirectFile:
    """A write-only file for `pa.PythonFile` that writes with O_DIRECT: the bytes pyarrow hands
    over (its large buffers arrive zero-copy) are copied into page-aligned staging buffers, and
    full ones go to the disk from a background thread while the next fills, up to `depth`
    writes in flight. `close` writes the padded tail and truncates to the true size; durability
    (fsync) is the caller's, as for any file (write_shard_file does it once, before the rename).
    `DirectFile.open` returns None where the file system refuses O_DIRECT (tmpfs on older
    kernels, some network file systems): the caller then writes buffered."""

    ALIGN = 4096  # logical block size that O_DIRECT offsets, lengths and addresses must respect

    def __init__(self, fd: int, chunk_bytes: int = 32 << 20, depth: int = 2):
        self._fd = fd
        self._chunk = chunk_bytes
        self._free = deque(mmap.mmap(-1, chunk_bytes) for _ in range(depth + 1))  # mmap: page-aligned
        self._buf = self._free.popleft()
        self._view = np.frombuffer(self._buf, dtype=np.uint8)
        self._fill = 0
        self._inflight: deque = deque()  # (future, buffer)
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="direct-write")
        self._file_off = 0
        self._size = 0
        self.closed = False

    @classmethod
    def open(cls, path: str | Path, **kwargs) -> DirectFile | None:
        if not hasattr(os, "O_DIRECT"):  # not Linux
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError:  # EINVAL: this file system does not do direct I/O
            return None
        return cls(fd, **kwargs)

    def write(self, data) -> int:
        src = np.frombuffer(data, dtype=np.uint8)
        i, n = 0, src.size
        while i < n:
            k = min(n - i, self._chunk - self._fill)
            self._view[self._fill:self._fill + k] = src[i:i + k]
            self._fill += k
            i += k
            if self._fill == self._chunk:
                self._submit(self._chunk)
        self._size += n
        return n

    def _submit(self, nbytes: int) -> None:
        if not self._free:
            future, buf = self._inflight.popleft()
            future.result()
            self._free.append(buf)
        self._inflight.append((self._pool.submit(_pwrite_all, self._fd, memoryview(self._buf)[:nbytes], self._file_off),
                               self._buf))
        self._file_off += nbytes
        self._buf = self._free.popleft()
        self._view = np.frombuffer(self._buf, dtype=np.uint8)
        self._fill = 0

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._fill:
                padded = -(-self._fill // self.ALIGN) * self.ALIGN
                self._view[self._fill:padded] = 0
                self._submit(padded)
            for future, _ in self._inflight:
                future.result()
            os.ftruncate(self._fd, self._size)
        finally:
            self._pool.shutdown(wait=True)
            os.close(self._fd)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_shard_file(table: pa.Table, path: str | Path, compression: str | None = None,
                     direct_io: bool = True) -> int:
    """Write atomically (temp file, fsync, rename); return the file size. Arrow IPC files are
    written with direct I/O where the file system allows it (`direct_io`)."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    per_row = max(1, table.nbytes // max(len(table), 1))
    rows_per_batch = max(1, BATCH_BYTES // per_row)
    try:
        if format_of(final) == "arrow":
            try:
                _write_ipc(table, tmp, compression, rows_per_batch, direct_io)
            except OSError as e:
                if not direct_io or e.errno != errno.EINVAL:
                    raise
                # the file system opened the file with O_DIRECT but refuses its writes (alignment)
                _write_ipc(table, tmp, compression, rows_per_batch, False)
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, tmp, compression=compression or "none", row_group_size=rows_per_batch,
                           use_dictionary=["sample_id"], write_statistics=["sample_id", "num_tokens"])
        # fsync before the rename: a manifest commit must never point at bytes a crash could lose.
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # a full disk keeps no partial file behind
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            need = f"the shard needs about {table.nbytes:,} bytes ({table.nbytes / 2**20:.1f} MiB)"
            raise disk_full_error(final, e, need, "Nothing of this shard was kept (its temporary file is removed, it "
                                  "is not committed)") from e
        raise
    return final.stat().st_size


# The errnos of a write that did not fit (disk_full_error's causes).
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full_error(path: Path, cause: OSError, need: str, outcome: str) -> OSError:
    """The error for a write of the extraction output that did not fit: where, what needed the room
    (`need`), how many bytes are free, what became of the write (`outcome`) and what to do. An
    OSError with the cause's errno (ENOSPC, EDQUOT), so it pickles through Ray as one."""
    import shutil

    usage = shutil.disk_usage(path.parent)
    what = "Disk quota exceeded" if cause.errno == errno.EDQUOT else "No space left"
    return OSError(cause.errno, f"{what} on the file system of {path.parent} writing {path.name}: {need}, "
                   f"{usage.free:,} bytes are free there ({usage.total:,} in all). {outcome}. Free space there (or set "
                   "output_dir on a larger disk) and resubmit the same job: the shards already committed are kept and "
                   "not redone")


def _write_ipc(table: pa.Table, path: Path, compression: str | None, rows_per_batch: int, direct_io: bool) -> None:
    options = pa.ipc.IpcWriteOptions(compression=compression)
    direct = DirectFile.open(path) if direct_io else None
    sink = pa.PythonFile(direct, mode="w") if direct is not None else pa.OSFile(str(path), "wb")
    try:
        with pa.ipc.new_file(sink, table.schema, options=options) as writer:
            writer.write_table(table, max_chunksize=rows_per_batch)
    finally:
        sink.close()
        if direct is not None:
            direct.close()  # idempotent; PythonFile.close already closed it on success


class ShardFile:
    def __init__(self, path: str | Path):
        self.path = str(path)
        self.format = format_of(path)
        if self.format == "arrow":
            self._reader = pa.ipc.open_file(pa.memory_map(self.path, "r"))
            self.schema = self._reader.schema
            self.batch_rows = [self._reader.get_batch(i).num_rows for i in range(self._reader.num_record_batches)]
        else:
            import pyarrow.parquet as pq

            self._reader = pq.ParquetFile(self.path)
            self.schema = self._reader.schema_arrow
            md = self._reader.metadata
            self.batch_rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]

    @property
    def num_rows(self) -> int:
        return sum(self.batch_rows)

    def iter_batches(self, batches: list[int] | None = None, columns: list[str] | None = None):
        """Record batches (in file order) of the given batch indices, with only `columns`."""
        indices = range(len(self.batch_rows)) if batches is None else batches
        if self.format == "arrow":
            for i in indices:
                batch = self._reader.get_batch(i)
                yield batch.select(columns) if columns else batch
        else:
            for i in indices:
                yield from self._reader.iter_batches(row_groups=[i], columns=columns)

    def read(self, columns: list[str] | None = None) -> pa.Table:
        return pa.Table.from_batches(list(self.iter_batches(columns=columns)), schema=self.schema if not columns
                                     else pa.schema([self.schema.field(c) for c in columns], metadata=self.schema.metadata))


def read_shards(paths, columns: list[str] | None = None) -> pa.Table:
    return pa.concat_tables([ShardFile(p).read(columns) for p in paths])


# Linux caps one POSIX_FADV_WILLNEED at the readahead window, so one call over a whole shard
# reads only its start. Advised window by window, the whole file is read.
_WILLNEED_WINDOW = 8 << 20


def advise_page_cache(path: str | Path, advice: str) -> None:
    """posix_fadvise over a whole file. 'willneed': read it into the page cache (Arrow shards are
    read through a memory map, whose page faults otherwise read a few pages at a time, and shards
    written with O_DIRECT are not cached); this submits the reads window by window and can block
    while the device queue is full, so callers that must not wait use `read_ahead`. 'dontneed':
    write it back, then drop its pages. A no-op where the OS has no posix_fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(str(path), os.O_RDONLY)
    try:
        if advice == "dontneed":
            os.fsync(fd)  # dirty pages are not dropped: a file just written buffered would stay cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        elif advice == "willneed":
            for offset in range(0, os.fstat(fd).st_size, _WILLNEED_WINDOW):
                os.posix_fadvise(fd, offset, _WILLNEED_WINDOW, os.POSIX_FADV_WILLNEED)
        else:
            raise ValueError(f"advice={advice!r}: expected 'willneed' or 'dontneed'")
    finally:
        os.close(fd)


def read_ahead(path: str | Path) -> threading.Thread:
    """advise_page_cache(path, 'willneed') in a daemon thread (posix_fadvise releases the GIL)."""
    thread = threading.Thread(target=advise_page_cache, args=(path, "willneed"), name="shard-read-ahead", daemon=True)
    thread.start()
    return thread

"""Shard files: the direct-I/O writer gives the same bytes as a buffered write, and falls back
where the file system refuses O_DIRECT."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pyarrow as pa
import pytest

from eagle3.extract import shards
from eagle3.extract.codec import binary_value
from eagle3.extract.shards import DirectFile, ShardFile, write_shard_file


def _direct_io_works(directory) -> bool:
    probe = DirectFile.open(os.path.join(directory, ".probe"))
    if probe is None:
        return False
    probe.close()
    os.remove(os.path.join(directory, ".probe"))
    return True


def _table(rows: int = 9, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    # odd byte counts, so buffers end off any alignment
    chunks = [binary_value(rng.integers(0, 255, size=3001 * (i + 1) + 7, dtype=np.uint8)) for i in range(rows)]
    return pa.table({"sample_id": [f"s{i}" for i in range(rows)], "hidden_states": pa.chunked_array(chunks)})


def test_direct_file_writes_exact_bytes_across_chunks(tmp_path):
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 255, size=int(n), dtype=np.uint8).tobytes() for n in rng.integers(1, 30000, size=40)]
    f = DirectFile.open(tmp_path / "x.bin", chunk_bytes=8192, depth=2)
    if f is None:
        pytest.skip("this file system refuses O_DIRECT")
    for p in parts:
        assert f.write(p) == len(p)
    assert f.tell() == sum(map(len, parts))
    f.close()
    assert (tmp_path / "x.bin").read_bytes() == b"".join(parts)


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_direct_and_buffered_shards_are_byte_identical(tmp_path, compression):
    table = _table()
    a = write_shard_file(table, tmp_path / "a.arrow", compression, direct_io=True)
    b = write_shard_file(table, tmp_path / "b.arrow", compression, direct_io=False)
    assert a == b
    assert (tmp_path / "a.arrow").read_bytes() == (tmp_path / "b.arrow").read_bytes()
    assert ShardFile(tmp_path / "a.arrow").read().equals(table)
    assert sorted(os.listdir(tmp_path)) == ["a.arrow", "b.arrow"]  # no temp file left behind


def test_file_system_without_direct_io_falls_back_to_buffered(tmp_path, monkeypatch):
    real_open = os.open
    refused = []

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            refused.append(path)
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, *args)

    monkeypatch.setattr(shards.os, "open", no_direct)
    table = _table(seed=2)
    write_shard_file(table, tmp_path / "c.arrow")
    monkeypatch.undo()
    assert refused or not hasattr(os, "O_DIRECT")
    assert ShardFile(tmp_path / "c.arrow").read().equals(table)


def test_shard_plan_bounds_bytes_of_a_shard():
    from eagle3.extract.manifest import ShardPlan
    from eagle3.schema import stored_bytes_per_token

    # A hidden-7168 target, 4 captured layers, 4K-token samples: 57 KB a token in bf16.
    bpt = stored_bytes_per_token(num_layers=4, hidden_size=7168, hs_dtype="bfloat16")
    assert bpt == 57344
    plan = ShardPlan.sized([4096] * 1000, 256, bpt, 1 << 30)
    assert plan.samples_per_shard == 4  # 4 x 4096 x 57344 = 0.94 GB <= 1 GiB < 5 samples
    assert plan.num_shards == 250
    # fp8 halves the bytes: twice the samples
    fp8 = stored_bytes_per_token(num_layers=4, hidden_size=7168, hs_dtype="float8_e4m3fn")
    assert ShardPlan.sized([4096] * 1000, 256, fp8, 1 << 30).samples_per_shard == 9
    # small samples: samples_per_shard stays the cap; 0 turns the byte bound off
    assert ShardPlan.sized([20] * 1000, 256, bpt, 1 << 30).samples_per_shard == 256
    assert ShardPlan.sized([4096] * 1000, 256, bpt, 0).samples_per_shard == 256
    # one huge sample still makes a shard
    assert ShardPlan.sized([1 << 20], 256, bpt, 1 << 30).samples_per_shard == 1


def test_failed_write_raises_and_leaves_no_file(tmp_path, monkeypatch):
    if not _direct_io_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")

    def disk_full(fd, view, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "_pwrite_all", disk_full)
    table = _table(rows=40, seed=3)  # smaller than a staging chunk: the tail write at close fails
    with pytest.raises(OSError, match="No space left"):
        write_shard_file(table, tmp_path / "d.arrow")
    assert os.listdir(tmp_path) == []


def test_o_direct_opened_but_writes_refused_falls_back_to_buffered(tmp_path, monkeypatch):
    calls = []

    def misaligned(fd, view, offset):
        calls.append(offset)
        raise OSError(errno.EINVAL, "Invalid argument")

    direct = _direct_io_works(tmp_path)
    monkeypatch.setattr(shards, "_pwrite_all", misaligned)
    table = _table(seed=4)
    write_shard_file(table, tmp_path / "e.arrow")
    assert bool(calls) == direct  # the direct path was tried first, where there is one
    assert ShardFile(tmp_path / "e.arrow").read().equals(table)
    assert os.listdir(tmp_path) == ["e.arrow"]


def _resident_fraction(path) -> float:
    """Share of the file's pages in the page cache (mincore(2) over a private mapping)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.addressof(anchor), size, vec) != 0:
            pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        del anchor
        return sum(v & 1 for v in vec) / pages
    finally:
        mm.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this OS")
def test_read_ahead_brings_the_whole_shard_into_the_page_cache(tmp_path):
    # One POSIX_FADV_WILLNEED over a whole file read only 8 MB of 1 GiB (Linux 6.18): the trainer's
    # read-ahead advises window by window. 64 MiB here, 8 windows.
    path = tmp_path / "shard.bin"
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    shards.advise_page_cache(path, "dontneed")
    if _resident_fraction(path) > 0.05:
        pytest.skip("this file system keeps the file's pages (tmpfs?); nothing to read ahead")
    shards.read_ahead(path).join(timeout=60)
    for _ in range(100):  # the reads are submitted, not awaited
        if _resident_fraction(path) > 0.99:
            break
        time.sleep(0.1)
    assert _resident_fraction(path) > 0.99


@pytest.mark.parametrize("file_format", ["arrow", "parquet"])
@pytest.mark.parametrize("hs_dtype", ["bfloat16", "float8_e4m3fn"])
def test_codec_decodes_what_it_encoded_through_a_shard_file(tmp_path, hs_dtype, file_format):
    """eagle3.extract.codec's columns, written and read back as a shard, decode to the encoded values:
    bf16 bit-exact, fp8 within e4m3's 3-bit mantissa of each token-and-layer's amax; a row whose
    hidden_states hold too few values is refused with the row named."""
    import torch

    from eagle3.extract.codec import decode_rows, encode_hidden_states, hidden_states_columns
    from eagle3.schema import hidden_states_schema

    rng = np.random.default_rng(0)
    layer_ids, hidden = [1, 3, 4], 24
    hs = [rng.standard_normal((T, len(layer_ids), hidden)).astype(np.float32) * 4 for T in (5, 1, 17)]
    encoded = [encode_hidden_states(x, hs_dtype) for x in hs]
    hs_col, scale_col = hidden_states_columns([v for v, _ in encoded], [s for _, s in encoded], hs_dtype)
    ids = [rng.integers(0, 100, len(x)).tolist() for x in hs]
    schema = hidden_states_schema(layer_ids=layer_ids, hidden_size=hidden, hs_dtype=hs_dtype)
    table = pa.Table.from_arrays([pa.array([f"s{i}" for i in range(3)]), pa.array(ids, pa.list_(pa.int32())),
                                  pa.array([[1] * len(x) for x in ids], pa.list_(pa.int8())),
                                  pa.array([len(x) for x in ids], pa.int32()), hs_col, scale_col], schema=schema)
    path = tmp_path / f"shard-000000{shards.SUFFIX[file_format]}"
    write_shard_file(table, path)
    rows = list(decode_rows(ShardFile(path).read()))
    assert [r.input_ids.tolist() for r in rows] == ids
    for row, x in zip(rows, hs, strict=True):
        got = row.hidden_states_as(torch.float32)
        assert got.shape == x.shape
        if hs_dtype == "bfloat16":
            assert row.scale is None and row.hidden_states.dtype == torch.bfloat16
            assert torch.equal(got, torch.from_numpy(x).to(torch.bfloat16).float())
        else:
            assert row.hidden_states.dtype == torch.float8_e4m3fn and row.scale.shape == x.shape[:2]
            amax = np.abs(x).max(axis=-1, keepdims=True)
            assert (np.abs(got.numpy() - x) <= amax / 16 + 1e-6).all()
    short = table.set_column(4, "hidden_states", pa.array([b"\0\0"] * 3, pa.large_binary()))
    with pytest.raises(ValueError, match=r"row 0: hidden_states holds \d+ values.*the shard is corrupt"):
        next(decode_rows(short))

"""Streaming reader of the extract stage's hidden-states shards, for draft training.

Owns: reading Parquet shards written with `eagle3.schema.hidden_states_schema` without
loading them whole, turning each row into the tensors speculators' Eagle3DraftModel takes
(shifted with speculators' own `shift_batch`), the seeded epoch-dependent shuffle, the
split across data-parallel ranks, the resumable position, packing samples into
micro-batches in the format of speculators' `CollateFn` (compat.speculators_batch.pack, straight
from the shard's memory), and token frequencies for the draft vocabulary.
Does not own: the schema (eagle3.schema) or what a batch is trained with (eagle3.trainer).

Order of one epoch, for one rank (all of it derived from (seed, epoch, rank), no data read):
1. the shards are permuted with rng(seed, epoch), identically on every rank;
2. rank r takes the shards at positions r, r + W, r + 2W, ... of that permutation (W ranks),
   so each shard is read by exactly one rank per epoch (no rank reads another's bytes);
   ranks can get one shard more than others, which is harmless because training length
   is counted in optimizer steps and each rank cycles its own epochs;
3. the rank's rows, in file order, go through a shuffle buffer of `shuffle_buffer_size`
   samples (rng(seed, epoch, rank)): fill, then emit a random slot and refill it.
Because the order is computed from indices alone, resuming at `samples_seen` skips the
consumed rows without decoding them and skips Parquet row groups that hold none of the
rows still to come.

Memory: Arrow IPC shards are memory-mapped and samples are views of them (page cache, not
copies). From Parquet shards, at most `shuffle_buffer_size` decoded samples plus what Arrow
holds while reading one row group: it reads a row group's hidden_states chunk whole whatever
the batch size (measured: 1.3 GiB peak RSS streaming 4-row batches out of one 512 MiB row
group), so the extract stage's row-group size bounds the transient read memory.
"""

from __future__ import annotations

import itertools
import logging
import math
import mmap
import os
import queue
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compat.speculators_batch import batch_layout, pack
from eagle3.schema import dequantize_fp8, hs_layout
from eagle3.shards import ShardFile, read_ahead

logger = logging.getLogger(__name__)

def resolve_files(files: str | Path | Sequence[str | Path]) -> list[str]:
    """An explicit list of shard files (kept in order), or a directory: an extraction output
    (its committed shards only, per eagle3.manifest) or a plain directory of *.arrow / *.parquet
    shard files (sorted)."""
    if isinstance(files, (str, Path)):
        root = Path(files)
        if not root.is_dir():
            raise ValueError(f"expected a directory of shard files or a list of files, found {str(root)!r}")
        if (root / "MANIFEST.json").exists():
            from eagle3.manifest import Manifest

            found = Manifest(root).committed_files()
        else:
            found = sorted(str(p) for p in root.iterdir() if p.suffix in (".arrow", ".parquet"))
        if not found:
            raise ValueError(f"no committed shard files in {str(root)!r}; run the extract stage first")
        return found
    out = [str(f) for f in files]
    if not out:
        raise ValueError("expected at least one hidden-states shard file, found an empty list")
    missing = [f for f in out if not Path(f).is_file()]
    if missing:
        raise ValueError(f"hidden-states shards do not exist: {missing[:5]}; check the extract manifest")
    return out


def token_frequencies(files: str | Path | Sequence[str | Path], vocab_size: int | None = None) -> np.ndarray:
    """Counts of every loss-masked token id over all shards: int64 array [vocab_size].

    Reads only the input_ids and loss_mask columns. vocab_size None: max id + 1.
    Feeds speculators' build_vocab_mappings_from_distribution (d2t/t2d).
    """
    counts = np.zeros(vocab_size or 0, dtype=np.int64)
    for path in resolve_files(files):
        pf = ShardFile(path)
        hs_layout(pf.schema)  # refuse other schema versions before reading
        for batch in pf.iter_batches(columns=["input_ids", "loss_mask"]):
            ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
            if not np.array_equal(ids_col.value_lengths().to_numpy(), mask_col.value_lengths().to_numpy()):
                raise ValueError(f"{path}: input_ids and loss_mask lengths differ in some rows; the shard is corrupt")
            ids = ids_col.flatten().to_numpy()
            mask = mask_col.flatten().to_numpy().astype(bool)
            kept = ids[mask]
            if kept.size and vocab_size is not None and kept.max() >= vocab_size:
                raise ValueError(
                    f"{path}: token id {int(kept.max())} >= target vocab_size {vocab_size}; "
                    "the shards were extracted with another tokenizer/target"
                )
            minlength = max(vocab_size or 0, int(kept.max()) + 1 if kept.size else 0, counts.size)
            if counts.size < minlength:
                counts = np.pad(counts, (0, minlength - counts.size))
            counts += np.bincount(kept, minlength=minlength)[: counts.size]
    return counts


@dataclass
class _Shard:
    path: str
    row_group_rows: list[int]

    @property
    def num_rows(self) -> int:
        return sum(self.row_group_rows)


class HiddenStatesDataset:
    """One data-parallel rank's view of the hidden-states shards.

    `samples(epoch, start)` yields, per sample (after speculators' shift_batch, so position t
    pairs token x_{t+1} and target y_{t+1} with hidden state g_t):
      input_ids [T-1] long, loss_mask [T-1] bool, hidden_states [T-1, num_aux*H] bf16 (aux
      layers concatenated in schema layer order), verifier_last_hidden_states [T-1, H] bf16
      (the last layer id: the target's final layer before its final norm), lengths [1],
      position_ids [T-1] (starting at 1).
    """

    def __init__(self, files: str | Path | Sequence[str | Path], *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle_buffer_size: int = 256):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.files = resolve_files(files)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle_buffer_size = max(1, shuffle_buffer_size)
        self.shards: list[_Shard] = []
        layout = None
        for path in self.files:
            pf = ShardFile(path)
            this = hs_layout(pf.schema)
            if layout is None:
                layout = this
            elif this != layout:
                raise ValueError(
                    f"{path} has (layer_ids, hidden_size, hs_dtype)={this}, {self.files[0]} has {layout}: "
                    "all shards of one training run must come from one extraction"
                )
            self.shards.append(_Shard(path, list(pf.batch_rows)))
        self.layer_ids, self.hidden_size, self.hs_dtype = layout
        if len(self.layer_ids) < 2:
            raise ValueError(f"layer_ids={self.layer_ids}: need at least one aux layer plus the last layer")
        if len(self.shards) < world_size:
            raise ValueError(
                f"{len(self.shards)} shard files for {world_size} data-parallel ranks: each rank needs at "
                "least one shard; write smaller shards (extract.samples_per_shard) or use fewer workers"
            )
        self.num_samples = sum(s.num_rows for s in self.shards)

    @property
    def aux_layer_ids(self) -> list[int]:
        """The EAGLE-3 auxiliary layer ids (all captured ids but the last)."""
        return list(self.layer_ids[:-1])

    def rank_shards(self, epoch: int) -> list[int]:
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        return [int(i) for i in perm[self.rank :: self.world_size]]

    def epoch_order(self, epoch: int) -> list[tuple[int, int]]:
        """(shard index, row) in the order this rank yields them in `epoch`. Reads no data."""
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        buffer: list[tuple[int, int]] = []
        out: list[tuple[int, int]] = []
        for s in self.rank_shards(epoch):
            for row in range(self.shards[s].num_rows):
                if len(buffer) < self.shuffle_buffer_size:
                    buffer.append((s, row))
                    continue
                j = int(rng.integers(len(buffer)))
                out.append(buffer[j])
                buffer[j] = (s, row)
        order = rng.permutation(len(buffer))
        out.extend(buffer[int(j)] for j in order)
        return out

    def samples(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's samples of `epoch` in shuffled order, skipping the first `start`."""
        for row in self.rows(epoch, start):
            yield _to_sample(*row)

    def rows(self, epoch: int, start: int = 0) -> Iterator[tuple]:
        """The same samples as `samples`, as stored and unshifted: (input_ids [T], loss_mask [T],
        hidden states [T, L, H], fp8 scales [T, L] or None), views of the shard's memory (_read_row)."""
        order = self.epoch_order(epoch)[start:]
        if not order:
            return
        needed = set(order)
        pending: dict[tuple[int, int], tuple] = {}
        rows = self._read_rows(epoch, needed)
        for key in order:
            while key not in pending:
                got_key, row = next(rows)
                pending[got_key] = row
            yield pending.pop(key)

    def _read_rows(self, epoch: int, needed: set[tuple[int, int]]) -> Iterator[tuple[tuple[int, int], tuple]]:
        """Rows of this rank's shards, file order, decoding only `needed` ones."""
        L, H = len(self.layer_ids), self.hidden_size
        columns = ["input_ids", "loss_mask", "num_tokens", "hidden_states", "hs_scale"]
        todo = []  # (shard, starts, row groups holding needed rows), in this rank's order
        for s in self.rank_shards(epoch):
            starts = np.concatenate([[0], np.cumsum(self.shards[s].row_group_rows)]).astype(int)
            groups = [g for g in range(len(starts) - 1)
                      if any((s, r) in needed for r in range(starts[g], starts[g + 1]))]
            if groups:
                todo.append((s, starts, groups))
        for k, (s, starts, groups) in enumerate(todo):
            shard = self.shards[s]
            # each shard is read in the background one shard ahead (the first one, now)
            for ahead in ([todo[0]] if k == 0 else []) + todo[k + 1:k + 2]:
                read_ahead(self.shards[ahead[0]].path)
            pf = ShardFile(shard.path)
            for g in groups:
                row = int(starts[g])
                for batch in pf.iter_batches([g], columns=columns):
                    for j in range(batch.num_rows):
                        if (s, row) in needed:
                            yield (s, row), _read_row(batch, j, L, H, self.hs_dtype, shard.path, row,
                                                      own=pf.format != "arrow")
                        row += 1


def _read_row(batch, j: int, num_layers: int, hidden_size: int, hs_dtype: str, path: str,
              row: int, own: bool = False) -> tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor | None]:
    """Row j of a record batch, as stored: (input_ids [T], loss_mask [T], hidden states [T, L, H],
    scale). Token columns are numpy views; hidden states a torch view of the Arrow buffer (which
    the view keeps alive): bf16 with scale None, or e4m3 with its float32 scales [T, L],
    dequantised where they are copied out (pack, _to_sample). `own`: copy the hidden states, for
    a record batch decoded into memory (Parquet), which a view would keep alive whole; an Arrow
    IPC shard is memory-mapped, and a view keeps only page cache."""
    T = int(batch.column("num_tokens")[j].as_py())

    def list_values(name):
        col = batch.column(name)
        offsets = col.offsets.to_numpy()
        return col.values.to_numpy(zero_copy_only=True)[offsets[j] : offsets[j + 1]]

    input_ids = list_values("input_ids")
    loss_mask = list_values("loss_mask")
    if len(input_ids) != T or len(loss_mask) != T:
        raise ValueError(f"{path} row {row}: num_tokens={T} but input_ids has {len(input_ids)} and loss_mask "
                         f"{len(loss_mask)} values; the shard is corrupt")
    fp8 = hs_dtype == "float8_e4m3fn"
    values = np.frombuffer(batch.column("hidden_states")[j].as_buffer(), dtype=np.uint8 if fp8 else np.uint16)
    scale = list_values("hs_scale") if fp8 else None
    want = T * num_layers * hidden_size
    if values.size != want or (fp8 and scale.size != T * num_layers):
        raise ValueError(f"{path} row {row}: hidden_states holds {values.size} values"
                         + (f" and hs_scale {scale.size}" if fp8 else "")
                         + f", expected {(T, num_layers, hidden_size)}; the shard is corrupt")
    # Arrow buffers are read-only and torch warns on wrapping them. Nothing writes to these
    # views: they are only copied out of.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        hs = torch.from_numpy(values.reshape(T, num_layers, hidden_size))
        hs = hs.clone() if own else hs
        if not fp8:
            return input_ids, loss_mask, hs.view(torch.bfloat16), None
        return input_ids, loss_mask, hs.view(torch.float8_e4m3fn), torch.from_numpy(scale.reshape(T, num_layers))


def _to_sample(input_ids: np.ndarray, loss_mask: np.ndarray, hs_TLD: torch.Tensor,
               scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A stored row as one speculators sample, shifted by speculators' own shift_batch."""
    from speculators.models.eagle3.data import shift_batch

    if scale is not None:
        hs_TLD = dequantize_fp8(hs_TLD, scale)
    T, num_layers, hidden_size = hs_TLD.shape
    return shift_batch({
        "input_ids": torch.from_numpy(input_ids.astype(np.int64)),
        "loss_mask": torch.from_numpy(loss_mask.astype(bool)),
        "hidden_states": hs_TLD[:, :-1, :].reshape(T, (num_layers - 1) * hidden_size),
        "verifier_last_hidden_states": hs_TLD[:, -1, :].clone(),
        "lengths": torch.tensor([T], dtype=torch.long),
        "position_ids": torch.arange(T, dtype=torch.long),
    })


class PackedBatches:
    """Endless micro-batches for one rank: samples packed into [1, micro_batch_tokens] in the
    format of speculators' CollateFn (document_ids mark samples, -1 marks padding; built by
    compat.speculators_batch.pack, in pinned memory when `pin_memory`), epochs cycled. fp8 shards:
    `dequantize=False` keeps the hidden states e4m3 with their scales, for
    compat.speculators_batch.dequantize_batch on the device.

    `state_dict()` = {"epoch", "samples_seen"}: samples of that epoch inside batches already
    returned. A sample that did not fit the last batch is re-read after a resume.
    Batches do not straddle epochs.
    """

    def __init__(self, dataset: HiddenStatesDataset, micro_batch_tokens: int,
                 hidden_states_dtype: torch.dtype = torch.bfloat16, state: dict | None = None,
                 pin_memory: bool = False, dequantize: bool = True):
        self.dataset = dataset
        self.micro_batch_tokens = micro_batch_tokens
        self.hidden_states_dtype = hidden_states_dtype
        self.pin_memory = pin_memory
        self.dequantize = dequantize
        self.num_truncated = 0
        self.num_skipped = 0
        self.load_state_dict(state or {"epoch": 0, "samples_seen": 0})

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.samples_seen = int(state["epoch"]), int(state["samples_seen"])
        self._stream = self.dataset.rows(self.epoch, self.samples_seen)
        self._pending: tuple | None = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return self.pack(self.take())

    def pack(self, rows: list, alloc=None) -> dict:
        return pack(rows, self.micro_batch_tokens, self.hidden_states_dtype, self.pin_memory, self.dequantize,
                    alloc=alloc)

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{name: (shape, dtype)} of a batch's tensor buffers (compat.speculators_batch.batch_layout)."""
        deferred = not self.dequantize and self.dataset.hs_dtype == "float8_e4m3fn"
        return batch_layout(self.micro_batch_tokens, len(self.dataset.layer_ids), self.dataset.hidden_size,
                            self.hidden_states_dtype, deferred)

    def take(self) -> list:
        """The next batch's rows (views of the shards: nothing is copied yet), advancing the position."""
        for _ in range(2):  # an exhausted epoch gets one retry in the next epoch
            batch, num_samples = [], 0
            used = 0
            while True:
                sample = self._pending or next(self._stream, None)
                self._pending = None
                if sample is None:
                    break
                n = len(sample[0]) - 1  # tokens after the shift
                if n < 1:
                    self.num_skipped += 1
                    num_samples += 1
                    continue
                if batch and used + n > self.micro_batch_tokens:
                    self._pending = sample
                    break
                if n > self.micro_batch_tokens:
                    if self.num_truncated == 0:
                        logger.warning("sample of %d tokens truncated to micro_batch_tokens=%d (counted in "
                                       "num_truncated; raise train.micro_batch_tokens to keep whole samples)",
                                       n, self.micro_batch_tokens)
                    self.num_truncated += 1
                batch.append(sample)
                num_samples += 1
                used += n
                if used >= self.micro_batch_tokens:
                    break
            if batch:
                self.samples_seen += num_samples
                return batch
            if self.samples_seen == 0 and num_samples == 0:
                raise ValueError(
                    f"rank {self.dataset.rank} got no samples in epoch {self.epoch} "
                    f"(shards {self.dataset.rank_shards(self.epoch)}); the shards are empty"
                )
            self.load_state_dict({"epoch": self.epoch + 1, "samples_seen": 0})
        raise ValueError(f"rank {self.dataset.rank}: two consecutive epochs without a usable sample (all < 2 tokens)")


_ALIGN = 4096  # each buffer of a slot starts on its own page


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class BatchRing:
    """`num_slots` batch buffers of `slot_bytes` in one shared-memory file, which DataLoader
    workers pack batches into and this process reads in place: a batch crosses processes as a
    slot number and a layout, and no memory is mapped, pinned or freed per batch.

    Why not DataLoader's own way: it moves each tensor through a new shared-memory segment, which
    the receiving process unmaps when the tensor is dropped, holding the GIL: 16.2 ms for a 134 MB
    batch on the H200 host, 11.5 ms on the CI machine (`batch_bench`'s drop probe), during which
    the training loop launches no kernel. In a profile of 9 training steps on the H200, 7 had a
    15-22 ms GPU-idle gap, each just after the pinning thread's last call
    (benchmarks/results/train-h200-1b-prof-gaps.md), and steps 6..20 varied from 63 to 95 ms; read
    from this ring they took 73-82 ms (train-h200-1b-run7). Its
    pin_memory thread also copied every batch once more, serially: ~1.1 GB/s (batch-h200-1b-run4).
    Here the file is page-locked once with cudaHostRegister (`page_lock`), so the copy to the
    device reads the slot itself.
    The file is unlinked at once: its memory goes when no process maps it any more.
    """

    def __init__(self, num_slots: int, slot_bytes: int, *, page_lock: bool = False, dir: str = "/dev/shm"):
        self.num_slots, self.slot_bytes = num_slots, _aligned(slot_bytes)
        self.nbytes = num_slots * self.slot_bytes
        fd, path = tempfile.mkstemp(prefix="eagle3-batch-ring-", dir=dir if os.path.isdir(dir) else None)
        os.unlink(path)
        os.ftruncate(fd, self.nbytes)
        self._fd = fd
        self._map()
        self.page_locked = False
        if page_lock:
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the {self.nbytes / 1e9:.2f} GB batch ring failed: {err}")
            self.page_locked = True

    def _map(self) -> None:
        """Map the file in this process (a forked worker maps it anew: CUDA may keep page-locked
        memory out of a child's address space)."""
        self.buffer = torch.frombuffer(mmap.mmap(self._fd, self.nbytes), dtype=torch.uint8)
        self._pid = os.getpid()

    def attach(self) -> None:
        """In a worker process: map the ring there (once)."""
        if self._pid != os.getpid():
            self._map()

    def slot(self, s: int) -> torch.Tensor:
        start = s * self.slot_bytes
        return self.buffer[start:start + self.slot_bytes]

    def layout(self, batch: dict, s: int) -> dict:
        """Worker side: a batch packed into slot s as {key: (offset, shape, dtype)} (other values as they are)."""
        base = self.slot(s).data_ptr()
        out = {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                if not v.is_contiguous() or not base <= v.data_ptr() < base + self.slot_bytes:
                    raise ValueError(f"{k} is not a contiguous buffer of slot {s}")
                v = (v.data_ptr() - base, tuple(v.shape), v.dtype)
            out[k] = v
        return out

    def views(self, layout: dict, s: int) -> dict:
        """The batch of `layout` as views of slot s."""
        slot, out = self.slot(s), {}
        for k, v in layout.items():
            if isinstance(v, tuple):
                offset, shape, dtype = v
                v = slot[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            out[k] = v
        return out

    def allocator(self, s: int):
        """alloc(shape, dtype) for compat.speculators_batch.pack: page-aligned buffers of slot s."""
        slot, used = self.slot(s), 0

        def alloc(shape, dtype):
            nonlocal used
            n = math.prod(shape) * dtype.itemsize
            if used + n > self.slot_bytes:
                raise ValueError(f"a batch needs more than the ring's {self.slot_bytes} bytes a slot")
            t = slot[used:used + n].view(dtype).view(shape)
            used += _aligned(n)
            return t

        return alloc

    def close(self) -> None:
        """Unlock the pages (views of them stay valid, as plain memory)."""
        if self.page_locked:
            torch.cuda.synchronize()  # no copy may still read them
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.page_locked = False
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def slot_bytes_for(layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
        """Bytes of a slot that holds a batch of `layout` ({name: (shape, dtype)})."""
        return sum(_aligned(math.prod(shape) * dtype.itemsize) for shape, dtype in layout.values())


class _PackedStream(torch.utils.data.IterableDataset):
    """A DataLoader worker's side of WorkerPrefetcher: (slot, batch layout, data position after
    it), batch after batch, each packed straight into its slot of the ring. Worker w of k walks the
    whole batch sequence but packs only batches w, w + k, ...: taking a batch's rows touches no
    hidden states, and DataLoader returns the workers' items round-robin, so the batches come out
    in order."""

    def __init__(self, batches: PackedBatches, ring: BatchRing):
        self.batches, self.ring = batches, ring

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, k = (info.id, info.num_workers) if info is not None else (0, 1)
        self.ring.attach()
        for i in itertools.count():
            rows = self.batches.take()
            if i % k != w:
                continue
            s = i % self.ring.num_slots
            batch = self.batches.pack(rows, alloc=self.ring.allocator(s))
            yield s, self.ring.layout(batch, s), self.batches.state_dict()


def _as_is(item):
    return item


class WorkerPrefetcher:
    """Prefetcher's contract, with the batches built in `num_workers` torch DataLoader worker
    processes instead of a thread. A thread that reads and packs holds the GIL in bursts, and the
    training loop, which launches the step's many small kernels from Python, stalls behind it: a
    loop of 3,000 small CUDA ops took 65.8 ms alone on the H200 host, 111.1 ms next to a packing
    thread, 51.3 ms next to a worker (`python -m benchmarks.batch_bench`). Batches come out in
    order (_PackedStream), packed by the workers straight into a BatchRing (page-locked when
    `page_lock`). Workers are forked: they must not touch CUDA, so `batches` must not pin.
    `depth` batches are built ahead in all (at least one a worker).

    A batch returned is a view of the ring: it stays valid until the second `next` after it (the
    trainer's DeviceBatches waits for its copy to the device before that); clone what must live longer.
    """

    def __init__(self, batches: PackedBatches, depth: int = 2, page_lock: bool = False, num_workers: int = 1):
        if batches.pin_memory:
            raise ValueError("WorkerPrefetcher's batches live in its ring: build its PackedBatches with pin_memory=False")
        self.batches, self.page_lock, self.num_workers = batches, page_lock, max(1, num_workers)
        self.depth = max(1, depth)
        self._state = batches.state_dict()
        self.ring: BatchRing | None = None
        self._start()

    @staticmethod
    def _prefetch_and_slots(depth: int, num_workers: int) -> tuple[int, int]:
        """DataLoader's prefetch_factor, and the ring's slots. DataLoader has at most prefetch x
        workers batches requested beyond the one it returned last, and returns them in order: with 2
        slots more, batch m + P is packed into batch m - 2's slot, after batch m is returned."""
        prefetch = -(-max(1, depth) // max(1, num_workers))
        return prefetch, prefetch * max(1, num_workers) + 2

    @staticmethod
    def ring_bytes(batches: PackedBatches, depth: int, num_workers: int) -> int:
        """Shared memory the ring of WorkerPrefetcher(batches, depth, num_workers=...) takes."""
        _, slots = WorkerPrefetcher._prefetch_and_slots(depth, num_workers)
        return slots * BatchRing.slot_bytes_for(batches.layout())

    def _start(self) -> None:
        prefetch, slots = self._prefetch_and_slots(self.depth, self.num_workers)
        self.ring = BatchRing(slots, BatchRing.slot_bytes_for(self.batches.layout()), page_lock=self.page_lock)
        loader = torch.utils.data.DataLoader(_PackedStream(self.batches, self.ring), batch_size=None,
                                             num_workers=self.num_workers, prefetch_factor=prefetch,
                                             collate_fn=_as_is, multiprocessing_context="fork")
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        s, layout, self._state = next(self._it)
        return self.ring.views(layout, s)

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.batches.load_state_dict(state)  # this process's copy; new workers fork from it
        self._state = self.batches.state_dict()
        self._start()

    def close(self) -> None:
        self._it = None  # the last reference: DataLoader's iterator stops its workers when collected
        if self.ring is not None:
            self.ring.close()


class Prefetcher:
    """Builds the next `depth` micro-batches of a PackedBatches in a background thread, so that
    reading and packing overlap the device's step instead of preceding it (`python -m
    benchmarks.batch_bench` measures how long one batch takes to build).

    `state_dict()` is the data position after the last batch *returned* (what a checkpoint must
    record), not after the last one built; `load_state_dict` drops the batches built ahead.
    Batches come out in exactly the order PackedBatches gives them, and building them draws on
    no global RNG, so prefetching changes no result.
    """

    def __init__(self, batches: PackedBatches, depth: int = 2):
        self.batches = batches
        self.depth = max(1, depth)
        self._state = batches.state_dict()
        self._start()

    def _start(self) -> None:
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        while not self._stop.is_set():
            try:
                item = (next(self.batches), self.batches.state_dict(), None)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                item = (None, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._error is not None:  # the producer has stopped: every later call fails the same way
            raise self._error
        batch, state, err = self._queue.get()
        if err is not None:
            self._error = err
            raise err
        self._state = state
        return batch

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.batches.load_state_dict(state)
        self._state = self.batches.state_dict()
        self._start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

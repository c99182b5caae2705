"""Training batches built ahead of the step: in a background thread (`Prefetcher`) or in
DataLoader worker processes that pack straight into a shared ring (`WorkerPrefetcher`).

Owns: building a PackedBatches' batches ahead, in order, and the data position of the last
batch returned (what a checkpoint records), so that prefetching changes no result.
Does not own: what a batch is (eagle3.train.data.packing), the shared memory (eagle3.train.data.ring),
copying batches to the device (eagle3.train.data.staging), choosing between these (eagle3.train.data.pipeline).
"""

from __future__ import annotations

import itertools
import queue
import threading

import torch

from eagle3.train.data.packing import PackedBatches
from eagle3.train.data.ring import BatchRing


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
    training loop, which launches the step's many small kernels from Python, stalls behind it
    (`python -m benchmarks.batch_bench`). Batches come out in
    order (_PackedStream), packed by the workers straight into a BatchRing (page-locked when
    `page_lock`). Workers are forked: they must not touch CUDA, so `batches` must not pin.
    `depth` batches are built ahead in all (at least one a worker).

    A batch returned is a view of the ring: it stays valid until the second `next` after it (the
    DeviceBatches (eagle3.train.data.staging) waits for its copy to the device before that); clone what must live longer.
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

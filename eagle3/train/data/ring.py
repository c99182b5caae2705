"""The shared-memory ring that DataLoader worker processes pack training batches into.

Owns: one shared-memory file of batch slots, mapped in every process, page-locked once on GPU
(cudaHostRegister), and a batch's crossing between processes as a slot number and a layout.
Does not own: which slot a batch goes to or when a slot may be reused (eagle3.train.data.prefetch's
WorkerPrefetcher and the trainer's staging decide), what a batch holds (eagle3.train.data.packing).
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile

import torch


_ALIGN = 4096  # each buffer of a slot starts on its own page


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class BatchRing:
    """`num_slots` batch buffers of `slot_bytes` in one shared-memory file, which DataLoader
    workers pack batches into and this process reads in place: a batch crosses processes as a
    slot number and a layout, and no memory is mapped, pinned or freed per batch.

    Why not DataLoader's own way: it moves each tensor through a new shared-memory segment, which
    the receiving process unmaps when the tensor is dropped, holding the GIL, and meanwhile the
    training loop launches no kernel: the GPU idles after each batch. Its pin_memory thread also copies
    every batch once more, serially. Here the file is page-locked once with cudaHostRegister
    (`page_lock`), so the copy to the device reads the slot itself.
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
        """alloc(shape, dtype) for eagle3.train.data.packing.pack: page-aligned buffers of slot s."""
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

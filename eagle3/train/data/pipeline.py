"""The training input pipeline a rank runs, chosen from the train config's data section
(`train.data`) and the machine.

Owns: how deep batches are built ahead (`prefetch_depth`, from a memory budget unless set), by how
many worker processes (`data_workers`), where (`batch_source`: worker processes into a shared
ring, a thread where /dev/shm cannot hold that ring, or in line), and assembling it with the
device staging (`input_pipeline`).
Does not own: the parts it assembles (eagle3.train.data.rows, .packing, .prefetch, .staging), the config
fields (eagle3.train.config.DataConfig).
"""

from __future__ import annotations

import logging
import math
import os

import torch

from eagle3.train.data.packing import PackedBatches, batch_layout
from eagle3.train.data.prefetch import Prefetcher, WorkerPrefetcher
from eagle3.train.data.rows import HiddenStatesDataset
from eagle3.train.data.staging import DeviceBatches
from eagle3.train.config import DataConfig

logger = logging.getLogger(__name__)

# Host memory (pinned on GPU) for batches built ahead, per worker, when train.data.prefetch_batches is
# None: ~15 batches of a 1B target at 8,192 tokens, 4 of a hidden-7168 one. A deep queue fills
# while the device is busy elsewhere (the first step's compile, a checkpoint) and is drawn on
# after; speculators' DataLoader holds 12 workers x prefetch_factor 4 = 48 batches.
PREFETCH_AUTO_BYTES = 2 << 30
PREFETCH_AUTO_MAX = 16  # and no deeper: small batches need no deep queue


def batch_bytes(cfg: DataConfig, num_layers: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes of one packed micro-batch of `num_layers` captured layers (the aux ones and the
    verifier's last) in `dtype`: the buffers of eagle3.train.data.packing.batch_layout."""
    layout = batch_layout(cfg.micro_batch_tokens, num_layers, hidden_size, dtype)
    return sum(math.prod(shape) * dt.itemsize for shape, dt in layout.values())


def prefetch_depth(cfg: DataConfig, num_layers: int, hidden_size: int, dtype: torch.dtype) -> int:
    """cfg.prefetch_batches, or where it is None, as many packed micro-batches as fit in
    PREFETCH_AUTO_BYTES, from 2 to PREFETCH_AUTO_MAX."""
    if cfg.prefetch_batches is not None:
        return cfg.prefetch_batches
    return min(PREFETCH_AUTO_MAX, max(2, PREFETCH_AUTO_BYTES // batch_bytes(cfg, num_layers, hidden_size, dtype)))


def data_workers(cfg: DataConfig, cpus: int | None = None, local_ranks: int | None = None) -> int:
    """cfg.data_workers, or where it is None: min(4, a rank's share of the CPUs // 4), at least 1
    (ranks on this node: LOCAL_WORLD_SIZE, which Ray Train and torchrun set)."""
    if cfg.data_workers is not None:
        return cfg.data_workers
    cpus = cpus or len(os.sched_getaffinity(0))
    local_ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(4, cpus // max(1, local_ranks) // 4))


def shm_free_bytes(path: str = "/dev/shm") -> int:
    """Free bytes of the shared memory that DataLoader workers hand their batches through (0 if none)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def batch_source(dataset: HiddenStatesDataset, micro: int, dtype: torch.dtype, depth: int, workers: int,
                 *, on_gpu: bool, dequantize: bool):
    """Where a rank's batches come from: built `depth` ahead by `workers` DataLoader worker
    processes (WorkerPrefetcher, into a ring page-locked on GPU), or in a thread (Prefetcher) where
    workers is 0 or /dev/shm cannot hold that ring, or in line when depth is 0."""
    need_bytes = 0
    if depth and workers:
        batches = PackedBatches(dataset, micro, dtype, dequantize=dequantize)
        need_bytes = WorkerPrefetcher.ring_bytes(batches, depth, workers)
        if shm_free_bytes() >= need_bytes:
            return WorkerPrefetcher(batches, depth, page_lock=on_gpu, num_workers=workers)
    packed = PackedBatches(dataset, micro, dtype, pin_memory=on_gpu, dequantize=dequantize)
    if not depth:
        return packed
    if workers:
        logger.warning("/dev/shm has %.2f GB free, %.2f GB needed to build batches in worker processes: building "
                       "them in a thread, which slows the step's kernel launches (give the container more shared "
                       "memory, e.g. docker --shm-size, or set train.data.prefetch_batches lower)",
                       shm_free_bytes() / 1e9, need_bytes / 1e9)
    return Prefetcher(packed, depth)


def input_pipeline(dataset: HiddenStatesDataset, cfg: DataConfig, dtype: torch.dtype,
                   device: torch.device) -> tuple[DeviceBatches, str]:
    """A rank's batches with their model inputs staged on `device` in `dtype`, and a description of
    how they are built (for the log). On GPU, batches are page-locked (each copy to the device is
    asynchronous) and fp8 shards go to the device as stored, to be dequantised there: the host's
    dequantisation is slower than packing bf16 (`python -m benchmarks.batch_bench --hs-dtype fp8`)."""
    on_gpu = device.type == "cuda"
    depth = prefetch_depth(cfg, len(dataset.layer_ids), dataset.hidden_size, dtype)
    # An online dataset (eagle3.train.data.online) asks the coordinator for its tables: forked workers
    # would each walk the batch sequence and ask for every shard again, so it is read in a thread.
    workers = data_workers(cfg) if dataset.forkable else 0
    source = batch_source(dataset, cfg.micro_batch_tokens, dtype, depth, workers,
                          on_gpu=on_gpu, dequantize=not on_gpu)
    how = (f"{workers} worker process(es)" if isinstance(source, WorkerPrefetcher) else
           "a thread" if depth else "the training loop")
    return DeviceBatches(source, device, dtype), f"built {depth} ahead by {how}"

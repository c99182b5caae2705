"""Packing stored rows into training micro-batches.

Owns: the micro-batch of speculators' Eagle3DraftModel built straight from the stored rows
(`pack`, into buffers of `batch_layout` that a caller may provide: pinned memory, or a slot of
eagle3.train.data.ring.BatchRing), fp8 batches kept as stored and dequantised where they land
(`dequantize_batch`), and the endless, resumable stream of a rank's batches (`PackedBatches`).
Does not own: which rows come in which order (eagle3.train.data.rows), building batches ahead or in
other processes (eagle3.train.data.prefetch), the batch format itself: it is speculators' (shift_batch
+ CollateFn), and compat/speculators_batch.py with its test in tests/test_compat.py checks that
`pack` still builds exactly that batch.

Why not CollateFn itself: it takes per-sample tensors (a reshape and a clone per sample out of the
shard's memory), zero-fills fresh buffers and copies into them, and the trainer then copied
every batch once more into pinned memory. `pack` copies each value once, from the
(memory-mapped) shard into the (pinned or shared) batch, and zero-fills only the padding
(measured by `python -m benchmarks.batch_bench`).
fp8 shards: `pack(dequantize=False)` keeps the e4m3 bytes and their scales (half the bytes to copy
and to send) and `dequantize_batch` turns them into the same batch on the GPU (host
dequantisation cost: benchmarks/results/training/batch-h200-1b-fp8.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from eagle3.extract.codec import StoredRow, dequantize_fp8
from eagle3.train.data.rows import HiddenStatesDataset

logger = logging.getLogger(__name__)


def batch_layout(max_len: int, num_layers: int, hidden: int, dtype: torch.dtype,
                 deferred: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of the buffers `pack` fills for rows of `num_layers` captured
    layers of size `hidden`; `deferred`: e4m3 hidden states kept as stored, with their scales."""
    hs_dtype = torch.float8_e4m3fn if deferred else dtype
    layout = {"hidden_states": ((max_len, num_layers - 1, hidden), hs_dtype),
              "verifier_last_hidden_states": ((max_len, hidden), hs_dtype),
              "input_ids": ((max_len,), torch.long), "position_ids": ((max_len,), torch.long),
              "document_ids": ((max_len,), torch.long), "loss_mask": ((max_len,), torch.bool)}
    if deferred:
        layout.update(hidden_states_scale=((max_len, num_layers - 1), torch.float32),
                      verifier_last_hidden_states_scale=((max_len,), torch.float32))
    return layout


def pack(rows: Sequence[tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor | None]], max_len: int,
         dtype: torch.dtype, pin_memory: bool = False, dequantize: bool = True, alloc=None) -> dict:
    """rows: (input_ids [T], loss_mask [T], hidden states [T, L, H], scale) per sample, unshifted;
    the last of the L layers is the verifier's last hidden state, the others the aux layers.
    Hidden states are bf16 with scale None, or e4m3 with float32 scales [T, L], dequantised here
    to bf16 by `eagle3.extract.codec.dequantize_fp8`, as `HiddenStatesDataset.samples` does. Returns
    the batch `CollateFn(max_len, H, L - 1, dtype)([shift_batch(sample) ...])` returns: input_ids,
    loss_mask, hidden_states [1, max_len, (L-1)*H], verifier_last_hidden_states [1, max_len, H],
    position_ids, document_ids, error_records.
    `dequantize=False` with e4m3 rows: both hidden-state tensors stay e4m3 (half the bytes to copy
    and to send to the device) and the batch also holds their float32 scales,
    hidden_states_scale [1, max_len, L-1] and verifier_last_hidden_states_scale [1, max_len];
    `dequantize_batch`, on the device, then gives what `dequantize=True` gives.
    `alloc(shape, dtype)`, if given, makes the buffers (of `batch_layout`) instead of torch.empty."""
    if not rows:
        raise ValueError("pack got no rows")
    num_layers, hidden = rows[0][2].shape[1:]
    deferred = not dequantize and rows[0][3] is not None
    if alloc is None:
        def alloc(shape, dt):
            return torch.empty(shape, dtype=dt, pin_memory=pin_memory)

    out = {k: alloc(shape, dt) for k, (shape, dt) in batch_layout(max_len, num_layers, hidden, dtype, deferred).items()}
    hs, last, mask = out["hidden_states"], out["verifier_last_hidden_states"], out["loss_mask"]
    ids, pos, docs = out["input_ids"], out["position_ids"], out["document_ids"]
    if deferred:
        hs_scale, last_scale = out["hidden_states_scale"], out["verifier_last_hidden_states_scale"]
    offset = 0
    for doc, (input_ids, loss_mask, hs_TLD, scale) in enumerate(rows):
        if offset == max_len:
            break
        n = min(max(len(input_ids) - 1, 0), max_len - offset)  # shifted length; the last one truncated
        end = offset + n
        if deferred:  # the e4m3 bytes and their scales, as stored
            hs[offset:end].view(torch.uint8).copy_(hs_TLD[:n, :-1, :].view(torch.uint8))
            last[offset:end].view(torch.uint8).copy_(hs_TLD[1:n + 1, -1, :].view(torch.uint8))
            hs_scale[offset:end].copy_(scale[:n, :-1])
            last_scale[offset:end].copy_(scale[1:n + 1, -1])
        else:
            _put(hs[offset:end], hs_TLD[:n, :-1, :], None if scale is None else scale[:n, :-1])  # g_0 .. g_{n-1}
            _put(last[offset:end], hs_TLD[1:n + 1, -1, :], None if scale is None else scale[1:n + 1, -1])  # y_1 .. y_n
        ids[offset:end].copy_(torch.from_numpy(np.asarray(input_ids[1:n + 1], dtype=np.int64)))
        mask[offset:end].copy_(torch.from_numpy(np.asarray(loss_mask[1:n + 1]) != 0))
        pos[offset:end].copy_(torch.arange(1, n + 1))
        docs[offset:end] = doc
        offset = end
    for t in (hs, last, ids, pos, mask) + ((hs_scale, last_scale) if deferred else ()):
        (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)[offset:].zero_()
    docs[offset:] = -1
    batch = {"input_ids": ids[None], "hidden_states": hs.view(1, max_len, -1),
             "verifier_last_hidden_states": last[None], "loss_mask": mask[None], "position_ids": pos[None],
             "document_ids": docs[None], "error_records": 0}
    if deferred:
        batch.update(hidden_states_scale=hs_scale[None], verifier_last_hidden_states_scale=last_scale[None])
    return batch


SCALE_KEYS = ("hidden_states_scale", "verifier_last_hidden_states_scale")


def dequantize_batch(batch: dict, dtype: torch.dtype) -> dict:
    """A batch packed with dequantize=False, its e4m3 hidden states replaced by their `dtype`
    values and the scale keys dropped, wherever its tensors are (the trainer calls it on the
    device): the values pack(..., dequantize=True) gives. Other batches are returned as they are."""
    if SCALE_KEYS[0] not in batch:
        return batch
    out = {k: v for k, v in batch.items() if k not in SCALE_KEYS}
    hs, scale = batch["hidden_states"], batch["hidden_states_scale"]
    hs = dequantize_fp8(hs.view(*scale.shape, -1), scale).view(hs.shape)  # [1, T, (L-1)*H]
    last = dequantize_fp8(batch["verifier_last_hidden_states"], batch["verifier_last_hidden_states_scale"])
    out["hidden_states"], out["verifier_last_hidden_states"] = hs.to(dtype), last.to(dtype)
    return out


def _put(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None) -> None:
    if scale is None:
        dst.copy_(src)
    elif dst.dtype == torch.bfloat16:
        dequantize_fp8(src, scale, out=dst)
    else:  # a sample's values are bf16 (as HiddenStatesDataset.samples gives them), whatever the batch dtype
        dst.copy_(dequantize_fp8(src, scale))


class PackedBatches:
    """Endless micro-batches for one rank: samples packed into [1, micro_batch_tokens] in the
    format of speculators' CollateFn (document_ids mark samples, -1 marks padding; built by
    `pack`, in pinned memory when `pin_memory`), epochs cycled. fp8 shards: `dequantize=False`
    keeps the hidden states e4m3 with their scales, for `dequantize_batch` on the device.

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
        self._pending: StoredRow | None = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return self.pack(self.take())

    def pack(self, rows: list, alloc=None) -> dict:
        return pack(rows, self.micro_batch_tokens, self.hidden_states_dtype, self.pin_memory, self.dequantize,
                    alloc=alloc)

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{name: (shape, dtype)} of a batch's tensor buffers (`batch_layout`)."""
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
                                       "num_truncated; raise train.data.micro_batch_tokens to keep whole samples)",
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
                    f"(shards {self.dataset.rank_shards(self.epoch)}); the shards are empty, or hold only samples "
                    "of the held-out split (prepare.heldout_fraction): write more samples per shard "
                    "(extract.samples_per_shard) or use fewer workers"
                )
            self.load_state_dict({"epoch": self.epoch + 1, "samples_seen": 0})
        raise ValueError(f"rank {self.dataset.rank}: two consecutive epochs without a usable sample (all < 2 tokens)")

"""Staging a packed batch's model inputs on the device ahead of the step.

Owns: which keys of a batch the model takes (`MODEL_INPUTS`), their copy to the device with fp8
dequantised there (`device_inputs`), and `DeviceBatches`, which starts the next batch's copy on a
side CUDA stream under the current step's kernels and keeps the data position of the last batch
returned. Does not own: building batches (eagle3.train.data.packing, .prefetch), the step (eagle3.train.trainer).
"""

from __future__ import annotations

import time

import torch

from eagle3.train.data.packing import SCALE_KEYS, dequantize_batch

MODEL_INPUTS = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
                "verifier_last_hidden_states")


def device_inputs(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The model's inputs of a packed batch, on `device` (asynchronous copies from pinned memory);
    e4m3 hidden states packed as stored are dequantised there, to `dtype`."""
    keys = MODEL_INPUTS + tuple(k for k in SCALE_KEYS if k in batch)
    return dequantize_batch({k: batch[k].to(device, non_blocking=True) for k in keys}, dtype)


class DeviceBatches:
    """Packed batches with their model inputs already on the device: `stage()` takes the next batch
    from `source` and starts its copy (and fp8 dequantisation) on a side CUDA stream, so that it
    runs under the current step's kernels instead of in front of the next step's. Off CUDA the copy
    is in line.

    `next()` returns (host batch, device inputs, seconds blocked on `source`). `state_dict()` is the
    data position after the last batch *returned*, as with Prefetcher, so a staged batch is not
    counted in a checkpoint; `load_state_dict` drops it. A host batch stays valid until the second
    `next` after it, as WorkerPrefetcher's do.
    """

    def __init__(self, source, device: torch.device, dtype: torch.dtype):
        self.source, self.device, self.dtype = source, device, dtype
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._staged: tuple | None = None
        self._copied: torch.cuda.Event | None = None
        self._state = source.state_dict()

    def stage(self) -> float:
        """Take the next batch and start its copy, unless one is staged; returns the seconds
        spent waiting for the source."""
        if self._staged is not None:
            return 0.0
        if self._copied is not None:  # the source may reuse the memory of the batch before it from now on
            self._copied.synchronize()  # (WorkerPrefetcher's ring); that copy ran under the last step
        t = time.perf_counter()
        batch = next(self.source)
        wait = time.perf_counter() - t
        event = None
        if self.stream is None:
            inputs = device_inputs(batch, self.device, self.dtype)
        else:
            with torch.cuda.stream(self.stream):
                inputs = device_inputs(batch, self.device, self.dtype)
                event = torch.cuda.Event()
                event.record(self.stream)
        self._copied = event
        self._staged = (batch, inputs, event, self.source.state_dict())
        return wait

    def __iter__(self):
        return self

    def __next__(self) -> tuple[dict, dict, float]:
        wait = self.stage()
        batch, inputs, event, self._state = self._staged
        self._staged = None
        if event is not None:  # the step's kernels wait for the copy; its memory is theirs from now
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in inputs.values():
                t.record_stream(current)
        return batch, inputs, wait

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self._staged = None
        self.source.load_state_dict(state)
        self._state = self.source.state_dict()

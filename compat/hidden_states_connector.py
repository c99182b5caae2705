"""Seam: the KV connector behind vLLM's `extract_hidden_states` speculative method.

vLLM versions: 0.26 - 0.32 (subclasses `ExampleHiddenStatesConnector`, overriding its
private `_submit_async_write`; tests/test_compat.py fails if that method or the
attributes used here move).
Why: the stock connector (a) copies to pinned host memory, which fails on a CPU-only
build ("pin_memory=True requires a CUDA or other accelerator backend"), and (b) writes
one safetensors file per request, which a reader must load and delete again.
This subclass adds a `sink` (kv_connector_extra_config["sink"]):
- "memory": tensors go to `SINK` in this process, keyed by the request's
  `hidden_states_path` (never written). Needs the worker in the caller's process:
  tensor_parallel_size * pipeline_parallel_size == 1 and VLLM_ENABLE_V1_MULTIPROCESSING=0.
- "shm": the stock file protocol, with a synchronous CPU copy where there is no
  accelerator. Files should live in memory-backed storage (/dev/shm); the reader
  deletes each file right after loading it (`take_hidden_states`).
Also `hs_dtype` (kv_connector_extra_config["hs_dtype"]): "float8_e4m3fn" quantises on the
device before the copy to host (one scale per token and layer, amax / 448), halving the
bytes that cross PCIe and that the host touches afterwards.
Remove when: vLLM offers an in-process hidden-states sink and a CPU-safe copy upstream.
"""

from __future__ import annotations

import fcntl
import os
import threading

import torch
from safetensors.torch import load_file, save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from compat.fp8 import quantize_fp8

CONNECTOR_NAME = "RayHiddenStatesConnector"
MODULE_PATH = __name__

# hidden_states_path -> ({"hidden_states": [T, L, H] on host, "token_ids": [T], "hs_scale": [T, L] or
# absent}, copy-done event)
SINK: dict[str, tuple[dict, object]] = {}
_SINK_LOCK = threading.Lock()


class _Done:
    """Stands where the stock connector keeps a CUDA event: a copy that already finished."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class RayHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._sink = self._kv_transfer_config.get_from_extra_config("sink", "shm")
        if self._sink not in ("memory", "shm"):
            raise ValueError(f"[compat] kv_connector_extra_config sink={self._sink!r}: use 'memory' or 'shm'")
        self._hs_dtype = self._kv_transfer_config.get_from_extra_config("hs_dtype", "bfloat16")
        if self._hs_dtype not in ("bfloat16", "float8_e4m3fn"):
            raise ValueError(f"[compat] kv_connector_extra_config hs_dtype={self._hs_dtype!r}: "
                             "use 'bfloat16' or 'float8_e4m3fn'")

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        kv_cache = self._kv_cache
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        token_ids = pending.token_ids.clone()

        if kv_cache.device.type == "cpu":
            # Fancy indexing already copies out of the cache: no clone needed.
            host = {k: v.contiguous() for k, v in self._encode(extract_from_kv_cache(kv_cache, slot_mapping, num_tokens)).items()}
            done = _Done()
        else:
            # As upstream: gather on a side stream, async copy into pinned memory, event marks done.
            stream = self._get_copy_stream()
            ready = torch.cuda.Event()
            ready.record()
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                gathered = extract_from_kv_cache(kv_cache, slot_mapping.to(kv_cache.device, non_blocking=True), num_tokens)
                host = {}
                for key, dev in self._encode(gathered).items():
                    host[key] = torch.empty(dev.shape, dtype=dev.dtype, device="cpu", pin_memory=True)
                    host[key].copy_(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        host["token_ids"] = token_ids

        if self._sink == "memory":
            with _SINK_LOCK:
                SINK[pending.filename] = (host, done)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is not None:
                os.close(lock_fd)
        else:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            future = self._executor.submit(self._write_tensors, host, done, pending.filename, lock_fd)
            self._req_futures[pending.req_id] = future
        self._req_copy_events[pending.req_id] = done

    def _encode(self, hs: torch.Tensor) -> dict[str, torch.Tensor]:
        """[T, L, H] in the engine dtype -> what goes to host: bf16 as is, or e4m3 bytes + scales."""
        if self._hs_dtype == "bfloat16":
            return {"hidden_states": hs.to(torch.bfloat16)}
        q, scale = quantize_fp8(hs)
        return {"hidden_states": q, "hs_scale": scale}


def take_hidden_states(path: str) -> tuple[dict[str, torch.Tensor], object]:
    """The captured tensors of one request, and the event of their copy to host: hidden_states
    [T, L, H] (bf16, or e4m3 bytes as uint8), token_ids [T] and, for fp8, hs_scale [T, L]; read
    them only after `done.synchronize()`, so a caller can hand the engine on before the last
    copies land. Removes them from the sink or from disk: nothing is left behind."""
    with _SINK_LOCK:
        item = SINK.pop(path, None)
    if item is not None:
        return item
    return _take_file(path), _Done


def _take_file(path: str) -> dict[str, torch.Tensor]:
    lock_path = path + ".lock"
    if os.path.exists(lock_path):
        with open(lock_path) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"[compat] hidden states for {path} are neither in this process's sink nor on disk: "
            "with sink='memory' the engine must run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, tp*pp == 1)"
        )
    data = load_file(path, device="cpu")
    os.remove(path)
    if os.path.exists(lock_path):
        os.remove(lock_path)
    return data

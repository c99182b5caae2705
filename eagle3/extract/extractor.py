"""Hidden-state extraction of one shard of prepared samples, without Ray.

Owns: turning a tokens table (eagle3.schema.TOKENS_SCHEMA) into a hidden-states table
(eagle3.schema.hidden_states_schema), with rejects for samples the engine cannot take.
Two backends behind one interface:
- VLLMBackend: the product. A vLLM engine with the `extract_hidden_states` speculative
  method (all vLLM specifics live in compat/).
- HFBackend: a transformers forward with hooks. The reference for correctness tests and
  benchmarks, and a way to test the Ray orchestration on CPU without an engine start.
Does not own: placement, scheduling of shards, writing files (actors/ and ray_jobs/).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import pyarrow as pa

from eagle3.config import ExtractConfig
from eagle3.schema import hidden_states_schema


def target_text_config(model_dir: str) -> dict:
    """The language model's config dict, also when it sits in a multimodal wrapper (`text_config`)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(cfg.get(key), dict) and "num_hidden_layers" in cfg[key]:
            return cfg[key]
    return cfg


@dataclass
class ExtractStats:
    num_samples: int
    num_rejected: int
    num_tokens: int
    seconds: float
    rejects: list[dict]


class VLLMBackend:
    def __init__(self, model_dir: str, cfg: ExtractConfig, layer_ids: list[int], *, max_model_len: int,
                 dtype: str = "auto", trust_remote_code: bool = False):
        from compat.vllm_engine import Engine, engine_env, extraction_engine_kwargs
        from eagle3.precision import engine_dtype

        dtype, self.dtype = engine_dtype(dtype)  # self.dtype: the choice and why, for logs
        in_process = cfg.tensor_parallel_size * cfg.pipeline_parallel_size == 1
        self.sink = cfg.sink if cfg.sink != "auto" else ("memory" if in_process else "shm")
        if self.sink == "memory" and not in_process:
            raise ValueError(
                f"extract.sink='memory' needs tensor_parallel_size*pipeline_parallel_size == 1, found "
                f"{cfg.tensor_parallel_size}*{cfg.pipeline_parallel_size}; use sink 'shm' or 'auto'"
            )
        os.environ.update(engine_env(in_process=self.sink == "memory", cpu_kvcache_space_gib=cfg.cpu_kvcache_space_gib))
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        self.storage_path = os.path.join(shm, f"eagle3-hs-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or max(8192, max_model_len)
        kwargs = extraction_engine_kwargs(
            model=model_dir, layer_ids=layer_ids, max_model_len=max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens, sink=self.sink, storage_path=self.storage_path,
            hs_dtype=cfg.hs_dtype, dtype=dtype, tensor_parallel_size=cfg.tensor_parallel_size,
            pipeline_parallel_size=cfg.pipeline_parallel_size, max_num_seqs=cfg.max_num_seqs,
            gpu_memory_utilization=cfg.engine_gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
            load_format=cfg.load_format, trust_remote_code=trust_remote_code, block_size=cfg.block_size,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        )
        self.engine = Engine(**kwargs)
        self.max_len = min(max_model_len - 1, self.max_num_batched_tokens)  # prompt + 1 output token
        # One short prefill through the whole path now, so the first shard is not the one that pays
        # for lazy initialisation (and a broken connector fails at start-up, not mid-job).
        try:
            self.hidden_states([[(7 * i + 3) % 100 + 1 for i in range(16)]])
        except BaseException:
            self.close()  # nobody else holds this backend yet: release the engine before raising
            raise

    def hidden_states(self, batch: list[list[int]]):
        """Per sample: a [T, L, D] bf16 tensor, or (uint8 e4m3 [T, L, D], scale [T, L]) when the
        connector quantised on the device (extract.hs_dtype float8_e4m3fn)."""
        return self.collect(self.submit(batch))

    def submit(self, batch: list[list[int]]):
        """Runs the engine; what it returns may still be in flight to host memory (`collect`)."""
        from compat.vllm_engine import run_prefill

        return run_prefill(self.engine.llm, batch)

    @staticmethod
    def collect(pending) -> list:
        out = []
        for item, done in pending:
            done.synchronize()
            hs = item["hidden_states"]
            out.append((hs, item["hs_scale"]) if "hs_scale" in item else hs)
        return out

    def close(self):
        """Release the engine (compat.vllm_engine.Engine.close) and the shm sink's directory."""
        import shutil

        try:
            self.engine.close()
        finally:
            shutil.rmtree(self.storage_path, ignore_errors=True)


class HFBackend:
    """transformers forward, one sample at a time, hooks on the decoder layers.

    Layer id k < n is `hidden_states[k]` (the residual stream after k layers); id n is the last
    decoder layer's output taken by a hook, since transformers applies the final norm to
    `hidden_states[-1]`.
    """

    def __init__(self, model_dir: str, layer_ids: list[int], *, dtype: str = "auto", device: str | None = None,
                 max_model_len: int = 1 << 30, trust_remote_code: bool = False, batch_size: int = 1,
                 random_weights: bool = False):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from eagle3.precision import describe, resolve_dtype

        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        on_gpu = self.device.startswith("cuda")
        dtype, self.dtype = resolve_dtype(dtype, on_gpu=on_gpu), describe(dtype, on_gpu=on_gpu)
        self.batch_size = batch_size
        if random_weights:  # benchmarks on dummy shapes: the same work as real weights, no files
            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
            with torch.device(self.device):
                self.model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code).to(self.device).eval()
        self.layer_ids = layer_ids
        self.max_len = max_model_len
        decoder = self.model.get_decoder()
        self._last = {}
        decoder.layers[-1].register_forward_hook(
            lambda _m, _i, out: self._last.__setitem__("h", out[0] if isinstance(out, tuple) else out))

    def hidden_states(self, batch: list[list[int]]):
        """Samples of equal length go through together, up to batch_size (no padding, so no
        padding-dependent numerics); the copy to host is part of the work, as for vLLM."""
        torch = self.torch
        out: list = [None] * len(batch)
        order = sorted(range(len(batch)), key=lambda i: len(batch[i]))
        groups, cur = [], []
        for i in order:
            if cur and (len(batch[i]) != len(batch[cur[0]]) or len(cur) == self.batch_size):
                groups.append(cur)
                cur = []
            cur.append(i)
        if cur:
            groups.append(cur)
        with torch.no_grad():
            for g in groups:
                res = self.model(torch.tensor([batch[i] for i in g], device=self.device), output_hidden_states=True)
                n = len(res.hidden_states) - 1
                per_layer = [self._last["h"] if k == n else res.hidden_states[k] for k in self.layer_ids]
                stacked = torch.stack(per_layer, dim=2).to(torch.bfloat16).cpu()  # [B, T, L, D]
                for j, i in enumerate(g):
                    out[i] = stacked[j]
        return out

    def submit(self, batch: list[list[int]]):
        return self.hidden_states(batch)

    @staticmethod
    def collect(pending) -> list:
        return pending

    def close(self):
        pass


class Extractor:
    """Turns tokens tables into encoded hidden-states tables with one backend."""

    def __init__(self, model_dir: str, cfg: ExtractConfig, *, max_length: int, dtype: str = "auto",
                 trust_remote_code: bool = False, backend=None):
        text_cfg = target_text_config(model_dir)
        self._engine_lock = threading.Lock()
        self.layer_ids = cfg.layer_ids(text_cfg["num_hidden_layers"])
        self.hidden_size = text_cfg["hidden_size"]
        self.cfg = cfg
        self.schema = hidden_states_schema(layer_ids=self.layer_ids, hidden_size=self.hidden_size, hs_dtype=cfg.hs_dtype)
        from compat.vllm_engine import prefill_max_model_len

        positions = text_cfg.get("max_position_embeddings")
        if backend is not None:
            self.backend = backend
        elif cfg.backend == "vllm":
            self.backend = VLLMBackend(model_dir, cfg, self.layer_ids, max_model_len=prefill_max_model_len(
                max_length, positions), dtype=dtype, trust_remote_code=trust_remote_code)
        else:  # a forward pass generates nothing: the position table is the only limit
            self.backend = HFBackend(model_dir, self.layer_ids, dtype=dtype,
                                     max_model_len=min(max_length, positions or max_length),
                                     trust_remote_code=trust_remote_code)
        self.dtype = getattr(self.backend, "dtype", None)  # the compute dtype, for logs (a test's backend has none)

    def extract(self, tokens: pa.Table) -> tuple[pa.Table, ExtractStats]:
        # The codec imports torch: the drivers and the online feed read target_text_config here and need none.
        from eagle3.extract.codec import encode_hidden_states, hidden_states_columns

        t0 = time.perf_counter()
        ids_col = tokens.column("input_ids").to_pylist()
        keep, rejects = [], []
        for i, ids in enumerate(ids_col):
            if len(ids) > self.backend.max_len:
                rejects.append({"sample_id": tokens.column("sample_id")[i].as_py(),
                                "reason": f"{len(ids)} tokens > the engine's limit {self.backend.max_len} "
                                          "(max_model_len / max_num_batched_tokens); raise extract.max_num_batched_tokens "
                                          "or prepare.max_length"})
            else:
                keep.append(i)
        kept = tokens.take(pa.array(keep, pa.int64())) if len(keep) != len(ids_col) else tokens
        # The engine serves one call at a time. The next call takes it while this one waits for its
        # last copies to host and encodes its table.
        with self._engine_lock:
            pending = self.backend.submit([ids_col[i] for i in keep]) if keep else []
        hs_list = self.backend.collect(pending)
        chunks, scales = [], []
        for i, hs in zip(keep, hs_list):
            if isinstance(hs, tuple):  # quantised on the device already
                hs, scale = hs
                v, s = hs.contiguous().numpy().reshape(-1), scale.float().contiguous().numpy().reshape(-1)
            else:
                v, s = encode_hidden_states(hs, self.cfg.hs_dtype)
            want = len(ids_col[i]) * len(self.layer_ids) * self.hidden_size
            if tuple(hs.shape) != (len(ids_col[i]), len(self.layer_ids), self.hidden_size) or v.size != want:
                raise RuntimeError(
                    f"[extract] sample {i}: engine returned hidden states {tuple(hs.shape)}, expected "
                    f"({len(ids_col[i])}, {len(self.layer_ids)}, {self.hidden_size})")
            chunks.append(v)
            scales.append(s)
        hs_col, scale_col = hidden_states_columns(chunks, scales, self.cfg.hs_dtype)
        table = pa.Table.from_arrays(
            [kept.column("sample_id"), kept.column("input_ids"), kept.column("loss_mask"), kept.column("num_tokens"),
             hs_col, scale_col], schema=self.schema)
        num_tokens = int(sum(len(ids_col[i]) for i in keep))
        return table, ExtractStats(len(keep), len(rejects), num_tokens, time.perf_counter() - t0, rejects)

    def close(self):
        """Release the backend's engine (idempotent); waits for a call that is using it (an actor
        runs several threads). Or use the Extractor as a context manager."""
        with self._engine_lock:
            self.backend.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

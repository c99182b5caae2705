"""Seam: starting a vLLM engine for hidden-state extraction and draining what it captured.

vLLM versions: 0.26 - 0.32. Public seams used: `LLM(...)` with the `extract_hidden_states`
speculative method and a KV connector loaded by module path; `LLM.generate` with token-id
prompts; each output's `kv_transfer_params["hidden_states_path"]`.
Private seam: `llm.llm_engine.step()` to drain the connector. The connector extracts a
request's hidden states one engine step after the request finishes (when the scheduler
hands its blocks over), and `LLM.generate` returns as soon as all outputs are final, so
with an in-process engine nobody runs that step; we run it. A multiprocess engine core
keeps stepping by itself. Remove when generate waits for connector sends (upstream: none
filed as of 0.32).
Settings forced for correctness: prefix caching off (a cached prefix shortens the captured
sequence: vllm-project/vllm#44485), chunked prefill off and max_num_batched_tokens >= the longest
sample (one prefill step per request, so hidden states come from one forward).
Also owns `Engine`, the one way our code starts and releases a vLLM `LLM` in a process,
`VLLMStepEngine`, an `LLM`'s engine driven request by request for regeneration, and
`request_amx_permission`, a vLLM general plugin for CPUs with AMX (see their docstrings for the
seams they use).
vLLM is imported only inside what starts or drives an engine: engine_env, core_in_process and
prefill_max_model_len serve processes that start none (the job's driver, an hf-backend extractor),
and engine_env's variables are set before vLLM is imported.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Self


def engine_env(*, in_process: bool, cpu_kvcache_space_gib: int) -> dict[str, str]:
    """Environment the engine's process needs; set before `import vllm`. in_process: the engine
    core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), see core_in_process."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cpu_kvcache_space_gib)}
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def extraction_engine_kwargs(
    *,
    model: str,
    layer_ids: list[int],
    max_model_len: int,
    max_num_batched_tokens: int,
    sink: str,
    storage_path: str,
    hs_dtype: str = "bfloat16",
    dtype: str = "bfloat16",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    max_num_seqs: int = 256,
    gpu_memory_utilization: float = 0.85,
    enforce_eager: bool = True,
    load_format: str = "auto",
    trust_remote_code: bool = False,
    hf_overrides: dict | None = None,
    block_size: int | None = None,
    kv_cache_memory_bytes: int | None = None,
) -> dict:
    if max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={max_num_batched_tokens} < max_model_len={max_model_len}: with chunked "
            "prefill off every sample must fit one step; raise extract.max_num_batched_tokens"
        )
    from compat.hidden_states_connector import CONNECTOR_NAME, MODULE_PATH  # imports vLLM: see the module docstring

    kwargs = dict(
        model=model,
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        enforce_eager=enforce_eager,
        load_format=load_format,
        trust_remote_code=trust_remote_code,
        skip_tokenizer_init=True,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        kv_transfer_config={
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": MODULE_PATH,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": storage_path,
                "sink": sink,
                "hs_dtype": hs_dtype,
                "use_synchronization_lock": sink == "shm",
            },
        },
    )
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if hf_overrides:
        kwargs["hf_overrides"] = hf_overrides
    if block_size is not None:
        kwargs["block_size"] = block_size
    if kv_cache_memory_bytes is not None:  # set, not profiled: see eagle3_engine_kwargs
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    return kwargs


def prefill_max_model_len(max_length: int, max_position_embeddings: int | None) -> int:
    """max_model_len of an extraction engine for samples of up to max_length tokens. Extraction's
    prefill asks for one output token (run_prefill: max_tokens=1), and vLLM 0.26 refuses a prompt
    without room for it ("The decoder prompt (length 2048) plus the number of requested output
    tokens (at least 1) is longer than the maximum model length of 2048"; 0.32 checks the prompt
    alone), so a sample of exactly max_length tokens needs max_length + 1, within the target's
    position table. The longest sample such an engine takes is one less than this
    (eagle3.extract.extractor.VLLMBackend.max_len): a longer one is a reject with its reason before it
    reaches the engine. On 0.26 a prompt refused there also crashed the stock hidden-states
    connector (KeyError in ExampleHiddenStatesConnector.request_finished for a request it never
    saw), which ended the extraction replica."""
    return min(max_length + 1, max_position_embeddings or max_length + 1)


def run_prefill(llm, prompt_token_ids: list[list[int]], *, capture: bool = True, drain_timeout_s: float = 120.0):
    """Prefill each prompt once (max_tokens=1). With capture, return one (tensors, done) pair per
    prompt, in prompt order, as `take_hidden_states` gives it: the hidden states are out of the
    engine (no file left behind) and the engine is free for the next call while the last copies
    to host finish (`done.synchronize()` before reading)."""
    from vllm import SamplingParams

    from compat.hidden_states_connector import SINK, take_hidden_states

    prompts = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    if not capture:
        return outputs
    paths = []
    for out in outputs:
        params = getattr(out, "kv_transfer_params", None) or {}
        if "hidden_states_path" not in params:
            raise RuntimeError(
                f"[vLLM] request {out.request_id} finished without kv_transfer_params['hidden_states_path']: "
                "the hidden-states connector is not active in this engine"
            )
        paths.append(params["hidden_states_path"])
    deadline = time.monotonic() + drain_timeout_s
    while any(p not in SINK and not os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            missing = [p for p in paths if p not in SINK and not os.path.exists(p)]
            raise TimeoutError(f"[vLLM] hidden states of {len(missing)} requests never arrived, e.g. {missing[:2]}")
        if engine_core_in_this_process():
            llm.llm_engine.step()
        else:
            time.sleep(0.001)
    return [take_hidden_states(p) for p in paths]


def request_amx_permission() -> bool:
    """Asks Linux for this process's permission to use AMX tiles, where the CPU has them (True when
    granted). A vLLM general plugin (pyproject.toml's `vllm.general_plugins` entry point), so vLLM
    runs it in every process that hosts an engine part (the LLM's, an engine core's, a worker's),
    before any kernel runs; Engine calls it too, for a VLLM_PLUGINS allowlist that leaves it out.

    Seam (vllm-cpu 0.32, on an Intel Xeon with AMX): vLLM's CPU attention picks
    its "amx" kernels for bf16 (`_get_attn_isa` in vllm/v1/attention/backends/cpu_attn.py) but does
    not request the tile permission, which Linux requires once per process (arch_prctl
    ARCH_REQ_XCOMP_PERM; reset by exec, so every spawned engine process needs it) before the first
    tile instruction: without it the process dies of SIGILL in `cpu_attention_with_kv_cache` (the
    tests' tiny target in bf16 did, every time; SmolLM2 did not, where oneDNN had asked for it
    first). torch's `torch.cpu._init_amx` makes the request (private; torch 2.13). No
    upstream issue found. Remove when vLLM's CPU attention requests the permission itself
    (tests/test_compat.py::test_amx_permission_seam; a torch without the request starts engines as
    before, and that test fails)."""
    import torch

    supported, request = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_init_amx"))
    return bool(supported and request and supported() and request())


def engine_core_in_this_process() -> bool:
    """Whether an engine started now runs its core in this process (engine_env(in_process=True) set
    VLLM_ENABLE_V1_MULTIPROCESSING=0; see core_in_process), so that a step of it runs here."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def core_in_process(*, on_gpu: bool) -> bool:
    """Where an engine that may run either way (regeneration's, eval's) puts its engine core. On a
    GPU in a process of its own, vLLM's default: the core keeps the device busy while this process
    builds requests and reads outputs. On a CPU in this process: there a multiprocess start spawns
    an engine-core process and a worker process, each importing torch and vLLM again (several
    times slower to start), and the overlap would only share the cores the model computes on.
    Extraction decides by its sink instead
    (eagle3/extract/extractor.py: in this process whenever tp * pp == 1)."""
    return not on_gpu


def generation_engine_kwargs(*, model: str, max_model_len: int, dtype: str = "bfloat16",
                             tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, max_num_seqs: int = 256,
                             gpu_memory_utilization: float = 0.85, enforce_eager: bool = False,
                             trust_remote_code: bool = False, kv_cache_memory_bytes: int | None = None) -> dict:
    """A plain generation engine (the regenerate stage). Prefix caching on: the prompt of a
    conversation's turn r extends turn r-1's prompt and answer, so most of each prefill is
    cached. The tokenizer is loaded: outputs come back as text. On CPU, no part-prefilled
    requests (cpu_seeded_sampling_kwargs): regeneration samples with per-turn seeds.
    kv_cache_memory_bytes (GPU): a set KV cache, for replicas that start side by side on one GPU
    (eagle3_engine_kwargs says why)."""
    kv = {} if kv_cache_memory_bytes is None else {"kv_cache_memory_bytes": kv_cache_memory_bytes}
    return dict(
        model=model, dtype=dtype, max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size, max_num_seqs=max_num_seqs,
        gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, enable_prefix_caching=True,
        trust_remote_code=trust_remote_code, **cpu_seeded_sampling_kwargs(max_model_len), **kv,
    )


def generate_texts(llm, prompts: list[list[int]], params: list[dict]) -> list[dict]:
    """One completion per token-id prompt, each with its own sampling (temperature, top_p,
    max_tokens, seed): [{"text", "num_tokens", "finish_reason"}] in prompt order. Special tokens
    are left out of the text (SamplingParams' default), as a chat client shows it."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [SamplingParams(**kw) for kw in params],
                        use_tqdm=False)
    return [{"text": o.outputs[0].text, "num_tokens": len(o.outputs[0].token_ids),
             "finish_reason": o.outputs[0].finish_reason} for o in outs]


class VLLMStepEngine:
    """An `LLM`'s engine driven request by request (eagle3.prepare.regenerate.StepEngine), so that a
    conversation's next turn joins the running batch as soon as its previous turn is back,
    instead of waiting for a whole `LLM.generate` call to end.

    Seam (vLLM 0.26 - 0.32, the V1 `LLMEngine` behind `LLM.llm_engine`), exactly what
    `LLM.generate` itself does (0.26 `entrypoints/offline_utils.py`, 0.32
    `entrypoints/common/offline.py`: `_add_request`, `_run_engine`):
    - `add_request(request_id, {"prompt_token_ids": ids}, SamplingParams)` with the params'
      `output_kind = RequestOutputKind.FINAL_ONLY`, so a step returns a request once, finished;
    - `step()`, which returns `RequestOutput`s with `finished`, `request_id` and `outputs[0]`
      (`text`, `token_ids`, `finish_reason`). vLLM appends a random suffix to the id internally
      (`InputProcessor.assign_request_id`) and hands outputs back under the id we gave.
    vLLM 0.32 takes our raw `{"prompt_token_ids": ...}` prompt but logs once that raw prompts to
    `InputProcessor` are deprecated (its `LLM.generate` renders them first, with the engine's
    renderer); when they go, render as `LLM.generate` does (the slow real-engine test fails then).
    A multiprocess engine core (on a GPU: core_in_process) keeps decoding while this process builds
    the next prompts, and `step` waits for its next output; an in-process one (on a CPU) runs the
    model step inside `step`. Only one thread may drive it. Remove when vLLM has a public
    incremental offline API (none as of 0.32); `AsyncLLM` is the served alternative.
    tests/test_compat.py::test_llm_engine_step_seam fails when this moves."""

    PREFIX = "regen-"  # our ids apart from LLM.generate's counter, should both share an engine

    def __init__(self, llm):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._engine = llm.llm_engine
        self._params, self._final_only = SamplingParams, RequestOutputKind.FINAL_ONLY

    def add(self, request_id: str, prompt: list[int], params: dict) -> None:
        sp = self._params(**params)
        sp.output_kind = self._final_only
        self._engine.add_request(self.PREFIX + request_id, {"prompt_token_ids": prompt}, sp)

    def step(self) -> list[tuple[str, dict]]:
        """Finished requests of one engine step: (request_id, {"text", "num_tokens", "finish_reason"})."""
        n = len(self.PREFIX)
        return [(o.request_id[n:], {"text": o.outputs[0].text, "num_tokens": len(o.outputs[0].token_ids),
                                    "finish_reason": o.outputs[0].finish_reason})
                for o in self._engine.step() if o.finished]

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished_requests()


def cpu_seeded_sampling_kwargs(max_model_len: int) -> dict:
    """On a CPU platform: chunked prefill off and a step budget of at least one whole prompt, so that
    no request is ever part-prefilled. vLLM 0.32 (GPUModelRunner._bookkeeping_sync) rewinds the
    generator of a part-prefilled request with a seed (`gen.set_offset(gen.get_offset() - 4)`), and
    torch's CPU generator has no offset: the engine dies ("CPU Generator does not use offset") as
    soon as a seeded sampled request is prefilled in chunks. Empty on other platforms. Remove when
    vLLM skips the rewind for CPU generators (upstream: none filed as of 0.32)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


def eagle3_engine_kwargs(*, target: str, draft: str | None, num_speculative_tokens: int, max_model_len: int,
                         dtype: str = "bfloat16", enforce_eager: bool = True, gpu_memory_utilization: float = 0.85,
                         trust_remote_code: bool = False, max_num_seqs: int | None = None,
                         kv_cache_memory_bytes: int | None = None, reloadable_draft: bool = False) -> dict:
    """Target + speculators-format EAGLE-3 draft, with stats on so spec-decode counters are kept;
    draft None: the target alone (the baseline of a speedup; num_speculative_tokens must be 0).
    enforce_eager=False is how a user serves on a GPU (CUDA graphs, vLLM's default); vLLM sizes its
    graph captures by max_num_seqs (0.32, VllmConfig._set_cudagraph_sizes: up to 2 x max_num_seqs x
    (1 + k) tokens, at most 512; 0.26 not checked), so a benchmark that decodes at most 16 sequences
    at once sets 16 and starts faster.
    Prefix caching stays off: a benchmark's warm-up pass would otherwise cache the timed prompts.
    kv_cache_memory_bytes (vLLM >= 0.11 CacheConfig; GPU): the KV cache's size, set rather than
    profiled. Several engines that start at once on one GPU need it: profiling reads the device's
    free memory, which the others' starts change (0.26's gpu_worker asserts on memory freed
    meanwhile); with it, vLLM only checks that gpu_memory_utilization of the device is free.
    reloadable_draft: the workers take new draft weights in place (compat.draft_reload)."""
    if (draft is None) != (num_speculative_tokens == 0):
        raise ValueError(f"draft={draft!r} with num_speculative_tokens={num_speculative_tokens}: give a draft "
                         "directory and k >= 1, or no draft and k = 0 (the target alone)")
    kwargs = dict(
        model=target, dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
        enable_prefix_caching=False, gpu_memory_utilization=gpu_memory_utilization,
        trust_remote_code=trust_remote_code, skip_tokenizer_init=True, disable_log_stats=False,
        **cpu_seeded_sampling_kwargs(max_model_len),
    )
    if draft is not None:
        from compat.spec_schedule import eagle3_speculative_config

        kwargs["speculative_config"] = eagle3_speculative_config(draft, num_speculative_tokens)
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if reloadable_draft and draft is not None:
        from compat.draft_reload import WORKER_EXTENSION

        kwargs["worker_extension_cls"] = WORKER_EXTENSION
    return kwargs


# Prometheus names (vLLM 0.26 - 0.32, vllm/v1/spec_decode/metrics.py); `LLM.get_metrics()` strips
# no suffix: counters are read by these names.
SPEC_DECODE_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
SPEC_DECODE_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_decode_counters(llm) -> dict:
    """Spec-decode counters of this process's engines, summed over label sets."""
    out = {k: 0 for k in SPEC_DECODE_COUNTERS}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        for key, name in SPEC_DECODE_COUNTERS.items():
            if m.name == name:
                out[key] += int(m.value)
        if m.name == SPEC_DECODE_PER_POS:
            vals = list(m.values)
            per_pos = [a + b for a, b in zip(per_pos, vals)] if per_pos else [int(v) for v in vals]
    out["accepted_per_pos"] = per_pos
    return out


class Engine:
    """One vLLM `LLM`, and the duty to release it: `close()`, or leaving a `with Engine(...) as e:`
    block. The `LLM` is reachable only through `.llm`, so that after close nothing of ours keeps
    its weights or KV cache alive; `.llm` of a closed engine raises.

    Seam (vLLM 0.26 - 0.32): `LLM` has no shutdown of its own (vllm-project/vllm#36283 proposed one;
    none in 0.32), and deleting an in-process `LLM` does not release it (vllm-project/vllm#21073,
    open; vllm-project/vllm#46023 open): EngineCore.__init__ moves the engine's objects into the
    GC's permanent generation (gc.freeze), and on 0.26 `InprocClient` has no finalizer at all, so
    an in-process engine keeps its device memory until the process ends. We call
    the client's `llm.llm_engine.engine_core.shutdown()`, public on both clients of both versions:
    - multiprocess (`SyncMPClient`): stops the engine-core process(es), and their memory with them;
    - in-process (`InprocClient`): `EngineCore.shutdown` shuts the worker down (its KV connector
      agent included: `ensure_kv_transfer_shutdown`), undoes the gc.freeze, and tears down vLLM's
      parallel state (`cleanup_dist_env_and_memory`). 0.26's `InprocClient.shutdown` has no
      idempotence guard (0.32's detaches a finalizer first), so we call it once only.
    Then our last reference goes, a full collection frees the engine's tensors, and torch's CUDA
    cache hands their memory back to the device. Remove when `LLM` releases itself on close or
    deletion in every tested vLLM (tests/test_compat.py::test_engine_client_shutdown_seam)."""

    def __init__(self, **engine_kwargs):
        from vllm import LLM

        request_amx_permission()
        self._llm = LLM(**engine_kwargs)

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("this vLLM engine was closed (Engine.close): start a new Engine to use one again")
        return self._llm

    @property
    def closed(self) -> bool:
        return self._llm is None

    def close(self) -> None:
        """Release the engine now: its processes end, its memory (host and device) is freed.
        Idempotent; an engine that failed mid-shutdown is still dropped."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()
            _empty_device_cache()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _empty_device_cache() -> None:
    """Hand torch's cached CUDA blocks back to the device, if this process ever used CUDA
    (never initialise CUDA just to empty a cache)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()

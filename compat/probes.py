"""Probes of every compat seam against the installed versions, for the doctor.

Each probe is cheap (imports and source inspection; no engine, no weights) and returns
(name, ok, detail, fix). tests/test_compat.py runs them on the installed vLLM, and the
same probes run on vLLM 0.26 on a GPU in tests/gpu/.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

# Row name -> the packages whose version the probe's result speaks for (compat.versions.UNTESTED:
# an untested version of a package runs only if every probe tagged with it passes).
SEAMS: dict[str, tuple[str, ...]] = {}


def seam(name: str, *packages: str):
    """Register a probe: its row name (also when it raises) and the packages it checks."""

    def register(fn):
        SEAMS[name] = packages
        fn.seam_name = name
        return fn

    return register

# Attributes of ExampleHiddenStatesConnector that compat/hidden_states_connector.py relies on.
CONNECTOR_ATTRS = ("_kv_cache", "_block_size", "_is_tp_rank_zero", "_req_copy_events", "_lock_fds", "_executor",
                   "use_lock", "_req_futures", "_kv_transfer_config")
CONNECTOR_METHODS = ("_submit_async_write", "_get_copy_stream", "_write_tensors", "get_finished", "request_finished")
PENDING_SAVE_FIELDS = ("req_id", "filename", "token_ids", "block_ids")
ENGINE_ARGS = ("enable_prefix_caching", "enable_chunked_prefill", "max_num_batched_tokens", "kv_transfer_config",
               "speculative_config", "load_format", "skip_tokenizer_init", "disable_log_stats")
# Draft config keys our export writes that change the draft's math; an older vLLM that does not
# read one of them would silently serve a different model than the one trained.
DRAFT_KEYS = ("draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids", "target_hidden_size",
              "norm_before_fc", "fc_norm", "norm_output")


@seam("seam vllm hidden-states connector", "vllm")
def probe_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as m

    cls = m.ExampleHiddenStatesConnector
    src = inspect.getsource(cls)
    missing = [a for a in CONNECTOR_METHODS if not hasattr(cls, a)] + [a for a in CONNECTOR_ATTRS if f"self.{a}" not in src
                                                                         and not hasattr(cls, a)]
    fields = getattr(m.PendingSave, "__dataclass_fields__", {})
    missing += [f"PendingSave.{f}" for f in PENDING_SAVE_FIELDS if f not in fields]
    missing += [] if hasattr(m, "extract_from_kv_cache") else ["extract_from_kv_cache"]
    return ("seam vllm hidden-states connector", not missing,
            "ExampleHiddenStatesConnector API as compat/hidden_states_connector.py expects" if not missing
            else f"moved or gone: {missing}",
            "" if not missing else "update compat/hidden_states_connector.py for this vLLM (see compat/README.md)")


@seam("seam vllm engine args + step + metrics", "vllm")
def probe_engine_args():
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    missing = [a for a in ENGINE_ARGS if a not in names]
    from vllm import LLM
    from vllm.v1.engine.llm_engine import LLMEngine

    missing += [m for m, owner in (("get_metrics", LLM), ("step", LLMEngine)) if not hasattr(owner, m)]
    return ("seam vllm engine args + step + metrics", not missing,
            "prefix caching / chunked prefill / batch budget settable; LLMEngine.step; LLM.get_metrics"
            if not missing else f"missing: {missing}",
            "" if not missing else "update compat/vllm_engine.py for this vLLM")


@seam("seam vllm spec-decode metric names", "vllm")
def probe_spec_decode_metrics():
    from vllm.v1.spec_decode import metrics

    from compat.vllm_engine import SPEC_DECODE_COUNTERS, SPEC_DECODE_PER_POS

    src = inspect.getsource(metrics)
    missing = [n for n in (*SPEC_DECODE_COUNTERS.values(), SPEC_DECODE_PER_POS) if f'"{n}"' not in src]
    return ("seam vllm spec-decode metric names", not missing,
            "acceptance counters found" if not missing else f"renamed or gone: {missing}",
            "" if not missing else "update SPEC_DECODE_COUNTERS in compat/vllm_engine.py")


@seam("seam speculators draft config -> vLLM eagle3", "vllm")
def probe_draft_config_keys():
    from vllm.transformers_utils.configs.speculators import algos

    src = inspect.getsource(algos.update_eagle3)
    ignored = [k for k in DRAFT_KEYS if f'"{k}"' not in src]
    # vLLM fills norm_before_residual from its own default when the key is absent; it is read via the
    # transformer_layer_config copy in some versions, so only the keys that change the math count.
    ignored = [k for k in ignored if k != "norm_before_residual"]
    return ("seam speculators draft config -> vLLM eagle3", not ignored,
            "vLLM reads every draft config key our export writes" if not ignored
            else f"this vLLM ignores draft config keys {ignored}: a draft trained with them set would be served "
                 "without them",
            "" if not ignored else "train with those options off, or use a vLLM that reads them")


def _target_config(target_dir: str) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def import_target_model(target_dir: str) -> str | None:
    """Imports the target's vLLM model class in the calling thread (and with it vLLM's layers, fused
    MoE included); returns its module's name, or None where it cannot (probe_target_arch reports why).
    The doctor calls it in its task's main thread before its checks thread and its dry run start:
    two threads importing the same modules at once can hand one of them a partially initialized
    module (vLLM 0.26.0: `cannot import name 'zero_experts_compute_triton' from partially
    initialized module 'vllm.model_executor.layers.fused_moe.fused_moe'`)."""
    try:
        from vllm.model_executor.models import ModelRegistry

        arch = (_target_config(target_dir).get("architectures") or [None])[0]
        model = ModelRegistry.models.get(arch)
        if model is None:
            return None
        model.load_model_cls()
        return getattr(model, "module_name", None)
    except Exception:  # noqa: BLE001 - the architecture row reports the cause
        return None


@seam("target architecture", "vllm", "transformers")
def probe_target_arch(target_dir: str):
    """The target's architecture is registered in vLLM and implements the EAGLE-3 aux-layer
    interface (extract_hidden_states and eagle3 both need `set_aux_hidden_state_layers`).
    Multimodal wrappers (Kimi-K2.5, Qwen-VL) and MoE models pass through their own classes."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    archs = _target_config(target_dir).get("architectures") or []
    if not archs:
        return ("target architecture", False, "config.json names no `architectures`", "add the HF architectures list")
    arch = archs[0]
    cls, err = None, "not registered in this vLLM"
    if arch in ModelRegistry.models:
        # Load it ourselves: the registry's own loader logs the import error and returns None, which
        # would read as "not registered" (e.g. Qwen2.5-VL without torchvision).
        try:
            cls = ModelRegistry.models[arch].load_model_cls()
        except Exception as e:  # noqa: BLE001 - reported as a failed row with its cause
            err = f"registered, but its module fails to import: {type(e).__name__}: {e}"
    if cls is None:
        return ("target architecture", False, f"{arch}: {err}",
                "install what the import needs on this node" if arch in ModelRegistry.models
                else "use a vLLM that supports this architecture")
    ok = supports_eagle3(cls)
    return ("target architecture", ok, f"{arch}: {'implements' if ok else 'does NOT implement'} SupportsEagle3",
            "" if ok else "vLLM cannot capture aux hidden states of this architecture (e.g. Mixtral, Qwen2-VL): "
                          "pick another target or add SupportsEagle3 upstream")


def probe_remote_code(target_dir: str, trust_remote_code: bool):
    cfg = _target_config(target_dir)
    needs = bool(cfg.get("auto_map")) or any((Path(target_dir) / p).suffix == ".py" for p in Path(target_dir).iterdir())
    if needs and not trust_remote_code:
        return ("trust_remote_code", False, "the target ships its own Python code (auto_map / *.py) and "
                "target.trust_remote_code is off", "read that code, then set target.trust_remote_code: true")
    return ("trust_remote_code", True, f"{'on' if trust_remote_code else 'off'}; target "
            f"{'ships' if needs else 'has no'} remote code", "")


def run_all(target_dir: str | None, trust_remote_code: bool) -> list[tuple]:
    from compat.ray_train import probe_ray_train_layout

    probes = [probe_connector, probe_engine_args, probe_spec_decode_metrics, probe_draft_config_keys,
              probe_ray_train_layout]
    rows = []
    for p in probes:
        rows.append(_guarded(p))
    if target_dir is not None:
        rows.append(_guarded(probe_target_arch, target_dir))
        rows.append(_guarded(probe_remote_code, target_dir, trust_remote_code))
    return rows


def _guarded(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a probe that cannot run is a failed check, with its cause
        return (getattr(fn, "seam_name", fn.__name__.replace("probe_", "seam ")), False,
                f"probe raised {type(e).__name__}: {e}",
                "the seam moved: update the compat module named in compat/README.md")

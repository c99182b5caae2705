"""Seam: new EAGLE-3 draft weights into a running vLLM engine, so that the eval's engines can start
while the draft trains (ray_jobs/evaluate.py, eval.start_during_training) from a provisional export of
the same shapes, and take the trained weights when training ends, without a second start.

vLLM versions: 0.26 - 0.32.
Public seams: `LLM(worker_extension_cls=...)` (ParallelConfig; vLLM mixes the class into each
worker, the way its RLHF examples add weight-update calls) and `LLM.collective_rpc(name, args)`.
Private seams, read from the installed source by tests/test_compat.py::test_draft_reload_seam:
- where a worker's model runner keeps the draft: `model_runner.speculator.model` (0.26's Model
  Runner V2, the GPU default for dense targets) or `model_runner.drafter.model` (the V1 runner:
  0.32's CPU runner, and 0.26 where V2 does not apply); the target is `model_runner.model`;
- the draft model's `load_weights((name, tensor) pairs)`, fed what vLLM's own loader feeds it at
  start: the speculators file's tensors as stored, between vLLM's `initialize_layerwise_reload`
  and `finalize_layerwise_reload` (model_loader.reload, as the runner's own `reload_weights` does
  for the target): the layers take checkpoint form, load, are processed again (the CPU's oneDNN
  linears repack) and are copied into the tensors the engine started with, so CUDA graphs
  captured at start go on reading them.
- vLLM shares the target's embed_tokens / lm_head with the draft where the draft's copy equals the
  target's (0.26 eagle/utils.py `_should_share`). A provisional draft that was shared at start
  must not write into the target: those tensors are compared instead of loaded, and a trained
  copy that differs refuses the reload (the engine has to start again from the trained draft).
Remove when vLLM exposes a public update of a draft's weights (none as of 0.32).
"""

from __future__ import annotations

from pathlib import Path

WORKER_EXTENSION = "compat.draft_reload.DraftWeights"
"""The qualified name given to LLM(worker_extension_cls=...)."""
RPC = "eagle3_load_draft_weights"

# A weight of these names is the draft's own only when vLLM did not share the target's at start.
_SHAREABLE = ("embed_tokens", "lm_head")


class DraftReloadRefused(RuntimeError):
    """The new draft cannot be loaded in place; start the engine from it instead."""


def _unwrapped(module):
    # A CUDA graph wrapper around a module keeps it as `.runnable` (0.26 CUDAGraphWrapper) or gives
    # it back from `.unwrap()`.
    while not hasattr(module, "parameters"):
        inner = getattr(module, "runnable", None) or (module.unwrap() if hasattr(module, "unwrap") else None)
        if inner is None:
            return module
        module = inner
    return module


def draft_and_target(model_runner):
    """(the draft nn.Module, the target nn.Module) of a worker's model runner (the module
    docstring's private seam); raises DraftReloadRefused where the runner holds no draft."""
    holder = getattr(model_runner, "speculator", None) or getattr(model_runner, "drafter", None)
    draft = getattr(holder, "model", None)
    if draft is None or not hasattr(_unwrapped(draft), "load_weights"):
        raise DraftReloadRefused(f"{type(model_runner).__name__} holds no draft model with load_weights "
                                 "(model_runner.speculator.model / model_runner.drafter.model)")
    target = model_runner.get_model() if hasattr(model_runner, "get_model") else model_runner.model
    return _unwrapped(draft), _unwrapped(target)


class DraftWeights:
    """Mixed into vLLM's worker (worker_extension_cls): `self` is the worker."""

    def eagle3_load_draft_weights(self, path: str) -> int:
        """Load the speculators-format safetensors at `path` into this worker's draft, in place;
        returns the number of tensors loaded."""
        import torch
        from safetensors import safe_open

        draft, target = draft_and_target(self.model_runner)
        target_params = {id(p) for p in target.parameters()}
        inner = getattr(draft, "model", draft)
        shared = {}
        for name, module in (("embed_tokens", getattr(inner, "embed_tokens", None)),
                             ("lm_head", getattr(draft, "lm_head", None))):
            weight = getattr(module, "weight", None)
            if weight is not None and id(weight) in target_params:
                shared[name] = weight
        loaded = []
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open's handle is not iterable
                tensor = f.get_tensor(name)
                key = next((k for k in shared if k in name), None)
                if key is not None:
                    held = shared[key].data
                    # vLLM pads a vocabulary's rows (VocabParallelEmbedding): compare the rows the file has
                    fits = tensor.dim() == held.dim() and all(n <= m for n, m in zip(tensor.shape, held.shape))
                    if fits:
                        held = held[tuple(slice(0, n) for n in tensor.shape)]
                    if not fits or not torch.equal(tensor.to(held.device, held.dtype), held):
                        raise DraftReloadRefused(
                            f"{name}: the engine serves the target's {key} for the draft (equal at start), the new "
                            "draft's differs; start the engine from the new draft")
                    continue
                loaded.append((name, tensor))
        # vLLM's own in-place reload (what its reload_weights does for the target): the layers back in
        # checkpoint form, loaded, then processed again (a CPU linear repacks its weight for oneDNN)
        # and copied into the storage the engine started with.
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(draft)
        draft.load_weights(iter(loaded))
        finalize_layerwise_reload(draft, self.vllm_config.speculative_config.draft_model_config)
        return len(loaded)


def reload_draft(llm, draft_dir: str | Path) -> int:
    """Load draft_dir's model.safetensors into every worker of `llm` (started with
    worker_extension_cls=WORKER_EXTENSION and a draft of the same config); the tensors loaded per
    worker. Raises DraftReloadRefused where the new weights cannot go in place."""
    path = Path(draft_dir) / "model.safetensors"
    if not path.exists():
        raise DraftReloadRefused(f"{path} does not exist: the draft directory holds no single safetensors file")
    try:
        counts = llm.collective_rpc(RPC, args=(str(path),))
    except Exception as e:  # the worker's error comes back wrapped (its type lost over the engine's pipe)
        raise DraftReloadRefused(f"loading {path} into the running engine failed: {e}") from e
    return int(min(counts))

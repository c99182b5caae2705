"""Seam: DeepSpeed's checkpoint reader, made to refuse pickled code.

DeepSpeed versions: 0.19 (`DeepSpeedEngine.checkpoint_engine`, a `TorchCheckpointEngine` built
in `_configure_checkpointing`; `engine.load_checkpoint` reads the model-states and ZeRO
optimizer files through its `load`). tests/test_security.py fails if a real engine stops
reading through it.
Why: `TorchCheckpointEngine.load` calls `torch.load(..., weights_only=False)`, a full unpickle:
a checkpoint file crafted with a pickle payload runs its code when the job resumes. Checkpoints
live in the run's storage, which a resubmitted job, another user or a copied run directory may
have written. `SafeTorchCheckpointEngine.load` reads with `weights_only=True` (tensors, plain
containers and numbers) plus the few classes DeepSpeed and our client state put there
(SAFE_GLOBALS); anything else is refused with the path and the class named.
Remove when: DeepSpeed loads with weights_only=True by default.
"""

from __future__ import annotations

import functools


def safe_globals() -> list:
    """What a checkpoint of ours holds beyond tensors and plain containers: numpy's RNG state
    (eagle3.train.trainer's client state), DeepSpeed's loss scaler, ZeRO stage enum and parameter
    fragment addresses (ZeRO optimizer files)."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    multiarray = getattr(np, "_core", None) or np.core
    return [np.ndarray, np.dtype, multiarray.multiarray._reconstruct, type(np.dtype(np.uint32)),
            LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@functools.cache
def _engine_class():
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's torch checkpoint engine, loading without running pickled code."""

        def load(self, path: str, map_location=None):
            import pickle

            import torch

            try:
                with torch.serialization.safe_globals(safe_globals()):
                    return torch.load(path, map_location=map_location, weights_only=True)
            except pickle.UnpicklingError as e:
                raise ValueError(
                    f"checkpoint file {path} holds a Python object that is not tensors, numbers, containers or "
                    f"DeepSpeed's own checkpoint state, and is not loaded (unpickling it would run code): {e}. "
                    "If this run wrote it with another DeepSpeed version, add the class named above to "
                    "compat.deepspeed_checkpoint.safe_globals; otherwise delete the checkpoint (or the run's "
                    "ray_train directory) and train again") from None

    return SafeTorchCheckpointEngine


def install_safe_loader(engine) -> None:
    """Swap `engine`'s checkpoint engine for the safe one. Refuses an engine whose checkpoint
    engine is not DeepSpeed's plain torch one (a decoupled/fast/nebula writer would be left
    reading with weights_only=False)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    current = getattr(engine, "checkpoint_engine", None)
    if type(current) is not TorchCheckpointEngine:
        raise ValueError(f"[compat] DeepSpeed engine's checkpoint_engine is {type(current).__name__}, expected "
                         "TorchCheckpointEngine: compat/deepspeed_checkpoint.py only makes that one load safely; "
                         "remove the checkpoint engine setting from the DeepSpeed config, or extend the seam")
    cls = _engine_class()
    safe = cls.__new__(cls)  # keeps the settings DeepSpeed gave it (serialization, name)
    safe.__dict__.update(current.__dict__)
    engine.checkpoint_engine = safe

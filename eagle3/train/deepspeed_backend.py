"""The one place that knows DeepSpeed: TrainConfig -> DeepSpeed config dict -> engine.

Owns: the translation of TrainConfig into a DeepSpeed config (ZeRO stage, bf16, gradient
accumulation, clipping, optimizer, WarmupCosineLR scheduler), the call to
`deepspeed.initialize`, process-group setup for a lone process, and gathering full weights
from a (possibly ZeRO-3 partitioned) engine. Nothing else reads the ZeRO stage.
Does not own: the model (speculators' Eagle3DraftModel, built by eagle3.train.trainer), the
training loop (eagle3.train.trainer), or multi-process launch (actors.trainer via Ray Train).

CPU: DeepSpeed's "AdamW" config optimizer builds a compiled op (FusedAdam / DeepSpeedCPUAdam)
on the CPU accelerator, so on CPU the optimizer is a torch.optim.AdamW handed to
deepspeed.initialize as a client optimizer; the scheduler still comes from the config.
DeepSpeed 0.19 builds its shared-memory all-reduce op (`deepspeed_shm_comm`, a C++ build once
per machine) at every init on the CPU accelerator, with no switch to skip it; on the CPU it
is marked incompatible first (compat/deepspeed_comm), so ranks all-reduce through gloo.
"""

from __future__ import annotations

import logging
import os
import socket

from eagle3.train.config import TrainConfig

logger = logging.getLogger(__name__)

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def detect_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_bf16(cfg: TrainConfig, use_gpu: bool) -> bool:
    """cfg.optimizer.bf16, or (None) bf16 mixed precision on GPUs and on a CPU that computes bf16
    natively (eagle3.precision's rule, which decides the engines' "auto" too), fp32 on a CPU that would
    emulate it. Called in the training worker's process, so the flags read are its host's. On a CPU
    with native bf16 it trains faster than fp32 at a similar held-out accuracy
    (benchmarks/results/job/cpu-demo-smollm2-135m-2-cores-2026-12-05.md)."""
    if cfg.optimizer.bf16 is not None:
        return cfg.optimizer.bf16
    if use_gpu:
        return True
    from eagle3.precision import cpu_has_native_bf16

    return cpu_has_native_bf16()


def deepspeed_config(cfg: TrainConfig, world_size: int, *, use_gpu: bool | None = None) -> dict:
    """The DeepSpeed config dict for `cfg` on `world_size` data-parallel ranks.

    One micro-batch per rank is one packed [1, micro_batch_tokens] sequence, hence
    train_micro_batch_size_per_gpu = 1. use_gpu None: detected (torch.cuda.is_available()).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: expected >= 1 data-parallel ranks")
    if use_gpu is None:
        use_gpu = detect_gpu()
    gas = cfg.data.gradient_accumulation_steps
    # DeepSpeed's schedulers leave optimizer step 1 at lr 0 (scheduler iteration -1); step k + 1
    # runs iteration k. Starting the linear ramp at 1/(W + 1) makes the whole warmup linear:
    # lr * (0, 1, 2, ..., W) / (W + 1), then cosine from ~lr to min_lr at num_steps.
    # WarmupCosineLR holds >= 2 warmup iterations; with W = 0 a start ratio of 1 keeps them at lr.
    W = cfg.optimizer.warmup_steps
    warmup = {"warmup_num_steps": max(W, 1), "warmup_min_ratio": 1.0 / (W + 1)}
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "train_batch_size": gas * world_size,
        "gradient_clipping": float(cfg.optimizer.grad_clip),
        "zero_optimization": {"stage": cfg.optimizer.zero_stage},
        "bf16": {"enabled": resolve_bf16(cfg, use_gpu)},
        "fp16": {"enabled": False},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": cfg.num_steps,
                "cos_min_ratio": cfg.optimizer.min_lr / cfg.optimizer.lr,
                "warmup_type": "linear",
                **warmup,
            },
        },
        "steps_per_print": 2**31 - 1,  # our trainer logs; DeepSpeed's own step log is noise
        "wall_clock_breakdown": False,
    }
    if use_gpu:
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": cfg.optimizer.lr, "betas": list(ADAM_BETAS), "eps": ADAM_EPS,
                       "weight_decay": cfg.optimizer.weight_decay},
        }
    return ds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group(world_size: int, use_gpu: bool) -> None:
    """Join torch.distributed. Launchers (Ray Train, torchrun) set it up for several ranks;
    a lone process gets a one-rank group on localhost here."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"torch.distributed has world size {dist.get_world_size()}, the trainer was told "
                             f"world_size={world_size}; pass the launcher's world size")
        return
    if world_size != 1:
        raise ValueError(f"world_size={world_size} but no torch.distributed process group exists: launch the "
                         "ranks through actors.trainer.run_training (Ray Train) or torchrun")
    # Explicit TCP rendezvous rather than RANK/MASTER_* in os.environ, which would leak into
    # anything this process starts later. deepspeed.initialize asserts LOCAL_RANK is set.
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(backend="nccl" if use_gpu else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)


def _import_deepspeed(use_gpu: bool):
    if not use_gpu:
        found = os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if found != "cpu":
            raise ValueError(f"DS_ACCELERATOR={found!r} but training runs on CPU: unset it or set it to 'cpu'")
    import deepspeed

    return deepspeed


def initialize(model, cfg: TrainConfig, world_size: int, *, use_gpu: bool | None = None):
    """deepspeed.initialize on `model`'s trainable parameters; returns the engine.

    The engine owns the optimizer (AdamW), the WarmupCosineLR scheduler, gradient accumulation,
    clipping, bf16 casting and ZeRO partitioning.
    """
    if use_gpu is None:
        use_gpu = detect_gpu()
    deepspeed = _import_deepspeed(use_gpu)
    import torch

    # The launcher picks each rank's GPU (Ray Train sets the default CUDA device per worker).
    ensure_process_group(world_size, use_gpu)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the draft has no trainable parameters; check that it was built for training")
    optimizer = None
    if not use_gpu:
        optimizer = torch.optim.AdamW(params, lr=cfg.optimizer.lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                      weight_decay=cfg.optimizer.weight_decay)
        from compat.deepspeed_comm import skip_cpu_shm_op

        skip_cpu_shm_op()  # no C++ build of DeepSpeed's CPU all-reduce op: gloo all-reduces
    config = deepspeed_config(cfg, world_size, use_gpu=use_gpu)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer, config=config)
    # DeepSpeed resumes with a full unpickle of the checkpoint files; a crafted file would run its
    # code. Ours reads tensors and DeepSpeed's own state only (compat/deepspeed_checkpoint).
    from compat.deepspeed_checkpoint import install_safe_loader

    install_safe_loader(engine)
    logger.info("DeepSpeed engine: ZeRO stage %d, bf16=%s, world_size=%d, %d trainable tensors (%d params)",
                cfg.optimizer.zero_stage, config["bf16"]["enabled"], world_size, len(params),
                sum(p.numel() for p in params))
    return engine


def gather_full_state_dict(module) -> dict:
    """Full CPU copies of `module`'s state dict on every rank, gathering ZeRO-3 partitioned
    parameters (a collective: every rank must call it). A plain module is copied as is."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

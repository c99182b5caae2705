"""Training-stage config (consumed by eagle3.trainer / actors.trainer). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    """DeepSpeed EAGLE-3 draft training."""

    num_workers: int = 1
    """Ray Train workers (one DeepSpeed rank each; one GPU each on a GPU cluster)."""
    num_steps: int = 20
    """Optimizer steps."""
    lr: float = 3e-4
    seed: int = 0

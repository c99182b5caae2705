"""Seam: the process group Ray Train's torch backend starts has no bound device.

Ray versions: 2.60. `ray/train/torch/config.py` `_setup_torch_process_group` calls
`dist.init_process_group(backend, init_method, rank, world_size, timeout)` without `device_id`.
torch (2.11 - 2.13) then warns in `barrier()` on rank 0 of an NCCL group:
"barrier(): using the device under current context. You can specify `device_id` in
`init_process_group` to mute this warning." The training run meets a barrier at every checkpoint,
so the warning fills the training log. The barrier itself is right: Ray Train made the worker's
GPU its current device.
Why muted, not fixed: the process group is Ray Train's, started before our code runs.
Remove when: Ray Train passes `device_id` (tests/test_compat.py fails then).
"""

from __future__ import annotations

import warnings

# The start of torch's message (torch/distributed/distributed_c10d.py, `barrier`), as a regex.
BARRIER_DEVICE_WARNING = r"barrier\(\): using the device under current context"


def mute_barrier_device_warning() -> None:
    """In a Ray Train worker, before training: drop torch's warning on each barrier (the docstring)."""
    warnings.filterwarnings("ignore", message=BARRIER_DEVICE_WARNING, category=UserWarning)

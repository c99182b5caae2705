"""Seam: DeepSpeed's shared-memory all-reduce op, not built on the CPU.

DeepSpeed versions: 0.19 (`deepspeed.comm.torch.TorchBackend.__init__` calls `build_shm_op()`,
which returns None without building when `deepspeed.ops.__compatible_ops__` marks
`ShareMemCommBuilder.NAME` ("deepspeed_shm_comm") incompatible; that dict is made once per process,
on first access, and DeepSpeed keeps it so that edits to it persist).
Why: on the CPU accelerator every DeepSpeed init builds that op (a C++ build, the first time on a
machine or whenever the build's paths change, e.g. another venv path) whether or not there is a
second rank to reduce with; DeepSpeed 0.19 has no switch for it.
It only speeds up all-reduce between ranks on one CPU host; without it DeepSpeed all-reduces
through torch.distributed (gloo), as it does on any backend without the op. CPU training is the
demo's and the tests' (a draft of a few million parameters): the build was a cost of every fresh
machine's first job (`make demo`, CI) for no use. GPU training never builds it (nccl).
Remove when: DeepSpeed builds the op only where it is used, or has a switch for it.
"""

from __future__ import annotations

SHM_OP = "deepspeed_shm_comm"


def skip_cpu_shm_op() -> None:
    """Mark DeepSpeed's shared-memory comm op incompatible in this process, before the first
    `deepspeed.initialize` / `deepspeed.comm.init_distributed` on the CPU accelerator."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__  # made on first access, kept by DeepSpeed
    if SHM_OP not in compatible:
        raise RuntimeError(f"DeepSpeed {deepspeed.__version__} lists no {SHM_OP!r} op: compat/deepspeed_comm.py's seam "
                           "moved (see its docstring)")
    compatible[SHM_OP] = False

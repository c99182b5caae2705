"""Seam: which loss implementation speculators' Eagle3DraftModel computes its loss with.

speculators 0.9 offers "fused" (Triton kernels, speculators/losses/fused.py) and "eager".
Its Eagle3DraftModel.forward is wrapped in torch.compile whenever CUDA is present
(`conditional_torch_compile`). With torch 2.11 (the vLLM 0.26 GPU stack) dynamo fails to
trace the fused kernels inside that compiled forward: the forward and backward kernels share
one autotune `configs` list, and dynamo refuses to track the same list twice
("ListVariable(length=21) is already tracked for mutation").
So we always pass "eager": under torch.compile, inductor fuses the eager loss itself; on CPU
(no compile, no Triton backend) eager is the only choice anyway.
Remove when: the fused kernels trace under torch.compile (tests/test_compat.py checks that the
two kernels still share their configs list).
"""

from __future__ import annotations


def loss_implementation() -> str:
    return "eager"

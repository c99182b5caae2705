"""The compute dtype behind `target.dtype: auto`: bf16 where the hardware computes it natively,
float32 where bf16 would be emulated.

Owns: reading the CPU's bf16 flags (once per process) and resolving "auto" for an engine or a
trainer on a GPU or on the CPU. Does not own the storage dtype of hidden states
(extract.hs_dtype: bf16 whatever the engine computes in) nor the trainer's precision switch
(train.optimizer.bf16, resolved by eagle3.train.deepspeed_backend.resolve_bf16 with the same rule).
Imports no torch: drivers call it.

Why: on an x86 CPU without AVX512-BF16 or AMX, torch's bf16 matmul is emulated, many times slower
than float32 (benchmarks/results/dtype/), and vLLM's CPU engine logs "Failed to create
oneDNN linear, fallback to torch linear" for bf16 weights.
"""

from __future__ import annotations

import functools
import os
import platform

# x86: AVX512-BF16 dot products, AMX tiles; aarch64: the BF16 extension (Features: bf16).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


@functools.lru_cache(maxsize=1)
def cpu_bf16_flags() -> frozenset[str]:
    """The CPU flags of /proc/cpuinfo that compute bf16 natively (empty where there are none, or no
    /proc/cpuinfo: then bf16 counts as emulated, and float32 is the safe choice)."""
    try:
        with open("/proc/cpuinfo") as f:
            return bf16_flags_of(f.read())
    except OSError:
        return frozenset()


def bf16_flags_of(cpuinfo: str) -> frozenset[str]:
    """The native-bf16 flags of a /proc/cpuinfo text (x86 'flags', Arm 'Features'; the first core's:
    every core of one host reports the same set)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.split()) & NATIVE_BF16_FLAGS
    return frozenset()


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) under which bf16 matmuls are emulated even on a CPU that has
# the flags: a user who caps oneDNN there gets float32 from "auto" (benchmarks/results/dtype/).
_ONEDNN_ISA_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"})


def cpu_has_native_bf16() -> bool:
    """The CPU computes bf16 natively and oneDNN is not capped below it (ONEDNN_MAX_CPU_ISA)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return bool(cpu_bf16_flags()) and cap not in _ONEDNN_ISA_WITHOUT_BF16


def resolve_dtype(dtype: str, *, on_gpu: bool) -> str:
    """`dtype` as given, or for "auto": bfloat16 on a GPU or on a CPU with native bf16, else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if on_gpu or cpu_has_native_bf16() else "float32"


def describe(dtype: str, *, on_gpu: bool) -> str:
    """One line for logs and provenance: what was chosen, and why."""
    chosen = resolve_dtype(dtype, on_gpu=on_gpu)
    if dtype != "auto":
        return f"{chosen} (target.dtype)"
    if on_gpu:
        return f"{chosen} (auto: GPU)"
    flags = ",".join(sorted(cpu_bf16_flags())) or "none"
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return (f"{chosen} (auto: CPU {platform.machine()}, native bf16 flags: {flags}"
            + (f", ONEDNN_MAX_CPU_ISA={cap}" if cap else "") + ")")


def engine_dtype(dtype: str) -> tuple[str, str]:
    """(`dtype` resolved, describe()'s line) in the process that computes with it (an engine's): on a
    GPU if this process sees one (CUDA_VISIBLE_DEVICES as Ray set it), else on this node's CPU."""
    import torch

    on_gpu = torch.cuda.is_available()
    return resolve_dtype(dtype, on_gpu=on_gpu), describe(dtype, on_gpu=on_gpu)

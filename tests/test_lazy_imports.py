"""Drivers must not import vllm, torch or deepspeed at import time (as Ray's test_lazy_imports.py
checks for ray.data.llm): a driver starts in a second, and a broken GPU stack fails in the
actor that needs it, with its own error, not in every process that parses a config."""

import subprocess
import sys

from tests.conftest import REPO


def test_drivers_import_no_heavy_packages():
    code = (
        "import sys\n"
        "import ray_jobs.run, ray_jobs.extract, ray_jobs.regenerate, ray_jobs.target, ray_jobs.cluster, ray_jobs.doctor, eagle3.config, eagle3.schema, compat\n"
        "heavy = sorted(m for m in ('vllm', 'torch', 'deepspeed', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"driver imports pulled in: {out.stdout.strip()}"

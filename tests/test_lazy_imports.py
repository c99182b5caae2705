"""Drivers must not import vllm, torch or deepspeed at import time (as Ray's test_lazy_imports.py
checks for ray.data.llm): a driver starts in a second, and a broken GPU stack fails in the
actor that needs it, with its own error, not in every process that parses a config."""

import json
import subprocess
import sys

from tests.conftest import REPO


def test_drivers_import_no_heavy_packages():
    code = (
        "import sys\n"
        "import ray_jobs.run, ray_jobs.evaluate, ray_jobs.summary, eagle3.evaluate, ray_jobs.background, ray_jobs.extract, ray_jobs.regenerate, ray_jobs.target, ray_jobs.cluster, ray_jobs.doctor, eagle3.config, eagle3.schema, compat\n"
        "heavy = sorted(m for m in ('vllm', 'torch', 'deepspeed', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"driver imports pulled in: {out.stdout.strip()}"


def test_engine_helpers_of_processes_without_an_engine_import_no_vllm_or_torch(tmp_path):
    """What the driver (placing eval engines, sizing extraction), the online feed and an hf-backend
    extractor call from the engine modules says where and how an engine runs and starts none: it
    imports neither vLLM nor torch, which come with an engine's kwargs or its start
    (compat.vllm_engine's docstring)."""
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 8,
                                                                      "max_position_embeddings": 4096}}))
    code = (
        "import sys\n"
        "from compat.vllm_engine import core_in_process, engine_env, prefill_max_model_len\n"
        "from eagle3.extract.extractor import target_text_config\n"
        f"text = target_text_config({str(tmp_path)!r})\n"
        "print(core_in_process(on_gpu=False), engine_env(in_process=True, cpu_kvcache_space_gib=1),\n"
        "      prefill_max_model_len(256, text['max_position_embeddings']))\n"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    called, heavy = out.stdout.splitlines()
    assert called == "True {'VLLM_CPU_KVCACHE_SPACE': '1', 'VLLM_ENABLE_V1_MULTIPROCESSING': '0'} 257"
    assert heavy == "[]", f"engine helpers pulled in: {heavy}"

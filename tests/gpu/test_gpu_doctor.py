"""On the GPU: the doctor command passes with the installed vLLM and fails on a planted moved seam;
its GPU hygiene names a process that holds GPU memory and says how to
stop it, and stops naming it once it is gone."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu


def test_doctor_names_a_process_holding_gpu_memory():
    from eagle3.doctor import check_gpus

    code = ("import time, torch; x = torch.empty(2**30, dtype=torch.uint8, device='cuda'); "
            "torch.cuda.synchronize(); print('up', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "up\n", "the holder process did not allocate GPU memory"
        rows = check_gpus()
        named = [r for r in rows if f"pid {holder.pid}: " in r.detail]
        assert len(named) == 1, [r.to_dict() for r in rows]
        row = named[0]
        assert not row.ok, row.to_dict()
        assert f"pid {holder.pid}: '{sys.executable} -c import time, torch;" in row.detail, row.detail
        assert f"`kill {holder.pid}`" in row.fix, row.fix
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 30
    while any(f"pid {holder.pid}: " in r.detail for r in check_gpus()):
        assert time.monotonic() < deadline, "nvidia-smi still lists the killed holder after 30 s"
        time.sleep(1)


# Put first on PYTHONPATH, this makes every Python process of the doctor (its driver and its Ray
# tasks) load vLLM's hidden-states connector with `_submit_async_write` renamed, as an upstream
# rename would leave it: the method compat/hidden_states_connector.py overrides is gone.
MOVED_SEAM_SITECUSTOMIZE = '''
import importlib.abc, importlib.util, sys

NAME = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


class MovedSeam(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != NAME:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            cls = module.ExampleHiddenStatesConnector
            cls._submit_write = cls._submit_async_write
            del cls._submit_async_write

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, MovedSeam())
'''


def _doctor(config, report, env=None):
    """`python -m ray_jobs.doctor` as a user runs it on this node; (exit code, output, rows by name)."""
    import json

    from tests.conftest import REPO

    out = subprocess.run([sys.executable, "-m", "ray_jobs.doctor", "--config", str(config), "--json", str(report)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    text = f"{out.stdout}\n{out.stderr[-3000:]}"  # the doctor's table, then the end of the log
    reports = json.loads(report.read_text()) if report.exists() else []
    rows = {r["name"]: r for rep in reports for r in rep["rows"]}
    return out.returncode, text, rows


def test_doctor_command_passes_here_and_fails_on_a_planted_moved_seam(gpu_target, tmp_path):
    """The doctor as a user runs it on a GPU node with the installed vLLM: versions, seams, GPU
    hygiene and the dry run pass (an untested vLLM as a WARN its seams decided). Then the same
    command with vLLM's connector moved in every process fails, naming the seam and its fix, and
    an untested vLLM's version row fails with it. Its seconds are printed for the results, never
    asserted."""
    import os

    import yaml

    from compat.versions import in_tested_range, installed
    from tests.conftest import REPO

    config = tmp_path / "doctor.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "run"), "target": {"model": gpu_target},
                                      "prepare": {"conversations": str(REPO / "data/demo_conversations.jsonl")},
                                      "regenerate": {"enabled": False}}))
    t0 = time.monotonic()
    rc, text, rows = _doctor(config, tmp_path / "doctor.json")
    print(f"doctor as installed: exit {rc} in {time.monotonic() - t0:.0f} s\n{text}")
    assert rc == 0, text[-4000:]
    assert rows["dry run"]["ok"] and "hidden states (16, 2, 512)" in rows["dry run"]["detail"], rows["dry run"]
    assert all(r["ok"] for name, r in rows.items() if name.startswith(("version ", "seam "))), rows
    assert rows["version vllm"]["warn"] == (not in_tested_range("vllm")[0]), rows["version vllm"]

    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(MOVED_SEAM_SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plant), os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    rc, text, rows = _doctor(config, tmp_path / "moved.json", env)
    print(f"doctor with the moved seam: exit {rc} in {time.monotonic() - t0:.0f} s\n{text}")
    assert rc == 1, text[-4000:]
    seam = rows["seam vllm hidden-states connector"]
    assert not seam["ok"] and seam["detail"] == f"[vllm {installed('vllm')}] moved or gone: ['_submit_async_write']"
    assert seam["fix"] == "update compat/hidden_states_connector.py for this vLLM (see compat/README.md)"
    assert "FAIL  seam vllm hidden-states connector" in text
    failed = sorted(n for n, r in rows.items() if not r["ok"] and n != "dry run")
    if in_tested_range("vllm")[0]:
        assert failed == ["seam vllm hidden-states connector"], rows
    else:  # untested: its seams decide, and one failed
        assert failed == ["seam vllm hidden-states connector", "version vllm"], rows
        assert rows["version vllm"]["detail"].endswith("failed: seam vllm hidden-states connector, dry run") or \
            rows["version vllm"]["detail"].endswith("failed: seam vllm hidden-states connector"), rows["version vllm"]

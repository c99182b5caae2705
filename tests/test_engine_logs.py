"""The job's output is for the user: vLLM's INFO lines go to each Ray worker's own engine log
file (actors.engine_logs), its warnings still reach the job's output; EAGLE3_ENGINE_LOGS=1
turns the routing off."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

# Applies our logging config the way vLLM applies VLLM_LOGGING_CONFIG_PATH (logging.config.dictConfig
# of the file's JSON), in a child process so that this one's logging stays as it is.
CHILD = """
import json, logging, logging.config, os, sys
logging.config.dictConfig(json.load(open(os.environ["VLLM_LOGGING_CONFIG_PATH"])))
log = logging.getLogger("vllm.engine.probe")
log.info("info-marker")
log.warning("warning-marker")
try:
    raise ValueError("boom-in-warning")
except ValueError:
    log.warning("warned-with-traceback", exc_info=True)
    log.error("error-with-traceback", exc_info=True)
print(os.getpid())
"""


def test_logging_config_sends_info_to_the_file_and_warnings_to_stderr(tmp_path):
    from actors.engine_logs import vllm_logging_config

    config = tmp_path / "logging.json"
    config.write_text(json.dumps(vllm_logging_config()))
    env = {**os.environ, "EAGLE3_ENGINE_LOG_DIR": str(tmp_path), "VLLM_LOGGING_CONFIG_PATH": str(config),
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.strip())
    log_file = tmp_path / f"eagle3-engine-{pid}.log"
    text = log_file.read_text()
    records = [line for line in text.splitlines() if line.split(" ", 1)[0] in ("INFO", "WARNING", "ERROR")]
    assert [r.split(" ", 1)[0] for r in records] == ["INFO", "WARNING", "WARNING", "ERROR"]
    assert records[0].endswith("info-marker") and records[1].endswith("warning-marker")
    assert text.count("ValueError: boom-in-warning") == 2  # the file keeps both tracebacks
    # The job's output: warnings in one line each (the traceback left in the file), the error in full.
    assert out.stderr.splitlines()[:2] == ["[vLLM] WARNING warning-marker",
                                           f"[vLLM] WARNING warned-with-traceback (traceback in {log_file})"]
    assert out.stderr.count("ValueError: boom-in-warning") == 1 and "[vLLM] ERROR error-with-traceback" in out.stderr
    assert "info-marker" not in out.stderr + out.stdout


def test_the_job_installs_the_routing_unless_switched_off(monkeypatch):
    from ray_jobs.cluster import REPO_ROOT, job_runtime_env

    monkeypatch.delenv("EAGLE3_ENGINE_LOGS", raising=False)
    env = job_runtime_env()
    assert env["worker_process_setup_hook"] == "actors.engine_logs.setup_worker"
    assert env["env_vars"]["PYTHONPATH"].split(os.pathsep)[0] == REPO_ROOT
    monkeypatch.setenv("EAGLE3_ENGINE_LOGS", "1")
    assert "worker_process_setup_hook" not in job_runtime_env()


def test_deepspeed_logs_warnings_only_by_default():
    """Why actors.engine_logs routes only vLLM: DeepSpeed's own logger already stays at WARNING."""
    from deepspeed.utils.logging import logger

    assert logger.name == "DeepSpeed" and logger.getEffectiveLevel() == logging.WARNING


@pytest.mark.slow  # starts Ray and a vLLM engine
def test_engine_info_lines_go_to_the_workers_file_not_to_its_output(tiny_target, ray_local):
    """A real vLLM CPU engine in a task of a cluster started by init_ray (as the job does): its
    INFO lines are in <session>/logs/eagle3-engine-<pid>.log; the worker's .out/.err, which Ray
    forwards to the job's output, hold none of them."""
    def start_engine(model_dir: str) -> tuple[int, str]:  # defined here: shipped by value to the worker
        from vllm import LLM

        llm = LLM(model=model_dir, enforce_eager=True, max_model_len=128, max_num_seqs=4, dtype="bfloat16")
        llm.generate([[5, 6, 7]], use_tqdm=False)
        return os.getpid(), os.environ["EAGLE3_ENGINE_LOG_DIR"]

    # In-process engine: its records are all in the task's own file.
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    task = ray_local.remote(num_cpus=1, max_calls=1, runtime_env={"env_vars": env})(start_engine)
    pid, log_dir = ray_local.get(task.remote(tiny_target))
    engine_log = (Path(log_dir) / f"eagle3-engine-{pid}.log").read_text()
    info = [line for line in engine_log.splitlines() if line.startswith("INFO ")]
    assert any("Resolved architecture" in line for line in info), engine_log[:2000]
    forwarded = "".join(p.read_text(errors="replace") for p in Path(log_dir).glob(f"worker-*-{pid}.*"))
    assert forwarded, f"no worker-*-{pid}.out/err in {log_dir}"
    for line in info:
        message = line.split("] ", 1)[1]
        assert message not in forwarded, f"forwarded to the job's output: {line}"

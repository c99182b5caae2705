"""On the GPU: online mode with the engine and the trainer sharing each GPU (train.online.gpu_split:
shared): vLLM extraction and DeepSpeed bf16 training at once on one device, every sample
trained once per epoch. The CPU tiers show the decision, its checks and Ray's placement on a
declared GPU (tests/test_online.py); this is where vLLM's memory share and the trainer's cap meet
on a real device. Its whole job log (and report) go to the log directory (EAGLE3_TEST_LOG_DIR, else a temp dir):
gpu_online_shared.log, gpu_online_shared-report.json."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.gpu


def test_gpu_online_job_shares_the_gpu_and_trains_every_sample_once(gpu_target, tmp_path, log_dir):
    from eagle3.gpu_processes import query
    from tests.fault_jobs import conversations
    from tests.test_online import _online_args, check_trained_once_per_epoch

    out = tmp_path / "out"
    dest = log_dir
    args = _online_args(out, conversations(tmp_path / "conversations.jsonl", 41), gpu_target,
                        "--set", "extract.backend=vllm", "--set", "train.online.gpu_split=shared",
                        "--set", "extract.gpu_memory_utilization=0.6", "--set", "train.optimizer.bf16=true")
    seen: list[set[int]] = []
    with open(dest / "gpu_online_shared.log", "w") as log:
        job = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + int(os.environ.get("GPU_JOB_TIMEOUT_S", "900"))
        try:
            while job.poll() is None and time.monotonic() < deadline:
                seen.append({p.pid for p in query()[1]})
                time.sleep(0.5)
        finally:
            if job.poll() is None:
                job.kill()
            job.wait()
    text = (dest / "gpu_online_shared.log").read_text()
    assert job.returncode == 0, text[-3000:]
    report = json.loads((out / "report.json").read_text())
    # the whole log and the report beside it, in the log directory: kept after the run
    (dest / "gpu_online_shared-report.json").write_text(json.dumps(report, indent=1))
    split = report["stages"]["train"]["online"]["gpu_split"]
    assert split["mode"] == "shared" and split["engine_bundle"]["GPU"] == pytest.approx(0.7), split
    assert split["trainer_gpus"] == pytest.approx(0.3) and split["num_replicas"] >= 1, split
    check_trained_once_per_epoch(out, 1)
    # the engine and the training worker held the GPU at the same time (two processes, at least)
    assert max(map(len, seen)) >= 2, seen[-5:]
    print(f"\nshared GPU online job: split {split}, at most {max(map(len, seen))} processes on the GPU at once")

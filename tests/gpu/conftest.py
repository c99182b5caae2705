"""GPU tier: runs on the device machine (vLLM 0.26, CUDA); skipped where there is no CUDA.

Each test of this tier runs in a pytest process of its own (`pytest_runtest_protocol` below), and
the pytest process that collects them never uses CUDA. Why: a process that once used CUDA keeps a
context (and whatever its caches hold) on the device until it ends, and the whole-job test's doctor
rightly fails on any other process holding GPU memory ("gpu hygiene"). With one process per test,
`pytest tests/gpu` passes as one command in any order, and what a test leaves on the device ends
with its process. Engines are still released by their owners inside a test (Extractor.close,
SpecDecodeEngine.close: compat.vllm_engine.Engine); test_gpu_extract checks that on the device.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Set in the child pytest process: there the test runs as usual.
CHILD_ENV = "EAGLE3_GPU_TEST_OWN_PROCESS"
CHILD_TIMEOUT_S = int(os.environ.get("GPU_TEST_TIMEOUT_S", "1800"))
# A directory the tests' own processes share for one run of the tier (the `tier_dir` fixture).
SHARED_ENV = "EAGLE3_GPU_TIER_DIR"
# EAGLE3_TEST_LOG_DIR: where GPU tests write job logs and reports as they run (kept; a run cut short leaves them); default: a pytest temp dir.
LOG_DIR_ENV = "EAGLE3_TEST_LOG_DIR"


def pytest_configure(config):
    if not os.environ.get(CHILD_ENV) and not os.environ.get(SHARED_ENV):
        os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="eagle3-gpu-tier-")
        config._eagle3_tier_dir = os.environ[SHARED_ENV]  # removed at unconfigure


def pytest_unconfigure(config):
    made = getattr(config, "_eagle3_tier_dir", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


@pytest.fixture(scope="session")
def tier_dir(tmp_path_factory) -> Path:
    """Shared by the processes of one `pytest tests/gpu` run, so that what several tests build once
    (a target) is built once (take a file lock while building)."""
    return Path(os.environ.get(SHARED_ENV) or tmp_path_factory.mktemp("gpu-tier"))


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    """The directory named by EAGLE3_TEST_LOG_DIR (made if missing), else one of pytest's temp dirs:
    where a test streams its job's log, so that what a long run wrote survives a timeout."""
    path = Path(os.environ.get(LOG_DIR_ENV) or tmp_path_factory.mktemp("logs"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def gpu_target(tier_dir):
    """The tier's seeded 12-layer target (hidden 512, real random weights), built once per run of
    the tier (its pretraining would otherwise run in each test's process)."""
    import fcntl

    from eagle3.tiny import build_tiny_target
    from tests.conftest import DEMO

    # size 2: hidden 512, 12 layers; seeded, real (random) weights, so both engines compute the same model.
    with open(tier_dir / "gpu-target.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # build_tiny_target reuses a complete build (its stamp)
        return str(build_tiny_target(tier_dir / "gpu-target", DEMO, size=2, seed=0))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()  # the driver's device count: no CUDA context is made
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA (the GPU tier runs on the device machine)")
        for item in items:
            if "tests/gpu" in str(item.fspath):
                item.add_marker(skip)


def _in_this_tier(item) -> bool:
    return Path(str(item.fspath)).resolve().is_relative_to(HERE)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Run a GPU-tier test as `python -m pytest <nodeid>` in a child process and report its outcome
    here (one call-phase report: passed, skipped or failed with the child's output)."""
    if os.environ.get(CHILD_ENV) or not _in_this_tier(item) or item.get_closest_marker("skip"):
        return None  # the usual protocol: in the child, elsewhere, or skipped without CUDA
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", item.nodeid]
    try:
        proc = subprocess.run(cmd, check=False, cwd=item.config.rootpath, env={**os.environ, CHILD_ENV: "1"},
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = f"{e.stdout or ''}{e.stderr or ''}"
        output, rc = (output if isinstance(output, str) else output.decode(errors="replace")), None
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    if rc == 0 and re.search(r"\b1 passed\b", summary):
        outcome, longrepr = "passed", None
    elif rc == 0 and re.search(r"\b1 skipped\b", summary):
        reason = re.findall(r"^SKIPPED \[\d+\] [^ ]+:\d+: (.*)$", output, re.MULTILINE)
        outcome, longrepr = "skipped", (str(item.fspath), item.location[1] or 0, reason[-1] if reason else summary)
    else:
        what = f"timed out after {CHILD_TIMEOUT_S} s (GPU_TEST_TIMEOUT_S)" if rc is None else f"exit code {rc}"
        first = re.findall(r"^(?:FAILED|ERROR) \S+ - (.*)$", output, re.MULTILINE)
        outcome = "failed"
        longrepr = f"in its own process, {what}: {first[-1] if first else summary}\n{' '.join(cmd)}\n{output[-12000:]}"
    report = pytest.TestReport(item.nodeid, item.location, {k: 1 for k in item.keywords}, outcome, longrepr, "call",
                               sections=[("own process output", output[-12000:])],
                               duration=time.perf_counter() - t0)
    item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True

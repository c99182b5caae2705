"""Shared fixtures: the tiny seeded target (built once per session) and CPU-engine settings;
and the guard that keeps the test tiers honest.

Tiers: a test that starts a Ray cluster, a vLLM engine or a DeepSpeed engine is marked
`slow`; the rest are the fast tier (`make test` runs it first: pytest -m "not slow"). The
guard below fails a fast-tier test that starts a Ray cluster (in this process or in a child
it runs) or DeepSpeed's process group, saying to mark it slow.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from ray_jobs.cluster import free_ports

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo_conversations.jsonl"

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads sleep when a parallel region ends instead of spinning (libgomp's default spins ~300k
# times first). The suite runs two xdist workers on 2 cores, each with its Ray cluster, engines and
# trainers: spinning threads then take the cores from whatever the other worker runs. Read when torch
# loads libgomp, so set here (before any test imports torch) and inherited by every job, Ray node and
# engine the tests start. Beside a vLLM engine test, test_train's slow tests: 73-81 s with it against
# 110-113 s without. The product leaves it alone.
# Torch may be loaded already only where the policy was set before it: a test module's `from tests.conftest
# import ...` loads this file a second time, under that name, after what pytest imported first.
assert "torch" not in sys.modules or "OMP_WAIT_POLICY" in os.environ, \
    "tests/conftest.py: torch was imported before OMP_WAIT_POLICY was set"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray Train's preemption watcher (an actor per training run that polls the nodes for a spot
# instance's notice every 5 s) has nothing to watch on one machine: 27.7 CPU-s of the suite's 2,360, in
# 15 runs, each its own process. No test covers
# preemption; the product leaves the watcher on. Inherited by every job and Ray node the tests start.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# Ray's log monitor (one a cluster, forwarding workers' output to the driver) reads its open files every
# 0.1 s, and below this many files it also globs the logs directory for new ones every 0.1 s, instead of
# every 0.5 s (LOG_NAME_UPDATE_INTERVAL_S) above it. 0: every 0.5 s here. A new worker's output then reaches
# the driver up to 0.4 s later, from its file's start, none of it lost. Measured (one run each):
# an idle cluster's monitor 0.30 CPU-s a minute against 0.66, the online fault job's 1.1 against 2.2; the
# suite runs two shared clusters all along and a dozen of the jobs' own (12 monitors, 61 CPU-s in session
# 30). The product leaves Ray's default. Inherited by every job and Ray node the tests start.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")


# Where the tiny target is kept between sessions; tests read it and never write into it.
TEST_CACHE = Path(os.environ.get("EAGLE3_TEST_CACHE", Path.home() / ".cache" / "eagle3-ray-tests"))


# Whether this session runs a test that needs the tiny target pretrained (a slow or GPU test: its
# engines generate, its drafts learn the target's text); set once -m has deselected what it does not run.
_PRETRAINED_NEEDED = True


# The slow tier's files in the order its two xdist workers take them (`make test` runs it with
# --dist loadfile --no-loadscope-reorder: whole files, in collection order, the first four two to a
# worker, then each to the first worker free). After the first four, heaviest first by worker-seconds
# in a full run, so that the
# last files are short ones and the workers end together. The second worker's first two files (2nd
# and 4th here) need no tiny target: on a fresh machine the first worker builds it (70-100 s, its
# pretraining) while the second works instead of waiting on the build's lock. A file not listed goes
# after the listed ones.
SLOW_FILE_ORDER = ("test_faults.py", "test_real_target_job.py", "test_online.py", "test_e2e_qwen3.py", "test_e2e.py",
                   "test_quality.py", "test_train.py", "test_recipes.py", "test_doctor.py", "test_extract.py", "test_compat.py",
                   "test_startup.py", "test_regenerate.py", "test_security.py", "test_prepare.py", "test_engine_logs.py")


def pytest_runtest_logreport(report):
    """EAGLE3_TEST_TIMELINE=FILE: one JSON line per phase of each test (xdist worker, test, phase,
    start and stop wall clock), appended by every worker: when each worker ran what, and where a
    worker waited (benchmarks/suite_timeline.py reads it)."""
    path = os.environ.get("EAGLE3_TEST_TIMELINE")
    # xdist's controller gets each worker's reports again (report.node): the worker wrote them
    if path and ("PYTEST_XDIST_WORKER" in os.environ or not hasattr(report, "node")):
        import json

        rec = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": report.nodeid, "when": report.when,
               "start": report.start, "stop": report.stop, "outcome": report.outcome}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _file_rank(item) -> int:
    name = item.path.name
    return SLOW_FILE_ORDER.index(name) if name in SLOW_FILE_ORDER else len(SLOW_FILE_ORDER)


def pytest_runtest_setup(item):
    """A fast test that asks for the session's shared cluster (shared_ray, ray_local) fails before
    its fixtures start it. That cluster lives in a temp dir of its own, so the check of each test's
    Ray temp dir (_ray_temp_dir_of_its_own) does not see it."""
    if "shared_ray" in item.fixturenames and not (item.get_closest_marker("slow") or item.get_closest_marker("gpu")):
        pytest.fail(f"{item.nodeid} uses the shared Ray cluster (shared_ray) but is not marked slow: mark it "
                    "@pytest.mark.slow (the fast tier starts no Ray cluster)", pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    global _PRETRAINED_NEEDED
    _PRETRAINED_NEEDED = any(item.get_closest_marker("slow") or item.get_closest_marker("gpu") for item in items)
    items.sort(key=_file_rank)  # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def tiny_target() -> str:
    """eagle3.tiny.build_tiny_target(size=1, seed=0), built once per machine: its pretraining
    takes 70-100 s on 2 cores (a 2-core development machine), most of a fresh machine's fast tier.
    The fast tier alone (no slow or GPU test selected) gets it without the pretraining (a few
    seconds): its tests read the target's files, config, tokenizer and tensors, never what its
    weights generate; they pass on either.
    Kept under EAGLE3_TEST_CACHE in a directory named by what its bytes depend on (eagle3/tiny.py,
    eagle3/prepare/conversations.py, the conversations, the torch/transformers/tokenizers versions), so a
    change to any of them builds a new one; a file lock lets concurrent sessions share the build."""
    import fcntl
    import hashlib
    from importlib.metadata import version

    from eagle3.tiny import build_tiny_target

    key = hashlib.sha256()
    for path in (REPO / "eagle3" / "tiny.py", REPO / "eagle3" / "prepare" / "conversations.py", DEMO):
        key.update(path.read_bytes())
    key.update(" ".join(version(p) for p in ("torch", "transformers", "tokenizers")).encode())
    steps = {} if _PRETRAINED_NEEDED else {"pretrain_steps": 0}
    out = TEST_CACHE / f"tiny-target-s1-seed0-{key.hexdigest()[:16]}{'' if _PRETRAINED_NEEDED else '-untrained'}"
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with open(TEST_CACHE / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a complete build (its stamp written last) is reused as is
        # Built from a copy of the conversations kept beside it: the build's stamp names the
        # conversations' path, so building from this checkout's data/ would rebuild (~40 s) in
        # every other checkout of the repository (each worktree, each fresh clone) on this machine.
        conversations = TEST_CACHE / f"{out.name}.conversations.jsonl"
        if not conversations.exists() or conversations.read_bytes() != DEMO.read_bytes():
            conversations.write_bytes(DEMO.read_bytes())
        return str(build_tiny_target(out, conversations, size=1, seed=0, **steps))


def start_ray_head(temp_dir: str, log, env: dict | None = None, num_cpus: int = 2) -> tuple[subprocess.Popen, dict]:
    """`ray start --head --block` with a temp dir and ports of its own, in a process group of its
    own (stop it with stop_ray_head: `ray stop` would stop every Ray cluster on the machine).
    Returns the process and its {"gcs": host:port, "dashboard": http address}."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    gcs, dashboard, client, node_manager, object_manager, agent, agent_grpc, metrics, runtime_env = free_ports(9)
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}", f"--port={gcs}",
         "--include-dashboard=true", f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
         f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return head, {"gcs": f"127.0.0.1:{gcs}", "dashboard": f"http://127.0.0.1:{dashboard}"}


def processes_of(temp_dir: str) -> list:
    """The running processes whose command line names `temp_dir` (a Ray head's own)."""
    import psutil

    return [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]


def stop_ray_head(head: subprocess.Popen, temp_dir: str, *, signal_it: bool = True) -> list:
    """Stop a head started by start_ray_head: `ray start --block` stops the processes it started
    when signalled (signal_it; the shared cluster's head stops when its stdin closes instead); its
    process group is its own, so whatever is left in it can be killed without touching others.
    Returns the processes of its temp dir still running then (killed, listed for the caller to
    assert on)."""
    if signal_it:
        head.send_signal(signal.SIGTERM)
    try:
        head.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
    left = processes_of(temp_dir)
    for proc in left:  # this cluster's own processes (its temp dir is in their command lines)
        proc.kill()
    shutil.rmtree(temp_dir, ignore_errors=True)
    return left


# The shared cluster's head: a local cluster started as a job starts one (init_ray), held until
# this process's stdin closes.
_SHARED_HEAD = """
import sys

import ray

from ray_jobs.cluster import init_ray

init_ray(num_cpus=2)
print("GCS " + ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.fixture(scope="session")
def shared_ray() -> str:
    """One real Ray cluster (a local one as a job starts it: 2 CPUs, dashboard and job server on
    loopback) shared by the slow tests that only use a cluster; its GCS address (a job joins it with
    `--set ray.address=<it>`, this process with ray_local). Starting and stopping a cluster costs
    ~6-10 s on 2 cores, each time; joining one ~1 s. Each test leaves it as it found it: a driver's
    actors, tasks and placement groups go with the driver (a job that ends, or ray.shutdown(), which
    only disconnects a driver that joined). Tests that SIGKILL a job's driver or its cluster's
    processes, remove nodes, or look at a cluster's own processes or logs start a cluster of their
    own; no test stops this one. Token authentication as Ray 2.60 sets it up for a local cluster,
    with a token of this session's (RAY_AUTH_MODE/RAY_AUTH_TOKEN in this process's environment,
    inherited by the jobs: a driver that joins must hold it). Stopped at the end of the session."""
    import ray

    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(16).hex())
    _refresh_ray_auth()
    temp_dir = tempfile.mkdtemp(prefix="e3shared-")  # short: Ray's socket paths stay under 107 characters
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=temp_dir, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    head = subprocess.Popen([sys.executable, "-c", _SHARED_HEAD], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in head.stdout:
            lines.append(line)
            if line.startswith("GCS "):
                break
        assert lines and lines[-1].startswith("GCS "), "the shared cluster did not start:\n" + "".join(lines)[-3000:]
        address = lines[-1].split()[1]
        threading.Thread(target=head.stdout.read, daemon=True).start()  # drained: a full pipe would stop it
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        head.stdin.close()
        stop_ray_head(head, temp_dir, signal_it=False)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _refresh_ray_auth()


def _refresh_ray_auth() -> None:
    """Make this process's Ray read RAY_AUTH_MODE / RAY_AUTH_TOKEN again (it caches both)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@pytest.fixture
def ray_local(shared_ray):
    """This process joined to the session's shared cluster (shared_ray) as a job's driver joins
    one (init_ray(address=...): the job's runtime env), disconnected after the test."""
    import ray

    from ray_jobs.cluster import init_ray

    init_ray(address=shared_ray)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _ray_temp_dir_of_its_own(request, monkeypatch):
    """Every test gets an empty Ray temp dir of its own (RAY_TMPDIR, inherited by child
    processes): a cluster it starts neither joins nor disturbs another one on this machine
    (Ray keeps `ray_current_cluster` there). For a test not marked slow (or gpu), a Ray session
    left in that directory means the test started a cluster, in this process or a child, and
    DeepSpeed's communication backend must be as unset after the test as before it."""
    fast = not (request.node.get_closest_marker("slow") or request.node.get_closest_marker("gpu"))
    # Short and outside pytest's tmp_path: Ray's socket paths must stay under 107 characters.
    ray_tmp = tempfile.mkdtemp(prefix="e3ray-")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    ds_before = getattr(ds_comm, "cdb", None)
    try:
        yield
    finally:
        ray_dir = Path(ray_tmp) / "ray"
        sessions = sorted(p.name for p in ray_dir.glob("session_2*")) if ray_dir.exists() else []
        ray = sys.modules.get("ray")
        if fast and sessions and ray is not None and ray.is_initialized():
            ray.shutdown()
        # A cluster this test started may outlive it (a module-scoped fixture's): its directory stays
        # while it runs. A directory no cluster used goes, even while another test's cluster runs.
        if not sessions or not (ray is not None and ray.is_initialized()):
            shutil.rmtree(ray_tmp, ignore_errors=True)
        ds_comm = sys.modules.get("deepspeed.comm.comm")
        ds_started = ds_before is None and getattr(ds_comm, "cdb", None) is not None
    if fast and sessions:
        pytest.fail(f"{request.node.nodeid} started a Ray cluster ({sessions[0]}) but is not marked slow: "
                    "mark it @pytest.mark.slow (the fast tier starts no Ray cluster)", pytrace=False)
    if fast and ds_started:
        pytest.fail(f"{request.node.nodeid} started DeepSpeed's process group but is not marked slow: "
                    "mark it @pytest.mark.slow (the fast tier starts no DeepSpeed engine)", pytrace=False)

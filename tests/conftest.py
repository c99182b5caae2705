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
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo_conversations.jsonl"

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Where the tiny target is kept between sessions; tests read it and never write into it.
TEST_CACHE = Path(os.environ.get("EAGLE3_TEST_CACHE", Path.home() / ".cache" / "eagle3-ray-tests"))


@pytest.fixture(scope="session")
def tiny_target() -> str:
    """eagle3.tiny.build_tiny_target(size=1, seed=0), built once per machine: its pretraining
    takes ~40 s on 2 idle cores and minutes on a busy machine, most of the fast tier otherwise.
    Kept under EAGLE3_TEST_CACHE in a directory named by what its bytes depend on (eagle3/tiny.py,
    eagle3/conversations.py, the conversations, the torch/transformers/tokenizers versions), so a
    change to any of them builds a new one; a file lock lets concurrent sessions share the build."""
    import fcntl
    import hashlib
    from importlib.metadata import version

    from eagle3.tiny import build_tiny_target

    key = hashlib.sha256()
    for path in (REPO / "eagle3" / "tiny.py", REPO / "eagle3" / "conversations.py", DEMO):
        key.update(path.read_bytes())
    key.update(" ".join(version(p) for p in ("torch", "transformers", "tokenizers")).encode())
    out = TEST_CACHE / f"tiny-target-s1-seed0-{key.hexdigest()[:16]}"
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with open(TEST_CACHE / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a complete build (its stamp written last) is reused as is
        # Built from a copy of the conversations kept beside it: the build's stamp names the
        # conversations' path, so building from this checkout's data/ would rebuild (~40 s) in
        # every other checkout of the repository (each worktree, each fresh clone) on this machine.
        conversations = TEST_CACHE / f"{out.name}.conversations.jsonl"
        if not conversations.exists() or conversations.read_bytes() != DEMO.read_bytes():
            conversations.write_bytes(DEMO.read_bytes())
        return str(build_tiny_target(out, conversations, size=1, seed=0))


@pytest.fixture
def ray_local():
    """A real local Ray cluster for one test (2 CPUs), shut down after it."""
    import ray

    from ray_jobs.cluster import init_ray

    init_ray(num_cpus=2)
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

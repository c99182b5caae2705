"""Joining or starting the Ray cluster: the job's runtime environment, compile caches and free ports.
Placement groups with a timeout that explains itself are actors/replica_pool.py's."""

from __future__ import annotations

import os
import socket
from pathlib import Path

REPO_ROOT = str(Path(__file__).resolve().parents[1])


def init_ray(address: str | None = None, num_cpus: int | None = None, object_store_memory: int | None = None,
             dashboard_host: str = "127.0.0.1", cache_dir: str | None = None) -> None:
    """Join the cluster this job runs in (ray job submit sets RAY_ADDRESS), the given address,
    or start a local one (with `object_store_memory` bytes of object store, else Ray's default),
    its dashboard and job server listening on `dashboard_host` only (loopback unless told
    otherwise: the job server runs whatever is submitted to it). Workers run with
    job_runtime_env(cache_dir) either way."""
    import ray

    if ray.is_initialized():
        return
    runtime_env = job_runtime_env(cache_dir)
    os.environ.update(runtime_env["env_vars"])  # and this process: an engine the driver starts itself
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:
        # The dashboard is where users watch the job, and Ray Train queries its controller through it.
        ray.init(num_cpus=num_cpus, runtime_env=runtime_env, include_dashboard=True, log_to_driver=True,
                 object_store_memory=object_store_memory, dashboard_host=dashboard_host)


# Where each compile cache goes under the job's cache_dir, by the variable its library reads.
COMPILE_CACHES = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


def compile_cache_env(cache_dir: str | None) -> dict[str, str]:
    """vLLM's, inductor's and Triton's cache directories under cache_dir ('~' expanded here, in the
    driver), so that every engine and training worker of a job, and a resubmitted job, compile into
    and load from the same files; {} for None (each library's own default)."""
    if cache_dir is None:
        return {}
    root = Path(cache_dir).expanduser().resolve()
    return {var: str(root / sub) for var, sub in COMPILE_CACHES.items()}


def job_runtime_env(cache_dir: str | None = None) -> dict:
    """The job's runtime env: this repository on the workers' PYTHONPATH, the compile caches under
    cache_dir (compile_cache_env; workers read them before they import vLLM or torch), and the
    engines' INFO lines sent to each worker's own log file instead of the job's output
    (actors.engine_logs), unless EAGLE3_ENGINE_LOGS=1 is set in this process's environment."""
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])),
                        **compile_cache_env(cache_dir)}}
    if os.environ.get("EAGLE3_ENGINE_LOGS") != "1":
        env["worker_process_setup_hook"] = "actors.engine_logs.setup_worker"
    return env


def free_ports(n: int) -> list[int]:
    """`n` TCP ports free on the loopback now (for the ports of a Ray node started by hand:
    tests/conftest.py's heads, benchmarks/two_node.py's head and worker)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()

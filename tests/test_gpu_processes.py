"""GPU holders named and told how to stop (eagle3.gpu_processes, eagle3.doctor.check_gpus), on
nvidia-smi output as the H200 node prints it, process trees laid out as /proc lays them out, and
real processes of this machine. No GPU needed: nvidia-smi is a script printing captured output."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3 import gpu_processes as gp
from eagle3.doctor import check_gpus

UUID0 = "GPU-8d2f3a4e-1b6c-4a7e-9f0d-2c5b7e1a3d90"
UUID1 = "GPU-1c9e7b52-77aa-4f3e-8e61-0b4d2f9c6a15"
# `nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits`
APPS = f"""\
{UUID0}, 812345, VLLM::EngineCore, 43520
{UUID0}, 812201, ray::ExtractorActor.extract_shard, 1032
{UUID1}, 90211, /usr/bin/python3, [N/A]
{UUID1}, 90388, python -c import torch, time, 512
"""
GPUS = f"""\
0, {UUID0}, 44637, 143771
1, {UUID1}, 1, 143771
"""


def test_parse_nvidia_smi():
    assert gp.parse_gpus(GPUS) == [gp.Gpu(0, UUID0, 44637, 143771), gp.Gpu(1, UUID1, 1, 143771)]
    assert gp.parse_compute_apps(APPS) == [
        gp.GpuProcess(UUID0, 812345, "VLLM::EngineCore", 43520),
        gp.GpuProcess(UUID0, 812201, "ray::ExtractorActor.extract_shard", 1032),
        gp.GpuProcess(UUID1, 90211, "/usr/bin/python3", None),
        gp.GpuProcess(UUID1, 90388, "python -c import torch, time", 512),  # a comma in the name
    ]
    assert gp.parse_compute_apps("") == []
    assert gp.parse_compute_apps("No running processes found\n") == []


def _proc_tree(root: Path, procs: dict[int, tuple[int, str]]) -> Path:
    """A /proc-shaped tree: pid -> (ppid, command line with NUL-separated arguments)."""
    for pid, (ppid, cmdline) in procs.items():
        d = root / str(pid)
        d.mkdir(parents=True)
        (d / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")
        (d / "comm").write_text(cmdline.split(" ")[0][-15:] + "\n")
        (d / "status").write_text(f"Name:\tx\nState:\tS (sleeping)\nPid:\t{pid}\nPPid:\t{ppid}\n")
    return root


@pytest.fixture
def proc_root(tmp_path):
    raylet = "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/ray/s"
    return _proc_tree(tmp_path / "proc", {
        1: (0, "/sbin/init"),
        100: (1, raylet),
        200: (100, "ray::ExtractorActor.extract_shard"),
        300: (200, "VLLM::EngineCore"),
        400: (1, "VLLM::EngineCore"),  # its actor was killed
        50: (1, "bash"),
        600: (50, "python train.py --gpu"),
        700: (100, "ray::IDLE"),
    })


def test_engine_of_an_actor_of_this_cluster_is_killed_with_its_actor(proc_root):
    h = gp.describe(gp.GpuProcess(UUID0, 300, "VLLM::EngineCore", 43520), proc_root=proc_root, own_raylet=100)
    assert h.describe() == ("pid 300: vLLM engine core 'VLLM::EngineCore', started by our ExtractorActor (Ray actor, "
                            "'ExtractorActor.extract_shard') (pid 200), in the Ray cluster this check runs in (42.5 GiB)")
    assert h.fix.startswith("`kill 200 300`") and "`ray stop` would stop this cluster too" in h.fix


def test_worker_of_a_stale_cluster_is_stopped_with_ray_stop(proc_root):
    h = gp.describe(gp.GpuProcess(UUID0, 300, "VLLM::EngineCore", 43520), proc_root=proc_root, own_raylet=999)
    assert "of another Ray cluster (raylet pid 100" in h.what
    assert h.fix.startswith("`ray stop` on this node") and "`kill 200 300`" in h.fix
    idle = gp.describe(gp.GpuProcess(UUID0, 700, "ray::IDLE", 300), proc_root=proc_root, own_raylet=999)
    assert idle.what.startswith("an idle Ray worker") and idle.fix.startswith("`ray stop`") and "`kill 700`" in idle.fix


def test_orphaned_engine_and_plain_process_are_killed_by_pid(proc_root):
    orphan = gp.describe(gp.GpuProcess(UUID0, 400, "VLLM::EngineCore", 40000), proc_root=proc_root, own_raylet=100)
    assert orphan.what == "vLLM engine core 'VLLM::EngineCore', orphaned (parent pid 1: its owner is gone)"
    assert orphan.fix.startswith("`kill 400`")
    plain = gp.describe(gp.GpuProcess(UUID1, 600, "python", None), proc_root=proc_root, own_raylet=100)
    assert plain.describe() == "pid 600: 'python train.py --gpu', child of pid 50 'bash' (?)"
    assert plain.fix.startswith("`kill 600`")


def test_pid_of_another_namespace_is_said_so(proc_root):
    h = gp.describe(gp.GpuProcess(UUID0, 812345, "VLLM::EngineCore", 43520), proc_root=proc_root)
    assert "'VLLM::EngineCore', not a process of this PID namespace" in h.what
    assert "`kill` here cannot reach it" in h.fix


def _sleeper() -> subprocess.Popen:
    """A real process, started (its command line is in /proc once it has printed)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "up\n"
    return child


def test_real_child_process_is_named_from_proc():
    child = _sleeper()
    try:
        h = gp.describe(gp.GpuProcess(UUID0, child.pid, "python", 100))
        assert h.what.startswith(f"'{sys.executable} -c import time; print('up', flush=True); time.sleep(60)', "
                                 f"child of pid {os.getpid()} ")
        assert h.fix.startswith(f"`kill {child.pid}`")
    finally:
        child.kill()
        child.wait()


def _fake_nvidia_smi(bin_dir: Path, gpus: str, apps: str) -> None:
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\n"
                      'case "$1" in\n'
                      f"  --query-gpu=*) printf '%s' '{gpus}' ;;\n"
                      f"  --query-compute-apps=*) printf '%s' '{apps}' ;;\n"
                      '  *) echo "unexpected arguments: $*" >&2; exit 2 ;;\n'
                      "esac\n")
    script.chmod(0o755)


def test_check_gpus_names_the_holder_and_how_to_stop_it(tmp_path, monkeypatch):
    child = _sleeper()
    try:
        _fake_nvidia_smi(tmp_path / "bin", GPUS, f"{UUID0}, {child.pid}, python3, 43520\n")
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        rows = {r.name: r for r in check_gpus()}
    finally:
        child.kill()
        child.wait()
    assert sorted(rows) == ["gpu 0 hygiene", "gpu 1 hygiene"]
    g0, g1 = rows["gpu 0 hygiene"], rows["gpu 1 hygiene"]
    assert not g0.ok and g0.detail.startswith("43.6 of 140 GiB in use; holders: pid %d: " % child.pid)
    assert g0.fix.startswith(f"pid {child.pid}: `kill {child.pid}`")
    assert g1.ok and g1.detail == "0.0 of 140 GiB in use; holders: none" and g1.fix == ""


def test_check_gpus_fails_on_memory_nobody_listed_holds(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path / "bin", f"0, {UUID0}, 44637, 143771\n", "")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    [row] = check_gpus()
    assert not row.ok and row.detail.endswith("holders: none") and "nvidia-smi does not list" in row.fix


def test_check_gpus_skips_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on it
    [row] = check_gpus()
    if gp.nvidia_gpus_present():  # a GPU node: a loud warning, not a silent pass
        assert row.ok and row.warn and "nvidia-smi is not on PATH" in row.detail
    else:
        assert row.ok and not row.warn and row.detail == "no NVIDIA GPU and no nvidia-smi on this node (CPU engine): skipped"

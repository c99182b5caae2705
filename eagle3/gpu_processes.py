"""Who holds GPU memory on this node, what each holder is, and how to stop it.

Owns: reading `nvidia-smi` (the GPUs and their compute processes; nvidia-smi sees every GPU of
the node whatever CUDA_VISIBLE_DEVICES says, and needs no CUDA context), and naming each holder
from /proc: a vLLM engine core or worker (vLLM titles them `VLLM::EngineCore`, `VLLM::Worker_TP0`),
a Ray worker (`ray::<Actor>.<method>`, `ray::IDLE`), one of our actors, and whether its owner is
gone (an orphan: its parent is pid 1). The advice follows from that: `kill <pid>` for a process
on its own or an orphaned engine, and for a Ray worker `kill` when it belongs to the Ray cluster
this process runs in (`ray stop` would stop that cluster too), `ray stop` when it belongs to
another one (a stale cluster, e.g. a killed driver's).
Does not own the pass/fail policy (eagle3.doctor.check_gpus) nor CUDA itself: torch is never
imported here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

GPU_QUERY = ["nvidia-smi", "--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"]
APPS_QUERY = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
              "--format=csv,noheader,nounits"]
# Our Ray actors and Ray Train's worker (which runs our training loop): named as ours.
OUR_ACTORS = ("ExtractorActor", "EvaluatorActor", "RegeneratorActor", "OnlineFeed", "RayTrainWorker")


class NvidiaSmiMissing(Exception):
    """nvidia-smi is not on PATH."""


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    used_mib: int
    total_mib: int


@dataclass(frozen=True)
class GpuProcess:
    """One row of `nvidia-smi --query-compute-apps`."""

    gpu_uuid: str
    pid: int
    name: str
    used_mib: int | None  # None where nvidia-smi says "[N/A]" (no permission, MIG, ...)


@dataclass(frozen=True)
class Holder:
    """A process holding GPU memory, as a user has to read it."""

    pid: int
    used_mib: int | None
    what: str  # e.g. "vLLM engine core 'VLLM::EngineCore', orphaned (parent pid 1: its owner is gone)"
    fix: str  # one line: the command to stop it, and why that one

    def describe(self) -> str:
        mem = "?" if self.used_mib is None else f"{self.used_mib / 1024:.1f} GiB"
        return f"pid {self.pid}: {self.what} ({mem})"


def _mib(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def parse_gpus(text: str) -> list[Gpu]:
    """Rows of GPU_QUERY's output: 'index, uuid, used MiB, total MiB'."""
    gpus = []
    for line in text.strip().splitlines():
        index, uuid, used, total = (f.strip() for f in line.split(","))
        gpus.append(Gpu(int(index), uuid, _mib(used) or 0, _mib(total) or 0))
    return gpus


def parse_compute_apps(text: str) -> list[GpuProcess]:
    """Rows of APPS_QUERY's output: 'gpu_uuid, pid, process_name, used MiB'. The name is whatever
    the process set as its title and may hold commas, so it is everything between the second
    field and the last."""
    procs = []
    for line in text.strip().splitlines():
        if not line.strip() or line.lstrip().startswith("No running"):
            continue
        uuid, pid, rest = line.split(",", 2)
        name, used = rest.rsplit(",", 1)
        procs.append(GpuProcess(uuid.strip(), int(pid), name.strip(), _mib(used)))
    return procs


def _title(pid: int, proc_root: Path) -> str | None:
    """The process's command line as `ps` shows it (a process title set with setproctitle
    replaces it), or None if there is no such process in this PID namespace."""
    try:
        raw = (proc_root / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or f"[{_comm(pid, proc_root)}]"


def _comm(pid: int, proc_root: Path) -> str:
    try:
        return (proc_root / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def _ppid(pid: int, proc_root: Path) -> int | None:
    try:
        for line in (proc_root / str(pid) / "status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _ancestors(pid: int, proc_root: Path) -> list[tuple[int, str]]:
    """(pid, title) of each ancestor, parent first, up to (not including) pid 1."""
    out, seen = [], {pid}
    ppid = _ppid(pid, proc_root)
    while ppid and ppid > 1 and ppid not in seen and len(out) < 64:
        seen.add(ppid)
        out.append((ppid, _title(ppid, proc_root) or "?"))
        ppid = _ppid(ppid, proc_root)
    return out


def _is_raylet(title: str) -> bool:
    return os.path.basename(title.split(" ", 1)[0]) == "raylet"


def _kind(title: str) -> str:
    if title.startswith("VLLM::EngineCore"):
        return f"vLLM engine core '{title}'"
    if title.startswith("VLLM::"):
        return f"vLLM engine process '{title}'"
    if title.startswith("ray::"):
        name = title[len("ray::"):].split(" ", 1)[0]
        cls = name.split(".", 1)[0]
        if cls in OUR_ACTORS:
            return f"our {cls} (Ray actor, '{name}')"
        return "an idle Ray worker" if cls == "IDLE" else f"Ray worker '{name}'"
    return f"'{title[:120]}'"


def describe(proc: GpuProcess, *, proc_root: str | Path = "/proc", own_raylet: int | None = None) -> Holder:
    """What `proc` is and how to stop it. own_raylet: the pid of the raylet of the Ray cluster
    the caller runs in (own_raylet_pid()), so that a worker of that cluster is told apart from
    one of a stale cluster."""
    root = Path(proc_root)
    title = _title(proc.pid, root)
    if title is None:
        return Holder(proc.pid, proc.used_mib, f"'{proc.name}', not a process of this PID namespace (a container "
                      "sees the host's pids)", f"stop pid {proc.pid} where it runs (nvidia-smi on the host "
                      "names it); `kill` here cannot reach it")
    ancestors = _ancestors(proc.pid, root)
    what = _kind(title)
    ppid = _ppid(proc.pid, root)
    ray_owner = next(((p, t) for p, t in ancestors if t.startswith("ray::")), None)
    raylet = next((p for p, t in ancestors if _is_raylet(t)), None)
    if ray_owner is not None:
        what += f", started by {_kind(ray_owner[1])} (pid {ray_owner[0]})"
    elif ppid == 1:
        what += ", orphaned (parent pid 1: its owner is gone)"
    elif ancestors:
        what += f", child of pid {ancestors[0][0]} '{ancestors[0][1][:80]}'"
    pids = " ".join(str(p) for p in ([ray_owner[0]] if ray_owner else []) + [proc.pid])
    if ray_owner is None and not title.startswith("ray::"):
        return Holder(proc.pid, proc.used_mib, what, f"`kill {proc.pid}` (then `kill -9 {proc.pid}` if nvidia-smi "
                      "still lists it after ~10 s)")
    if raylet is not None and raylet == own_raylet:
        return Holder(proc.pid, proc.used_mib, what + ", in the Ray cluster this check runs in",
                      f"`kill {pids}` (another job's or a leaked actor of this cluster; `ray stop` would stop "
                      "this cluster too)")
    if raylet is None:
        where = "whose raylet is gone (a stale Ray cluster)"
    elif own_raylet is None:
        where = f"of the Ray cluster of raylet pid {raylet}"
    else:
        where = f"of another Ray cluster (raylet pid {raylet}: a stale one, e.g. a killed driver's)"
    return Holder(proc.pid, proc.used_mib, what + f", {where}",
                  f"`ray stop` on this node stops that cluster's processes (and any other Ray cluster "
                  f"started here); or `kill {pids}` for this one alone")


def own_raylet_pid(proc_root: str | Path = "/proc") -> int | None:
    """The raylet this process descends from (it runs as a Ray task or actor), else None."""
    root = Path(proc_root)
    return next((p for p, t in _ancestors(os.getpid(), root) if _is_raylet(t)), None)


def _nvidia_smi(cmd: list[str]) -> str:
    """nvidia-smi's output for cmd. Raises NvidiaSmiMissing without it, RuntimeError with
    nvidia-smi's own message when it fails (e.g. a driver/library mismatch)."""
    if shutil.which("nvidia-smi") is None:
        raise NvidiaSmiMissing("nvidia-smi is not on PATH")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({res.returncode}): {(res.stderr or res.stdout).strip()[:300]}")
    return res.stdout


def gpus() -> list[Gpu]:
    """The node's GPUs, from nvidia-smi (errors: _nvidia_smi)."""
    return parse_gpus(_nvidia_smi(GPU_QUERY))


def query() -> tuple[list[Gpu], list[GpuProcess]]:
    """The node's GPUs and compute processes, from nvidia-smi (errors: _nvidia_smi)."""
    return gpus(), parse_compute_apps(_nvidia_smi(APPS_QUERY))


def nvidia_gpus_present() -> bool:
    """Whether an NVIDIA driver shows GPUs on this node (/proc/driver/nvidia/gpus), without
    nvidia-smi or CUDA."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())

"""The machinery of the tests that inject real faults into a whole job (tests/test_faults.py on the
CPU, tests/gpu/test_gpu_faults.py on the GPU): the job started as a subprocess (`python -m
ray_jobs.run`), waiting for its committed shards, SIGKILL of its driver, stopping what it started,
and the check of its output sample by sample (id and content hash: 0 lost, 0 duplicated).

Owns no test and no fault policy: what to kill, when, and what to expect is each test's own.
Kills only processes of the job a test started (the driver and its descendants, snapshotted by
pid), never by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from tests.conftest import REPO

# How often the waits below look at the output directory: fine enough to catch a job between two
# of its shards' commits, light enough on a 2-core machine.
POLL_S = 0.02


def conversations(path: Path, n: int) -> Path:
    """The first `n` demo conversations, written to `path`."""
    lines = (REPO / "data" / "demo_conversations.jsonl").read_text().splitlines()[:n]
    path.write_text("\n".join(lines) + "\n")
    return path


def start_job(config: str, out: Path, *sets: str, log: Path | None = None) -> subprocess.Popen:
    """`python -m ray_jobs.run --config <config> --set output_dir=<out> --set <each of sets>`,
    stdout and stderr merged into one pipe (read it with job.communicate()), or into the file
    `log` (read it with output(job)): a job whose output may pass the pipe's 64 KiB before the
    test reads it (an engine's warnings) must not block on it."""
    args = [sys.executable, "-m", "ray_jobs.run", "--config", config, "--set", f"output_dir={out}"]
    for s in sets:
        args += ["--set", s]
    if log is None:
        return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(log, "w") as f:  # the child keeps its own descriptor
        job = subprocess.Popen(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True)
    job.log = log
    return job


def output(job: subprocess.Popen, timeout: float | None = None) -> str:
    """The job's whole output, once it has ended (waits up to `timeout` s for that)."""
    text, _ = job.communicate(timeout=timeout)
    log = getattr(job, "log", None)
    return log.read_text(errors="replace") if log is not None else text


def committed_shards(out: Path) -> dict[int, dict]:
    """The shards the job's manifest counts as committed ({} before extraction has begun)."""
    from eagle3.extract.manifest import Manifest

    root = out / "hidden_states"
    return Manifest(root).committed() if root.is_dir() else {}


def wait_for(job: subprocess.Popen, done, what: str) -> None:
    """Until `done()` is true while the job runs; fails with the job's output if it ends first."""
    while job.poll() is None and not done():
        time.sleep(POLL_S)
    assert job.poll() is None, f"the job ended before {what}: " + output(job)[-3000:]


def wait_for_committed(job: subprocess.Popen, out: Path, n: int) -> dict[int, dict]:
    """Until at least `n` shards are committed; returns them as the manifest listed them then."""
    wait_for(job, lambda: len(committed_shards(out)) >= n, f"{n} shards were committed")
    return committed_shards(out)


class Created:
    """The names created in a directory, as the kernel reports them (Linux inotify, IN_CREATE): a
    test waits for a file that lives for milliseconds without polling the directory, where a poll
    fine enough to catch it (every 0.5 ms) took 8% of a core on an idle machine for the whole job."""

    IN_CREATE = 0x100

    def __init__(self, directory: Path):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self.fd, os.fsencode(directory), self.IN_CREATE) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"inotify_add_watch {directory}")
        self._pending = [e.name for e in os.scandir(directory)]  # created before the watch

    def names(self, timeout: float) -> list[str]:
        """The names created since the last call (the first call: also those there before the
        watch), waiting up to `timeout` s for one; [] if none came."""
        import select
        import struct

        found, self._pending = self._pending, []
        if found or not select.select([self.fd], [], [], timeout)[0]:
            return found
        buf, i = os.read(self.fd, 1 << 16), 0
        while i < len(buf):  # struct inotify_event: int wd; uint32 mask, cookie, len; char name[len]
            length = struct.unpack_from("iIII", buf, i)[3]
            found.append(os.fsdecode(buf[i + 16:i + 16 + length].rstrip(b"\0")))
            i += 16 + length
        return found

    def close(self) -> None:
        os.close(self.fd)


def descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


def kill_driver(job: subprocess.Popen) -> list:
    """SIGKILL of the driver, as `kill -9` or the OOM killer would; returns the processes it had
    started (psutil.Process, snapshotted just before the kill), left to their own fate."""
    cluster = descendants(job.pid)
    job.send_signal(signal.SIGKILL)
    job.wait(timeout=60)
    return cluster


def kill_all(procs: list) -> None:
    """SIGKILL of each of `procs` still running (processes a test's job started, by pid)."""
    for proc in procs:
        if proc.is_running():
            proc.kill()


def stop(job: subprocess.Popen) -> None:
    """Kill a job that is still running, and the local cluster it started (its descendants only)."""
    if job.poll() is None:
        cluster = descendants(job.pid)
        job.kill()
        job.wait(timeout=60)
        kill_all(cluster)


def shard_mtimes(out: Path) -> dict[str, int]:
    """{file name: mtime in ns} of the shard data files: equal before and after a resubmit means
    no shard was written again."""
    return {p.name: p.stat().st_mtime_ns for p in (out / "hidden_states" / "data").iterdir()}


def committed_mtimes(out: Path) -> dict[int, int]:
    """{shard: mtime in ns of its data file} of the committed shards (other files in data/, such as
    a shard written but never committed, are not counted)."""
    from eagle3.extract.manifest import Manifest

    manifest = Manifest(out / "hidden_states")
    return {shard: manifest.data_path(shard).stat().st_mtime_ns for shard in manifest.committed()}


def check_every_sample_once(out: Path) -> dict:
    """Every prepared sample is in the committed shards exactly once, with its own tokens (sha256
    of input_ids, loss_mask) and hidden states of its length; returns {sample_id: sha256 of its
    hidden-states bytes}."""
    from eagle3.extract.manifest import Manifest
    from eagle3.extract.shards import read_shards

    tokens = pq.read_table(out / "prepared" / "tokens.parquet")
    want = {sid: hashlib.sha256(json.dumps([ids, mask]).encode()).hexdigest() for sid, ids, mask in
            zip(*(tokens.column(c).to_pylist() for c in ("sample_id", "input_ids", "loss_mask")))}
    got = read_shards(Manifest(out / "hidden_states").committed_files(),
                      columns=["sample_id", "input_ids", "loss_mask", "num_tokens", "hidden_states"])
    ids = got.column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicated samples"
    assert set(ids) == set(want), f"lost {sorted(set(want) - set(ids))[:5]}, extra {sorted(set(ids) - set(want))[:5]}"
    hashes = {}
    for sid, ids_, mask, n, hs in zip(ids, *(got.column(c).to_pylist() for c in
                                            ("input_ids", "loss_mask", "num_tokens", "hidden_states"))):
        assert hashlib.sha256(json.dumps([ids_, mask]).encode()).hexdigest() == want[sid], sid
        assert n == len(ids_) and len(hs) > 0 and len(hs) % n == 0, sid
        hashes[sid] = hashlib.sha256(hs).hexdigest()
    return hashes

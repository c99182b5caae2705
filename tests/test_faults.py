"""Faults injected for real, each ending with the job finished (or resubmitted and finished) and
its output checked by sample id and content: 0 lost, 0 duplicated.

- the output file system full in the middle of extraction (a tmpfs of a few hundred KB mounted
  by the test: needs root, as on the project's CI machines): a clear error naming the path and
  the bytes needed, no partial shard counted, and the resubmitted job completes once the file
  system has room.
- the shard writer's process killed (SIGKILL) in the middle of a shard's write: the job finishes
  by itself, and the dead writes' temporary files are removed at the end.
- a Ray Train worker killed (SIGKILL) after a checkpoint: Ray Train restarts it from that
  checkpoint in the same job (train.checkpoint.max_failures), and the loss curve goes on;
- then, in that job, the driver killed (SIGKILL) during training, its cluster gone: the
  resubmitted job redoes no extraction and resumes training from the checkpoint.

The job-as-a-subprocess machinery (start, wait, SIGKILL of the driver, the per-sample check) is
tests/fault_jobs.py, shared with the GPU driver-kill test (tests/gpu/test_gpu_faults.py).
"""

from __future__ import annotations

import re
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.trainer import RUN_NAME
from compat.ray_train import read_snapshot
from tests.conftest import REPO
from tests.fault_jobs import Created, check_every_sample_once, kill_all, kill_driver, shard_mtimes, start_job
from tests.fault_jobs import conversations as _conversations
from tests.fault_jobs import descendants as _descendants
from tests.fault_jobs import stop as _stop


@contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` (mount's syntax: 600k, 4m) mounted at `path` for the block; skips the
    test where this process may not mount (not root)."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (root needed): {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _resize(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


@pytest.mark.parametrize("name,direct_io", [("s.arrow", True), ("s.arrow", False), ("s.parquet", False)],
                         ids=["arrow-direct", "arrow-buffered", "parquet"])
def test_shard_that_does_not_fit_is_a_clear_error_and_leaves_nothing(tmp_path, name, direct_io):
    import errno

    from eagle3.extract.shards import read_shards, write_shard_file

    table = pa.table({"sample_id": [f"s{i}" for i in range(4)],
                      "hidden_states": [os.urandom(300_000) for _ in range(4)]})
    with small_filesystem(tmp_path / "fs", "600k") as fs:
        with pytest.raises(OSError) as err:
            write_shard_file(table, fs / name, direct_io=direct_io)
        assert err.value.errno == errno.ENOSPC
        msg = str(err.value)
        assert f"No space left on the file system of {fs} writing {name}" in msg
        assert f"needs about {table.nbytes:,} bytes" in msg and "614,400 bytes are free" in msg
        assert os.listdir(fs) == []  # no temporary or partial file left
        _resize(fs, "4m")  # space freed: the same write succeeds
        write_shard_file(table, fs / name, direct_io=direct_io)
        assert read_shards([fs / name]).equals(table)


def test_commit_record_that_does_not_fit_is_a_clear_error_and_counts_nothing(tmp_path):
    """The last data file took the last of the room: its commit record (a few hundred bytes) does not
    fit. The error says where, that the shard is not counted and what to do; no record, temporary or
    whole, is left, and once there is room the same commit goes through."""
    import errno

    from eagle3.extract.manifest import Manifest

    with small_filesystem(tmp_path / "fs", "256k") as fs:
        manifest = Manifest(fs)
        manifest.open({"input": "x"})
        manifest.data_path(0).write_bytes(b"shard")
        ballast = fs / "ballast"
        fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
        try:  # the rest of the file system, to the last byte
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC
        finally:
            os.close(fd)
        with pytest.raises(OSError) as err:
            manifest.commit(0, {"num_samples": 4})
        assert err.value.errno == errno.ENOSPC
        msg = str(err.value)
        assert f"No space left on the file system of {fs / 'committed'} writing shard-000000.json: the commit record " \
               "of shard 0 needs" in msg
        assert "shard-000000.arrow is written but not committed" in msg and "resubmit the same job" in msg
        assert os.listdir(fs / "committed") == [] and manifest.committed() == {}
        ballast.unlink()
        manifest.commit(0, {"num_samples": 4})
        assert manifest.committed()[0]["num_samples"] == 4


# ---------------------------------------------------------------------------------------------
# the real job: prepare + extract (hf backend: the engine is not under test) on a local cluster

def _job_args(out: Path, conversations: Path, tiny_target: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ray_jobs.run", "--config", "configs/demo.yaml", "--set", f"output_dir={out}",
            "--set", f"target.model={tiny_target}", "--set", f"prepare.conversations={conversations}",
            "--set", "prepare.num_eval_prompts=1", "--set", "stages=[prepare, extract]", "--set", "doctor=false",
            "--set", "extract.backend=hf", "--set", "extract.samples_per_shard=4", "--set", "ray.num_cpus=2", *extra]


def _job(out: Path, conversations: Path, tiny_target: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_job_args(out, conversations, tiny_target, *extra), cwd=REPO, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_output_filesystem_full_mid_extraction_then_resubmit_completes(tiny_target, tmp_path, shared_ray):
    """The output file system, too small: the extract stage says so before its engine starts, and
    extracts nothing (ray_jobs.extract.check_room). Then room enough at the start, filled by another
    writer once the check has passed: the run stops at the first shard that does not fit, with
    every committed shard whole; the resubmitted run, the file system freed, finishes the rest.
    All runs on the session's shared cluster (conftest's shared_ray): the fault is the output file
    system's, not the cluster's."""
    from eagle3.extract.manifest import Manifest

    root = Path(tempfile.mkdtemp(prefix="e3full-"))
    out = root / "out"
    data = _conversations(root / "conversations.jsonl", 24)
    try:
        with small_filesystem(out / "hidden_states", "1300k") as fs:
            first = _job(out, data, tiny_target, "--set", f"ray.address={shared_ray}")
            text = first.stdout + first.stderr
            assert first.returncode != 0, text[-3000:]
            assert re.search(r"extract: no room for the hidden states of \d+ tokens: .* MB free at "
                             rf"{re.escape(str(fs))}; the dataset needs", text), text[-3000:]
            assert "Nothing was extracted" in text and "extraction replica" not in text  # no engine started
            assert Manifest(fs).committed() == {}

            _resize(fs, "64m")
            ballast = root / "ballast"
            second = subprocess.Popen(_job_args(out, data, tiny_target, "--set", f"ray.address={shared_ray}"),
                                      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            lines = []
            try:
                for line in second.stdout:
                    lines.append(line)
                    m = re.search(r"extract: \d+ tokens left to extract: ([\d,]+) bytes of hidden states", line)
                    if m and not ballast.exists():  # the check passed: another writer fills all but half the need
                        need = int(m.group(1).replace(",", ""))
                        ballast = fs / "ballast"
                        ballast.write_bytes(b"\0" * (shutil.disk_usage(fs).free - need // 2))
                second.wait(timeout=600)
            finally:
                _stop(second)
            text = "".join(lines)
            assert ballast.exists(), text[-3000:]
            assert second.returncode != 0, text[-3000:]
            # a shard's data file that does not fit, or (where the last data file took the last of the room)
            # its commit record: either is said as clearly
            assert re.search(rf"No space left on the file system of ({re.escape(str(fs / 'data'))} writing shard-.*the "
                             rf"shard needs about|{re.escape(str(fs / 'committed'))} writing shard-\d+\.json: the "
                             r"commit record of shard \d+ .*is written but not committed)", text), text[-3000:]
            assert "bytes are free there" in text
            manifest = Manifest(fs)
            committed = manifest.committed()
            num_shards = -(-pq.read_metadata(out / "prepared" / "tokens.parquet").num_rows // 4)
            # It stopped in the middle: shards written, not all of them counted. The writer has up to
            # extract.max_inflight_shards writes at once, so the in-flight data files may take the last of the
            # room together and leave none for even the first commit record (0 committed, data files whole).
            written = sorted(p.name for p in (fs / "data").glob("shard-*"))
            assert written and len(committed) < num_shards, (written, len(committed), num_shards)
            assert not [p for p in (fs / "data").iterdir() if p.name.startswith(".")]  # no partial file
            for shard, record in committed.items():  # every shard counted is whole
                assert pq.read_metadata(manifest.data_path(shard)).num_rows == record["num_samples"] \
                    if manifest.data_path(shard).suffix == ".parquet" else \
                    pa.ipc.open_file(str(manifest.data_path(shard))).read_all().num_rows == record["num_samples"]
            ballast.unlink()
            third = _job(out, data, tiny_target, "--set", f"ray.address={shared_ray}")
            assert third.returncode == 0, (third.stdout + third.stderr)[-3000:]
            assert f"extract: {len(committed)} of {num_shards} shards already committed" in third.stdout + third.stderr
            check_every_sample_once(out)
            print(f"\nno room: stopped before extraction; disk filled after {len(committed)} of {num_shards} shards; "
                  "resubmit finished the rest")
    finally:
        subprocess.run(["umount", "-l", str(out / "hidden_states")], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_writer_killed_mid_write_loses_and_duplicates_nothing(tiny_target, tmp_path):
    """SIGKILL of the node's shard writer (actors/writer.ShardWriter) while a shard's temporary
    file is open (the file's name carries the writer's pid; inotify tells the test of the file as
    it is created). The job finishes by itself: the writer restarts, each write it had in flight is
    written again, every sample is in the output once, and no temporary file is left."""
    import re
    import signal
    import time

    import psutil

    from eagle3.extract.manifest import Manifest

    out = tmp_path / "out"
    data = _conversations(tmp_path / "conversations.jsonl", 64)
    job = subprocess.Popen(
        [sys.executable, "-m", "ray_jobs.run", "--config", "configs/demo.yaml", "--set", f"output_dir={out}",
         "--set", f"target.model={tiny_target}", "--set", f"prepare.conversations={data}",
         "--set", "prepare.num_eval_prompts=1", "--set", "stages=[prepare, extract]", "--set", "doctor=false",
         "--set", "extract.backend=hf", "--set", "extract.samples_per_shard=16", "--set", "ray.num_cpus=2",
         "--set", "extract.direct_io=false"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = None
    data_dir = out / "hidden_states" / "data"
    try:
        while job.poll() is None and not data_dir.is_dir():  # prepare, then the extract stage's start
            time.sleep(0.05)
        created = Created(data_dir) if job.poll() is None else None
        while created is not None and job.poll() is None and killed is None:
            for name in created.names(timeout=0.1):
                m = re.fullmatch(r"\.shard-(\d+)\.arrow\.tmp-(\d+)", name)
                if not m:
                    continue
                pid = int(m.group(2))
                # Only a process of this job's own cluster (a descendant of the driver it started).
                if pid in {p.pid for p in psutil.Process(job.pid).children(recursive=True)}:
                    os.kill(pid, signal.SIGKILL)
                    try:
                        psutil.Process(pid).wait(timeout=30)
                    except (psutil.NoSuchProcess, psutil.TimeoutExpired):  # gone, or a zombie: dead
                        pass
                    # A write that finished (renamed its file) between its creation and the kill was
                    # not killed mid-write (seen once: the job then had no temporary file to remove):
                    # only a file still there once its writer is dead counts; else wait for the next.
                    if (data_dir / name).exists():
                        # Every write in flight in that process died with it, each leaving its file.
                        left = sorted(p.name for p in data_dir.glob(f".shard-*.tmp-{pid}"))
                        killed = (int(m.group(1)), pid, left)
                        break
        if created is not None:
            created.close()
        text, _ = job.communicate(timeout=600)
    finally:
        _stop(job)
    assert killed is not None, "no write was caught in progress: " + text[-2000:]
    assert job.returncode == 0, text[-3000:]
    shard, pid, left = killed
    # The killed writes left their temporary files (they died mid-write); each shard was written again
    # (Ray's retry of the writer's task, or our scheduler handing it out again), and the end of the run
    # removed the files.
    assert f"removed {len(left)} unfinished temporary files of lost writes ({', '.join(left[:3])})" in text, \
        text[-3000:]
    check_every_sample_once(out)
    assert not [p.name for p in data_dir.iterdir() if p.name.startswith(".")]
    assert Manifest(out / "hidden_states").committed()[shard]["writer_pid"] != pid  # written again, by another process
    print(f"\nwriter pid {pid} killed mid-write of shard {shard}; job finished, 0 lost, 0 duplicated")


# ---------------------------------------------------------------------------------------------
# training: the driver killed, a Ray Train worker killed

def test_max_failures_is_checked():
    from eagle3.config import config_from_dict
    from eagle3.train.config import TrainConfig

    assert config_from_dict(TrainConfig, {}, "train").checkpoint.max_failures == 3
    with pytest.raises(ValueError, match=r"checkpoint.max_failures.*-2.*>= 0, or -1"):
        config_from_dict(TrainConfig, {"checkpoint": {"max_failures": -2}}, "train")


# The kills land after step CKPT_EVERY + 2 once a checkpoint is registered; the steps after that
# only have to show the run going on to the end (and, online, to finish an epoch on every rank):
# 10 leaves checkpoint 8 to register before the end, 6 steps fewer to train after each resume
# than the 16 it was.
TRAIN_STEPS, CKPT_EVERY = 10, 4
# How often the waits below read metrics.jsonl and Ray Train's record: a tiny target's step takes
# ~0.5-1.5 s on 2 cores, and each look parses both files (every 0.02 s: 3.8% of a core, every 0.1 s: 0.9%,
# on an idle machine).
STEP_POLL_S = 0.1


def _start_job(out: Path, data: Path, tiny_target: str, *extra: str, steps: int = TRAIN_STEPS) -> subprocess.Popen:
    return start_job("configs/demo.yaml", out, f"target.model={tiny_target}", f"prepare.conversations={data}",
                     "prepare.num_eval_prompts=1", "stages=[prepare, extract, train]", "doctor=false",
                     "extract.backend=hf", "extract.samples_per_shard=16", "ray.num_cpus=2",
                     f"train.num_steps={steps}", f"train.checkpoint.checkpoint_every={CKPT_EVERY}", *extra)


def _steps(metrics: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.exists() else []


def _wait_for_step(job: subprocess.Popen, metrics: Path, step: int) -> None:
    import time

    while job.poll() is None and (not _steps(metrics) or _steps(metrics)[-1] < step):
        time.sleep(STEP_POLL_S)
    assert job.poll() is None, f"the job ended before step {step}: " + job.communicate()[0][-3000:]


def _checkpointed_steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (out / "train" / "ray_train").glob("train/checkpoint_*/step_*"))


def _registered_steps(out: Path) -> list[int]:
    """Steps of the checkpoints Ray Train's controller has registered (its snapshot in storage).
    A checkpoint is on disk once the worker has reported it, but counts for a restart or a resume
    only once the controller has polled that report: a worker killed in between restarts from the
    checkpoint before it (seen: a kill two steps after step 4's report restarted from step 0)."""
    try:
        snap = read_snapshot(out / "train" / "ray_train", RUN_NAME)
    except (FileNotFoundError, json.JSONDecodeError):  # mid-rewrite
        return []
    return sorted(c.metrics["step"] for c in snap.checkpoints if "step" in c.metrics) if snap is not None else []


def _wait_for_registered_checkpoint(job: subprocess.Popen, out: Path, steps: int = TRAIN_STEPS) -> None:
    """Until Ray Train holds a checkpoint the fault can be recovered from (step < the run's `steps`)."""
    import time

    while job.poll() is None and not [s for s in _registered_steps(out) if CKPT_EVERY <= s < steps]:
        time.sleep(STEP_POLL_S)
    assert job.poll() is None, "the job ended before Ray Train registered a checkpoint: " + job.communicate()[0][-3000:]


# Both training faults in one job (as the online fault test folds its two): a cluster, prepare and
# extraction fewer than a job each. Two checkpoints before the end: the worker is killed after the
# first one registered, the driver after the restart has trained on.
FOLD_STEPS = 3 * CKPT_EVERY


def _restart(steps: list[int]) -> int | None:
    """Where metrics.jsonl starts over (the first step not after the one before it), if it does."""
    return next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), None)


@pytest.mark.slow
def test_training_worker_then_driver_killed_each_resumes_from_its_checkpoint(tiny_target, tmp_path, shared_ray):
    """Two faults in one job's training, each with its own assertions below:
    - SIGKILL of the Ray Train worker process after a checkpoint: Ray Train (FailureConfig,
      train.checkpoint.max_failures) restarts the worker group from the last checkpoint, no
      resubmit; metrics.jsonl goes on from the step after that checkpoint;
    - once the restarted group has trained two steps, SIGKILL of the driver (its local cluster's
      processes are then stopped by the test, as a lost head would take them): the same job
      resubmitted, to another cluster (the session's shared one, conftest's shared_ray), skips
      prepare's and extract's committed outputs and resumes training from the last registered
      checkpoint, to the end."""
    import signal
    import time

    out = tmp_path / "out"
    data = _conversations(tmp_path / "conversations.jsonl", 64)
    job = _start_job(out, data, tiny_target, steps=FOLD_STEPS)
    metrics = out / "train" / "metrics.jsonl"
    try:
        _wait_for_step(job, metrics, CKPT_EVERY + 2)
        _wait_for_registered_checkpoint(job, out, FOLD_STEPS)
        workers = [p for p in _descendants(job.pid) if p.name() == "ray::RayTrainWorker"]  # not its data workers
        assert len(workers) == 1, [p.name() for p in _descendants(job.pid)]
        registered = _registered_steps(out)[-1]
        killed_after = _steps(metrics)[-1]
        workers[0].send_signal(signal.SIGKILL)
        # Ray Train restarts the group: metrics.jsonl starts over, then goes on for two steps.
        while job.poll() is None and (_restart(_steps(metrics)) is None
                                      or len(_steps(metrics)) < _restart(_steps(metrics)) + 2):
            time.sleep(STEP_POLL_S)
        assert job.poll() is None, "the job ended before the driver was killed: " + job.communicate()[0][-3000:]
        kill_all(kill_driver(job))  # only what this driver started
        time.sleep(1)
    finally:
        _stop(job)
    steps = _steps(metrics)
    restart = _restart(steps)
    before, after = steps[:restart], steps[restart:]
    # the worker's kill: Ray Train resumed at the checkpoint it held, registered before the kill or
    # while the kill landed, and trained on in the same job
    assert before == list(range(1, len(before) + 1)) and before[-1] >= killed_after
    resumed_at = after[0] - 1
    assert resumed_at % CKPT_EVERY == 0 and CKPT_EVERY <= registered <= resumed_at <= killed_after
    assert after == list(range(resumed_at + 1, resumed_at + 1 + len(after))) and len(after) >= 2

    # The driver's kill. What the resubmit restores: the checkpoints Ray Train had registered then.
    ckpts = _registered_steps(out)
    assert ckpts and resumed_at <= ckpts[-1] < FOLD_STEPS and set(ckpts) <= set(_checkpointed_steps(out)), ckpts
    shards_before = shard_mtimes(out)
    job = _start_job(out, data, tiny_target, f"ray.address={shared_ray}", steps=FOLD_STEPS)
    text, _ = job.communicate(timeout=600)
    assert job.returncode == 0, text[-3000:]
    report = json.loads((out / "report.json").read_text())
    num_shards = report["stages"]["extract"]["num_shards"]
    assert report["stages"]["extract"]["shards_skipped"] == num_shards
    assert re.search(r"extract: (\d+) of \1 shards already committed", text), text[-3000:]
    assert shard_mtimes(out) == shards_before
    summary = json.loads((out / "train" / "train_summary.json").read_text())
    assert summary["resumed_from_step"] == ckpts[-1]
    assert summary["steps"] == report["stages"]["train"]["steps"] == FOLD_STEPS
    steps = _steps(metrics)
    assert steps[len(steps) - (FOLD_STEPS - ckpts[-1]):] == list(range(ckpts[-1] + 1, FOLD_STEPS + 1))
    check_every_sample_once(out)
    print(f"\ntrain worker killed after step {killed_after}; Ray Train resumed at step {resumed_at + 1}; driver killed "
          f"after step {after[-1]} (checkpoint {ckpts[-1]}); resubmit skipped extraction ({num_shards} shards) and "
          f"trained steps {ckpts[-1] + 1}..{FOLD_STEPS}")

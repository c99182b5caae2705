"""Seam: Ray Train's run storage, read without starting Ray Train.

Ray versions: 2.60 (Ray Train V2; checked here by tests/test_compat.py against a real run). The
layout comes from Ray's source at 2.60.0 (commit b7f4259e), python/ray/train/v2/:
- `api/config.py` RunConfig.storage_context: the run's directory is `<storage_path>/<name>`
  (`StorageContext.experiment_fs_path`; V2 adds no date suffix to the name);
- `_internal/constants.py` CHECKPOINT_MANAGER_SNAPSHOT_FILENAME: that directory holds
  `checkpoint_manager_snapshot.json`, written by the controller after each registered report
  (`CheckpointManager._save_state_and_delete_old_checkpoints`);
- `_internal/execution/checkpoint/checkpoint_manager.py` `_CheckpointManagerState`: the snapshot's
  `checkpoint_results` (kept checkpoints, oldest first) and `latest_checkpoint_result`, each a
  `_TrainingResultState` {checkpoint_dir_name, metrics}; the checkpoint is the directory
  `<run dir>/<checkpoint_dir_name>` (`StorageContext.build_checkpoint_path_from_name`).
Why: a resubmitted job whose training already finished must not start a worker group (the
trainer's `finished_run_summary`), and fault tests watch which checkpoints Ray Train has
registered while a job runs. Ray's public reader, `ray.train.Result.from_path`, refuses a
snapshot of another Ray version and any kept checkpoint missing from disk, and gives no
registered-but-not-latest list; the test compares this reader with it on a real run.
Remove when: Ray Train offers a public, version-tolerant read of a run's checkpoints.
Owns only the layout; what a finished run of ours is stays in actors/trainer.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from compat.probes import seam

SNAPSHOT_FILENAME = "checkpoint_manager_snapshot.json"
# Fields of the snapshot (_CheckpointManagerState) and of each result (_TrainingResultState) read here.
SNAPSHOT_FIELDS = ("checkpoint_results", "latest_checkpoint_result")
RESULT_FIELDS = ("checkpoint_dir_name", "metrics")


@dataclass(frozen=True)
class RegisteredCheckpoint:
    """One checkpoint Ray Train's controller registered: where it is, what was reported with it."""

    path: Path
    metrics: dict


@dataclass(frozen=True)
class RunSnapshot:
    """The controller's record of a run, as a Ray Train resume restores it."""

    latest: RegisteredCheckpoint | None
    """The last checkpoint reported (what `ray.train.get_checkpoint()` gives a resumed worker)."""
    checkpoints: list[RegisteredCheckpoint]
    """The checkpoints kept (CheckpointConfig.num_to_keep), oldest first."""


def run_dir(storage_path: str | Path, name: str) -> Path:
    """The directory Ray Train keeps a run in: RunConfig(storage_path=..., name=...)."""
    return Path(storage_path) / name


def read_snapshot(storage_path: str | Path, name: str) -> RunSnapshot | None:
    """The registered checkpoints of the run RunConfig(storage_path, name) describes; None when
    Ray Train has registered none there (a fresh run). Raises json.JSONDecodeError on a snapshot
    caught mid-write (only possible while its run is going)."""
    root = run_dir(storage_path, name)
    path = root / SNAPSHOT_FILENAME
    if not path.exists():
        return None
    state = json.loads(path.read_text())

    def record(result: dict | None) -> RegisteredCheckpoint | None:
        if not result or not result.get("checkpoint_dir_name"):
            return None
        return RegisteredCheckpoint(root / result["checkpoint_dir_name"], result.get("metrics") or {})

    kept = [record(r) for r in state.get("checkpoint_results") or []]
    return RunSnapshot(record(state.get("latest_checkpoint_result")), [r for r in kept if r is not None])


@seam("seam ray train storage layout", "ray")
def probe_ray_train_layout():
    """Doctor probe: the installed Ray keeps the snapshot under the name and with the fields read
    here. Imports only (no cluster)."""
    from ray.train.v2._internal import constants
    from ray.train.v2._internal.execution.checkpoint import checkpoint_manager as cm
    from ray.train.v2._internal.execution.storage import StorageContext

    moved = [] if getattr(constants, "CHECKPOINT_MANAGER_SNAPSHOT_FILENAME", None) == SNAPSHOT_FILENAME else [
        f"CHECKPOINT_MANAGER_SNAPSHOT_FILENAME={getattr(constants, 'CHECKPOINT_MANAGER_SNAPSHOT_FILENAME', None)!r}"]
    moved += [f"_CheckpointManagerState.{f}" for f in SNAPSHOT_FIELDS if f not in cm._CheckpointManagerState.__fields__]
    moved += [f"_TrainingResultState.{f}" for f in RESULT_FIELDS if f not in cm._TrainingResultState.__fields__]
    # read_only: a writable context creates its run directory and a marker file in it.
    ctx = StorageContext(storage_path="/storage", experiment_dir_name="run", read_only=True)
    expected = {"checkpoint_manager_snapshot_path": f"/storage/run/{SNAPSHOT_FILENAME}",
                "checkpoint": "/storage/run/checkpoint_x"}
    found = {"checkpoint_manager_snapshot_path": ctx.checkpoint_manager_snapshot_path,
             "checkpoint": ctx.build_checkpoint_path_from_name("checkpoint_x")}
    moved += [f"{k}: {found[k]} (expected {v})" for k, v in expected.items() if found[k] != v]
    return ("seam ray train storage layout", not moved,
            f"<storage_path>/<name>/{SNAPSHOT_FILENAME} with {', '.join(SNAPSHOT_FIELDS)}" if not moved
            else f"moved or gone: {moved}",
            "" if not moved else "update compat/ray_train.py for this Ray (see compat/README.md)")

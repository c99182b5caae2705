"""Exactly-once bookkeeping of extraction shards.

Owns: the layout of an extraction output directory and the commit protocol.
    hidden_states/
      MANIFEST.json            fingerprint of the input (so a resume never mixes datasets)
      data/shard-000012.arrow  (or .parquet: eagle3.extract.shards)
      committed/shard-000012.json   written last, by atomic rename: the commit
A shard counts only once its commit file exists. A data file without one is partial
(a crash between write and commit) and is rewritten on resume. Data files are
themselves written to a temporary name and renamed, so a reader never sees half a file.
Shard k always holds rows [k * samples_per_shard, (k + 1) * samples_per_shard) of the
prepared tokens table, so each sample belongs to exactly one shard.
An input that only grew (its old samples first, in order) keeps the shards that were full (Manifest.open).
Also which files a path given for training names (`resolve_files`: a run's committed shards, or a
plain directory's shard files).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from eagle3.schema import ids_sha256


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: no half-written file left beside the record
        raise


@dataclass(frozen=True)
class ShardPlan:
    num_samples: int
    samples_per_shard: int

    @classmethod
    def sized(cls, num_tokens: list[int], samples_per_shard: int, bytes_per_token: int, shard_bytes: int) -> ShardPlan:
        """At most samples_per_shard samples, and at most shard_bytes of hidden states for a shard of
        mean-length samples (0: no byte bound). A function of the input and the config alone, so a
        resumed run plans the same shards."""
        n = samples_per_shard
        if shard_bytes and num_tokens:
            mean_bytes = bytes_per_token * sum(num_tokens) / len(num_tokens)
            n = max(1, min(n, int(shard_bytes // max(mean_bytes, 1))))
        return cls(len(num_tokens), n)

    @property
    def num_shards(self) -> int:
        return -(-self.num_samples // self.samples_per_shard)

    def rows(self, shard: int) -> tuple[int, int]:
        start = shard * self.samples_per_shard
        return start, min(start + self.samples_per_shard, self.num_samples)


class Grown(NamedTuple):
    """Manifest.open on an input that only grew: the old input's sample count, and the shards dropped
    (the old last shard where it was not full)."""

    num_samples: int
    dropped: list[int]


class Manifest:
    def __init__(self, root: str | Path, file_format: str = "arrow"):
        from eagle3.extract.shards import SUFFIX

        self.root = Path(root)
        self.suffix = SUFFIX[file_format]
        self.data_dir = self.root / "data"
        self.commit_dir = self.root / "committed"

    def open(self, fingerprint: dict, sample_ids: Sequence[str] | None = None) -> Grown | None:
        """Create the layout, or check that an existing one was made for the same input; a Grown where
        the input only grew, else None.

        An input that only grew keeps what it can: given the new input's `sample_ids`, where the
        old input's samples are its first ones in the same order (their hash) and nothing else in
        the fingerprint differs, each shard that was full in the old plan holds the same samples in
        the new one and stays committed. The old last shard, if it was not full, is dropped (its
        commit first, then its file), and the manifest then names the new input. Anything else
        that differs is refused, nothing deleted."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.commit_dir.mkdir(parents=True, exist_ok=True)
        path = self.root / "MANIFEST.json"
        if not path.exists():
            atomic_write_text(path, json.dumps(fingerprint, indent=1, sort_keys=True))
            return None
        found = json.loads(path.read_text())
        if found == fingerprint:
            return None
        diff = {k: (found.get(k), fingerprint.get(k)) for k in set(found) | set(fingerprint)
                if found.get(k) != fingerprint.get(k)}
        old_n = found.get("num_samples")
        if not (sample_ids is not None and set(diff) == {"num_samples", "sample_ids_sha256"}
                and isinstance(old_n, int) and 0 < old_n < len(sample_ids)
                and ids_sha256(sample_ids[:old_n]) == found["sample_ids_sha256"]):
            raise ValueError(
                f"{self.root} holds shards of another input (differs in {diff}, as (found, now)); "
                "use a new output_dir, or delete that directory to start over")
        size = fingerprint["samples_per_shard"]
        dropped = sorted(k for k in self.committed() if (k + 1) * size > old_n)
        for k in dropped:
            (self.commit_dir / f"shard-{k:06d}.json").unlink()
            self.data_path(k).unlink(missing_ok=True)
        atomic_write_text(path, json.dumps(fingerprint, indent=1, sort_keys=True))
        return Grown(old_n, dropped)

    def data_path(self, shard: int) -> Path:
        return self.data_dir / f"shard-{shard:06d}{self.suffix}"

    def committed(self) -> dict[int, dict]:
        out = {}
        if self.commit_dir.exists():
            for p in sorted(self.commit_dir.glob("shard-*.json")):
                out[int(p.stem.split("-")[1])] = json.loads(p.read_text())
        return out

    def commit(self, shard: int, record: dict) -> None:
        if not self.data_path(shard).exists():
            raise AssertionError(f"commit of shard {shard} before its data file exists")
        record = {**record, "file": self.data_path(shard).name}
        text = json.dumps(record, sort_keys=True)
        path = self.commit_dir / f"shard-{shard:06d}.json"
        try:
            atomic_write_text(path, text)
        except OSError as e:
            # The data file took the last of the room (seen on a small tmpfs): as clear as a shard's own.
            from eagle3.extract.shards import DISK_FULL, disk_full_error

            if e.errno not in DISK_FULL:
                raise

            raise disk_full_error(path, e, f"the commit record of shard {shard} needs {len(text)} bytes",
                                  f"Its data file {self.data_path(shard).name} is written but not committed, so it "
                                  "does not count and is written again") from e

    def remove_temp_files(self) -> list[str]:
        """Delete the temporary files of writes that never finished (a writer killed mid-write
        leaves its `.shard-*.tmp-<pid>` behind; no commit ever names one); returns their names.
        Only when no writer of this output runs: at the end of a run."""
        removed = []
        for d in (self.data_dir, self.commit_dir):
            for p in sorted(d.glob(".shard-*.tmp-*")) if d.exists() else []:
                p.unlink(missing_ok=True)
                removed.append(p.name)
        return removed

    def committed_files(self) -> list[str]:
        """Data files of the committed shards, in shard order (each commit names its file)."""
        return [str(self.data_dir / rec["file"]) if "file" in rec else str(self.data_path(s))
                for s, rec in sorted(self.committed().items())]


def resolve_files(files: str | Path | Sequence[str | Path]) -> list[str]:
    """An explicit list of shard files (kept in order), or a directory: an extraction output
    (its committed shards only: Manifest.committed_files) or a plain directory of *.arrow / *.parquet
    shard files (sorted)."""
    if isinstance(files, (str, Path)):
        root = Path(files)
        if not root.is_dir():
            raise ValueError(f"expected a directory of shard files or a list of files, found {str(root)!r}")
        if (root / "MANIFEST.json").exists():
            found = Manifest(root).committed_files()
        else:
            found = sorted(str(p) for p in root.iterdir() if p.suffix in (".arrow", ".parquet"))
        if not found:
            raise ValueError(f"no committed shard files in {str(root)!r}; run the extract stage first")
        return found
    out = [str(f) for f in files]
    if not out:
        raise ValueError("expected at least one hidden-states shard file, found an empty list")
    missing = [f for f in out if not Path(f).is_file()]
    if missing:
        raise ValueError(f"hidden-states shards do not exist: {missing[:5]}; check the extract manifest")
    return out


def tokens_fingerprint(sample_ids: list[str], samples_per_shard: int, layer_ids: list[int], hs_dtype: str,
                       file_format: str = "arrow") -> dict:
    return {"num_samples": len(sample_ids), "sample_ids_sha256": ids_sha256(sample_ids),
            "samples_per_shard": samples_per_shard, "layer_ids": list(layer_ids), "hs_dtype": hs_dtype,
            "file_format": file_format}

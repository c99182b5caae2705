"""speculators' side of the training benchmark (benchmarks/train_bench.py): its on-disk data
format, and its trainer launched with a per-step clock.

Owns:
1. `convert_shards`: our hidden-states shard files (eagle3.schema; Arrow IPC or Parquet, see
   eagle3.extract.shards) -> the layout speculators 0.9's own trainer reads (`speculators.train.data.
   ArrowDataset` with `hs_connectors.FileTransfer`), the same samples in shard order:
     <data_path>/                      a `datasets` directory (save_to_disk, torch format) with
                                       input_ids int64, loss_mask int64, seq_len int: the columns
                                       `speculators prepare-data` writes
     <data_path>/hidden_states/hs_<i>.safetensors
                                       {"hidden_states": bf16 [T, num_layers, H] (aux layers, then
                                       the target's last layer, as in our shards), "token_ids":
                                       int64 [T]}: what vLLM's ExampleHiddenStatesConnector writes
                                       and `generate-offline-data` moves there; i = dataset row
2. The launch entry: `torchrun --nproc_per_node 1 -m benchmarks.speculators_data STEP_LOG -- FLAGS`
   runs `speculators.train.cli.main(TrainConfig.resolve(FLAGS))`, which is all that
   `python -m speculators.train FLAGS` does, with one logging handler added in front of its
   console handler: each per-step metric record of the "speculators.metrics" logger is appended
   to STEP_LOG as a JSON line (the record's time stamp, the step, its tokens and speculators' own
   step profile).
Does not own: the benchmark flow and the flags (benchmarks/train_bench.py), our shard schema and formats,
the draft vocabulary (eagle3.train.data.vocab.draft_vocab_mapping, which both trainers' runs use).
One file per sample is speculators' format, not ours; fine for a benchmark's few hundred samples.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WRITES_IN_FLIGHT = 4  # safetensors files written at once by convert_shards (its writes release the GIL)

STEP_LOG_FIELDS = ("t", "step", "tokens")
"""Every line of a step log has at least these: wall time stamp (s, LogRecord.created), 1-based
optimizer step, packed tokens of that step."""


def _rows(files: Sequence[str]):
    """(sample_id, input_ids int64 [T], loss_mask int64 [T], hidden_states bf16 [T, L, H]) per row
    of our shard files (either format, eagle3.extract.shards), in file and row order, decoded by
    eagle3.extract.codec (fp8 shards dequantised: speculators' files hold bf16)."""
    import numpy as np
    import torch

    from eagle3.extract.codec import decode_rows
    from eagle3.extract.shards import ShardFile

    for path in files:
        for batch in ShardFile(path).iter_batches():
            for sample_id, row in zip(batch.column("sample_id").to_pylist(), decode_rows(batch), strict=True):
                yield (sample_id, torch.from_numpy(row.input_ids.astype(np.int64)),
                       torch.from_numpy(row.loss_mask.astype(np.int64)), row.hidden_states_as(torch.bfloat16))


def convert_shards(files: str | Path | Sequence[str | Path], data_path: str | Path, *,
                   expected_input_ids: Mapping[str, Sequence[int]] | None = None, heldout_threshold: int = 0) -> dict:
    """Write the samples of our shard files (a list, or an extraction output directory) to
    `data_path` in speculators' layout (see the module docstring). Returns {"sample_ids" (row order),
    "num_samples", "num_tokens", "hidden_states_bytes", "layer_ids", "hidden_size"}.

    expected_input_ids: sample_id -> the token ids that were sent to extraction. When given, every
    sample must be there exactly once with exactly these ids, else ValueError.
    heldout_threshold > 0: the held-out split's samples (eagle3.prepare.heldout) are left out, as our
    trainer leaves them out, so both trainers see the same training samples.
    """
    from datasets import Dataset
    from safetensors.torch import save_file

    from eagle3.prepare.heldout import is_heldout
    from eagle3.extract.manifest import resolve_files
    from eagle3.schema import hs_layout
    from eagle3.extract.shards import ShardFile

    files = resolve_files(files if isinstance(files, (str, Path)) else list(files))
    layouts = [hs_layout(ShardFile(f).schema) for f in files]
    if any(layout != layouts[0] for layout in layouts):
        raise ValueError(f"shards {files} come from different extractions (layer_ids, hidden_size, hs_dtype: "
                         f"{layouts}); convert one extraction's shards")
    layer_ids, hidden_size, _ = layouts[0]
    root = Path(data_path)
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"{root} is not empty; convert into a new directory (speculators' dataset row i "
                         "must be hidden_states/hs_<i>.safetensors)")
    hs_dir = root / "hidden_states"
    hs_dir.mkdir(parents=True)
    sample_ids: list[str] = []
    seen: set[str] = set()
    cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    num_tokens = 0
    writes: deque = deque()
    with ThreadPoolExecutor(max_workers=WRITES_IN_FLIGHT, thread_name_prefix="convert-write") as pool:
        for sample_id, ids, mask, hs_TLD in _rows(files):
            if heldout_threshold and is_heldout(sample_id, heldout_threshold):
                continue
            i = len(sample_ids)
            if expected_input_ids is not None:
                want = expected_input_ids.get(sample_id)
                if want is None or sample_id in seen:
                    how = "seen twice" if want is not None else "never sent"
                    raise ValueError(f"shard sample {sample_id!r} was {how} to extraction; the shards do not hold "
                                     "the benchmark's prompts")
                got = ids.tolist()
                if got != list(want):
                    first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    raise ValueError(f"sample {sample_id!r}: the shard's {len(got)} token ids differ from the "
                                     f"{len(want)} sent to extraction (first difference at position {first})")
                seen.add(sample_id)
            path = hs_dir / f"hs_{i}.safetensors"
            writes.append(pool.submit(save_file, {"hidden_states": hs_TLD.contiguous(), "token_ids": ids.clone()},
                                      str(path)))
            while len(writes) > WRITES_IN_FLIGHT:  # bounded memory: a few samples' tensors at a time
                writes.popleft().result()
            sample_ids.append(sample_id)
            cols["input_ids"].append(ids.tolist())
            cols["loss_mask"].append(mask.tolist())
            cols["seq_len"].append(len(ids))
            num_tokens += len(ids)
        for w in writes:
            w.result()
    num_bytes = sum((hs_dir / f"hs_{i}.safetensors").stat().st_size for i in range(len(sample_ids)))
    if expected_input_ids is not None and len(sample_ids) != len(expected_input_ids):
        missing = sorted(set(expected_input_ids) - set(sample_ids))
        raise ValueError(f"{len(missing)} of {len(expected_input_ids)} prompts have no hidden states in the "
                         f"shards (first: {missing[:5]}); see the extraction's rejects.jsonl")
    if not sample_ids:
        raise ValueError(f"the shards {files} hold no samples")
    ds = Dataset.from_dict(cols)
    ds.set_format(type="torch")  # as `speculators prepare-data` saves it: rows come back as tensors
    ds.save_to_disk(str(root))
    return {"sample_ids": sample_ids, "num_samples": len(sample_ids), "num_tokens": num_tokens,
            "hidden_states_bytes": num_bytes, "layer_ids": list(layer_ids), "hidden_size": hidden_size}


class StepClock(logging.Handler):
    """Appends speculators' per-step training records ({"train": ..., "profile": ..., "global_step"})
    to a JSON-lines file: t (LogRecord.created), step (1-based), tokens, step_ms, loss."""

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if record.name != "speculators.metrics" or not isinstance(msg, Mapping):
            return
        profile = msg.get("profile")
        if "train" not in msg or not isinstance(profile, Mapping):
            return
        step_s = profile["step_ms"] / 1000.0
        line = {"t": record.created, "step": int(msg["global_step"]) + 1,  # logged before the increment
                # speculators logs tokens/s of the step; tokens = that * step time (an integer count)
                "tokens": int(round(profile["tokens_per_s"] * step_s)), "step_ms": profile["step_ms"],
                "fetch_ms": profile.get("fetch_ms"), "loss": msg["train"].get("loss")}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def _launch(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit("usage: torchrun --nproc_per_node 1 -m benchmarks.speculators_data STEP_LOG -- "
                         "<speculators train flags>")
    step_log, flags = argv[0], argv[2:]
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig
    from speculators.train.logger import setup_root_logger

    # speculators' main calls setup_root_logger too (a no-op once the root has handlers). Our handler
    # goes first: speculators' console handler rewrites dict messages into text when it handles them.
    setup_root_logger()
    logging.getLogger().handlers.insert(0, StepClock(step_log))
    main(TrainConfig.resolve(flags))


if __name__ == "__main__":
    _launch(sys.argv[1:])

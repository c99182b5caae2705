"""The draft's vocabulary, from the training data: how often each target token is a loss-masked
target, and the d2t / t2d mapping of the draft's LM head built from those counts by speculators
(the trainer and the benchmarks that train speculators side by side call `draft_vocab_mapping`,
so both train the same head).
Does not own: choosing the draft vocabulary's size (eagle3.train.trainer, train.draft.draft_vocab_size).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eagle3.extract.manifest import resolve_files
from eagle3.schema import hs_layout
from eagle3.extract.shards import ShardFile


def token_frequencies(files: str | Path | Sequence[str | Path], vocab_size: int | None = None, *,
                      heldout_threshold: int = 0) -> np.ndarray:
    """Counts of every loss-masked token id over all shards: int64 array [vocab_size].

    Reads only the input_ids and loss_mask columns (and sample_id, to leave the held-out split out:
    eagle3.prepare.heldout, threshold 0 = none held out). vocab_size None: max id + 1.
    Feeds speculators' build_vocab_mappings_from_distribution (d2t/t2d).
    """
    counts = np.zeros(vocab_size or 0, dtype=np.int64)
    for path in resolve_files(files):
        pf = ShardFile(path)
        hs_layout(pf.schema)  # refuse other schema versions before reading
        for batch in pf.iter_batches(columns=["sample_id", "input_ids", "loss_mask"]):
            counts = _add_counts(counts, _without_heldout(batch, heldout_threshold), vocab_size, path)
    return counts


def _without_heldout(batch, threshold: int):
    """The rows of `batch` outside the held-out split: the draft's vocabulary is chosen from the
    training data alone."""
    if not threshold:
        return batch
    import pyarrow as pa

    from eagle3.prepare.heldout import is_heldout

    keep = [not is_heldout(s, threshold) for s in batch.column("sample_id").to_pylist()]
    return batch.filter(pa.array(keep))


def tokens_frequencies(tokens_path: str | Path, vocab_size: int | None = None, *,
                       heldout_threshold: int = 0) -> np.ndarray:
    """`token_frequencies` of a prepared tokens table (prepare's tokens.parquet: input_ids and
    loss_mask, the same columns the shards copy), for online training, which has no shards before
    it trains. Equal to the shards' counts when extraction rejected no sample (a sample longer than
    the engine takes is counted here and not there)."""
    import pyarrow.parquet as pq

    from eagle3.schema import check_schema

    pf = pq.ParquetFile(tokens_path)
    check_schema(pf.schema_arrow, "tokens")
    counts = np.zeros(vocab_size or 0, dtype=np.int64)
    for batch in pf.iter_batches(columns=["sample_id", "input_ids", "loss_mask"]):
        counts = _add_counts(counts, _without_heldout(batch, heldout_threshold), vocab_size, str(tokens_path))
    return counts


def _add_counts(counts: np.ndarray, batch, vocab_size: int | None, path: str) -> np.ndarray:
    ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
    if not np.array_equal(ids_col.value_lengths().to_numpy(), mask_col.value_lengths().to_numpy()):
        raise ValueError(f"{path}: input_ids and loss_mask lengths differ in some rows; the file is corrupt")
    ids = ids_col.flatten().to_numpy()
    mask = mask_col.flatten().to_numpy().astype(bool)
    kept = ids[mask]
    if kept.size and vocab_size is not None and kept.max() >= vocab_size:
        raise ValueError(
            f"{path}: token id {int(kept.max())} >= target vocab_size {vocab_size}; "
            "the data was made with another tokenizer/target"
        )
    minlength = max(vocab_size or 0, int(kept.max()) + 1 if kept.size else 0, counts.size)
    if counts.size < minlength:
        counts = np.pad(counts, (0, minlength - counts.size))
    counts += np.bincount(kept, minlength=minlength)[: counts.size]
    return counts


def draft_vocab_mapping(files: str | Path | Sequence[str | Path], draft_vocab_size: int, target_vocab_size: int, *,
                        heldout_threshold: int = 0):
    """(d2t, t2d) torch tensors for a draft vocabulary of the `draft_vocab_size` most frequent
    loss-masked tokens of the shards (speculators' build_vocab_mappings_from_distribution over
    `token_frequencies`, the held-out split left out), or (None, None) when the draft keeps the
    whole target vocabulary."""
    return draft_vocab_mapping_from_counts(
        lambda: token_frequencies(files, target_vocab_size, heldout_threshold=heldout_threshold), draft_vocab_size,
        target_vocab_size)


def draft_vocab_mapping_from_counts(counts_fn, draft_vocab_size: int, target_vocab_size: int):
    """`draft_vocab_mapping` from counts of loss-masked token ids, `counts_fn()` (called only
    when the draft vocabulary is smaller than the target's)."""
    if draft_vocab_size > target_vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} > target vocab {target_vocab_size}: "
                         "use at most the target's vocabulary size")
    if draft_vocab_size == target_vocab_size:
        return None, None
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    counts = counts_fn()
    freq = {int(i): int(counts[i]) for i in np.flatnonzero(counts)}
    return build_vocab_mappings_from_distribution(freq, draft_vocab_size, target_vocab_size)

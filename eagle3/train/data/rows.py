"""Which hidden-states rows one data-parallel rank reads for training, in which order, and
reading them.

Owns: the seeded epoch-dependent shuffle, the split across data-parallel ranks, the resumable
position, and streaming the rows a rank needs out of the shards without loading them whole, each
decoded by eagle3.extract.codec.decode_row as views of the shard's memory.
Does not own: which files are the shards of a run (eagle3.extract.manifest.resolve_files), the schema
(eagle3.schema), the stored encoding (eagle3.extract.codec), packing rows into batches
(eagle3.train.data.packing), moving batches to the device (eagle3.train.data.prefetch, .staging).

Order of one epoch, for one rank (all of it derived from (seed, epoch, rank), no data read):
1. the shards are permuted with rng(seed, epoch), identically on every rank;
2. rank r takes the shards at positions r, r + W, r + 2W, ... of that permutation (W ranks),
   so each shard is read by exactly one rank per epoch (no rank reads another's bytes);
   ranks can get one shard more than others, which is harmless because training length
   is counted in optimizer steps and each rank cycles its own epochs;
3. the rank's rows, in file order (without those of the other side of the held-out split,
   eagle3.prepare.heldout, when a threshold is given), go through a shuffle buffer of `shuffle_buffer_size`
   samples (rng(seed, epoch, rank)): fill, then emit a random slot and refill it.
Because the order is computed from indices alone, resuming at `samples_seen` skips the
consumed rows without decoding them and skips Parquet row groups that hold none of the
rows still to come.

Memory: Arrow IPC shards are memory-mapped and samples are views of them (page cache, not
copies). From Parquet shards, at most `shuffle_buffer_size` decoded samples plus what Arrow
holds while reading one row group: it reads a row group's hidden_states chunk whole whatever
the batch size, so the extract stage's row-group size bounds the transient read memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3.extract.codec import StoredRow, decode_row, dequantize_fp8
from eagle3.extract.manifest import resolve_files
from eagle3.schema import hs_layout
from eagle3.extract.shards import ShardFile, read_ahead


def rank_shards(num_shards: int, seed: int, epoch: int, rank: int, world_size: int) -> list[int]:
    """The shards rank `rank` reads in `epoch`, in reading order (steps 1 and 2 above)."""
    perm = np.random.default_rng([seed, epoch]).permutation(num_shards)
    return [int(i) for i in perm[rank::world_size]]


def epoch_order(shard_rows: Sequence[int], shards: Sequence[int], shuffle_buffer_size: int, seed: int, epoch: int,
                rank: int) -> list[tuple[int, int]]:
    """(shard, row) in the order a rank yields the rows of `shards` (of shard_rows[s] rows each, read
    in this order) in `epoch` (step 3 above). Online training (eagle3.train.data.online) orders the same way."""
    rng = np.random.default_rng([seed, epoch, rank])
    size = max(1, shuffle_buffer_size)
    buffer: list[tuple[int, int]] = []
    out: list[tuple[int, int]] = []
    for s in shards:
        for row in range(shard_rows[s]):
            if len(buffer) < size:
                buffer.append((s, row))
                continue
            j = int(rng.integers(len(buffer)))
            out.append(buffer[j])
            buffer[j] = (s, row)
    order = rng.permutation(len(buffer))
    out.extend(buffer[int(j)] for j in order)
    return out


@dataclass
class _Shard:
    path: str
    row_group_rows: list[int]
    kept: list[int] | None = None
    """The shard's rows on this dataset's side of the held-out split, ascending; None: all."""

    @property
    def num_rows(self) -> int:
        return sum(self.row_group_rows) if self.kept is None else len(self.kept)


class HiddenStatesDataset:
    """One data-parallel rank's view of the hidden-states shards.

    `samples(epoch, start)` yields, per sample (after speculators' shift_batch, so position t
    pairs token x_{t+1} and target y_{t+1} with hidden state g_t):
      input_ids [T-1] long, loss_mask [T-1] bool, hidden_states [T-1, num_aux*H] bf16 (aux
      layers concatenated in schema layer order), verifier_last_hidden_states [T-1, H] bf16
      (the last layer id: the target's final layer before its final norm), lengths [1],
      position_ids [T-1] (starting at 1).
    """

    forkable = True
    """DataLoader worker processes may read it (each opens the shards itself); eagle3.train.data.pipeline."""

    def __init__(self, files: str | Path | Sequence[str | Path], *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle_buffer_size: int = 256, heldout_threshold: int = 0,
                 heldout: bool = False):
        """heldout_threshold > 0: only the rows outside the held-out split (eagle3.prepare.heldout), or
        with `heldout` only those inside it; found from each shard's sample_id column, so a resume
        or another rank finds the same rows. 0: every row (`heldout` must then be False)."""
        if heldout and not heldout_threshold:
            raise ValueError("heldout=True needs a heldout_threshold > 0 (prepared/heldout.json)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.files = resolve_files(files)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle_buffer_size = max(1, shuffle_buffer_size)
        self.shards: list[_Shard] = []
        layout = None
        for path in self.files:
            pf = ShardFile(path)
            this = hs_layout(pf.schema)
            if layout is None:
                layout = this
            elif this != layout:
                raise ValueError(
                    f"{path} has (layer_ids, hidden_size, hs_dtype)={this}, {self.files[0]} has {layout}: "
                    "all shards of one training run must come from one extraction"
                )
            kept = None
            if heldout_threshold:
                from eagle3.prepare.heldout import is_heldout

                ids = pf.read(columns=["sample_id"]).column("sample_id").to_pylist()
                kept = [r for r, sid in enumerate(ids) if is_heldout(sid, heldout_threshold) == heldout]
            self.shards.append(_Shard(path, list(pf.batch_rows), kept))
        self.heldout_threshold, self.heldout = heldout_threshold, heldout
        self.layer_ids, self.hidden_size, self.hs_dtype = layout
        if len(self.layer_ids) < 2:
            raise ValueError(f"layer_ids={self.layer_ids}: need at least one aux layer plus the last layer")
        if len(self.shards) < world_size:
            raise ValueError(
                f"{len(self.shards)} shard files for {world_size} data-parallel ranks: each rank needs at "
                "least one shard; write smaller shards (extract.samples_per_shard) or use fewer workers"
            )
        self.num_samples = sum(s.num_rows for s in self.shards)
        self.rejected: set[str] = set()
        """Always empty: rejected samples are not in committed shards (OnlineDataset's interface)."""
        self._ids: dict[int, list[str]] = {}

    @property
    def aux_layer_ids(self) -> list[int]:
        """The EAGLE-3 auxiliary layer ids (all captured ids but the last)."""
        return list(self.layer_ids[:-1])

    def rank_shards(self, epoch: int) -> list[int]:
        return rank_shards(len(self.shards), self.seed, epoch, self.rank, self.world_size)

    def epoch_order(self, epoch: int) -> list[tuple[int, int]]:
        """(shard index, row) in the order this rank yields them in `epoch`. Reads no data."""
        order = epoch_order([s.num_rows for s in self.shards], self.rank_shards(epoch), self.shuffle_buffer_size,
                            self.seed, epoch, self.rank)
        if self.heldout_threshold:  # positions among the kept rows -> rows of the shard
            order = [(s, self.shards[s].kept[j]) for s, j in order]
        return order

    def sample_id(self, key: tuple[int, int]) -> str:
        """The sample id of (shard, row) of epoch_order (each shard's ids read once, when first asked)."""
        s, row = key
        if s not in self._ids:
            self._ids[s] = ShardFile(self.shards[s].path).read(columns=["sample_id"]).column("sample_id").to_pylist()
        return self._ids[s][row]

    def token_frequencies(self, vocab_size: int):
        """Counts of every loss-masked token id of these shards outside the held-out split
        (eagle3.train.data.vocab)."""
        from eagle3.train.data.vocab import token_frequencies

        return token_frequencies(self.files, vocab_size, heldout_threshold=self.heldout_threshold)

    def samples(self, epoch: int, start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's samples of `epoch` in shuffled order, skipping the first `start`, each shifted
        by speculators' own shift_batch (compat.speculators_batch.speculators_sample), fp8 dequantised
        to bf16. Training packs `rows` instead (eagle3.train.data.packing), to the same values."""
        from compat.speculators_batch import speculators_sample

        for row in self.rows(epoch, start):
            hs = row.hidden_states if row.scale is None else dequantize_fp8(row.hidden_states, row.scale)
            yield speculators_sample(row.input_ids, row.loss_mask, hs)

    def rows(self, epoch: int, start: int = 0) -> Iterator[StoredRow]:
        """The same samples as `samples`, as stored and unshifted (eagle3.extract.codec.StoredRow: input_ids
        [T], loss_mask [T], hidden states [T, L, H], fp8 scales [T, L] or None), views of the shard's
        memory."""
        order = self.epoch_order(epoch)[start:]
        if not order:
            return
        needed = set(order)
        pending: dict[tuple[int, int], StoredRow] = {}
        rows = self._read_rows(epoch, needed)
        for key in order:
            while key not in pending:
                got_key, row = next(rows)
                pending[got_key] = row
            yield pending.pop(key)

    def _read_rows(self, epoch: int, needed: set[tuple[int, int]]) -> Iterator[tuple[tuple[int, int], StoredRow]]:
        """Rows of this rank's shards, file order, decoding only `needed` ones."""
        L, H = len(self.layer_ids), self.hidden_size
        columns = ["input_ids", "loss_mask", "num_tokens", "hidden_states", "hs_scale"]
        todo = []  # (shard, starts, row groups holding needed rows), in this rank's order
        for s in self.rank_shards(epoch):
            starts = np.concatenate([[0], np.cumsum(self.shards[s].row_group_rows)]).astype(int)
            groups = [g for g in range(len(starts) - 1)
                      if any((s, r) in needed for r in range(starts[g], starts[g + 1]))]
            if groups:
                todo.append((s, starts, groups))
        for k, (s, starts, groups) in enumerate(todo):
            shard = self.shards[s]
            # each shard is read in the background one shard ahead (the first one, now)
            for ahead in ([todo[0]] if k == 0 else []) + todo[k + 1:k + 2]:
                read_ahead(self.shards[ahead[0]].path)
            pf = ShardFile(shard.path)
            for g in groups:
                row = int(starts[g])
                for batch in pf.iter_batches([g], columns=columns):
                    for j in range(batch.num_rows):
                        if (s, row) in needed:
                            # own: a Parquet row group is decoded into memory, which a view would keep
                            # alive whole; an Arrow IPC shard is memory-mapped, a view holds page cache
                            yield (s, row), decode_row(batch, j, L, H, self.hs_dtype, own=pf.format != "arrow",
                                                       where=f"{shard.path} row {row}")
                        row += 1

"""One data-parallel rank's rows in online mode (`train.source: online`): the hidden-states tables
come from the engines through the Ray object store instead of shard files.

Owns: a rank's order of an epoch, computed from the prepared tokens alone (the shard plan of the
extract stage: eagle3.extract.manifest.ShardPlan; the same shards per rank, the same seeded shuffle
window, as offline: eagle3.train.data.rows.epoch_order), asking the feed (actors/online_feed.py,
eagle3.train.online_feed) for the shards still needed from a position, in that order, and decoding each
table's rows (eagle3.extract.codec) as views of the object store's memory. A sample the engine rejected
(longer than it takes) is a row of zero tokens, which packing skips and counts, so positions stay
those of the plan and a checkpoint's (epoch, samples_seen) means the same samples on a restart.
With a held-out split (eagle3.prepare.heldout: heldout_threshold) its rows are skipped, as offline
training skips them (the order is offline's with the same threshold), and the feed extracts them
into shards of their own, which `heldout_files` gives the trainer for its evaluations.
Does not own: packing and prefetching (eagle3.train.data.packing, .prefetch: this dataset is read in a
thread, not in forked DataLoader workers, which would each ask the feed for the same shards), the
coordinator and its back-pressure (eagle3.train.online_feed).
Same interface as eagle3.train.data.rows.HiddenStatesDataset where eagle3.train.data and eagle3.train.trainer use it.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from eagle3.extract.codec import StoredRow, decode_row
from eagle3.train.data.rows import epoch_order, rank_shards
from eagle3.extract.manifest import ShardPlan
from eagle3.schema import hs_layout

TAKE_POLL_S = 1.0


class OnlineDataset:
    forkable = False

    def __init__(self, feed, tokens_path: str | Path, samples_per_shard: int, layout: tuple[list[int], int, str], *,
                 seed: int = 0, rank: int = 0, world_size: int = 1, shuffle_buffer_size: int = 256,
                 heldout_threshold: int = 0):
        import pyarrow.parquet as pq

        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.feed = feed
        self.files = [str(tokens_path)]  # what it trains from, for provenance
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.shuffle_buffer_size = max(1, shuffle_buffer_size)
        self.layer_ids, self.hidden_size, self.hs_dtype = list(layout[0]), int(layout[1]), layout[2]
        if len(self.layer_ids) < 2:
            raise ValueError(f"layer_ids={self.layer_ids}: need at least one aux layer plus the last layer")
        self.tokens_path = str(tokens_path)
        self.sample_ids = pq.read_table(tokens_path, columns=["sample_id"]).column("sample_id").to_pylist()
        self.plan = ShardPlan(len(self.sample_ids), samples_per_shard)
        self.heldout_threshold = heldout_threshold
        self.kept: list[list[int]] | None = None
        """Per shard, its rows outside the held-out split, ascending; None: every row."""
        if heldout_threshold:
            from eagle3.prepare.heldout import is_heldout

            self.kept = [[r for r in range(hi - lo) if not is_heldout(self.sample_ids[lo + r], heldout_threshold)]
                         for lo, hi in map(self.plan.rows, range(self.plan.num_shards))]
            self.shard_rows = [len(k) for k in self.kept]
        else:
            self.shard_rows = [hi - lo for lo, hi in map(self.plan.rows, range(self.plan.num_shards))]
        if self.plan.num_shards < world_size:
            raise ValueError(f"{self.plan.num_shards} shards of {samples_per_shard} samples for {world_size} "
                             "data-parallel ranks: each rank needs at least one shard; lower "
                             "extract.samples_per_shard or use fewer workers")
        self.num_samples = sum(self.shard_rows)
        self.rejected: set[str] = set()
        """Sample ids the engines rejected (seen so far)."""
        self.take_wait_s = 0.0

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.layer_ids[:-1])

    def rank_shards(self, epoch: int) -> list[int]:
        return rank_shards(self.plan.num_shards, self.seed, epoch, self.rank, self.world_size)

    def epoch_order(self, epoch: int) -> list[tuple[int, int]]:
        """(shard, row of the plan's shard) in this rank's order of `epoch`: the offline order of the
        same shards (eagle3.train.data.rows.epoch_order), held-out rows skipped as offline."""
        order = epoch_order(self.shard_rows, self.rank_shards(epoch), self.shuffle_buffer_size, self.seed, epoch,
                            self.rank)
        if self.kept is not None:  # positions among the kept rows -> rows of the plan's shard
            order = [(s, self.kept[s][j]) for s, j in order]
        return order

    def sample_id(self, key: tuple[int, int]) -> str:
        return self.sample_ids[self.plan.rows(key[0])[0] + key[1]]

    def token_frequencies(self, vocab_size: int):
        """Loss-masked token counts from the prepared tokens (no shards exist before training)."""
        from eagle3.train.data.vocab import tokens_frequencies

        return tokens_frequencies(self.tokens_path, vocab_size, heldout_threshold=self.heldout_threshold)

    def rows(self, epoch: int, start: int = 0) -> Iterator[StoredRow]:
        """This rank's rows of `epoch` from position `start` on, in order (HiddenStatesDataset.rows);
        a rejected sample is a row of zero tokens."""
        import ray

        order = self.epoch_order(epoch)[start:]
        if not order:
            return
        needed = Counter(s for s, _ in order)
        shards = [s for s in self.rank_shards(epoch) if needed[s]]
        session = uuid.uuid4().hex
        ray.get(self.feed.want.remote(self.rank, session, epoch, shards))
        wanted = set(order)
        pending: dict[tuple[int, int], StoredRow] = {}
        next_shard = iter(shards)
        for key in order:
            while key not in pending:
                s = next(next_shard)
                pending.update(self._decode(s, self._take(session, s), wanted))
            yield pending.pop(key)
            needed[key[0]] -= 1
            if not needed[key[0]]:  # its last row is out: the table may go (the feed counts it held till now)
                self.feed.release.remote(self.rank, session, key[0])

    def heldout_files(self) -> list[str]:
        """The held-out split's committed shard files, once the feed has extracted them (before any
        training shard, so this waits only while the engines start)."""
        import ray

        while True:
            status, files = ray.get(self.feed.heldout_files.remote(TAKE_POLL_S))
            if status == "ready":
                return files

    def _take(self, session: str, shard: int):
        import ray

        t0 = time.perf_counter()
        while True:
            status, ref = ray.get(self.feed.take.remote(self.rank, session, shard, TAKE_POLL_S))
            if status == "ready":
                self.take_wait_s += time.perf_counter() - t0
                return ray.get(ref[0])
            if status == "cancelled":
                raise RuntimeError(f"rank {self.rank}: session {session} was replaced by a newer one (a resume); "
                                   "this reader is stale")

    def _decode(self, shard: int, table, wanted: set) -> dict[tuple[int, int], StoredRow]:
        layer_ids, hidden_size, hs_dtype = hs_layout(table.schema)
        if (layer_ids, hidden_size, hs_dtype) != (self.layer_ids, self.hidden_size, self.hs_dtype):
            raise ValueError(f"shard {shard} came with (layer_ids, hidden_size, hs_dtype)="
                             f"{(layer_ids, hidden_size, hs_dtype)}, expected "
                             f"{(self.layer_ids, self.hidden_size, self.hs_dtype)}: one extraction config per run")
        lo, hi = self.plan.rows(shard)
        index = {sid: row for row, sid in enumerate(self.sample_ids[lo:hi])}
        out: dict[tuple[int, int], StoredRow] = {}
        L = len(self.layer_ids)
        for batch in table.to_batches():
            ids = batch.column("sample_id").to_pylist()
            for j, sid in enumerate(ids):
                key = (shard, index[sid])
                if key in wanted:
                    out[key] = decode_row(batch, j, L, self.hidden_size, self.hs_dtype, where=f"shard {shard} {sid}")
        for row in range(hi - lo):  # rejected by the engine: not in the table
            key = (shard, row)
            if key in wanted and key not in out:
                self.rejected.add(self.sample_ids[lo + row])
                out[key] = StoredRow(np.zeros(0, np.int32), np.zeros(0, np.int8),
                                     torch.zeros(0, L, self.hidden_size, dtype=torch.bfloat16), None)
        return out

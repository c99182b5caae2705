"""Online mode (`train.source: online`): the engines extract while the trainer trains; tables
reach the training ranks through the Ray object store.

Fast tier: the feed's bookkeeping (eagle3.online.FeedState: back-pressure, a restart's new
session, a lost engine), the online order against the offline one, the draft vocabulary from the
prepared tokens against the one from the shards, the config switch.
Slow tier (real Ray, the hf extraction backend, real DeepSpeed): the whole job online, every
sample id counted per epoch (0 lost, 0 trained twice) and the bytes in flight under the bound
with the engines waiting for the trainer; then faults injected with SIGKILL: a training worker,
an engine replica, the driver.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.online import DROPPED, READY, FeedState
from tests.conftest import REPO


# ---------------------------------------------------------------------------------------------
# the feed's bookkeeping, without Ray

def _feed(shard_bytes=(100,) * 8, ranks=1, bound=250, per_replica=2) -> FeedState:
    state = FeedState(list(shard_bytes), ranks, max_inflight_bytes=bound, max_inflight_per_replica=per_replica)
    state.sched.add_replica()
    return state


def test_feed_admits_under_the_byte_bound_and_engines_wait_for_the_trainer():
    s = _feed()
    s.want(0, "a", 0, [3, 1, 4, 0])
    s.admit()
    work = s.assign()
    assert [(r, j.shard) for r, j in work] == [(0, 3), (0, 1)]  # 200 of 250 bytes; the third would be 300
    assert s.bytes_in_flight == 200
    for _, job in work:
        s.extracted(job.id, f"ref-{job.shard}")
    s.admit()
    assert s.assign() == [] and s.bytes_in_flight == 200  # extracted, not taken: still waiting in the store
    s.tick(1.5, idle_replicas=1)
    assert s.engine_idle_budget_s == 1.5 and s.engine_idle_no_request_s == 0  # waiting for the trainer
    assert s.take(0, "a", 4, now=10.0) == ("wait", None)  # the trainer asks for one not admitted yet
    assert s.take(0, "a", 3, now=11.0) == ("ready", "ref-3")
    assert s.bytes_in_flight == 100 and s.bytes_held == 100
    s.admit()
    assert [j.shard for _, j in s.assign()] == [4]  # the taken table's bytes made room
    assert s.peak_bytes == 200 <= s.max_inflight_bytes
    s.release(0, "a", 3)
    assert s.bytes_held == 0


def test_feed_lets_one_shard_larger_than_the_bound_through():
    s = _feed(shard_bytes=(1000, 1000), bound=10)
    s.want(0, "a", 0, [0, 1])
    s.admit()
    assert [j.shard for _, j in s.assign()] == [0]  # alone: it moves; the second waits for it
    assert s.bytes_in_flight == 1000


def test_feed_splits_the_bound_between_ranks_so_a_slow_rank_cannot_starve_the_other():
    s = _feed(ranks=2, bound=200)
    s.want(0, "a", 0, [0, 2, 4])
    s.want(1, "b", 0, [1, 3, 5])
    s.admit()
    for _, job in s.assign():
        s.extracted(job.id, job.shard)
    s.admit()
    assert s.assign() == []  # each rank has its 100 bytes waiting
    assert s.take(1, "b", 1, now=0.0) == ("ready", 1)  # rank 1 reads on; rank 0 does not
    s.admit()
    assert [(j.rank, j.shard) for _, j in s.assign()] == [(1, 3)]


def test_a_restarted_rank_cancels_the_old_session_and_reuses_its_waiting_tables():
    s = _feed(bound=1000)
    s.want(0, "old", 0, [0, 1, 2, 3])
    s.admit()
    work = s.assign()
    assert [j.shard for _, j in work] == [0, 1]  # 2 per replica
    s.extracted(work[0][1].id, "ref-0")  # shard 0 waiting, shard 1 extracting, 2 and 3 admitted
    assert s.take(0, "old", 0, now=0.0) == ("ready", "ref-0")
    # the rank restarts from a checkpoint that still needs shards 1 and 2 (and 5 of the next plan)
    s.want(0, "new", 0, [1, 2, 5])
    assert s.take(0, "old", 1, now=0.0) == ("cancelled", None)
    assert s.bytes_held == 0  # what the dead session held is gone with it
    assert s.num_reserved == 2  # shard 1 (extracting) and shard 2 (admitted) kept for the new session
    s.extracted(work[1][1].id, "ref-1")
    assert s.take(0, "new", 1, now=0.0) == ("ready", "ref-1")
    s.admit()
    got = [j.shard for _, j in s.assign()]
    assert got == [2, 5]  # shard 3, no longer wanted, was never handed out
    assert {j.shard for j in s.jobs.values()} == {2, 5}


def test_a_request_cancelled_while_extracting_is_dropped_when_it_arrives():
    s = _feed(bound=1000)
    s.want(0, "old", 0, [0, 1])
    s.admit()
    jobs = [j for _, j in s.assign()]
    s.want(0, "new", 1, [0])  # the next epoch: shard 0 of epoch 1 is another request
    assert all(j.state == DROPPED for j in jobs)
    assert s.extracted(jobs[0].id, "late").state == DROPPED
    assert s.bytes_in_flight == 0  # the dropped ones freed their budget; the new one is queued
    s.admit()
    (_, new), = s.assign()
    assert (new.epoch, new.shard) == (1, 0)
    assert s.extractions[(0, 0)] == 1 and s.summary()["num_extractions"] == 1


def test_a_lost_extraction_is_handed_to_another_replica():
    s = _feed(bound=1000, per_replica=1)
    s.sched.add_replica()
    s.want(0, "a", 0, [0, 1, 2])
    s.admit()
    work = s.assign()
    assert [(r, j.shard) for r, j in work] == [(0, 0), (1, 1)]
    assert s.lost(work[0][1].id, "ActorDiedError: killed", replica_died=True)
    assert s.assign() == []  # replica 1 is busy, replica 0 dead
    s.extracted(work[1][1].id, "ref-1")
    assert [(r, j.shard) for r, j in s.assign()] == [(1, 0)]  # the lost shard first, on the live replica
    assert s.summary()["num_lost"] == 1


def test_online_order_is_the_offline_order_of_the_same_shards():
    from eagle3.data.rows import epoch_order, rank_shards

    rows = [4, 4, 4, 4, 4, 3]
    for rank in range(2):
        for epoch in range(2):
            shards = rank_shards(len(rows), 7, epoch, rank, 2)
            order = epoch_order(rows, shards, 5, 7, epoch, rank)
            assert sorted(order) == sorted((s, r) for s in shards for r in range(rows[s]))
            assert order == epoch_order(rows, shards, 5, 7, epoch, rank)  # seeded
    both = [set(rank_shards(6, 7, 0, r, 2)) for r in range(2)]
    assert both[0].isdisjoint(both[1]) and both[0] | both[1] == set(range(6))


# ---------------------------------------------------------------------------------------------
# the draft vocabulary: from the prepared tokens (online) = from the shards (offline)

def _tokens_and_shards(tmp_path: Path, rng, n: int = 30, per_shard: int = 7):
    from eagle3.schema import TOKENS_SCHEMA, hidden_states_schema
    from eagle3.shards import write_shard_file

    ids = [rng.integers(0, 50, size=int(rng.integers(3, 20))).astype(np.int32) for _ in range(n)]
    masks = [(rng.random(len(x)) < 0.6).astype(np.int8) for x in ids]
    cols = {"sample_id": [f"s{i}" for i in range(n)], "input_ids": [x.tolist() for x in ids],
            "loss_mask": [m.tolist() for m in masks], "num_tokens": [len(x) for x in ids]}
    tokens = pa.table(cols, schema=TOKENS_SCHEMA)
    pq.write_table(tokens, tmp_path / "tokens.parquet")
    schema = hidden_states_schema(layer_ids=[1, 2], hidden_size=4)
    files = []
    for k, lo in enumerate(range(0, n, per_shard)):
        part = tokens.slice(lo, per_shard)
        hs = [bytes(2 * 2 * 4 * t) for t in part.column("num_tokens").to_pylist()]
        table = pa.Table.from_arrays([*part.columns, pa.array(hs, pa.large_binary()),
                                      pa.array([None] * len(part), pa.list_(pa.float32()))], schema=schema)
        files.append(str(tmp_path / f"shard-{k:06d}.arrow"))
        write_shard_file(table, files[-1], direct_io=False)
    return tmp_path / "tokens.parquet", files


def test_draft_vocab_from_prepared_tokens_equals_the_one_from_the_shards(tmp_path):
    from eagle3.data.vocab import draft_vocab_mapping, draft_vocab_mapping_from_counts, token_frequencies, \
        tokens_frequencies

    tokens_path, files = _tokens_and_shards(tmp_path, np.random.default_rng(0))
    online, offline = tokens_frequencies(tokens_path, 64), token_frequencies(files, 64)
    assert online.sum() > 0 and np.array_equal(online, offline)
    d2t_off, t2d_off = draft_vocab_mapping(files, 16, 64)
    d2t_on, t2d_on = draft_vocab_mapping_from_counts(lambda: tokens_frequencies(tokens_path, 64), 16, 64)
    assert d2t_off.tolist() == d2t_on.tolist() and t2d_off.tolist() == t2d_on.tolist()
    assert int(t2d_on.sum()) == 16


def test_online_config_switch_is_checked():
    from eagle3.config import load_job_config

    assert load_job_config(None).train.source == "offline"  # the default stays offline
    cfg = load_job_config(None, {"train.source": "online", "train.online.max_inflight_bytes": 1 << 20})
    assert cfg.train.online.max_inflight_bytes == 1 << 20 and cfg.train.online.epochs == "reextract"
    with pytest.raises(ValueError, match=r"train.source.*'disk'"):
        load_job_config(None, {"train.source": "disk"})
    with pytest.raises(ValueError, match=r"train.online.max_inflight_bytes=0: must be >= 1"):
        load_job_config(None, {"train.online.max_inflight_bytes": 0})


def test_online_replicas_leave_the_gpus_training_needs():
    from eagle3.config import load_job_config
    from ray_jobs.online import online_replicas

    cfg = load_job_config(None, {"train.source": "online", "train.num_workers": 1})
    assert online_replicas(cfg, 0) == 1 and online_replicas(cfg, 2) == 1 and online_replicas(cfg, 8) == 7
    assert online_replicas(load_job_config(None, {"train.num_workers": 1, "extract.num_replicas": 3}), 8) == 3
    with pytest.raises(ValueError, match=r"has 1 GPUs, train.num_workers=1"):
        online_replicas(cfg, 1)


def test_online_driver_imports_no_heavy_packages():
    code = ("import sys\nimport ray_jobs.online, actors.online_feed, eagle3.online\n"
            "print(','.join(sorted(m for m in ('vllm', 'torch', 'deepspeed', 'transformers') if m in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the online driver's imports pulled in: {out.stdout.strip()}"

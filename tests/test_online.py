"""Online mode (`train.source: online`): the engines extract while the trainer trains; tables
reach the training ranks through the Ray object store.

Fast tier: the feed's bookkeeping (eagle3.train.online_feed.FeedState: back-pressure, a restart's new
session, a lost engine), the online order against the offline one, the draft vocabulary from the
prepared tokens against the one from the shards, the config switch.
Slow tier (real Ray, the hf extraction backend, real DeepSpeed): the whole job online, every
sample id counted per epoch (0 lost, 0 trained twice) and the bytes in flight under the bound
with the engines waiting for the trainer, while faults are injected with SIGKILL: an engine
replica and a training worker in that job, the driver in another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.train.online_feed import DROPPED, FeedState
from tests.conftest import REPO
from tests.helpers import gpu_probe_class


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
    assert s.num_budget_waits == 2  # shards 4 and 0 each waited for the budget once
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


def test_keep_writes_each_shard_once_and_serves_later_epochs_from_disk():
    s = FeedState([100] * 2, 1, max_inflight_bytes=1000, max_inflight_per_replica=3, keep=True)
    s.sched.add_replica()
    s.want(0, "a", 0, [0, 1])
    s.admit()
    first = [j for _, j in s.assign()]
    for job in first:
        s.extracted(job.id, f"ref-{job.shard}")
        assert s.take(0, "a", job.shard, now=0.0)[0] == "ready"
    s.want(0, "b", 1, [0, 1])  # the next epoch, before shard 1's file is committed
    s.written(0, ok=True)
    s.admit()
    assert s.assign() == [] and [j.shard for j in s.reads()] == [0]  # shard 1 waits for its file
    assert s.queued[0] and s.jobs[s.queued[0][0]].shard == 1
    s.written(1, ok=False)  # its write was lost: extracted again
    s.admit()
    assert [j.shard for _, j in s.assign()] == [1]
    assert s.extractions[(0, 0)] == 1 and (1, 0) not in s.extractions


# ---------------------------------------------------------------------------------------------
# the draft vocabulary: from the prepared tokens (online) = from the shards (offline)

def _tokens_and_shards(tmp_path: Path, rng, n: int = 30, per_shard: int = 7):
    from eagle3.schema import TOKENS_SCHEMA, hidden_states_schema
    from eagle3.extract.shards import write_shard_file

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
    from eagle3.train.data.vocab import draft_vocab_mapping, draft_vocab_mapping_from_counts, token_frequencies, \
        tokens_frequencies

    tokens_path, files = _tokens_and_shards(tmp_path, np.random.default_rng(0))
    online, offline = tokens_frequencies(tokens_path, 64), token_frequencies(files, 64)
    assert online.sum() > 0 and np.array_equal(online, offline)
    threshold = 1 << 62  # a quarter of the conversations held out: the counts are the rest's on both sides
    online, offline = (tokens_frequencies(tokens_path, 64, heldout_threshold=threshold),
                       token_frequencies(files, 64, heldout_threshold=threshold))
    assert 0 < online.sum() < tokens_frequencies(tokens_path, 64).sum() and np.array_equal(online, offline)
    d2t_off, t2d_off = draft_vocab_mapping(files, 16, 64)
    d2t_on, t2d_on = draft_vocab_mapping_from_counts(lambda: tokens_frequencies(tokens_path, 64), 16, 64)
    assert d2t_off.tolist() == d2t_on.tolist() and t2d_off.tolist() == t2d_on.tolist()
    assert int(t2d_on.sum()) == 16


def test_online_order_is_the_offline_order_of_the_same_shards(tmp_path):
    """A rank's samples, epoch after epoch, are those offline training reads from the shards the
    extract stage would write from the same tokens (same plan, seed, shuffle window, held-out split)."""
    from eagle3.prepare.heldout import choose_split
    from eagle3.train.data.online import OnlineDataset
    from eagle3.train.data.rows import HiddenStatesDataset
    from eagle3.extract.shards import read_shards

    tokens_path, files = _tokens_and_shards(tmp_path, np.random.default_rng(1), n=30, per_shard=7)
    ids_of_file = [read_shards([f], columns=["sample_id"]).column(0).to_pylist() for f in files]
    every = [s for ids in ids_of_file for s in ids]
    split = choose_split(every, 0.2, 4)
    assert 0 < split.num_heldout_samples < len(every)
    for threshold in (0, split.threshold):  # without a held-out split, and with one skipped as offline skips it
        for rank in range(2):
            offline = HiddenStatesDataset(files, seed=5, rank=rank, world_size=2, shuffle_buffer_size=6,
                                          heldout_threshold=threshold)
            online = OnlineDataset(None, tokens_path, 7, ([1, 2], 4, "bfloat16"), seed=5, rank=rank, world_size=2,
                                   shuffle_buffer_size=6, heldout_threshold=threshold)
            assert online.num_samples == offline.num_samples
            for epoch in range(3):
                want = [ids_of_file[s][r] for s, r in offline.epoch_order(epoch)]
                assert [online.sample_id(k) for k in online.epoch_order(epoch)] == want
                assert len(want) == len(set(want)) > 0
                assert threshold == 0 or not any(split.is_heldout(s) for s in want)


def test_online_config_switch_is_checked():
    from tests.helpers import job_config

    assert job_config().train.source == "offline"  # the default stays offline
    cfg = job_config({"train.source": "online", "train.online.max_inflight_bytes": 1 << 20})
    assert cfg.train.online.max_inflight_bytes == 1 << 20 and cfg.train.online.epochs == "reextract"
    with pytest.raises(ValueError, match=r"train.source.*'disk'"):
        job_config({"train.source": "disk"})
    with pytest.raises(ValueError, match=r"train.online.max_inflight_bytes=0: must be >= 1"):
        job_config({"train.online.max_inflight_bytes": 0})


def test_online_replicas_leave_the_gpus_training_needs():
    from tests.helpers import job_config
    from ray_jobs.online import GpuSplit, split_gpus

    cfg = job_config({"train.source": "online", "train.num_workers": 1})
    assert split_gpus(cfg, 0) == GpuSplit("none", 1, 0.0, 0.0)  # a CPU cluster: one replica on a CPU
    assert split_gpus(cfg, 2) == GpuSplit("separate", 1, 1.0, 1.0) and split_gpus(cfg, 8).num_replicas == 7
    assert split_gpus(job_config({"train.num_workers": 1, "extract.num_replicas": 3}), 8).num_replicas == 3
    separate = job_config({"train.source": "online", "train.online.gpu_split": "separate"})
    with pytest.raises(ValueError, match=r"has 1 GPUs, train.num_workers=1"):
        split_gpus(separate, 1)
    # whole GPUs asked for beyond the cluster: refused before placement waits for them
    with pytest.raises(ValueError, match=r"has 3 GPUs, train.num_workers=1 take 1 and 3 engine replica\(s\) need 1"):
        split_gpus(job_config({"train.source": "online", "extract.num_replicas": 3}), 3)


def _online(**overrides):
    from tests.helpers import job_config

    return job_config({"train.source": "online", **overrides})


def test_gpu_split_auto_shares_each_gpu_only_where_engine_and_trainer_cannot_have_their_own():
    from ray_jobs.online import GpuSplit, split_gpus

    # one GPU: engine and trainer share it, 0.7 and 0.3 of it in Ray's accounting
    fits = {"extract.gpu_memory_utilization": 0.6}
    one = split_gpus(_online(**fits), 1)
    assert one == GpuSplit("shared", 1, 0.7, 0.3) and one.engine_bundle == {"CPU": 1, "GPU": 0.7}
    # two workers and a replica need 3 GPUs apart: on 3 separate, on 2 each GPU holds a replica and a worker
    assert split_gpus(_online(**fits, **{"train.num_workers": 2}), 3) == GpuSplit("separate", 1, 1.0, 1.0)
    assert split_gpus(_online(**fits, **{"train.num_workers": 2}), 2) == GpuSplit("shared", 2, 0.7, 0.3)
    # a replica over 2 GPUs beside a worker needs 3 GPUs; on 2 it cannot take a share of one
    with pytest.raises(ValueError, match=r"train.online.gpu_split='shared': needs engine replicas of one GPU, "
                                         r"found extract.tensor_parallel_size \* pipeline_parallel_size = 2 \* 1"):
        split_gpus(_online(**fits, **{"extract.tensor_parallel_size": 2}), 2)
    assert split_gpus(_online(**{"extract.tensor_parallel_size": 2}), 3) == GpuSplit("separate", 1, 2.0, 1.0)
    # the hf backend's engines run on CPUs: training takes the GPU whole, nothing is shared
    assert split_gpus(_online(**{"extract.backend": "hf"}), 1) == GpuSplit("none", 1, 0.0, 1.0)


def test_gpu_split_auto_refuses_an_engine_memory_share_that_leaves_the_trainer_no_room():
    from ray_jobs.online import split_gpus

    # the default 0.85 is the engine's share when it has the GPU to itself; beside a trainer it is too much
    with pytest.raises(ValueError, match=r"extract.gpu_memory_utilization=0.85: leaves the training worker .* less than "
                                         r"train.online.trainer_gpu_fraction=0.3: .* set extract.gpu_memory_utilization "
                                         r"<= 0.70 .*\[train.online.gpu_split='auto' \(shared on 1 GPUs\)\]"):
        split_gpus(_online(), 1)
    cfg = _online(**{"extract.gpu_memory_utilization": 0.8, "train.online.trainer_gpu_fraction": 0.2})
    assert split_gpus(cfg, 1).engine_gpus == 0.8  # exactly the whole GPU
    assert split_gpus(_online(), 2).mode == "separate"  # with a GPU each, 0.85 is fine


def test_gpu_split_shared_is_checked_at_load_and_placed_one_replica_and_one_worker_per_gpu():
    from ray_jobs.online import GpuSplit, split_gpus

    shared = {"train.online.gpu_split": "shared", "extract.gpu_memory_utilization": 0.6}
    assert split_gpus(_online(**shared), 8) == GpuSplit("shared", 8, 0.7, 0.3)  # shared even where separate fits
    # what one GPU cannot hold fails at load, before any cluster or model
    with pytest.raises(ValueError, match=r"config extract.gpu_memory_utilization=0.85: .*sum to <= 1"):
        _online(**{"train.online.gpu_split": "shared"})
    with pytest.raises(ValueError, match=r"config extract.gpu_memory_utilization=0.71: .*<= 0.70"):
        _online(**{**shared, "extract.gpu_memory_utilization": 0.71})  # just over
    with pytest.raises(ValueError, match=r"config train.online.gpu_split='shared': needs engine replicas of one GPU"):
        _online(**shared, **{"extract.pipeline_parallel_size": 2})
    _online(**{"train.online.gpu_split": "shared", "train.source": "offline"})  # offline: the split is not used
    with pytest.raises(ValueError, match=r"train.online.trainer_gpu_fraction=0.5: must be in \(0, 0.5\)"):
        _online(**shared, **{"train.online.trainer_gpu_fraction": 0.5})
    with pytest.raises(ValueError, match=r"train.online.gpu_split='half': not one of 'auto', 'separate', 'shared'"):
        _online(**{"train.online.gpu_split": "half"})
    # what needs the cluster's size fails before the engines start
    with pytest.raises(ValueError, match=r"train.num_workers=3 is more than the 2 GPUs"):
        split_gpus(_online(**shared, **{"train.num_workers": 3}), 2)
    with pytest.raises(ValueError, match=r"extract.num_replicas=1: sharing places one engine replica on every GPU; "
                                         r"set it to null or 2"):
        split_gpus(_online(**shared, **{"extract.num_replicas": 1}), 2)
    assert split_gpus(_online(**shared), 0).mode == "none"  # a CPU cluster: ignored, with a warning


def test_a_shared_gpu_engine_gets_a_given_kv_cache_so_the_trainer_can_set_up_beside_its_start():
    from ray_jobs.extract import AUTO_KV_CACHE_BYTES
    from ray_jobs.online import shared_engine_config, split_gpus

    shared = _online(**{"train.online.gpu_split": "shared", "extract.gpu_memory_utilization": 0.6})
    assert shared_engine_config(shared, split_gpus(shared, 1)).extract.kv_cache_memory_bytes == AUTO_KV_CACHE_BYTES
    given = _online(**{"train.online.gpu_split": "shared", "extract.gpu_memory_utilization": 0.6,
                       "extract.kv_cache_memory_bytes": 1 << 30})
    assert shared_engine_config(given, split_gpus(given, 1)).extract.kv_cache_memory_bytes == 1 << 30
    separate = _online(**{"train.online.gpu_split": "separate"})
    assert shared_engine_config(separate, split_gpus(separate, 2)).extract.kv_cache_memory_bytes is None  # profiled
    assert shared_engine_config(shared, split_gpus(shared, 0)).extract.kv_cache_memory_bytes is None  # CPU cluster


def test_online_driver_imports_no_heavy_packages():
    code = ("import sys\nimport ray_jobs.online, actors.online_feed, eagle3.train.online_feed\n"
            "print(','.join(sorted(m for m in ('vllm', 'torch', 'deepspeed', 'transformers') if m in sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the online driver's imports pulled in: {out.stdout.strip()}"


# ---------------------------------------------------------------------------------------------
# the shared split placed by Ray on a cluster that declares one GPU (this machine has none)

@pytest.mark.slow
def test_shared_split_places_an_engine_replica_and_the_training_worker_group_on_the_one_gpu(tmp_path):
    """train.online.gpu_split auto on a cluster of one GPU (declared: Ray schedules it, nothing
    runs on it): the replica bundle split_gpus gives, placed by the online feed's ReplicaPool, and
    the Ray Train worker group of actors.trainer.scaling_config are both placed on GPU 0, 0.7 and
    0.3 of it, leaving nothing. The worker group is placed and runs while the engine is still
    starting (the pool's `place` returns before its `wait_up`, as the feed overlaps the two
    start-ups): the probe's constructor waits for the worker's file, so it would see none if the
    trainer had to wait for the engine. Placement only: with a GPU in Ray's accounting the trainer
    would start NCCL and CUDA, which this machine has not (the job itself is for the GPU tier)."""
    import ray
    from ray.train import RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from actors.replica_pool import ReplicaPool
    from actors.trainer import scaling_config
    from eagle3.extract.schedule import ShardScheduler
    from ray_jobs.cluster import job_runtime_env
    from ray_jobs.online import split_gpus

    _GpuProbe = gpu_probe_class()

    class _SlowStart(_GpuProbe):
        """An engine whose start ends when the training worker has run (or after 120 s)."""

        def __init__(self, replica: int, worker_file: str):
            import time

            super().__init__(replica)
            deadline = time.monotonic() + 120
            while not Path(worker_file).exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            self.saw_trainer = Path(worker_file).exists()

        def info(self) -> dict:
            return {**super().info(), "saw_trainer": self.saw_trainer}

    def _report_gpu(config: dict) -> None:
        """A Ray Train worker's body: what Ray gave it, and the cluster's GPU left while it runs."""
        import ray

        ctx = ray.get_runtime_context()
        Path(config["out"]).write_text(json.dumps({
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "gpu": ctx.get_assigned_resources().get("GPU"),
            "gpu_free": ray.available_resources().get("GPU", 0.0), "cuda_visible_devices": os.environ.get(
                "CUDA_VISIBLE_DEVICES")}))

    cfg = _online(**{"extract.gpu_memory_utilization": 0.6})
    ray.init(num_cpus=2, num_gpus=1, runtime_env=job_runtime_env(), include_dashboard=True)
    try:
        split = split_gpus(cfg, int(ray.cluster_resources()["GPU"]))
        worker_file = tmp_path / "worker.json"
        pool = ReplicaPool(ShardScheduler(1, max_inflight_per_replica=1), _SlowStart,
                           lambda i: ((i, str(worker_file)), {}), split.engine_bundle, max_concurrency=1,
                           what="probe replica")
        placed = pool.place(split.num_replicas, 30.0)
        TorchTrainer(_report_gpu, train_loop_config={"out": str(worker_file)},
                     scaling_config=scaling_config(cfg.train.num_workers, True, split.trainer_gpus),
                     torch_config=TorchConfig(backend="gloo"),
                     run_config=RunConfig(name="probe", storage_path=str(tmp_path / "ray_train"))).fit()
        [replica] = pool.wait_up(placed)
        engine = ray.get(replica.actor.info.remote())
        worker = json.loads(worker_file.read_text())
    finally:
        ray.shutdown()
    assert (split.mode, split.num_replicas) == ("shared", 1)
    assert engine["gpu_ids"] == ["0"] and engine["gpu"] == pytest.approx(0.7)
    assert worker["gpu_ids"] == ["0"] and worker["gpu"] == pytest.approx(0.3) and worker["cuda_visible_devices"] == "0"
    assert worker["gpu_free"] == pytest.approx(0.0)  # the two take the whole GPU between them
    assert engine["saw_trainer"], "the training worker ran only after the engine's start: the starts did not overlap"
    assert [s["replica"] for s in pool.starts] == [0]  # wait_up recorded the engine's start
    print(f"\nshared GPU: engine replica {engine}, training worker {worker}")


# ---------------------------------------------------------------------------------------------
# the real job online: prepare, then extraction (hf backend: the engine is not under test here)
# and DeepSpeed training at once, on a local cluster

from tests.test_faults import (  # noqa: E402 - the offline fault tests' helpers
    CKPT_EVERY, STEP_POLL_S, TRAIN_STEPS, _conversations, _descendants, _registered_steps, _steps, _stop,
    _wait_for_step, _wait_for_registered_checkpoint)


def _online_args(out: Path, data: Path, tiny_target: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ray_jobs.run", "--config", "configs/demo.yaml", "--set", f"output_dir={out}",
            "--set", f"target.model={tiny_target}", "--set", f"prepare.conversations={data}",
            "--set", "prepare.num_eval_prompts=1", "--set", "stages=[prepare, train]", "--set", "doctor=false",
            "--set", "extract.backend=hf", "--set", "extract.samples_per_shard=4", "--set", "train.source=online",
            "--set", "train.online.record_sample_ids=true", "--set", "train.online.log_every_s=1",
            "--set", "train.data.micro_batch_tokens=512", "--set", f"train.num_steps={TRAIN_STEPS}",
            "--set", f"train.checkpoint.checkpoint_every={CKPT_EVERY}", *extra]


def _start_online(out: Path, data: Path, tiny_target: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(_online_args(out, data, tiny_target, *extra), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def check_trained_once_per_epoch(out: Path, num_workers: int) -> dict:
    """From train/sample_ids (the last line of each step counts: a step redone after a restart is
    written again): per rank and epoch no sample twice, ranks' samples of an epoch disjoint, and
    every epoch that all ranks finished holds every prepared sample outside the held-out split
    exactly once, and none inside it. Returns {epoch: Counter of sample ids} over ranks."""
    from eagle3.prepare.heldout import read_split

    split = read_split(out / "prepared")
    every = pq.read_table(out / "prepared" / "tokens.parquet", columns=["sample_id"]).column(0).to_pylist()
    prepared = [s for s in every if not split.is_heldout(s)]
    assert split.num_heldout_samples > 0 and len(prepared) == len(every) - split.num_heldout_samples
    per_epoch: dict[int, Counter] = {}
    finished: list[set[int]] = []
    for rank in range(num_workers):
        lines = [json.loads(x) for x in (out / "train" / "sample_ids" / f"rank-{rank}.jsonl").read_text().splitlines()]
        last = {rec["step"]: rec for rec in lines}
        assert sorted(last) == list(range(1, TRAIN_STEPS + 1)), sorted(last)
        mine: dict[int, list[str]] = {}
        for step in sorted(last):
            rec = last[step]
            assert rec["rejected"] == []
            for epoch in rec["epochs"]:
                mine.setdefault(epoch, []).extend(rec["sample_ids"])
        for epoch, ids in mine.items():
            assert len(ids) == len(set(ids)), f"rank {rank} trained {Counter(ids).most_common(1)} in epoch {epoch}"
            per_epoch.setdefault(epoch, Counter()).update(ids)
        finished.append(set(sorted(mine)[:-1]))  # the last epoch of a rank may be cut by num_steps
    for epoch, counts in per_epoch.items():
        assert max(counts.values()) == 1, f"epoch {epoch}: {counts.most_common(2)} (ranks overlap)"
        if all(epoch in f for f in finished):
            assert sorted(counts) == sorted(prepared), f"epoch {epoch}: lost {sorted(set(prepared) - set(counts))}"
    assert any(all(e in f for f in finished) for e in per_epoch), "no epoch was finished by every rank"
    return per_epoch


@pytest.mark.slow
def test_online_job_trains_every_sample_once_per_epoch_under_the_byte_bound_through_faults(tiny_target, tmp_path):
    """Two training ranks, two engine replicas, 40 samples in 10 shards, a bound of about 3 shards
    per rank: the job trains from tables it never writes, the bytes waiting in the object store stay
    under the bound, and requests wait for it (the engines for the trainer). Two faults on the way
    (one job for both: each fault's check is its own assertion below):
    - once training runs, engine replica 0 (the one the feed fills first) is SIGKILLed: its shards
      in flight are handed to another replica;
    - after a registered checkpoint, a Ray Train worker is SIGKILLed: Ray Train restarts the group
      from that checkpoint, and the ranks ask the feed again for the shards holding the samples
      after it.
    Every sample is still trained once per epoch."""
    import re
    import signal
    import time

    out = tmp_path / "out"
    bound = 3_000_000
    job = _start_online(out, _conversations(tmp_path / "conversations.jsonl", 41), tiny_target,
                        "--set", "train.num_workers=2", "--set", "extract.num_replicas=2", "--set", "ray.num_cpus=4",
                        "--set", f"train.online.max_inflight_bytes={bound}")
    metrics = out / "train" / "metrics.jsonl"
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(job.stdout.readline, "")), daemon=True)
    reader.start()  # drained all along: a full pipe would stop the job
    try:
        pid = None
        while pid is None and job.poll() is None:  # the feed logs each replica's pid once the engines are up
            m = re.search(r"online: engine replica 0 is pid (\d+)", "".join(lines))
            pid = int(m.group(1)) if m else time.sleep(0.05)
        assert pid in {p.pid for p in _descendants(job.pid)}, "".join(lines)[-3000:]
        while job.poll() is None and len(_steps(metrics)) < 2:  # training has started: extraction goes on
            time.sleep(STEP_POLL_S)
        os.kill(pid, signal.SIGKILL)
        _wait_for_step(job, metrics, CKPT_EVERY + 2)
        _wait_for_registered_checkpoint(job, out)
        workers = [p for p in _descendants(job.pid) if p.name() == "ray::RayTrainWorker"]
        assert len(workers) == 2, [p.name() for p in _descendants(job.pid)]
        killed_after = _steps(metrics)[-1]
        workers[0].send_signal(signal.SIGKILL)
        job.wait(timeout=600)
        reader.join(timeout=60)
        text = "".join(lines)
    finally:
        _stop(job)
    assert job.returncode == 0, text[-3000:]
    report = json.loads((out / "report.json").read_text())
    online = report["stages"]["train"]["online"]
    assert report["stages"]["train"]["steps"] == TRAIN_STEPS and "extract" not in report["stages"]
    assert not (out / "hidden_states").exists()  # no training shard written
    # the held-out split: left out of training (check_trained_once_per_epoch), extracted first into
    # shards of its own, and measured at the last step, as offline
    from eagle3.extract.manifest import Manifest
    from eagle3.extract.shards import read_shards
    from eagle3.prepare.heldout import read_split

    split = read_split(out / "prepared")
    held = read_shards(Manifest(out / "hidden_states_heldout").committed_files(), columns=["sample_id"])
    assert sorted(held.column(0).to_pylist()) == sorted(
        s for s in pq.read_table(out / "prepared" / "tokens.parquet", columns=["sample_id"]).column(0).to_pylist()
        if split.is_heldout(s))
    assert online["heldout"]["num_samples"] == split.num_heldout_samples > 0, online["heldout"]
    last = json.loads((out / "train" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == TRAIN_STEPS and last["heldout_samples"] == split.num_heldout_samples, last
    assert 0 <= last["heldout_full_acc_0"] <= 1 and report["stages"]["train"]["heldout"]["step"] == TRAIN_STEPS
    # every engine start is in the start-up record, the replacement of the killed replica too
    assert len(report["startup"]["online"]) >= len(online["replicas"]) >= 2, report["startup"]
    per_epoch = check_trained_once_per_epoch(out, 2)
    assert 0 < online["peak_bytes_in_flight"] <= bound, online
    assert online["num_budget_waits"] > 0, online
    assert "waiting for the trainer (bound reached)" in text and "trainer ranks waited" in text
    # the killed engine replica: its shards lost and redone elsewhere
    assert online["num_lost"] >= 1, online
    replicas = {r["replica"]: r for r in online["replicas"]}
    assert not replicas[0]["alive"] and any(r["alive"] and r["shards"] for i, r in replicas.items() if i != 0)
    assert "lost on replica 0" in text
    # the killed training worker: resumed from a registered checkpoint; the samples after it came
    # from shards extracted again, or from tables still waiting in the store
    steps = _steps(metrics)
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    resumed_at = steps[restart] - 1
    assert resumed_at % CKPT_EVERY == 0 and CKPT_EVERY <= resumed_at <= killed_after
    assert online["num_reextracted"] + online["num_reserved"] >= 1, online
    print(f"\nonline: {len(per_epoch)} epochs, {sum(sum(c.values()) for c in per_epoch.values())} samples trained, "
          f"peak {online['peak_bytes_in_flight']} bytes in flight (bound {bound}), "
          f"{online['num_budget_waits']} requests waited for the bound, engine idle for the trainer "
          f"{online['engine_idle_budget_s']} s; engine replica 0 (pid {pid}) killed, {online['num_lost']} shard(s) "
          f"lost and redone, replicas {[(i, r['alive'], len(r['shards'])) for i, r in replicas.items()]}; "
          f"train worker killed after step {killed_after}, resumed at {resumed_at + 1}: "
          f"{online['num_reextracted']} shard extractions redone, {online['num_reserved']} re-served")


@pytest.mark.slow
def test_online_driver_killed_then_resubmitted_resumes_and_keeps_shards(tiny_target, tmp_path, shared_ray):
    """train.online.epochs: keep. SIGKILL of the driver after a registered checkpoint, its
    cluster's processes stopped; the job resubmitted to another cluster (the session's shared
    one, conftest's shared_ray) resumes training from that checkpoint,
    reads back the shards committed in the background instead of extracting them, and every
    sample is trained once per epoch. The job plans its GPU split once: gpu_split shared, ignored
    on this CPU cluster, warns once in the resubmitted job's output (not again in run_online)."""
    import signal
    import time

    from eagle3.extract.manifest import Manifest

    out = tmp_path / "out"
    data = _conversations(tmp_path / "conversations.jsonl", 41)
    extra = ("--set", "ray.num_cpus=2", "--set", "train.online.epochs=keep", "--set", "train.online.gpu_split=shared",
             "--set", "extract.gpu_memory_utilization=0.6")
    job = _start_online(out, data, tiny_target, *extra)
    metrics = out / "train" / "metrics.jsonl"
    try:
        _wait_for_step(job, metrics, CKPT_EVERY + 2)
        _wait_for_registered_checkpoint(job, out)
        cluster = _descendants(job.pid)
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=60)
        for proc in cluster:
            if proc.is_running():
                proc.kill()
        time.sleep(1)
    finally:
        _stop(job)
    ckpt = _registered_steps(out)[-1]
    committed = Manifest(out / "hidden_states").committed()
    assert committed, "no shard was committed in the background before the kill"
    job = _start_online(out, data, tiny_target, *extra, "--set", f"ray.address={shared_ray}")
    text, _ = job.communicate(timeout=600)
    assert job.returncode == 0, text[-3000:]
    assert text.count("train.online.gpu_split=shared is ignored: the engines use no GPU") == 1, text[-3000:]
    summary = json.loads((out / "train" / "train_summary.json").read_text())
    online = json.loads((out / "report.json").read_text())["stages"]["train"]["online"]
    assert summary["resumed_from_step"] == ckpt and summary["steps"] == TRAIN_STEPS
    check_trained_once_per_epoch(out, 1)
    # every shard was extracted at most once in the second run: later epochs were read back
    assert online["num_extractions"] <= online["num_shards"] - len(committed), online
    assert online["num_shards_on_disk"] == online["num_shards"]
    from tests.test_faults import check_every_sample_once

    check_every_sample_once(out)  # the kept shards are the offline layout, whole and once (the split's rows too)
    print(f"\ndriver killed after checkpoint {ckpt} with {len(committed)} shards kept; resubmit resumed, "
          f"{online['num_extractions']} extractions in the second run")

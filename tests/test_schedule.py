"""The shard scheduler's decisions, without Ray: dispatch order, the in-flight bound, a lost
replica's shards handed out again, a failed write redone, giving up, resume."""

from __future__ import annotations

import pytest

from eagle3.extract.schedule import ShardFailed, ShardScheduler


def test_dispatch_deals_shards_round_robin_up_to_the_bound():
    s = ShardScheduler(7, max_inflight_per_replica=2)
    a, b = s.add_replica(), s.add_replica()
    assert s.assign() == [(a, 0), (b, 1), (a, 2), (b, 3)]
    assert s.assign() == []  # every replica at its bound
    assert s.replicas[a].load == 2 and s.replicas[b].load == 2
    s.commit(1)
    assert s.assign() == [(b, 4)]  # the freed slot, and only it
    for shard in (0, 2, 3, 4):
        s.commit(shard)
    assert s.assign() == [(a, 5), (b, 6)]
    s.commit(5), s.commit(6)
    assert s.finished and s.committed == set(range(7))
    assert s.replicas[a].done == [0, 2, 5] and s.replicas[b].done == [1, 3, 4, 6]


def test_fewer_shards_than_slots_still_give_every_replica_work():
    """Regeneration of a small target: 4 replicas on one GPU, 3 shards in flight each, 9 shards."""
    s = ShardScheduler(9, max_inflight_per_replica=3)
    replicas = [s.add_replica() for _ in range(4)]
    s.assign()
    assert [s.replicas[r].load for r in replicas] == [3, 2, 2, 2]


def test_a_lost_replicas_shards_go_out_again_to_the_others_first():
    s = ShardScheduler(6, max_inflight_per_replica=2)
    a, b = s.add_replica(), s.add_replica()
    assert s.assign() == [(a, 0), (b, 1), (a, 2), (b, 3)]
    assert s.lose(1, "ActorDiedError", replica_died=True) is True  # b is dead now
    assert s.lose(3, "ActorDiedError", replica_died=True) is False  # ... and was already
    assert not s.replicas[b].alive and s.replicas[b].load == 0
    s.commit(0)
    # The lost shards come back before the untouched ones, and only the live replica gets work.
    assert s.assign() == [(a, 3)]
    s.commit(2)
    assert s.assign() == [(a, 1)]
    assert not s.needs_replica()  # a is alive
    c = s.add_replica()  # a replacement joins and takes the rest
    assert s.assign() == [(c, 4), (c, 5)]
    for shard in (3, 1, 4, 5):
        s.commit(shard)
    assert s.finished and sorted(s.committed) == list(range(6))
    assert s.failures == {1: ["ActorDiedError"], 3: ["ActorDiedError"]}


def test_a_failed_write_is_redone_and_its_replica_keeps_working():
    s = ShardScheduler(3, max_inflight_per_replica=1)
    a = s.add_replica()
    assert s.assign() == [(a, 0)]
    assert s.lose(0, "ObjectLostError", replica_died=False) is False
    assert s.replicas[a].alive
    assert s.assign() == [(a, 0)]  # the same shard again, before shard 1
    s.commit(0)
    assert s.assign() == [(a, 1)]


def test_gives_up_on_a_shard_lost_max_attempts_times():
    s = ShardScheduler(2, max_inflight_per_replica=1, max_attempts=3)
    for attempt in range(2):
        s.add_replica()
        assert [shard for _, shard in s.assign()] == [0]
        s.lose(0, f"died {attempt}", replica_died=True)
    s.add_replica()
    s.assign()
    with pytest.raises(ShardFailed, match=r"shard 0 was lost 3 times .*'died 0', 'died 1', 'died 2'"):
        s.lose(0, "died 2", replica_died=True)


def test_no_live_replica_with_work_left_needs_a_replica():
    s = ShardScheduler(2, max_inflight_per_replica=1)
    assert s.needs_replica()  # nothing placed yet
    a = s.add_replica()
    assert not s.needs_replica()
    s.assign()
    s.lose(0, "NodeDiedError", replica_died=True)
    assert s.needs_replica() and s.assign() == []  # a dead replica gets nothing
    assert not s.replicas[a].alive


def test_resume_skips_committed_shards():
    s = ShardScheduler(5, committed=[0, 3, 9], max_inflight_per_replica=4)
    assert s.skipped == [0, 3]  # 9 is not a shard of this plan
    a = s.add_replica()
    assert s.assign() == [(a, 1), (a, 2), (a, 4)]
    assert s.describe_resume("extract") == "extract: 2 of 5 shards already committed, 3 to do"
    done = ShardScheduler(2, committed=[0, 1], max_inflight_per_replica=1)
    assert done.finished and not done.needs_replica()


def test_events_for_shards_not_in_flight_are_refused():
    s = ShardScheduler(2, max_inflight_per_replica=1)
    s.add_replica()
    with pytest.raises(AssertionError, match="shard 1 is not in flight"):
        s.commit(1)
    with pytest.raises(ValueError, match="max_inflight_per_replica=0"):
        ShardScheduler(2, max_inflight_per_replica=0)

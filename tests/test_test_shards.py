"""The slow tier's split into processes run at once (tests/conftest.py, scripts/test_shards.sh)."""

from tests.conftest import shard_of_modules


def test_shards_take_whole_modules_the_longest_first_to_the_least_loaded():
    seconds = {"a.py": 200.0, "b.py": 150.0, "c.py": 60.0, "d.py": 50.0, "e.py": 40.0}
    owner = shard_of_modules(seconds, 2)
    # a -> 0 (200); b -> 1 (150); c -> 1 (210); d -> 0 (250); e -> 1 (250)
    assert owner == {"a.py": 0, "b.py": 1, "c.py": 1, "d.py": 0, "e.py": 1}
    assert shard_of_modules(seconds, 1) == dict.fromkeys(seconds, 0)
    # more processes than modules: the extra ones get none
    assert sorted(shard_of_modules({"a.py": 1.0, "b.py": 1.0}, 3).values()) == [0, 1]

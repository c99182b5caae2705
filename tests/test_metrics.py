"""The drivers' Ray metrics (ray_jobs.metrics): the names users' dashboards query, and `add` on
a shard that counted nothing (Ray's Counter refuses an increment of 0). Ray metrics record
without a cluster (they are dropped), so no Ray cluster is started here."""

import pytest
from ray.util.metrics import Counter

from ray_jobs.metrics import extract_metrics, regenerate_metrics


def _names(m) -> set[str]:
    return {c.info["name"] for c in m.counters.values()} | {m.total.info["name"], m.rate.info["name"]}


def test_metric_names_are_the_dashboards():
    assert _names(extract_metrics(10)) == {
        "eagle3_extract_samples_done", "eagle3_extract_tokens", "eagle3_extract_bytes_written",
        "eagle3_extract_samples_total", "eagle3_extract_tokens_per_s_total"}
    assert _names(regenerate_metrics(10)) == {
        "eagle3_regenerate_samples_done", "eagle3_regenerate_tokens",
        "eagle3_regenerate_samples_total", "eagle3_regenerate_tokens_per_s_total"}


def test_add_skips_zero_counts_that_ray_refuses():
    with pytest.raises(ValueError, match="must be >0"):  # why add filters: Ray's own refusal
        Counter("eagle3_test_zero", "").inc(0)
    m = extract_metrics(4)
    m.add(samples_done=4, tokens=0, bytes_written=0)  # a shard whose samples were all rejected
    m.add(samples_done=0, tokens=0, bytes_written=0)


def test_add_names_an_unknown_counter():
    with pytest.raises(ValueError, match=r"unknown counters \['bytes_written'\]; this stage has \['samples_done', 'tokens'\]"):
        regenerate_metrics(4).add(samples_done=1, bytes_written=10)

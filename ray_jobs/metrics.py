"""Ray metrics of a driver stage that commits shards (extract, regenerate): counters of committed
work, a gauge of the samples the stage has to do and a gauge of its tokens/s over all replicas.

Owns the metric names (`eagle3_<stage>_<counter>`, `eagle3_<stage>_samples_total`,
`eagle3_<stage>_tokens_per_s_total`): users' dashboards query them, so a rename is a breaking
change. Does not own what is counted or when; the stage's driver calls `add` once per committed
shard. Imports only ray.util.metrics, lazily (drivers stay light: tests/test_lazy_imports.py).
"""

from __future__ import annotations


class StageMetrics:
    """One stage's metrics. counters maps a counter's name (the part after `eagle3_<stage>_`)
    to its description; `add` takes the same names."""

    def __init__(self, stage: str, total: int, counters: dict[str, str], *, total_help: str, rate_help: str):
        from ray.util.metrics import Counter, Gauge

        self.counters = {name: Counter(f"eagle3_{stage}_{name}", help_) for name, help_ in counters.items()}
        self.total = Gauge(f"eagle3_{stage}_samples_total", total_help)
        self.rate = Gauge(f"eagle3_{stage}_tokens_per_s_total", rate_help)
        self.total.set(total)

    def add(self, **values: int) -> None:
        """Add one committed shard's counts, e.g. add(samples_done=64, tokens=8192)."""
        unknown = sorted(set(values) - set(self.counters))
        if unknown:
            raise ValueError(f"unknown counters {unknown}; this stage has {sorted(self.counters)}")
        for name, value in values.items():
            if value > 0:  # Ray counters refuse 0 ("value must be >0")
                self.counters[name].inc(value)


def extract_metrics(total: int) -> StageMetrics:
    return StageMetrics("extract", total, {
        "samples_done": "Samples extracted and committed",
        "tokens": "Tokens extracted and committed",
        "bytes_written": "Shard file bytes written (Arrow IPC or Parquet)",
    }, total_help="Samples this extraction has to do", rate_help="Extraction tokens/s over all replicas")


def regenerate_metrics(total: int) -> StageMetrics:
    return StageMetrics("regenerate", total, {
        "samples_done": "Conversations regenerated and committed",
        "tokens": "Tokens generated in committed shards",
    }, total_help="Conversations this regeneration has to do", rate_help="Generated tokens/s over all replicas")

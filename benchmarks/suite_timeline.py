"""When each pytest-xdist worker ran what (where a parallel test run's time goes).

tests/conftest.py appends one JSON line per test phase to the file named by EAGLE3_TEST_TIMELINE
({"worker", "test", "when", "start", "stop", "outcome"}, wall clock). This reads it: per worker,
the span from its first phase to its last, the seconds inside phases (busy) and between them
(collection, fixtures' own waits, xdist's hand-offs), and where it ended beside the other; then the
longest phases. A slow tier whose workers end far apart is unbalanced (tests/conftest.py's
SLOW_FILE_ORDER); one whose workers are busy throughout and end together is shortened only by
less work.

    EAGLE3_TEST_TIMELINE=/tmp/tl.jsonl make test
    python -m benchmarks.suite_timeline /tmp/tl.jsonl [--top 20] [--worker-prefix gw]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summarize(records: list[dict], worker_prefix: str = "") -> dict:
    """{"workers": {name: {"first", "last", "span_s", "busy_s", "idle_s", "phases"}}, "end_gap_s",
    "start"}: times in seconds from the earliest phase's start among the chosen workers."""
    recs = [r for r in records if r["worker"].startswith(worker_prefix)]
    if not recs:
        raise ValueError(f"no phase of a worker named {worker_prefix!r}...")
    t0 = min(r["start"] for r in recs)
    workers = {}
    for name in sorted({r["worker"] for r in recs}):
        mine = sorted((r for r in recs if r["worker"] == name), key=lambda r: r["start"])
        first, last = mine[0]["start"] - t0, max(r["stop"] for r in mine) - t0
        busy = sum(r["stop"] - r["start"] for r in mine)
        workers[name] = {"first": round(first, 1), "last": round(last, 1), "span_s": round(last - first, 1),
                         "busy_s": round(busy, 1), "idle_s": round(last - first - busy, 1), "phases": len(mine)}
    ends = [w["last"] for w in workers.values()]
    return {"workers": workers, "end_gap_s": round(max(ends) - min(ends), 1), "start": t0}


def longest(records: list[dict], top: int, worker_prefix: str = "") -> list[tuple[float, str, str, str]]:
    """The `top` longest phases: (seconds, worker, phase, test)."""
    rows = [(r["stop"] - r["start"], r["worker"], r["when"], r["test"]) for r in records
            if r["worker"].startswith(worker_prefix)]
    return sorted(rows, reverse=True)[:top]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--worker-prefix", default="", help="e.g. gw (xdist workers only)")
    args = ap.parse_args(argv)
    records = read(args.timeline)
    summary = summarize(records, args.worker_prefix)
    for name, w in summary["workers"].items():
        print(f"{name}: {w['first']:7.1f} -> {w['last']:7.1f} s, {w['phases']} phases, busy {w['busy_s']:.1f} s, "
              f"between phases {w['idle_s']:.1f} s")
    print(f"the workers ended {summary['end_gap_s']:.1f} s apart")
    for seconds, worker, when, test in longest(records, args.top, args.worker_prefix):
        print(f"{seconds:7.1f} s  {worker:4s} {when:8s} {test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

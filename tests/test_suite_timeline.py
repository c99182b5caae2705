"""benchmarks/suite_timeline.py and the hook that writes its input (tests/conftest.py,
EAGLE3_TEST_TIMELINE): each test phase's worker, start and stop, and the per-worker summary. Also
conftest's guard of the tiers: a fast test that asks for the shared Ray cluster fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.suite_timeline import longest, main, read, summarize
from tests.conftest import REPO


def test_conftest_writes_one_line_per_phase_and_the_reader_sums_them(tmp_path, capsys):
    timeline = tmp_path / "tl.jsonl"
    test = "tests/test_uv_env.py::test_the_highest_level_wins_as_in_pip"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
                               "EAGLE3_TEST_TIMELINE": str(timeline)})  # not an xdist worker's name
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = read(timeline)
    assert [(r["worker"], r["test"], r["when"], r["outcome"]) for r in records] == [
        ("main", test, when, "passed") for when in ("setup", "call", "teardown")]
    assert all(0 < r["start"] <= r["stop"] for r in records)
    assert records[0]["stop"] <= records[1]["start"] <= records[1]["stop"] <= records[2]["start"]
    main([str(timeline)])
    out = capsys.readouterr().out
    assert "main:" in out and "3 phases" in out and f"call     {test}" in out


def test_summary_per_worker_and_the_gap_between_their_ends():
    def rec(worker, test, start, stop):
        return {"worker": worker, "test": test, "when": "call", "start": start, "stop": stop, "outcome": "passed"}

    records = [rec("gw0", "a", 100, 150), rec("gw0", "b", 160, 200), rec("gw1", "c", 101, 190), rec("main", "d", 0, 5)]
    s = summarize(records, "gw")
    assert s["start"] == 100 and s["end_gap_s"] == 10.0
    assert s["workers"]["gw0"] == {"first": 0.0, "last": 100.0, "span_s": 100.0, "busy_s": 90.0, "idle_s": 10.0,
                                   "phases": 2}
    assert s["workers"]["gw1"]["busy_s"] == 89.0 and "main" not in s["workers"]
    assert [row[3] for row in longest(records, 2, "gw")] == ["c", "a"]
    json.dumps(s)  # a plain record


def test_a_fast_test_on_the_shared_cluster_fails_before_the_cluster_starts(tmp_path):
    """The shared cluster lives in a temp dir of its own, out of sight of the per-test Ray temp dir
    check; tests/conftest.py's pytest_runtest_setup refuses a fast test that asks for it (here
    through ray_local), before its fixtures run: in well under the cluster's ~10 s start."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_fast_but_on_the_shared_cluster(ray_local):\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "-c", "pyproject.toml", "--rootdir", ".", str(probe)], cwd=REPO, capture_output=True,
                          text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
                               "TMPDIR": str(tmp_path)})  # where shared_ray would make its e3shared- dir
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "test_fast_but_on_the_shared_cluster uses the shared Ray cluster (shared_ray) but is not marked slow" \
        in proc.stdout
    assert "1 error" in proc.stdout and not list(tmp_path.glob("e3shared-*"))  # no cluster was started

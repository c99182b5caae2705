"""Session 17's online-against-offline figures (issue 29), from this folder's files: the bench
(`benchmarks.online_bench --one-gpu`) was cut at its queue step's 780 s limit in the offline run's eval,
after both runs had trained and exported, so it wrote no result. The same figures as its own, read
from the same sources: each run's wall from its job log (offline: the extract stage's first line to
`training done`; online: the train stage's first line to `online: done`, which the online report's
`seconds.train`, 82.52 s, confirms), the steady rate and acceptance with the bench's functions, the
offline acceptance from the eval-only job on that run's draft (queue2.sh).

    python benchmarks/results/leases/session17-h200/recover_online.py
"""
import json
import math
import re
import sys
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))
from benchmarks.online_bench import acceptance_stderr, engine_start_s, greedy_acceptance, steady_tokens_per_s  # noqa: E402

STAMP = re.compile(r"^(20\d\d-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def stamp(log: str, pattern: str) -> datetime:
    """The time of the first log line (Ray's worker prefixes removed) that holds pattern."""
    for line in log.replace("\r", "\n").splitlines():
        line = re.sub(r"^\x1b\[36m\([^)]*\)\x1b\[0m ", "", line)
        m = STAMP.match(line)
        if m and pattern in line:
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
    raise ValueError(f"no line with {pattern!r}")


def run(name: str, first: str, last: str) -> dict:
    log = (HERE / f"online-h200-1gpu-smollm2-warm-{name}.log").read_text(errors="replace")
    ev = greedy_acceptance(json.loads((HERE / "online-runs" / name / "eval.json").read_text()))[0]
    train = re.search(r"training done: .*'setup_s': ([0-9.]+).*", log)
    first_step = re.search(r"first step of this run, ([0-9.]+) s", log)
    return {"wall_s": round((stamp(log, last) - stamp(log, first)).total_seconds(), 2),
            "engine_start_s": engine_start_s(log), "trainer_setup_s": float(train.group(1)) if train else None,
            "first_step_s": float(first_step.group(1)),
            "steady_tokens_per_s": round(steady_tokens_per_s(HERE / "online-runs" / name / "metrics.jsonl", 28)),
            "acceptance_length_k3": ev["acceptance_length"], "stderr": acceptance_stderr(ev),
            "num_drafts": ev.get("num_drafts")}


runs = {"offline": run("offline", "extract: 0 of", "training done"),
        "online": run("online", "the engine's KV cache", "online: done")}
report = json.loads((HERE / "online-runs" / "online" / "report.json").read_text())
feed = {k: v for k, v in report["stages"]["train"]["online"].items() if k != "replicas"}
on, off = runs["online"], runs["offline"]
diff = on["acceptance_length_k3"] - off["acceptance_length_k3"]
two_sigma = 2 * math.hypot(on["stderr"], off["stderr"])
checks = {"online wall <= 0.8x offline's": (on["wall_s"] / off["wall_s"], on["wall_s"] / off["wall_s"] <= 0.8),
          "0 bytes of hidden states on disk (online)": (feed["num_shards_on_disk"], feed["num_shards_on_disk"] == 0),
          "trainer >= 0.8x its offline rate": (on["steady_tokens_per_s"] / off["steady_tokens_per_s"],
                                               on["steady_tokens_per_s"] / off["steady_tokens_per_s"] >= 0.8),
          "same acceptance length within noise, k=3": (diff, abs(diff) <= two_sigma)}
out = {"runs": runs, "online_feed": feed, "acceptance_two_sigma": two_sigma,
       "checks": {k: {"value": v, "ok": ok} for k, (v, ok) in checks.items()}}
json.dump(out, sys.stdout, indent=1)
print()

"""Where the GPU waited, in a torch.profiler trace of training steps (train.profile_steps).

    python -m benchmarks.trace_gaps TRACE.json[.gz] [--min-ms 5] [--out GAPS.md]

For each profiled step: its wall time, the GPU's kernel time, and every gap of at least --min-ms
between kernels. For each gap: which of the trainer's ranges (eagle3.forward, ...) the training
thread was in, how many host ops it started during the gap (next to none over many ms: it was
stuck in Python or waiting for the GIL, or in one long op, named), and the last event of each
other host thread shortly before the gap (what another thread had just done). top_ops.txt gives totals; this gives the stalls.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")


def load(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def gaps(events: list[dict], min_ms: float = 5.0, before_ms: float = 10.0, first_step: int = 1) -> list[dict]:
    """One record per profiled step: step, wall_ms, kernel_ms, gaps [{at_ms, ms, ranges,
    host_ops_started, longest_started, others}], where at_ms is the gap's start from the step's
    start. step is the training step: torch.profiler numbers its steps from 0 at the run's first
    step (`first_step`: 1, or a resumed run's first)."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    if not steps:
        return []
    main = steps[0]["tid"]
    host = [e for e in events if e.get("cat") in HOST_CATS and "dur" in e]
    ranges = [e for e in host if e["tid"] == main and e["name"].startswith("eagle3.")]
    out = []
    for step in steps:
        a, b = step["ts"], step["ts"] + step["dur"]
        ks = [k for k in kernels if a <= k["ts"] < b]
        found, end = [], None
        for k in ks:
            if end is not None and k["ts"] - end >= min_ms * 1e3:
                found.append((end, k["ts"]))
            end = max(end or 0.0, k["ts"] + k["dur"])
        rows = []
        for g0, g1 in found:
            inside = [r["name"] for r in ranges if r["ts"] <= g0 < r["ts"] + r["dur"]]
            started = [e for e in host if e["tid"] == main and e.get("cat") != "user_annotation" and g0 <= e["ts"] < g1]
            longest = max(started, key=lambda e: e["dur"], default=None)
            others = {}
            for e in host:
                if e["tid"] != main and g0 - before_ms * 1e3 <= e["ts"] + e["dur"] <= g0 + 1e3:
                    if e["tid"] not in others or e["ts"] > others[e["tid"]]["ts"]:
                        others[e["tid"]] = e
            rows.append({
                "at_ms": (g0 - a) / 1e3, "ms": (g1 - g0) / 1e3, "ranges": inside,
                "host_ops_started": len(started),
                "longest_started": None if longest is None else {"name": longest["name"], "ms": longest["dur"] / 1e3},
                "others": [{"tid": t, "name": e["name"], "ended_ms_before": (g0 - e["ts"] - e["dur"]) / 1e3}
                           for t, e in sorted(others.items())],
            })
        out.append({"step": int(step["name"].split("#")[1]) + first_step, "wall_ms": step["dur"] / 1e3,
                    "kernel_ms": sum(k["dur"] for k in ks) / 1e3, "gaps": rows})
    return out


def markdown(steps: list[dict], min_ms: float) -> str:
    lines = [f"| step | wall (ms) | GPU kernels (ms) | gaps >= {min_ms:g} ms: at (ms) + length, in range; "
             "host ops the training thread started in the gap; other threads' last event before it |",
             "|---|---|---|---|"]
    for s in steps:
        cells = []
        for g in s["gaps"]:
            op = f"{g['host_ops_started']} host ops started" + (
                f" (longest {g['longest_started']['name'][:40]}, {g['longest_started']['ms']:.1f} ms)"
                if g["longest_started"] else "")
            others = ", ".join(f"{o['name'][:28]} {o['ended_ms_before']:.1f} ms before" for o in g["others"]) or "-"
            cells.append(f"{g['at_ms']:.1f} + **{g['ms']:.1f}** in {'/'.join(g['ranges']) or '-'}; {op}; {others}")
        lines.append(f"| {s['step']} | {s['wall_ms']:.1f} | {s['kernel_ms']:.1f} | {'<br>'.join(cells) or 'none'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.trace_gaps")
    ap.add_argument("trace")
    ap.add_argument("--min-ms", type=float, default=5.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    md = markdown(gaps(load(args.trace), args.min_ms), args.min_ms)
    if args.out:
        Path(args.out).write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a command's CPU goes, by kind of process (e.g. where a test suite's time goes).

The slow tier keeps both cores busy (vmstat: 0-2% idle), so only less CPU work shortens it. This
runs a command (e.g. `make test-slow`) and samples /proc every `--every` seconds: each process's own
CPU seconds (utime + stime), every process of the machine, not only the command's (a job's Ray
cluster outlives its driver's parentage; run it on an otherwise quiet machine), grouped by what it
is: a Ray worker by its actor or task (`ray::RayTrainWorker`, the method dropped; a worker's first
seconds as `default_worker.py` or `setup_worker.py` count under what it then became), a Python
process by its module or script (a `python -c` one by its code's first 50 characters), the
dashboard's head modules as one group, anything else by its executable. A process that lives less
than one period is missed, and a killed one keeps its last sample: the total is a lower bound.

    python -m benchmarks.cpu_by_process --out cpu.json -- make test-slow

Writes {"command", "wall_s", "cores", "sampled_cpu_s", "by_kind": [[kind, processes, cpu_s], ...]}
(largest first) and prints the first 30 kinds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
# What a Ray worker is called before it runs its first actor or task, and what it is called between them.
UNNAMED = ("python default_worker.py", "python setup_worker.py", "ray::IDLE")
# execnet's command line for a worker it starts (execnet.gateway_io.popen_bootstrapline): pytest-xdist's workers.
EXECNET_BOOTSTRAP = "import sys;exec(eval(sys.stdin.readline()))"
# How much of a `python -c` child's code names its kind (enough to tell the suite's children apart).
CODE_CHARS = 50


def kind(cmdline: list[str]) -> str:
    """The group a process's CPU counts under, from its command line."""
    first = cmdline[0]
    if first.startswith("ray::"):
        return first.split()[0].split(".")[0]  # 'ray::EvaluatorActor.measure' -> 'ray::EvaluatorActor'
    if first.startswith("ray-dashboard-") or "multiprocessing.forkserver" in " ".join(cmdline[:4]):
        return "ray dashboard head modules"
    # An xdist worker starts as execnet's `python -c` bootstrap and takes its "[pytest-xdist running] ..."
    # title later; a process keeps the kind it was first seen under, so the bootstrap names it too.
    if first.startswith("[pytest-xdist") or first.startswith("tests/") or EXECNET_BOOTSTRAP in cmdline[1:]:
        return "pytest worker (the tests' own code)"
    exe = os.path.basename(first)
    if "python" in exe:
        if "-m" in cmdline[1:]:
            i = cmdline.index("-m")
            return "python -m " + (cmdline[i + 1] if i + 1 < len(cmdline) else "")
        if "-c" in cmdline[1:]:
            # by its code's start: tests, vLLM (multiprocessing's spawn) and Ray all run `python -c` children
            i = cmdline.index("-c")
            code = " ".join(cmdline[i + 1].split()) if i + 1 < len(cmdline) else ""
            return "python -c " + code[:CODE_CHARS]
        scripts = [os.path.basename(a) for a in cmdline[1:] if not a.startswith("-")]
        return "python " + (scripts[0] if scripts else "")
    return exe


def _read(pid: str) -> tuple[list[str], str, float] | None:
    """(command line, start time in ticks, own CPU seconds) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return (cmdline, fields[19], (int(fields[11]) + int(fields[12])) / TICK) if cmdline else None


def sample(command: list[str], every: float) -> dict:
    seen: dict[str, list] = {}  # 'pid:start' -> [kind, cpu seconds]
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or (got := _read(pid)) is None:
                continue
            cmdline, start, cpu = got
            named = kind(cmdline)
            entry = seen.setdefault(f"{pid}:{start}", [named, cpu])
            entry[1] = max(entry[1], cpu)
            if entry[0] in UNNAMED and named not in UNNAMED:
                entry[0] = named
        time.sleep(every)
    totals: dict[str, list] = {}
    for name, cpu in seen.values():
        t = totals.setdefault(name, [0, 0.0])
        t[0] += 1
        t[1] += cpu
    by_kind = sorted(([k, n, round(c, 1)] for k, (n, c) in totals.items()), key=lambda r: -r[2])
    return {"command": command, "returncode": proc.returncode, "wall_s": round(time.monotonic() - t0, 1),
            "cores": os.cpu_count(), "sampled_cpu_s": round(sum(r[2] for r in by_kind), 1), "by_kind": by_kind}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    result = sample(command, args.every)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['sampled_cpu_s']:.0f} CPU-s sampled over {result['wall_s']:.0f} s on {result['cores']} cores "
          f"(rc {result['returncode']})")
    for name, n, cpu in result["by_kind"][:30]:
        print(f"{cpu:8.1f} s  {n:4d}  {name}")
    sys.exit(result["returncode"])


if __name__ == "__main__":
    main()

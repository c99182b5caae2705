"""Loads, on the CPU VM, the job config of every `ray_jobs.run` / `ray_jobs.doctor` command in a lease's queue
scripts, with their --set overrides, so that a config the job refuses fails here in seconds instead of on the
device (session 32: a warm-up's `--set train.num_steps=20` under the config's warmup_steps 50 failed there in 1 s,
and the lease's warm-up was lost).

    .venv/bin/python benchmarks/results/leases/check_queue.py benchmarks/results/leases/session32-plan/queue.sh ...

Paths under /tmp/repo/ (the device's copy of the tree) are read from this checkout. Exit 1 on the first refusal."""
import re
import shlex
import sys
from pathlib import Path

from eagle3.config import load_job_config
from ray_jobs.run import argument_parser, overrides_from

ROOT = Path(__file__).resolve().parents[3]


def commands(script: Path):
    """Each `python -m ray_jobs.{run,doctor}` command line of the script, continuation lines joined and the
    script's own plain assignments (`C=/tmp/repo/...`, `C=$L/x.yaml`, and the
    last `... && STEPS=500` before a command: a run-time value's floor) put in for $NAME."""
    text = script.read_text().replace("\\\n", " ")
    names: dict[str, str] = {}
    for line in text.splitlines():
        line = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda v: names.get(v[1], v[0]), line)
        m = re.search(r"(?:^|&&\s*)([A-Za-z_]\w*)=([^\s$()]+)$", line.strip())
        if m:
            names[m[1]] = m[2]
        words = shlex.split(line, comments=True)
        for i in range(len(words) - 2):
            if words[i] == "python" and words[i + 1] == "-m" and words[i + 2] in ("ray_jobs.run", "ray_jobs.doctor"):
                yield words[i + 3:]


def config_of(args: list[str]):
    """The job config a command's --config and --set give, parsed and built as ray_jobs.run's main does
    (ray_jobs.doctor takes the same two)."""
    parsed, _ = argument_parser().parse_known_args(args)
    config = parsed.config.replace("/tmp/repo/", f"{ROOT}/") if parsed.config else None
    return load_job_config(config, overrides_from(parsed.set))


def main(paths: list[str]) -> int:
    n = 0
    for p in paths:
        for args in commands(Path(p)):
            try:
                cfg = config_of(args)
            except (ValueError, SystemExit) as e:
                print(f"{p}: refused: {' '.join(args)}\n  {e}", file=sys.stderr)
                return 1
            n += 1
            print(f"{p}: ok ({cfg.output_dir}, stages {','.join(cfg.stages)}, {cfg.train.num_steps} steps)")
    if not n:
        print(f"no ray_jobs command in {paths}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

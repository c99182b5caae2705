"""The GPU benchmarks as one command, and one table that judges every target from the JSON.

    python -m benchmarks.gpu_all --out DIR [--tag T] [--parts extract-1b,extract-8b,train,replicas,replicas-disk]
    python -m benchmarks.gpu_all --summarize A.json B.json ... --out DIR [--tag T]

The first form runs the parts one after another, each in its own process (its own Ray instance;
GPU memory is returned between parts), with the settings of the committed results:
  extract-1b, extract-8b   benchmarks.extract_bench: (1) plain prefill, (2) object store, (3) Arrow
                           on local disk, (3b) fp8, (4) transformers, (5) dd, plus the breakdown
  train                    benchmarks.train_bench: (6) our trainer's tokens/s against speculators'
  replicas, replicas-disk  benchmarks.replica_bench: (7) two replicas against one, writing Arrow
                           into /dev/shm and onto the local disk (skipped with fewer than 2 GPUs)
then writes DIR/gpu-all[-T].json and .md: the measured figures and, per target, met / missed by
how much / not measured. The second form builds that report from part results run separately:
on the lent H200 one device call may run 10 minutes, and all parts take about 25.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = {
    # an 8 GiB object store wraps within one pass of the 1B prompts (17 GB), so the second pass of
    # every side timed over passes 2..P, sides rotated (extract_bench)
    "extract-1b": ["benchmarks.extract_bench", "--shapes", "1b", "--num-prompts", "1024", "--prompt-len", "1024",
                   "--diagnose"],
    "extract-8b": ["benchmarks.extract_bench", "--shapes", "8b", "--num-prompts", "1024", "--prompt-len", "1024",
                   "--hf-prompts", "32"],
    # hidden states by transformers: the trainers' throughput does not depend on which engine made
    # them, and it saves a vLLM engine start
    "train": ["benchmarks.train_bench", "--shape", "1b", "--extract-backend", "hf"],
    # 4096 prompts: the loop of 2 replicas runs ~10 s, of which ~1 s is fill and the last write
    "replicas": ["benchmarks.replica_bench", "--shape", "1b", "--replicas", "1,2", "--num-prompts", "4096",
                 "--prompt-len", "1024", "--hs-dtype", "float8_e4m3fn", "--disk-dir", "/dev/shm"],
    "replicas-disk": ["benchmarks.replica_bench", "--shape", "1b", "--replicas", "1,2", "--num-prompts", "4096",
                      "--prompt-len", "1024", "--hs-dtype", "float8_e4m3fn"],
}
DISK_PARTS = ("extract-1b", "extract-8b", "replicas-disk")  # take --disk-dir


def _kind(doc: dict) -> str | None:
    """Which part wrote a result file: 'extract', 'train' or 'replicas'."""
    if "ours" in doc and "speculators" in doc:
        return "train"
    rows = doc.get("results") or [{}]
    return "extract" if "plain_prefill_tok_s" in rows[0] else "replicas" if "speedup" in rows[0] else None


def _of(results: list[dict], kind: str) -> list[dict]:
    return [d for d in results if _kind(d) == kind]


def _extract(results: list[dict], shape: str) -> tuple[dict, dict] | None:
    """(result row, meta) of the extract_bench run that measured `shape`."""
    return next(((row, doc["meta"]) for doc in _of(results, "extract") for row in doc["results"]
                 if row["shape"] == shape), None)


def _div(a, b):
    return a / b if a is not None and b else None


def target_values(results: list[dict]) -> list[tuple[str, float | None, float]]:
    """(target, measured value or None, threshold) for every target the project sets."""
    e1, e8 = _extract(results, "1b"), _extract(results, "8b")
    r1, m1 = e1 if e1 else ({}, {})
    r8, _ = e8 if e8 else ({}, {})
    train = next(iter(_of(results, "train")), {})
    two = {}  # in memory (/dev/shm) or on disk: the replicas share the one machine's disk
    for doc in _of(results, "replicas"):
        where = "memory" if str(doc.get("meta", {}).get("args", {}).get("disk_dir", "")).startswith("/dev/shm") else "disk"
        two[where] = next((r["speedup"] for r in doc["results"] if r["replicas"] == 2), None)
    return [
        ("8B: (3) Arrow on disk / (1) plain prefill >= 0.97", r8.get("arrow_disk_ratio"), 0.97),
        ("1B: (2) object store / (1) plain prefill >= 0.95", r1.get("object_store_ratio"), 0.95),
        ("1B: Arrow writing / (5) dd >= 0.8", _div(r1.get("arrow_disk_write_gb_s"), m1.get("disk_gb_s")), 0.8),
        ("1B: fp8 on disk / bf16 on disk, 'roughly double' (>= 1.8)",
         _div(r1.get("arrow_disk_fp8_tok_s"), r1.get("arrow_disk_tok_s")), 1.8),
        ("(7) two replicas / one >= 1.9, Arrow into memory (/dev/shm)", two.get("memory"), 1.9),
        ("(7) the same, Arrow on the local disk both replicas share", two.get("disk"), 1.9),
        ("(6) ours / speculators' trainer tokens/s, median over repeats >= 1.0",
         (train.get("ratio_ours_over_theirs") or {}).get("median"), 1.0),
    ]


def verdict(value: float | None, threshold: float) -> str:
    if value is None:
        return "not measured"
    return "met" if value >= threshold else f"missed by {threshold - value:.2f}"


def report(results: list[dict], sources: list[str]) -> tuple[dict, str]:
    from benchmarks.extract_bench import markdown as extract_markdown

    targets = [{"target": t, "measured": v, "threshold": th, "verdict": verdict(v, th)}
               for t, v, th in target_values(results)]
    lines = ["# GPU benchmarks, one report", "", "Sources: " + ", ".join(f"`{s}`" for s in sources), "",
             "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t['target']} | {'-' if t['measured'] is None else format(t['measured'], '.3f')} | {t['verdict']} |"
              for t in targets]
    for doc in _of(results, "extract"):
        lines += ["", extract_markdown(doc["results"], doc["meta"]).replace("# Extraction benchmark", "## Extraction")]
    train = next(iter(_of(results, "train")), None)
    if train:
        theirs = (train["speculators"].get("steady") or {}).get("tokens_per_s")
        why = train["speculators"].get("error", "no steady-state figure").splitlines()[0][:300]
        lines += ["", "## Training (6)", "",
                  f"ours {train['ours']['steady']['tokens_per_s']:,.0f} tokens/s; speculators' trainer "
                  + (f"{theirs:,.0f} tokens/s" if theirs else f"not measured: {why}")]
    for doc in _of(results, "replicas"):
        where = doc.get("meta", {}).get("args", {}).get("disk_dir", "?")
        lines += ["", f"## Replicas (7), Arrow under {where}", ""] + [
            f"- {r['replicas']} replica(s): {r['tok_s']:,.0f} tok/s, {r['speedup']:.2f}x"
            + (f"; steady {r['steady_tok_s']:,.0f} tok/s, {r['steady_speedup']:.2f}x" if r.get("steady_speedup") else "")
            for r in doc["results"]]
    return {"targets": targets, "sources": sources}, "\n".join(lines) + "\n"


def run_parts(parts: list[str], out: Path, tag: str, disk_dir: str) -> list[Path]:
    import torch

    files = []
    for part in parts:
        if part.startswith("replicas") and torch.cuda.device_count() < 2:
            print(f"[gpu_all] {part}: skipped, {torch.cuda.device_count()} GPU(s) here", flush=True)
            continue
        part_tag = f"{tag}-{part}" if tag else part
        cmd = [sys.executable, "-m", *PARTS[part], "--out", str(out), "--tag", part_tag]
        if part in DISK_PARTS:
            cmd += ["--disk-dir", disk_dir]
        print(f"[gpu_all] {part}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd).returncode
        print(f"[gpu_all] {part}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        files += sorted(p for p in out.glob(f"*-{part_tag}.json"))
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_all")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {list(PARTS)}")
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="build the report from these part results")
    ap.add_argument("--disk-dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default="benchmarks/results/job")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        files = [Path(f) for f in args.summarize]
    else:
        unknown = [p for p in args.parts.split(",") if p not in PARTS]
        if unknown:
            ap.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
        files = run_parts(args.parts.split(","), out, args.tag, args.disk_dir)
    doc, md = report([json.loads(f.read_text()) for f in files], [f.name for f in files])
    name = f"gpu-all{('-' + args.tag) if args.tag else ''}"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

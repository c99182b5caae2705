"""How long the trainer's input pipeline takes to build one packed micro-batch, side by side:
  collate  speculators' per-sample tensors (shift_batch; fp8 dequantised on the host by
           eagle3.extract.codec) + CollateFn, then a copy into pinned memory where there is CUDA (the
           trainer's path until this benchmark)
  pack     eagle3.train.data.packing.pack: one copy per value from the shard into the (pinned)
           batch; fp8 dequantised on the way on a CPU-only machine, and left e4m3 with its scales
           where there is CUDA (the trainer dequantises on the device)
over the same shard files (written by the product's shard writer, direct I/O), each read cold
(the files' pages dropped from the page cache first, as after an extraction that wrote them
with O_DIRECT) and warm (a second pass). Then the throughput of the whole input pipeline as the
trainer runs it (pack in DataLoader worker processes (1, 2, 4), or behind a thread as before; shards read
ahead), over one cold epoch, against the disk's own O_DIRECT read rate over the same files: in
the long run, reading bounds a trainer whose device step is faster than that. Last, what the
producer costs the step's host side: a loop of small torch ops from Python, alone and next to a
packing thread or 4 worker processes (the thread holds the GIL in bursts).

    python -m benchmarks.batch_bench [--shape 1b] [--hs-dtype bfloat16] [--samples 128] [--batches 6]
                                     [--out DIR --tag T]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from speculators.models.eagle3.data import shift_batch  # noqa: F401 - imported here, not inside a timed batch
from speculators.train.data import CollateFn

from benchmarks.common import direct_read_gb_s, drop_cache, result_meta, write_result
from eagle3.train.data.packing import PackedBatches
from eagle3.train.data.pipeline import batch_source
from eagle3.train.data.rows import HiddenStatesDataset
from eagle3.schema import hidden_states_schema, stored_bytes_per_token
from eagle3.extract.shards import write_shard_file

SHAPES = {"tiny": (256, [2, 4, 5, 8], 256), "1b": (2048, [2, 8, 13, 16], 1024), "8b": (4096, [2, 16, 29, 32], 1024)}


def write_data(root: Path, hidden: int, layer_ids: list[int], seq: int, samples: int, hs_dtype: str,
               per_shard: int = 32) -> list[str]:
    schema = hidden_states_schema(layer_ids=layer_ids, hidden_size=hidden, hs_dtype=hs_dtype)
    rng = np.random.default_rng(0)
    fp8 = hs_dtype == "float8_e4m3fn"
    n_values = seq * len(layer_ids) * hidden
    files = []
    for s in range(-(-samples // per_shard)):
        n = min(per_shard, samples - s * per_shard)
        cols = {"sample_id": [f"s{s}-{i}" for i in range(n)],
                "input_ids": [rng.integers(0, 32000, seq).tolist() for _ in range(n)],
                "loss_mask": [[1] * seq for _ in range(n)], "num_tokens": [seq] * n,
                # finite values only: e4m3 bytes below 0x7f (0x7f is NaN), bf16 bits below 0x7f80
                "hidden_states": [(rng.integers(0, 0x7F, n_values, dtype=np.uint8) if fp8 else
                                   rng.integers(0, 1 << 14, n_values, dtype=np.uint16)).tobytes() for _ in range(n)],
                "hs_scale": [rng.random(seq * len(layer_ids), dtype=np.float32).tolist() if fp8 else None
                             for _ in range(n)]}
        files.append(str(root / f"shard-{s:06d}.arrow"))
        write_shard_file(pa.Table.from_pydict(cols, schema=schema), files[-1], None, True)
    return files


def collate_batches(ds, micro: int, pin: bool):
    """The former path: per-sample tensors (HiddenStatesDataset.samples: shift_batch, fp8 dequantised
    on the host), CollateFn, then pinned."""
    collate = CollateFn(max_len=micro, hidden_size=ds.hidden_size, num_target_layers=len(ds.aux_layer_ids),
                        dtype=torch.bfloat16)
    samples = ds.samples(0)
    while True:
        batch, used = [], 0
        for sample in samples:
            batch.append(sample)
            n = len(sample["input_ids"])  # tokens after the shift
            used += n
            if used + n > micro:
                break
        if not batch:
            return
        out = collate(batch)
        yield {k: v.pin_memory() if pin and torch.is_tensor(v) else v for k, v in out.items()}


def pack_batches(ds, micro: int, pin: bool):
    # as the trainer packs: where there is CUDA, fp8 stays e4m3 for the device to dequantise
    yield from PackedBatches(ds, micro, hidden_states_dtype=torch.bfloat16, pin_memory=pin, dequantize=not pin)


def measure(make, files, micro: int, batches: int, pin: bool, cold: bool) -> list[float]:
    if cold:
        drop_cache(files)
    ds = HiddenStatesDataset(files, seed=0, shuffle_buffer_size=1)  # file order: reading is the cost measured
    it = make(ds, micro, pin)
    times = []
    for _ in range(batches):
        t = time.perf_counter()
        if next(it, None) is None:
            break
        times.append(time.perf_counter() - t)
    return times


def _source(files, micro: int, pin: bool, depth: int, workers: int):
    """The trainer's batch source over `files` (eagle3.train.data.pipeline.batch_source): `workers` DataLoader
    processes, or a thread where 0, `depth` batches ahead; fp8 left for the device where there is CUDA."""
    ds = HiddenStatesDataset(files, seed=0, shuffle_buffer_size=1)  # file order: reading is the cost measured
    return ds, batch_source(ds, micro, torch.bfloat16, depth, workers, on_gpu=pin, dequantize=not pin)


def stream(files, micro: int, seq: int, pin: bool, depth: int, workers: int = 0) -> dict:
    """The input pipeline's throughput from a cold page cache (the trainer's batch source: a thread
    where `workers` is 0, else that many DataLoader processes, `depth` batches ahead), with a consumer
    that takes each batch as soon as it is built: one epoch's full batches, in GB/s of the bytes read."""
    drop_cache(files)
    ds, it = _source(files, micro, pin, depth, workers)
    num_batches = ds.num_samples // (micro // (seq - 1))  # equal-length samples: full batches only
    t = time.perf_counter()
    for _ in range(num_batches):
        next(it)
    seconds = time.perf_counter() - t
    if depth:
        it.close()
    bytes_per_sample = sum(os.path.getsize(f) for f in files) / ds.num_samples
    read = num_batches * (micro // (seq - 1)) * bytes_per_sample
    return {"kind": f"{workers} worker{'s' if workers > 1 else ''}" if workers else "thread", "depth": depth,
            "batches": num_batches, "seconds": round(seconds, 3),
            "gb_s": read / seconds / 1e9}


def launch_loop(x: torch.Tensor, n: int = 3000) -> float:
    """Seconds to issue n small elementwise ops from Python: a training step's host side, which
    launches many small kernels (on CUDA they run asynchronously; this times their launch)."""
    t = time.perf_counter()
    for _ in range(n):
        x = x * 1.0001 + 0.5
    return time.perf_counter() - t


def gil(files, micro: int, pin: bool, loops: int = 30) -> dict:
    """The launch loop's median ms alone, then between batches taken from a packing thread and from
    4 worker processes (each loop after one batch, as a step does): what the producer's GIL costs."""
    x = torch.zeros(16, device="cuda" if pin else "cpu")
    for _ in range(3):
        launch_loop(x)
    alone = [launch_loop(x) for _ in range(loops)]
    out = {"alone_ms": statistics.median(alone) * 1e3, "alone_max_ms": max(alone) * 1e3}
    for kind, workers in (("thread", 0), ("worker", 4)):
        drop_cache(files)
        _, it = _source(files, micro, pin, 16, workers)
        times = []
        for _ in range(loops):
            next(it)
            times.append(launch_loop(x))
        it.close()
        out[f"{kind}_ms"] = statistics.median(times) * 1e3
        out[f"{kind}_max_ms"] = max(times) * 1e3  # a stall of the producer's shows here
    return out


class _Blobs(torch.utils.data.IterableDataset):
    def __init__(self, nbytes: int, n: int):
        self.nbytes, self.n = nbytes, n

    def __iter__(self):
        for _ in range(self.n):
            yield {"hidden_states": torch.ones(self.nbytes, dtype=torch.uint8)}


def drop_probe(nbytes: int, n: int = 8) -> dict:
    """What the ring avoids: a DataLoader worker hands a batch of `nbytes` through a new
    shared-memory segment, and dropping it in this process unmaps that segment with the GIL held.
    Median and max ms of `del batch`, while a thread that wakes every 0.5 ms measures its longest
    wait for the GIL meanwhile."""
    import threading

    waits, stop = [], threading.Event()

    def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            waits.append(now - last)
            last = now

    th = threading.Thread(target=ticker, daemon=True)
    th.start()
    drops, held = [], []
    loader = torch.utils.data.DataLoader(_Blobs(nbytes, n), batch_size=None, num_workers=1, prefetch_factor=2,
                                         multiprocessing_context="fork")
    for batch in loader:
        time.sleep(0.02)
        mark = len(waits)
        t = time.perf_counter()
        del batch
        drops.append(time.perf_counter() - t)
        time.sleep(0.02)
        held.append(max(waits[mark:], default=0.0))
    stop.set()
    th.join()
    return {"batch_mb": nbytes / 1e6, "drop_ms": statistics.median(drops) * 1e3, "drop_max_ms": max(drops) * 1e3,
            "other_thread_max_wait_ms": statistics.median(held) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.batch_bench")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--samples", type=int, default=128, help="written, 32 per shard; the stream rows read them all")
    ap.add_argument("--batches", type=int, default=6, help="batches measured per pass (8 samples each at 1b)")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--hs-dtype", choices=("bfloat16", "float8_e4m3fn"), default="bfloat16")
    ap.add_argument("--work-dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default="benchmarks/results/training")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    hidden, layer_ids, seq = SHAPES[args.shape]
    pin = torch.cuda.is_available()
    root = Path(tempfile.mkdtemp(prefix="eagle3-batch-bench-", dir=args.work_dir))
    files = write_data(root, hidden, layer_ids, seq, args.samples, args.hs_dtype)
    rows = []
    for cold in (True, False):
        for name, make in (("collate", collate_batches), ("pack", pack_batches)):
            times = measure(make, files, args.micro_batch_tokens, args.batches, pin, cold)
            rows.append({"path": name, "cold": cold, "batch_ms": [round(t * 1e3, 1) for t in times],
                         "median_ms": statistics.median(times) * 1e3})
            print(json.dumps(rows[-1]), flush=True)
    streams = [stream(files, args.micro_batch_tokens, seq, pin, depth, workers)
               for depth, workers in ((2, 0), (16, 0), (16, 1), (16, 2), (16, 4))]
    for r in streams:
        print(json.dumps(r), flush=True)
    launches = gil(files, args.micro_batch_tokens, pin)
    print(json.dumps(launches), flush=True)
    bytes_per_batch = args.micro_batch_tokens * stored_bytes_per_token(num_layers=len(layer_ids), hidden_size=hidden,
                                                                      hs_dtype=args.hs_dtype)
    drops = drop_probe(bytes_per_batch)
    print(json.dumps(drops), flush=True)
    disk_gb_s = direct_read_gb_s(files)
    for f in files:
        os.remove(f)
    root.rmdir()
    meta = result_meta(args, pinned=pin, torch_threads=torch.get_num_threads(),
                       hidden_states_bytes_per_batch=bytes_per_batch, stream=streams, disk_read_gb_s=disk_gb_s,
                       launch_loop=launches, dataloader_drop=drops)
    med = {(r["path"], r["cold"]): r["median_ms"] for r in rows}
    lines = [f"# Building one packed micro-batch ({meta['date']})", "", f"Machine: {meta['machine']}", "",
             f"Shape {args.shape}: hidden {hidden}, layers {layer_ids}, {seq}-token samples, "
             f"{args.micro_batch_tokens} tokens per batch ({bytes_per_batch / 1e6:.0f} MB of {args.hs_dtype} hidden "
             "states, read as stored" + ("; pack leaves fp8 for the device" if pin and args.hs_dtype != "bfloat16"
                                         else "") + "); "
             f"pinned: {pin}; torch threads: {meta['torch_threads']}; median of {args.batches} batches.", "",
             "| page cache | collate + pin (ms) | pack (ms) | ratio |", "|---|---|---|---|"]
    for cold in (True, False):
        a, b = med[("collate", cold)], med[("pack", cold)]
        lines.append(f"| {'cold' if cold else 'warm'} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    lines += ["", f"One epoch ({args.samples} samples) through the trainer's input pipeline from a cold page cache, "
              "taken as fast as it is built: " + "; ".join(
                  f"{r['kind']}, prefetch depth {r['depth']}: {r['gb_s']:.2f} GB/s ({r['batches']} batches in "
                  f"{r['seconds']:.2f} s)" for r in streams) + ". The same files read with O_DIRECT (16 MiB reads): "
              + (f"{disk_gb_s:.2f} GB/s." if disk_gb_s else "not measured (no O_DIRECT here)."),
              "", f"A step's host side next to the producer (3,000 small {'CUDA' if pin else 'CPU'} ops from Python, "
              f"each after one batch is taken; median (max) of 30): alone {launches['alone_ms']:.1f} "
              f"({launches['alone_max_ms']:.1f}) ms; next to a packing thread {launches['thread_ms']:.1f} "
              f"({launches['thread_max_ms']:.1f}) ms; next to 4 worker processes {launches['worker_ms']:.1f} "
              f"({launches['worker_max_ms']:.1f}) ms.",
              "", f"What the workers' ring avoids: a {drops['batch_mb']:.0f} MB batch handed over by DataLoader's own "
              f"shared memory took {drops['drop_ms']:.1f} ms (max {drops['drop_max_ms']:.1f}) to drop, and another "
              f"thread waited up to {drops['other_thread_max_wait_ms']:.1f} ms (median over batches) for the GIL meanwhile."]
    write_result(args.out, "batch", args.tag, {"meta": meta, "results": rows}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

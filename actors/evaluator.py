"""Ray actor running one speculative-decoding engine (target + draft) to measure acceptance
length. One actor per num_speculative_tokens value: a fresh process, a fresh engine and
fresh Prometheus counters each time."""

from __future__ import annotations

import os


class EvaluatorActor:
    def __init__(self, cpu_kvcache_space_gib: int = 1):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kvcache_space_gib))

    def measure(self, target_dir: str, draft_dir: str, prompts: list[list[int]], **kwargs) -> dict:
        from eagle3.evaluate import measure_acceptance

        return measure_acceptance(target_dir, draft_dir, prompts, **kwargs)

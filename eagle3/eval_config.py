"""Eval-stage config (`eval:` in a job file; consumed by eagle3.evaluate and ray_jobs/evaluate.py).

A module of eagle3's top level, as the stage's code (eagle3/evaluate.py) is. Owns: the fields of the
evaluation inside vLLM and their checks. Does not own: limits against other stages
(eagle3.config.JobConfig). Imports neither torch nor vllm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eagle3.typed_config import check_types, fail


@dataclass(frozen=True)
class EvalConfig:
    """The exported draft inside vLLM speculative decoding (eagle3.evaluate): acceptance length at
    each num_speculative_tokens, greedy and at the served sampling (the regeneration's resolved
    regenerate.temperature/top_p: the target's generation_config.json where null), and decode
    output tokens/s with and without the draft at speed_batch_sizes. Engines: one per
    num_speculative_tokens (speed_k's, or each of speed_ks, also times the windows), plus the target
    alone when speed is measured. The timed windows are derived from the platform
    (eagle3.evaluate.speed_windows: longer on a GPU, each timed several times; eval.json states them
    and whether each speedup exceeds the spread of its windows)."""

    num_speculative_tokens: tuple[int, ...] = (3,)
    """One engine per value (each costs an engine start); acceptance length = mean accepted tokens per
    verification step + 1. 3 alone also gives k=1 and 2 from its prefixes (eval.json's
    acceptance_length_prefix); list more to measure each k in its own engine."""
    speed_k: int | None = None
    """The k whose draft engine is timed against the target alone; must be listed in
    num_speculative_tokens. None: 3 if listed (acceptance mostly saturates there while a step still
    costs little more, as vLLM's EAGLE-3 examples serve), else the largest listed."""
    speed_ks: tuple[int, ...] | None = None
    """Several k to time against the target alone, each listed in num_speculative_tokens; the first
    is eval.json's `speed` (speed_k, where also set, must be it), every one is in `speed_by_k`. null:
    [speed_k]. A second timed k checks the verdict's step-cost model (eagle3.evaluate.verdict), which
    predicts the other k, against a speedup it was not fitted on; each costs its windows' time."""
    speed_batch_sizes: tuple[int, ...] = (1, 16)
    """Batch sizes the decode speedup is timed at (1: one user's latency; larger: a loaded server).
    Empty: no throughput, no baseline engine."""
    enforce_eager: Literal["auto", True, False] = "auto"
    """Of the timed engines: 'auto' = CUDA graphs on a GPU (as `vllm serve` runs) and eager on the CPU.
    true: eager everywhere (starts faster, decodes slower). Acceptance-only engines always run eager."""
    engines_at_once: Literal["auto", True, False] = "auto"
    """Start the engines side by side, each on its share of the device, so their starts overlap and the
    timed windows alternate draft and baseline round by round. 'auto': true on a GPU for a small target
    (extraction's replicas_per_gpu rule) and for a larger one whose engines fit on one GPU together
    (each its bf16 weights, its KV cache and 3 GiB, within extract.gpu_memory_utilization of the
    smallest GPU); false on the CPU and for engines of several GPUs. false: one engine at a time, the
    device its own, and the speedup divides two separate runs (eval.json says interleaved: false)."""
    start_during_training: Literal["auto", True, False] = "auto"
    """Start the eval's engines while the draft trains (from a provisional export; the trained weights
    load in place at the end), so their start overlaps training. 'auto': on where engines_at_once is and
    training is offline on one worker; true where that cannot work stops the job at its start."""
    select_every_steps: int | None = None
    """Every this many steps the trainer exports the draft, and the draft engine (speed_k's) takes it in
    place and measures vLLM's greedy acceptance length on select_num_prompts held-out prompts apart from
    the eval's; the job exports the step with the highest, the last step's unless one beats it (eval.json's
    selection, metrics.jsonl, curves.png, serving.json's draft_step). Where the engines start during
    training they measure each draft as it comes; elsewhere the drafts wait on disk (one draft's size
    each) for the eval stage. None: train.eval_every_steps, or the smallest multiple of it that keeps a
    run to about 20 drafts; on the CPU only where the engines start during training. 0: off, the last
    step's draft."""
    select_num_prompts: int = 32
    """Held-out prompts the selection decodes: those after the eval's num_prompts in
    prepared/eval_prompts.jsonl (prepare.num_eval_prompts must hold both; with none left, no selection)."""
    speed_repeats: int | None = None
    """Rounds each timed engine decodes every window, fixed before timing: more rounds, a tighter
    spread, a longer stage. None: 3 on a GPU, 2 on the CPU."""
    num_prompts: int = 64
    """Held-out prompts (at most prepare.num_eval_prompts): acceptance runs all of them, and the timed
    windows decode them (eagle3.evaluate.speed_windows). Enough that two drafts' acceptance lengths can
    be told apart, not only the draft from no draft."""
    max_tokens: int = 128
    """Tokens generated per prompt for acceptance, at most (exactly, with ignore_eos)."""
    ignore_eos: bool = False
    """Acceptance runs: false = each answer ends where the target ends it, as `vllm serve` answers a user;
    true = exactly max_tokens tokens, past the end of the turn. The timed windows always end at EOS."""
    seed: int = 0
    """Sampled acceptance: request i's seed is seed + i (repeatable). Timed windows sample unseeded, as
    served requests do."""
    enabled: bool = True
    """False: no eval engines start; the job ends with the exported draft."""

    def __post_init__(self):
        check_types(self, "eval")
        if not self.num_speculative_tokens or min(self.num_speculative_tokens) < 1:
            fail("eval", "num_speculative_tokens", list(self.num_speculative_tokens),
                 "give at least one value, each >= 1, e.g. [1, 3]")
        if len(set(self.num_speculative_tokens)) != len(self.num_speculative_tokens):
            fail("eval", "num_speculative_tokens", list(self.num_speculative_tokens),
                 "list each value once (one engine per value)")
        if self.speed_k is not None and self.speed_k not in self.num_speculative_tokens:
            fail("eval", "speed_k", self.speed_k,
                 f"must be one of eval.num_speculative_tokens={list(self.num_speculative_tokens)} (its engine "
                 "times the decode speed); add it there, pick a listed value, or null (3 if listed, else the largest)")
        if self.speed_ks is not None:
            ks = list(self.speed_ks)
            if not ks or len(set(ks)) != len(ks) or any(k not in self.num_speculative_tokens for k in ks):
                fail("eval", "speed_ks", ks,
                     f"list distinct values of eval.num_speculative_tokens={list(self.num_speculative_tokens)} (each "
                     "one's engine times the decode speed), or null for [speed_k]")
            if self.speed_k is not None and self.speed_k != ks[0]:
                fail("eval", "speed_ks", ks, f"must start with eval.speed_k={self.speed_k} (eval.json's `speed`), "
                     "or leave speed_k null")
        if any(b < 1 for b in self.speed_batch_sizes) or len(set(self.speed_batch_sizes)) != len(self.speed_batch_sizes):
            fail("eval", "speed_batch_sizes", list(self.speed_batch_sizes),
                 "give distinct batch sizes, each >= 1, e.g. [1, 16]; or [] for no throughput")
        if self.speed_repeats is not None and self.speed_repeats < 1:
            fail("eval", "speed_repeats", self.speed_repeats, "must be >= 1 rounds, or null (3 on a GPU, 2 on the CPU)")
        if self.num_prompts < 1:
            fail("eval", "num_prompts", self.num_prompts, "must be >= 1 (or eval.enabled: false)")
        if self.select_every_steps is not None and self.select_every_steps < 0:
            fail("eval", "select_every_steps", self.select_every_steps, "must be >= 1 step, 0 (off) or null "
                 "(train.eval_every_steps)")
        if self.select_num_prompts < 1:
            fail("eval", "select_num_prompts", self.select_num_prompts, "must be >= 1 (eval.select_every_steps: 0 "
                 "turns the selection off)")
        if self.max_tokens < 1:
            fail("eval", "max_tokens", self.max_tokens, "must be >= 1")

    @property
    def resolved_speed_k(self) -> int | None:
        """The k whose engine times decode speed (speed_k, derived where null); None when
        speed_batch_sizes is empty."""
        if not self.speed_batch_sizes:
            return None
        if self.speed_k is not None:
            return self.speed_k
        if self.speed_ks is not None:
            return self.speed_ks[0]
        return 3 if 3 in self.num_speculative_tokens else max(self.num_speculative_tokens)

    @property
    def resolved_speed_ks(self) -> tuple[int, ...]:
        """Every k whose engine times decode speed, resolved_speed_k first; () when
        speed_batch_sizes is empty."""
        if not self.speed_batch_sizes:
            return ()
        return tuple(self.speed_ks) if self.speed_ks is not None else (self.resolved_speed_k,)

"""One vLLM engine (the target, with an EAGLE-3 draft or alone) and what is measured on it:
acceptance from the engine's own counters, tokens/s over timed windows. vLLM is imported when an
engine starts, so the driver can import this module to merge results.
"""

from __future__ import annotations

import time
from typing import Self

from eagle3.evaluate.stats import spread
from eagle3.evaluate.windows import DecodeSampling, SpeedWindow


def _cycle(prompts: list[list[int]], n: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(n)]


class SpecDecodeEngine:
    """A vLLM engine of `target_dir` with the EAGLE-3 draft `draft_dir` proposing
    num_speculative_tokens tokens per step, or the target alone (draft_dir None, k 0)."""

    def __init__(self, target_dir: str, draft_dir: str | None, *, num_speculative_tokens: int, max_model_len: int,
                 dtype: str = "auto", enforce_eager: bool = True, max_num_seqs: int | None = None,
                 gpu_memory_utilization: float = 0.85, trust_remote_code: bool = False,
                 kv_cache_memory_bytes: int | None = None, reloadable_draft: bool = False):
        """reloadable_draft: the draft's weights can be replaced in place later (reload_draft)."""
        # Before started_at and the clock: startup_s is the engine's start, not vLLM's import.
        from vllm import LLM  # noqa: F401

        from compat.vllm_engine import Engine, eagle3_engine_kwargs, engine_core_in_this_process
        from eagle3.precision import engine_dtype

        dtype, self.dtype = engine_dtype(dtype)  # self.dtype: the choice and why, for logs
        self.draft_dir, self.k = draft_dir, num_speculative_tokens
        self.enforce_eager = enforce_eager
        self.started_at = time.time()  # wall clock: the driver compares it with when it placed the actor
        t0 = time.perf_counter()
        self.engine = Engine(**eagle3_engine_kwargs(
            target=target_dir, draft=draft_dir, num_speculative_tokens=num_speculative_tokens,
            max_model_len=max_model_len, dtype=dtype, enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=trust_remote_code,
            kv_cache_memory_bytes=kv_cache_memory_bytes, reloadable_draft=reloadable_draft))
        self.startup_s = time.perf_counter() - t0
        self.in_process = engine_core_in_this_process()
        self.reloaded_from: str | None = None  # the draft this engine started with, once reload_draft replaced it

    def reload_draft(self, draft_dir: str) -> dict:
        """Serve draft_dir's weights from now on, in place (compat.draft_reload): an engine started
        with reloadable_draft=True from a draft of the same config. Raises
        compat.draft_reload.DraftReloadRefused where it cannot; the engine then still serves the old one."""
        from compat.draft_reload import reload_draft

        if self.draft_dir is None:
            raise ValueError("this engine serves the target alone: there is no draft to reload")
        t = time.perf_counter()
        tensors = reload_draft(self.llm, draft_dir)
        if self.reloaded_from is None:  # the draft it started with (the selection reloads several)
            self.reloaded_from = self.draft_dir
        self.draft_dir = str(draft_dir)
        return {"tensors": tensors, "seconds": time.perf_counter() - t}

    @property
    def llm(self):
        return self.engine.llm

    def close(self) -> None:
        """Release the engine (compat.vllm_engine.Engine.close); idempotent."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float, top_p: float = 1.0,
                  seed: int | None = None, ignore_eos: bool = True):
        """seed None: unseeded requests (as served); else request i of a sampled call gets seed + i."""
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, ignore_eos=ignore_eos,
                                 seed=None if temperature == 0 or seed is None else seed + i)
                  for i in range(len(prompts))]
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> list[list[int]]:
        """The generated token ids of each prompt (exactly max_tokens each: ignore_eos)."""
        return [list(o.outputs[0].token_ids) for o in self._generate(prompts, max_tokens=max_tokens,
                                                                      temperature=temperature, seed=seed)]

    def _counters(self) -> dict:
        from compat.vllm_engine import spec_decode_counters

        return spec_decode_counters(self.llm)

    def acceptance(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0,
                   top_p: float = 1.0, seed: int = 0, ignore_eos: bool = True,
                   output_token_ids: bool = False) -> dict:
        """Acceptance of this engine's draft on `prompts`. Also per draft position i (0-based)
        vLLM's count of accepted tokens (num_accepted_tokens_per_pos) and the fraction of drafts
        whose first i+1 tokens were all accepted, and from it `acceptance_length_prefix[j-1]` = 1 +
        the sum of the first j of those: the acceptance length the same drafts would give if they
        stopped after j tokens (a greedy draft's first j tokens do not depend on k; where a k=j
        engine starts its drafts does, so this estimates, and does not replace, a k=j measurement).
        output_token_ids: also every answer's tokens (benchmarks/train_serve.py replays them)."""
        if self.draft_dir is None:
            raise ValueError("acceptance needs an engine with a draft; this one serves the target alone")
        before = self._counters()
        t = time.perf_counter()
        outs = self._generate(prompts, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              ignore_eos=ignore_eos)
        gen_s = time.perf_counter() - t
        after = self._counters()
        drafts = after["num_drafts"] - before["num_drafts"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
                   for i, a in enumerate(after["accepted_per_pos"])]
        if drafts == 0:
            raise RuntimeError(
                f"[vLLM] no speculative drafts were counted for {len(prompts)} prompts: the draft at {self.draft_dir} "
                "was not used (check the engine log for the speculative config it resolved)")
        rates = [p / drafts for p in per_pos]
        return {
            "num_speculative_tokens": self.k,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed if temperature else None,
            "ignore_eos": ignore_eos,
            "acceptance_length": 1.0 + accepted / drafts,
            "num_drafts": drafts,
            "num_draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
            "num_accepted_tokens": accepted,
            "num_accepted_tokens_per_pos": per_pos,
            "acceptance_rate_per_pos": [round(r, 4) for r in rates],
            "acceptance_length_prefix": [round(1.0 + sum(rates[:j]), 4) for j in range(1, len(rates) + 1)],
            "num_prompts": len(prompts),
            "num_generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "generate_s": gen_s,
            "engine_start_s": self.startup_s, "dtype": self.dtype,
            "enforce_eager": self.enforce_eager,
            "first_output_token_ids": list(outs[0].outputs[0].token_ids[:16]),
        } | ({"output_token_ids": [list(o.outputs[0].token_ids) for o in outs]} if output_token_ids else {})

    def speed(self, prompts: list[list[int]], windows: tuple[SpeedWindow, ...] | list[SpeedWindow],
              samplings: tuple[DecodeSampling, ...] | list[DecodeSampling], *, rounds: range | list[int] | None = None,
              warmup: bool = True, only: list[tuple[int, str]] | None = None) -> list[dict]:
        """Output tokens/s (generated tokens over the window's wall seconds, its prompts' prefill
        included) of each window at each sampling, one entry per (window, sampling) with every
        round's seconds and tokens, and each wave's. Answers end at the target's EOS, as served;
        sampled requests carry no seed, as served requests do not. One untimed wave of each
        (window, sampling) first (first-call work: buffers, lazy kernels), then the rounds
        interleaved (round r of every window before round r+1 of any), so that a drift of the
        machine spreads over all of them. A draft engine also gives the acceptance length over its
        timed windows. rounds: which rounds to time (None: every window's repeats); warmup False: no
        untimed wave; only: the (batch_size, mode) pairs to time. Engines side by side take turns a
        round at a time (ray_jobs.evaluate); merge_speed joins the rounds."""
        if not prompts:
            raise ValueError("speed needs at least one prompt")
        runs = {}
        for w in windows:
            for s in samplings:
                if warmup:
                    self._generate(_cycle(prompts, w.batch_size), max_tokens=w.max_tokens, temperature=s.temperature,
                                   top_p=s.top_p, ignore_eos=False)  # warm-up, untimed
                runs[w, s] = {"batch_size": w.batch_size, "mode": s.mode, "temperature": s.temperature,
                              "top_p": s.top_p, "num_prompts": w.num_prompts, "max_tokens": w.max_tokens,
                              "seconds": [], "num_tokens": [], "wave_seconds": [], "wave_tokens": [],
                              "drafts": 0, "accepted": 0}
        for r in (range(max((w.repeats for w in windows), default=0)) if rounds is None else rounds):
            for (w, s), run in runs.items():
                if (only is None and r < w.repeats) or (only is not None and (w.batch_size, s.mode) in only):
                    self._time_window(w, s, prompts, run)
        return merge_speed([list(runs.values())])

    def _time_window(self, w: SpeedWindow, s: DecodeSampling, prompts: list[list[int]], run: dict) -> None:
        """Times window `w` once at sampling `s` into `run`: its seconds and tokens, each wave's, and
        for a draft engine its drafts and accepted tokens (the engine's counters)."""
        batch = _cycle(prompts, w.num_prompts)
        before = self._counters() if self.draft_dir else None
        t, seconds, tokens = time.perf_counter(), [], []
        for i in range(0, len(batch), w.batch_size):
            c = time.perf_counter()
            outs = self._generate(batch[i:i + w.batch_size], max_tokens=w.max_tokens, temperature=s.temperature,
                                  top_p=s.top_p, ignore_eos=False)
            seconds.append(time.perf_counter() - c)
            tokens.append(sum(len(o.outputs[0].token_ids) for o in outs))
        run["seconds"].append(time.perf_counter() - t)
        run["num_tokens"].append(sum(tokens))
        run["wave_seconds"].append(seconds)
        run["wave_tokens"].append(tokens)
        if before is not None:
            after = self._counters()
            run["drafts"] += after["num_drafts"] - before["num_drafts"]
            run["accepted"] += after["num_accepted_tokens"] - before["num_accepted_tokens"]


def merge_speed(parts: list[list[dict]]) -> list[dict]:
    """One engine's speed runs from several SpecDecodeEngine.speed calls (each a list of runs, one per
    (batch_size, mode) it timed; a later call may time fewer): each (batch_size, mode)'s seconds,
    tokens and waves in call order, its drafts and accepted tokens summed, then its tokens_per_s spread and
    acceptance length; in the order the pairs first appear."""
    by_key: dict[tuple[int, str], list[dict]] = {}
    for part in parts:
        for r in part:
            by_key.setdefault((r["batch_size"], r["mode"]), []).append(r)
    out = []
    for runs in by_key.values():
        run = {k: v for k, v in runs[0].items() if k not in ("tokens_per_s", "acceptance_length")}
        run["seconds"] = [x for r in runs for x in r["seconds"]]
        run["num_tokens"] = [x for r in runs for x in r["num_tokens"]]
        run["wave_seconds"] = [x for r in runs for x in r["wave_seconds"]]
        run["wave_tokens"] = [x for r in runs for x in r["wave_tokens"]]
        run["drafts"], run["accepted"] = sum(r["drafts"] for r in runs), sum(r["accepted"] for r in runs)
        run["tokens_per_s"] = spread([n / s for n, s in zip(run["num_tokens"], run["seconds"])]) if run["seconds"] else None
        run["acceptance_length"] = 1.0 + run["accepted"] / run["drafts"] if run["drafts"] else None
        out.append(run)
    return out


def measure(e: SpecDecodeEngine, *, prompts: list[list[int]], max_tokens: int, samplings: tuple[DecodeSampling, ...],
            windows: tuple[SpeedWindow, ...] = (), speed_prompts: list[list[int]] | None = None, seed: int = 0,
            ignore_eos: bool = False) -> dict:
    """The eval stage's measurements on a started engine: the acceptance of its draft (if any) at
    each sampling on `prompts`, then the tokens/s of `windows` (if any) at each sampling on
    `speed_prompts` (None: `prompts`). ignore_eos: of the acceptance runs (False: answers end at
    the target's EOS, as served; the timed windows always do). wall_s: the engine's start and these
    measurements."""
    t = time.perf_counter()
    res = {"num_speculative_tokens": e.k, "draft": e.draft_dir, "enforce_eager": e.enforce_eager,
           "engine_start_s": e.startup_s, "engine_started_at": e.started_at, "dtype": e.dtype,
           "in_process": e.in_process}
    if e.reloaded_from is not None:  # started from a provisional draft during training, then given this one
        res["started_with_draft"] = e.reloaded_from
    if e.draft_dir is not None:
        res["acceptance"] = {s.mode: e.acceptance(prompts, max_tokens=max_tokens, temperature=s.temperature,
                                                  top_p=s.top_p, seed=seed, ignore_eos=ignore_eos)
                             for s in samplings}
    if windows:
        res["speed"] = e.speed(prompts if speed_prompts is None else speed_prompts, windows, samplings)
    res["wall_s"] = e.startup_s + time.perf_counter() - t
    return res

"""What an EAGLE-3 draft is worth: acceptance length inside vLLM speculative decoding, decode
throughput with and without it, and the draft's own first-token accuracy on stored hidden states.

Owns:
- `SpecDecodeEngine`: one vLLM engine (the target, with a draft or without), and what is measured on
  it; `close()` or a `with` block releases the engine. `acceptance`: acceptance length = 1 +
  accepted draft tokens / verification steps (drafts), the mean number of tokens one target forward
  produces, greedy or sampled (a seed per request), each answer ending at the target's EOS as
  served, or with `ignore_eos` exactly `max_tokens` tokens past it; also vLLM's accepted tokens per
  draft position. Counters come from the engine's own
  Prometheus metrics (compat/vllm_engine.py), as differences before/after, so one engine serves
  several measurements. `speed`: output tokens/s over windows of held-out prompts (`SpeedWindow`:
  prompts decoded batch_size at a time, answers ending at EOS as served), a fixed number of rounds.
- The pure parts of a speedup: `speed_windows` (the windows the job times, derived from the
  platform), `spread`, `wave_speedup` (the ratio and its bootstrap interval over prompts),
  `eval_samplings` (greedy and the served sampling), `resolve_enforce_eager`, and `eval_report`
  (eval.json from the engines' results); `merge_speed` joins one engine's rounds timed in turns.
- `draft_accuracy`: the trainer's metric (speculators' full_acc_i: the draft's argmax equals the
  target's argmax at loss-masked positions, step i of the TTT unroll) for an exported draft on
  hidden-state shards: the training side of a train/serve comparison, through the exported files
  rather than the trainer's memory, so the export is part of what is compared.
Does not own: the engine settings (compat.vllm_engine.eagle3_engine_kwargs), placement (actors.
evaluator, ray_jobs.evaluate, benchmarks.quality_bench). Imports neither torch nor vllm at module level:
the driver builds eval.json with the pure parts.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Self

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeSampling:
    """How measured requests sample: mode 'greedy' (temperature 0) or 'sampled' (the sampling the
    target is served with)."""

    mode: str
    temperature: float
    top_p: float = 1.0


def eval_samplings(temperature: float, top_p: float) -> tuple[DecodeSampling, ...]:
    """Greedy, and `temperature`/`top_p` (the regeneration's resolved sampling: what the draft was
    trained on and the target is served with) unless that is greedy too."""
    greedy = DecodeSampling("greedy", 0.0, 1.0)
    if temperature == 0:
        return (greedy,)
    return greedy, DecodeSampling("sampled", float(temperature), float(top_p))


@dataclass(frozen=True)
class SpeedWindow:
    """One timed window: num_prompts held-out prompts in waves of batch_size requests, each answer
    ending where the target ends it (EOS, or max_tokens), as `vllm serve` answers; every engine
    times it `repeats` times, a number fixed before timing."""

    batch_size: int
    num_prompts: int
    max_tokens: int
    repeats: int

    def __post_init__(self):
        if min(self.batch_size, self.num_prompts, self.max_tokens, self.repeats) < 1 or self.num_prompts % self.batch_size:
            raise ValueError(f"{self}: every size must be >= 1 and num_prompts a multiple of batch_size")

    @property
    def num_waves(self) -> int:
        return self.num_prompts // self.batch_size


# The job's windows by platform. GPU: every held-out prompt at batch 1, at least two waves at larger
# batches, three rounds. CPU: a few short answers, so that the demo and the tests show the
# measurement without spending minutes on it.
GPU_WINDOWS = {"prompts_at_batch_1": None, "min_waves": 2, "max_tokens": None, "repeats": 3}
CPU_WINDOWS = {"prompts_at_batch_1": 4, "min_waves": 1, "max_tokens": 24, "repeats": 2}


def speed_windows(batch_sizes: tuple[int, ...], *, gpu: bool, num_prompts: int, max_tokens: int,
                  repeats: int | None = None) -> tuple[SpeedWindow, ...]:
    """The windows the eval times at each batch size over `num_prompts` held-out prompts, answers of
    at most max_tokens tokens (the CPU caps both); repeats None: the platform's."""
    p = GPU_WINDOWS if gpu else CPU_WINDOWS
    n1 = min(num_prompts, p["prompts_at_batch_1"] or num_prompts)
    tokens = min(max_tokens, p["max_tokens"] or max_tokens)
    return tuple(SpeedWindow(batch_size=b, num_prompts=n1 if b == 1 else b * max(p["min_waves"], num_prompts // b),
                             max_tokens=tokens, repeats=repeats or p["repeats"]) for b in batch_sizes)


def resolve_enforce_eager(setting: bool | str, *, gpu: bool) -> bool:
    """eval.enforce_eager and regenerate.enforce_eager: 'auto' is eager on the CPU (vLLM has no CUDA
    graphs there, and torch.compile's warm-up costs a minute) and CUDA graphs on a GPU, as `vllm
    serve` runs."""
    if setting == "auto":
        return not gpu
    return bool(setting)


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min and max of repeated measurements."""
    if not values:
        raise ValueError("spread of no values: time at least one window")
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"n": n, "mean": mean, "std": std, "min": min(values), "max": max(values)}


def ranges_apart(a: list[float], b: list[float]) -> bool:
    """Every value of one list above every value of the other: the difference between the two
    exceeds the spread of either (e.g. tokens/s of two drafts, each window timed several times)."""
    return min(a) > max(b) or min(b) > max(a)


def speedup(with_draft: list[float], without: list[float]) -> dict:
    """Tokens/s with a draft over tokens/s without, from repeated windows of each: `ratio` of the
    means; `ratio_min`/`ratio_max` the slowest and fastest pairing of one window with the draft and
    one without; `exceeds_spread`: every pairing is on the same side of 1."""
    w, wo = spread(with_draft), spread(without)
    return {"ratio": w["mean"] / wo["mean"], "ratio_min": w["min"] / wo["max"], "ratio_max": w["max"] / wo["min"],
            "exceeds_spread": ranges_apart(with_draft, without)}


BOOTSTRAP_RESAMPLES = 2000


def wave_speedup(with_waves: list[list[tuple[int, float]]], without_waves: list[list[tuple[int, float]]], *,
                 resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict:
    """The speedup of one window and its 95% interval over prompts. Each argument holds, for each
    round, each wave's (generated tokens, seconds), wave i being the same prompts on both engines.
    ratio: (tokens / seconds with the draft) / (without), all rounds pooled. ci95: the 2.5th and
    97.5th percentiles of that ratio over `resamples` bootstrap draws of the waves (with
    replacement, each wave's rounds kept together), so that it covers how the speedup varies from
    prompt to prompt, not only the timing jitter of the same prompts; None for a single wave."""
    import random

    def totals(waves: list[list[tuple[int, float]]], pick) -> tuple[float, float]:
        return (sum(rnd[i][0] for rnd in waves for i in pick), sum(rnd[i][1] for rnd in waves for i in pick))

    n = len(with_waves[0])
    if any(len(r) != n for r in with_waves + without_waves):
        raise ValueError("every round of both engines must time the same waves")

    def ratio(pick) -> float:
        (tw, sw), (two, swo) = totals(with_waves, pick), totals(without_waves, pick)
        return (tw / sw) / (two / swo)

    point = ratio(range(n))
    ci = None
    if n > 1:
        rng = random.Random(seed)
        draws = sorted(ratio([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
        ci = [draws[int(0.025 * (resamples - 1))], draws[int(0.975 * (resamples - 1))]]
    return {"ratio": point, "ci95": ci, "waves": n, "rounds": len(with_waves), "resamples": resamples if ci else 0,
            "ci95_excludes_one": bool(ci) and (ci[0] > 1 or ci[1] < 1)}


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
        self.reloaded_from, self.draft_dir = self.draft_dir, str(draft_dir)
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


SPEED_METHOD = ("each window decodes held-out prompts in waves of batch_size requests, every answer ending where the "
                "target ends it (EOS or max_tokens), as served; each engine (the draft's at num_speculative_tokens, "
                "the target alone) times it `repeats` rounds, a number fixed before timing. Engines side by side "
                "take turns, round r of every window on one engine and then the other, the order reversed every "
                "other round (interleaved: true); engines one at a time time all their rounds in turn "
                "(interleaved: false). tokens_per_s: generated tokens / wall seconds of a window, prefill included. "
                "speedup.ratio: (tokens / seconds with the draft) / (tokens / seconds without), every round and "
                "wave pooled; ci95: the 2.5th-97.5th percentiles of that ratio over bootstrap draws of the waves "
                "(batch 1: of the prompts), so it covers prompt-to-prompt variance; acceptance_length: vLLM's "
                "over the same timed windows")


def eval_report(engines: list[dict], *, samplings: tuple[DecodeSampling, ...], sampling_source: str,
                windows: tuple[SpeedWindow, ...], speed_k: int | None, num_prompts: int, max_tokens: int,
                ignore_eos: bool = False) -> dict:
    """eval.json from measure's results (one per engine: the draft's at each k, and the
    target alone's when speed is measured): acceptance per k and sampling, and the speedup of the
    draft at speed_k over the target alone for each window and sampling (wave_speedup)."""
    drafts = sorted((e for e in engines if e["draft"] is not None), key=lambda e: e["num_speculative_tokens"])
    report = {
        "samplings": {s.mode: {"temperature": s.temperature, "top_p": s.top_p} for s in samplings},
        "sampling_source": sampling_source,
        "num_prompts": num_prompts,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "acceptance": [{"num_speculative_tokens": e["num_speculative_tokens"], **e["acceptance"]} for e in drafts],
        "speed": None,
        "engines": [{k: e.get(k) for k in ("num_speculative_tokens", "enforce_eager", "engine_start_s", "dtype",
                                           "in_process", "wall_s", "before_engine_s", "actor_start_s", "process_start_s",
                                           "engines_at_once", "started_with_draft")}
                    | {"measured": [m for m in ("acceptance", "speed") if m in e]} for e in engines],
    }
    if windows:
        with_draft = next(e for e in drafts if e["num_speculative_tokens"] == speed_k)
        without = next(e for e in engines if e["draft"] is None)
        base = {(r["batch_size"], r["mode"]): r for r in without["speed"]}
        interleaved = bool(with_draft.get("speed_interleaved") and without.get("speed_interleaved"))
        results = []
        for r in with_draft["speed"]:
            b = base[r["batch_size"], r["mode"]]
            if len(r["wave_seconds"]) != len(b["wave_seconds"]) or r["num_prompts"] != b["num_prompts"]:
                raise RuntimeError(f"the engines timed different windows at batch {r['batch_size']} {r['mode']}: "
                                   f"{len(r['wave_seconds'])} rounds of {r['num_prompts']} prompts with the draft, "
                                   f"{len(b['wave_seconds'])} of {b['num_prompts']} without")
            sp = wave_speedup([list(zip(t, s)) for t, s in zip(r["wave_tokens"], r["wave_seconds"])],
                              [list(zip(t, s)) for t, s in zip(b["wave_tokens"], b["wave_seconds"])])
            if interleaved:
                paired = [(nw / sw) / (nb / sb) for nw, sw, nb, sb in zip(r["num_tokens"], r["seconds"],
                                                                           b["num_tokens"], b["seconds"])]
                sp["paired_rounds"] = spread(paired)
            side = ("tokens_per_s", "seconds", "num_tokens", "wave_seconds", "wave_tokens")
            results.append({k: r[k] for k in ("batch_size", "mode", "temperature", "top_p", "num_prompts",
                                              "max_tokens")}
                           | {"with_draft": {k: r[k] for k in side + ("acceptance_length",)},
                              "without_draft": {k: b[k] for k in side},
                              "speedup": sp})
        report["speed"] = {"num_speculative_tokens": speed_k, "enforce_eager": with_draft["enforce_eager"],
                           "interleaved": interleaved, "ignore_eos": False,
                           "windows": [asdict(w) for w in windows], "method": SPEED_METHOD, "results": results}
    return report


def draft_accuracy(draft_dir: str | Path, target_dir: str | Path, data_files, *, micro_batch_tokens: int = 4096,
                   ttt_steps: int = 3, loss: str = "kl_div", max_batches: int | None = None,
                   heldout_threshold: int = 0, heldout: bool = False, rounds_k: int | None = None) -> dict:
    """An exported draft's accuracy on hidden-state shards, one pass over every sample: full_acc_i
    (i = 0..ttt_steps-1) as the trainer computes it (speculators' compute_metrics, teacher-forced
    inputs), summed over batches: {"full_acc": [...], "num_positions": [...], "num_samples",
    "num_batches"}. The verifier's norm and lm_head, which the export leaves out, are read from
    `target_dir` (compat.speculators_verifier). heldout_threshold / heldout: only the rows outside
    (or, with `heldout`, inside) the held-out split (eagle3.prepare.heldout), as the trainer reads them.
    rounds_k: also the same predictions judged as vLLM judges them (eagle3.train.rounds): against the
    target's argmax over its whole vocabulary ("strict_full_acc"; "out_of_draft_vocab": the share of
    positions whose argmax the draft cannot propose), and counted in rounds of rounds_k tokens
    (walk_rounds over each answer: "rounds"), which on the target's own greedy text replays what
    vLLM counts."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    from compat.speculators_loss import loss_implementation
    from compat.speculators_verifier import draft_to_target_ids, full_lm_head, read_text_model_tensors
    from eagle3.train.data.packing import PackedBatches
    from eagle3.train.data.rows import HiddenStatesDataset
    from eagle3.train.data.staging import device_inputs
    from eagle3.train.rounds import strict_rounds

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = Eagle3SpeculatorConfig.from_pretrained(str(draft_dir))
    # flex attention (speculators' default) compiles; sdpa is the same attention without that
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001
    model = Eagle3DraftModel.from_pretrained(str(draft_dir), config=config)
    target_tensors = read_text_model_tensors(str(target_dir))
    _load_verifier_head(model, target_tensors, str(target_dir))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = model.to(device=device, dtype=dtype).eval()
    loss_config = resolve_loss_config(loss, loss_implementation())
    dataset = HiddenStatesDataset(data_files, seed=0, shuffle_buffer_size=1, heldout_threshold=heldout_threshold,
                                  heldout=heldout)
    batches = PackedBatches(dataset, micro_batch_tokens, dtype)
    correct = [0.0] * ttt_steps
    total = [0.0] * ttt_steps
    num_batches = num_samples = 0
    if rounds_k is not None:
        if not 1 <= rounds_k <= ttt_steps:
            raise ValueError(f"rounds_k={rounds_k}: must be 1..ttt_steps={ttt_steps}")
        full_head = full_lm_head(target_tensors).to(device=device, dtype=dtype)
        to_target = draft_to_target_ids(model)
        strict = {"correct": [0] * ttt_steps, "total": [0] * ttt_steps, "oov": 0, "rounds": 0,
                  "accepted": [0] * rounds_k}
    with torch.no_grad():
        while max_batches is None or num_batches < max_batches:
            rows = batches.take()
            if batches.epoch > 0:  # take() went on to the next epoch: every sample was seen
                break
            inputs = device_inputs(batches.pack(rows), device, dtype)
            draft_tokens, _, metrics = model(**inputs, ttt_steps=ttt_steps, ttt_step_loss_decay=1.0,
                                             loss_config=loss_config)
            if rounds_k is not None:
                strict_rounds(model, inputs, draft_tokens, full_head, to_target, rounds_k, strict)
            for i in range(ttt_steps):
                correct[i] += float(metrics[f"full_acc_{i}_sum"])
                total[i] += float(metrics[f"full_acc_{i}_total"])
            num_batches += 1
            num_samples += len(rows)
    if batches.num_truncated:
        raise ValueError(f"{batches.num_truncated} samples are longer than micro_batch_tokens={micro_batch_tokens}: "
                         "raise it so that every position is counted")
    out = {"full_acc": [c / t if t else None for c, t in zip(correct, total)], "num_positions": total,
           "num_samples": num_samples, "num_batches": num_batches}
    if rounds_k is not None:
        rates = [a / strict["rounds"] if strict["rounds"] else None for a in strict["accepted"]]
        out |= {"strict_full_acc": [c / t if t else None for c, t in zip(strict["correct"], strict["total"])],
                "out_of_draft_vocab": strict["oov"] / strict["total"][0] if strict["total"][0] else None,
                "rounds": {"k": rounds_k, "num_rounds": strict["rounds"], "num_accepted_tokens_per_pos":
                           strict["accepted"], "acceptance_rate_per_pos": rates,
                           "acceptance_length": 1.0 + sum(rates) if strict["rounds"] else None}}
    return out


def _load_verifier_head(model, want: dict, target_dir: str) -> None:
    """The target's final norm and lm_head (rows of the draft vocabulary; `want`: its tensors, as
    compat.speculators_verifier.read_text_model_tensors reads them from target_dir) into the draft's
    frozen verifier_norm / verifier_lm_head, which the exported draft does not hold; the draft's own
    (trained) lm_head and embed_tokens stay as exported."""
    import torch

    from compat.speculators_verifier import full_lm_head

    head = full_lm_head(want)
    if head is None or "model.norm.weight" not in want:
        raise ValueError(f"{target_dir}: no lm_head / final norm tensors found; pass the draft's target directory")
    if getattr(model, "use_draft_vocab", False):
        head = head[model.t2d.to(torch.bool)]
    with torch.no_grad():
        for param, tensor in ((model.verifier_lm_head.weight, head), (model.verifier_norm.weight,
                                                                        want["model.norm.weight"])):
            if param.shape != tensor.shape:
                raise ValueError(f"{target_dir}: the target's tensor has shape {tuple(tensor.shape)}, the draft's "
                                 f"verifier head expects {tuple(param.shape)}: not this draft's target")
            param.copy_(tensor.to(param.dtype))

"""eval.json from the engines' results: acceptance per k and sampling, the speedup of the draft
over the target alone per window and sampling, with how it was timed (SPEED_METHOD), and the
verdict: the k to serve per batch size and where to serve without the draft (verdict.py).
"""

from __future__ import annotations

from dataclasses import asdict

from eagle3.evaluate.stats import spread, wave_speedup
from eagle3.evaluate.verdict import eval_verdict
from eagle3.evaluate.windows import DecodeSampling, SpeedWindow


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
                ignore_eos: bool = False, speed_ks: tuple[int, ...] | list[int] | None = None) -> dict:
    """eval.json from measure's results (one per engine: the draft's at each k, and the
    target alone's when speed is measured): acceptance per k and sampling, and the speedup of the
    draft at each timed k over the target alone for each window and sampling (wave_speedup).
    speed_ks: the timed k (None: [speed_k]); `speed` is the first's, as before several were timed,
    `speed_by_k` every one's (keyed by k as a string), and `verdict` the k to serve per batch size
    (eagle3.evaluate.verdict)."""
    drafts = sorted((e for e in engines if e["draft"] is not None), key=lambda e: e["num_speculative_tokens"])
    report = {
        "samplings": {s.mode: {"temperature": s.temperature, "top_p": s.top_p} for s in samplings},
        "sampling_source": sampling_source,
        "num_prompts": num_prompts,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "acceptance": [{"num_speculative_tokens": e["num_speculative_tokens"], **e["acceptance"]} for e in drafts],
        "speed": None,
        "speed_by_k": None,
        "verdict": None,
        "engines": [{k: e.get(k) for k in ("num_speculative_tokens", "enforce_eager", "engine_start_s", "dtype",
                                           "in_process", "wall_s", "before_engine_s", "actor_start_s", "process_start_s",
                                           "engines_at_once", "started_with_draft")}
                    | {"measured": [m for m in ("acceptance", "speed") if m in e]} for e in engines],
    }
    if windows:
        timed = list(speed_ks) if speed_ks else [speed_k]
        if speed_ks and speed_k is not None and speed_k != timed[0]:
            raise ValueError(f"speed_k={speed_k} must be the first of speed_ks={timed} (eval.json's `speed`)")
        without = next(e for e in engines if e["draft"] is None)
        blocks = {k: _speed_block(next(e for e in drafts if e["num_speculative_tokens"] == k), without, windows)
                  for k in timed}
        report["speed"] = blocks[timed[0]]
        report["speed_by_k"] = {str(k): b for k, b in blocks.items()}
        report["verdict"] = eval_verdict(report)
    return report


def _speed_block(with_draft: dict, without: dict, windows: tuple[SpeedWindow, ...]) -> dict:
    """eval.json's speed record of one timed draft engine against the target alone: per window and
    sampling both sides' timings and the speedup with its interval over prompts (wave_speedup)."""
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
    return {"num_speculative_tokens": with_draft["num_speculative_tokens"], "enforce_eager": with_draft["enforce_eager"],
            "interleaved": interleaved, "ignore_eos": False,
            "windows": [asdict(w) for w in windows], "method": SPEED_METHOD, "results": results}

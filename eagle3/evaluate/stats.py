"""The statistics of a speedup: the spread of repeated windows, whether two ranges are apart, and
the speedup's ratio with its bootstrap interval over prompts. Pure, so eval.json is built on the driver.
"""

from __future__ import annotations

import math


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

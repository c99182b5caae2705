"""The pure parts of the eval stage's speedup (eagle3.evaluate): windows, spread, ratio, the
samplings measured, eval.json's assembly and the job summary's lines; and eval's config. The
engines themselves are covered by tests/test_e2e.py (the job) and tests/test_quality.py."""

from __future__ import annotations

import pytest

from eagle3.config import load_job_config
from eagle3.evaluate import (DecodeSampling, SpeedWindow, eval_report, eval_samplings, ranges_apart,
                             resolve_enforce_eager, speed_windows, speedup, spread)


def test_spread_of_repeated_windows():
    s = spread([90.0, 100.0, 110.0])
    assert s == {"n": 3, "mean": 100.0, "std": 10.0, "min": 90.0, "max": 110.0}
    assert spread([5.0])["std"] == 0.0
    with pytest.raises(ValueError, match="no values"):
        spread([])


def test_speedup_is_with_over_without_and_says_whether_it_exceeds_the_spread():
    apart = speedup([150.0, 160.0, 155.0], [100.0, 104.0, 96.0])
    assert apart["ratio"] == pytest.approx(155.0 / 100.0)
    assert apart["ratio_min"] == pytest.approx(150.0 / 104.0) and apart["ratio_max"] == pytest.approx(160.0 / 96.0)
    assert apart["exceeds_spread"] is True
    # slower with the draft in every pairing: also outside the spread
    assert speedup([80.0, 82.0], [100.0, 99.0])["exceeds_spread"] is True
    # the ranges overlap: a 3% difference inside a 10% spread
    close = speedup([103.0, 98.0, 108.0], [100.0, 95.0, 105.0])
    assert close["ratio"] == pytest.approx(103.0 / 100.0) and close["exceeds_spread"] is False
    assert close["ratio_min"] < 1 < close["ratio_max"]
    assert ranges_apart([1.0, 2.0], [2.5, 3.0]) and not ranges_apart([1.0, 2.6], [2.5, 3.0])


def test_windows_are_longer_on_a_gpu_and_whole_waves():
    cpu, gpu = speed_windows((1, 16), gpu=False), speed_windows((1, 16), gpu=True)
    for windows in (cpu, gpu):
        assert [w.batch_size for w in windows] == [1, 16]
        assert all(w.num_prompts % w.batch_size == 0 and w.repeats >= 3 for w in windows)
    assert all(g.num_tokens > c.num_tokens and g.repeats >= c.repeats for g, c in zip(gpu, cpu))
    assert speed_windows((), gpu=True) == ()
    with pytest.raises(ValueError, match="num_prompts a multiple of batch_size"):
        SpeedWindow(batch_size=16, num_prompts=20, max_tokens=8, repeats=3)


def test_samplings_are_greedy_and_the_served_one():
    assert eval_samplings(0.7, 0.9) == (DecodeSampling("greedy", 0.0, 1.0), DecodeSampling("sampled", 0.7, 0.9))
    assert eval_samplings(0.0, 0.9) == (DecodeSampling("greedy", 0.0, 1.0),)  # greedy regeneration: once


def test_enforce_eager_auto_is_graphs_on_gpu_only():
    assert resolve_enforce_eager("auto", gpu=True) is False and resolve_enforce_eager("auto", gpu=False) is True
    assert resolve_enforce_eager(True, gpu=True) is True and resolve_enforce_eager(False, gpu=False) is False


def test_speed_k_is_derived_and_checked():
    assert load_job_config(None).eval.resolved_speed_k == 3  # defaults: k in (1, 3)
    assert load_job_config(None, {"eval.num_speculative_tokens": [1, 2]}).eval.resolved_speed_k == 2
    assert load_job_config(None, {"eval.num_speculative_tokens": [1, 2], "eval.speed_k": 1}).eval.resolved_speed_k == 1
    assert load_job_config(None, {"eval.speed_batch_sizes": []}).eval.resolved_speed_k is None


def _run(batch, mode, rates, tokens, al=None):
    return {"batch_size": batch, "mode": mode, "temperature": 0.0 if mode == "greedy" else 0.7,
            "top_p": 1.0 if mode == "greedy" else 0.9, "num_tokens": [tokens] * len(rates),
            "seconds": [tokens / r for r in rates], "tokens_per_s": spread(rates), "acceptance_length": al}


def _acc(al, k):
    return {"acceptance_length": al, "num_accepted_tokens_per_pos": [10] * k, "acceptance_rate_per_pos": [0.5] * k}


def test_eval_report_pairs_each_window_with_the_baseline():
    samplings = eval_samplings(0.7, 0.9)
    windows = speed_windows((1, 16), gpu=False)
    t1, t16 = windows[0].num_tokens, windows[1].num_tokens
    engines = [
        {"num_speculative_tokens": 1, "draft": "d", "enforce_eager": True, "engine_start_s": 20.0, "wall_s": 30.0,
         "acceptance": {"greedy": _acc(1.6, 1), "sampled": _acc(1.3, 1)}},
        {"num_speculative_tokens": 3, "draft": "d", "enforce_eager": False, "engine_start_s": 40.0, "wall_s": 90.0,
         "acceptance": {"greedy": _acc(2.2, 3), "sampled": _acc(1.6, 3)},
         "speed": [_run(1, "greedy", [150.0, 152.0, 149.0], t1, 2.3), _run(1, "sampled", [110.0, 100.0, 105.0], t1, 1.6),
                   _run(16, "greedy", [1200.0, 1210.0, 1190.0], t16, 2.2),
                   _run(16, "sampled", [900.0, 905.0, 910.0], t16, 1.5)]},
        {"num_speculative_tokens": 0, "draft": None, "enforce_eager": False, "engine_start_s": 30.0, "wall_s": 60.0,
         "speed": [_run(1, "greedy", [100.0, 101.0, 99.0], t1), _run(1, "sampled", [100.0, 103.0, 97.0], t1),
                   _run(16, "greedy", [1000.0, 1001.0, 999.0], t16), _run(16, "sampled", [1000.0, 990.0, 1010.0], t16)]},
    ]
    ev = eval_report(engines, samplings=samplings, sampling_source="test", windows=windows, speed_k=3,
                     num_prompts=8, max_tokens=48)
    assert [a["num_speculative_tokens"] for a in ev["acceptance"]] == [1, 3]
    assert ev["acceptance"][1]["sampled"]["acceptance_length"] == 1.6
    assert ev["samplings"] == {"greedy": {"temperature": 0.0, "top_p": 1.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}
    sp = ev["speed"]
    assert sp["num_speculative_tokens"] == 3 and sp["enforce_eager"] is False
    assert [w["num_tokens"] for w in sp["windows"]] == [t1, t16]
    by = {(r["batch_size"], r["mode"]): r for r in sp["results"]}
    assert by[1, "greedy"]["speedup"]["ratio"] == pytest.approx(150.333333 / 100.0)
    assert by[1, "greedy"]["speedup"]["exceeds_spread"] is True
    assert by[1, "sampled"]["speedup"]["exceeds_spread"] is False  # 1.05x inside +-5% windows
    assert by[16, "greedy"]["with_draft"]["acceptance_length"] == 2.2
    assert [e["measured"] for e in ev["engines"]] == [["acceptance"], ["acceptance", "speed"], ["speed"]]
    # The summary the job prints from it.
    from ray_jobs.run import _eval_summary

    lines = _eval_summary(ev)
    assert lines[0].endswith("(greedy / T=0.7 top_p=0.9; answers ending at EOS): k=1: 1.60 / 1.30, k=3: 2.20 / 1.60")
    assert "draft at k=3 over the target alone (CUDA graphs" in lines[1]
    assert any("batch   1 greedy" in x and "1.50x (100 -> 150 tokens/s" in x and "within" not in x
               and "AL 2.30;" in x and "tokens past EOS)" in x for x in lines)
    assert any("batch   1 T=0.7 top_p=0.9" in x and "within the spread" in x for x in lines)
    # Engines that timed different windows cannot be compared.
    engines[2]["speed"][0] = _run(1, "greedy", [100.0], t1 + 1)
    with pytest.raises(RuntimeError, match="different windows"):
        eval_report(engines, samplings=samplings, sampling_source="test", windows=windows, speed_k=3,
                    num_prompts=8, max_tokens=48)


def test_rounds_timed_in_turns_merge_and_pair_each_round_with_the_baselines():
    """Engines side by side time the windows in turns (ray_jobs.run._interleaved_speed): one
    SpecDecodeEngine.speed call per round, merged per engine; the report then pairs round r with
    the draft with round r without it. A drift that slows both engines' round 2 alike leaves the
    paired ratios tight while the unpaired range crosses 1."""
    from eagle3.evaluate import merge_speed

    def part(rate, tokens, drafts, accepted):
        return [{"batch_size": 1, "mode": "greedy", "temperature": 0.0, "top_p": 1.0, "num_prompts": 2,
                 "max_tokens": 24, "seconds": [tokens / rate], "num_tokens": [tokens], "drafts": drafts,
                 "accepted": accepted}]

    t1 = speed_windows((1,), gpu=False)[0].num_tokens
    with_draft = merge_speed([part(r, t1, 10, 12) for r in (130.0, 132.0, 80.0)])
    without = merge_speed([part(r, t1, 0, 0) for r in (100.0, 101.0, 61.0)])  # round 2: the machine slowed
    [w] = with_draft
    assert w["num_tokens"] == [t1] * 3 and w["tokens_per_s"]["mean"] == pytest.approx((130 + 132 + 80) / 3)
    assert w["acceptance_length"] == pytest.approx(1 + 36 / 30) and without[0]["acceptance_length"] is None
    engines = [{"num_speculative_tokens": 3, "draft": "d", "enforce_eager": False, "engine_start_s": 1.0, "wall_s": 2.0,
                "acceptance": {"greedy": _acc(2.2, 3)}, "speed": with_draft, "speed_interleaved": True},
               {"num_speculative_tokens": 0, "draft": None, "enforce_eager": False, "engine_start_s": 1.0,
                "wall_s": 2.0, "speed": without, "speed_interleaved": True}]
    ev = eval_report(engines, samplings=eval_samplings(0.0, 1.0), sampling_source="test",
                     windows=speed_windows((1,), gpu=False), speed_k=3, num_prompts=2, max_tokens=24)
    [r] = ev["speed"]["results"]
    sp = r["speedup"]
    assert ev["speed"]["interleaved"] is True and sp["exceeds_spread"] is False  # 80/101 < 1 < 132/61
    assert sp["paired"]["min"] == pytest.approx(1.3) and sp["paired"]["max"] == pytest.approx(80 / 61)
    assert sp["paired_exceeds_one"] is True
    from ray_jobs.run import _eval_summary

    lines = _eval_summary(ev)
    assert "the engines taking turns" in lines[1]
    assert any("within the spread; rounds paired 1.30-1.31x" in x for x in lines)
    # Engines measured one after the other have no pairs.
    for e in engines:
        e.pop("speed_interleaved")
    ev = eval_report(engines, samplings=eval_samplings(0.0, 1.0), sampling_source="test",
                     windows=speed_windows((1,), gpu=False), speed_k=3, num_prompts=2, max_tokens=24)
    assert ev["speed"]["interleaved"] is False and "paired" not in ev["speed"]["results"][0]["speedup"]


def test_eval_report_without_speed_has_no_baseline():
    engines = [{"num_speculative_tokens": 1, "draft": "d", "enforce_eager": True, "engine_start_s": 20.0,
                "wall_s": 30.0, "acceptance": {"greedy": _acc(1.6, 1)}}]
    ev = eval_report(engines, samplings=eval_samplings(0.0, 1.0), sampling_source="test", windows=(), speed_k=None,
                     num_prompts=8, max_tokens=48)
    assert ev["speed"] is None and list(ev["samplings"]) == ["greedy"]
    from ray_jobs.run import _eval_summary

    assert _eval_summary(ev) == ["  eval.json        acceptance length in vLLM (greedy; answers ending at EOS): k=1: 1.60"]
    ev = eval_report(engines, samplings=eval_samplings(0.0, 1.0), sampling_source="test", windows=(), speed_k=None,
                     num_prompts=8, max_tokens=48, ignore_eos=True)
    assert ev["ignore_eos"] is True and "(greedy; past EOS)" in _eval_summary(ev)[0]

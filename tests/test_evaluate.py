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
    # eval.speed_window_tokens: the tokens a prompt decodes in every window, whatever the platform
    assert [w.max_tokens for w in speed_windows((1, 16), gpu=True, max_tokens=8)] == [8, 8]
    assert [(w.num_prompts, w.repeats) for w in speed_windows((1, 16), gpu=True, max_tokens=8)] == \
        [(w.num_prompts, w.repeats) for w in gpu]
    from eagle3.config import load_job_config

    assert load_job_config(None, {"eval.speed_window_tokens": 8}).eval.speed_window_tokens == 8
    with pytest.raises(ValueError, match=r"eval.speed_window_tokens=0: must be >= 1 tokens, or null"):
        load_job_config(None, {"eval.speed_window_tokens": 0})
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
    """Engines side by side time the windows in turns (ray_jobs.evaluate._interleaved_speed): one
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


def test_ci95_is_students_t_and_imprecise_names_what_to_time_again():
    """The session 25 job's batch-1 greedy rounds (paired ratios): 1.45x with a 95% interval of
    1.23-1.68 (t = 2.776 at 4 degrees of freedom), far from +-5%; a tight series is precise."""
    from eagle3.evaluate import ci95, imprecise

    rounds = [1.1411, 1.5, 1.5873, 1.55, 1.48]
    lo, hi = ci95(rounds)
    s = spread(rounds)
    assert (hi - lo) / 2 == pytest.approx(2.776 * s["std"] / 5 ** 0.5)
    assert lo == pytest.approx(1.23, abs=0.005) and hi == pytest.approx(1.673, abs=0.005)
    assert ci95([1.2]) is None
    # 31 or more values: the normal's 1.96
    many = [1.0, 1.1] * 20
    assert (ci95(many)[1] - ci95(many)[0]) / 2 == pytest.approx(1.96 * spread(many)["std"] / 40 ** 0.5)
    samples = {(1, "greedy"): rounds, (16, "greedy"): [1.10, 1.11, 1.09, 1.10, 1.105], (1, "sampled"): [1.2]}
    assert imprecise(samples, 0.05) == [(1, "greedy"), (1, "sampled")]  # one value: not known at all
    assert imprecise(samples, 0.5) == [(1, "sampled")]


def test_rounds_beyond_the_repeats_only_where_they_can_reach_the_precision():
    """reachable: of the imprecise speedups, those whose interval could reach +-precision in the
    rounds left, at their spread so far (1.96 sd / (precision x mean), squared, rounds in all).
    Session 32's SmolLM2 eval timed 8 more rounds of every window for its 120 s and none got
    there: at that spread, +-5% needs ~20 rounds."""
    from eagle3.evaluate import reachable, rounds_to_precision

    noisy = [1.06, 1.34, 1.21, 1.03, 1.38]  # batch 1 greedy, +-15% after 5 rounds
    quiet = [1.12, 1.30, 1.22, 1.27, 1.14]  # +-8%: imprecise at 5 rounds, ~9 would do
    need = (1.96 * spread(noisy)["std"] / (0.05 * spread(noisy)["mean"])) ** 2
    assert rounds_to_precision(noisy, 0.05) == pytest.approx(need) and 20 < need < 40
    assert 5 < rounds_to_precision(quiet, 0.05) < 13 and rounds_to_precision([1.2], 0.05) == float("inf")
    assert rounds_to_precision([1.2, 1.2], 0.05) == 2
    samples = {"noisy": noisy, "quiet": quiet, "one": [1.2]}
    assert reachable(samples, 0.05, rounds_left=8) == ["quiet"]  # the noisy one would need ~25 more
    assert reachable(samples, 0.05, rounds_left=need) == ["noisy", "quiet"]
    # at +-50% the others are precise already; a single value gives no spread to project from
    assert reachable(samples, 0.5, rounds_left=8) == []


class _ScriptedSpeedActor:
    """An eval actor's `speed` (the calls ray_jobs.evaluate._interleaved_speed makes) on a clock the test
    owns: each window it times takes 1 s and runs at 100 x ratios[key][round] tokens/s (the target
    alone's: ratios None, 100). Stands in for no engine and no Ray: it tests which rounds are run."""

    def __init__(self, ratios, clock):
        from types import SimpleNamespace

        self.ratios, self.clock = ratios, clock
        self.speed = SimpleNamespace(remote=self._speed)

    def _speed(self, prompts, windows, samplings, *, rounds, warmup, only=None):
        out = []
        for w in windows:
            for smp in samplings:
                key = (w.batch_size, smp.mode)
                if warmup or (only is not None and key not in only):
                    continue
                self.clock[0] += 1.0
                rate = 100.0 * (self.ratios[key][rounds[0]] if self.ratios else 1.0)
                out.append({"batch_size": w.batch_size, "mode": smp.mode, "temperature": smp.temperature,
                            "top_p": smp.top_p, "num_prompts": w.num_prompts, "max_tokens": w.max_tokens,
                            "seconds": [w.num_tokens / rate], "num_tokens": [w.num_tokens], "drafts": 0,
                            "accepted": 0})
        return out


def test_interleaved_rounds_go_on_only_for_speedups_that_can_reach_the_precision(monkeypatch):
    """ray_jobs.evaluate._interleaved_speed after its 5 paired repeats: batch 1's ratios spread +-20%
    (+-5% would need ~55 rounds, the 30 s left hold ~7), so it gets none; batch 16's (+-7% after 5,
    ~4 needed) gets rounds until its interval is within +-5%, and then no more."""
    from types import SimpleNamespace

    import ray_jobs.evaluate as stage
    from eagle3.evaluate import imprecise

    clock = [0.0]
    monkeypatch.setattr(stage.time, "perf_counter", lambda: clock[0])
    noisy = [1.0, 1.5, 1.1, 1.45, 1.05] + [1.0, 1.5] * 20
    steady = [1.08, 1.22, 1.12, 1.20, 1.10] + [1.15] * 40
    draft = _ScriptedSpeedActor({(1, "greedy"): noisy, (16, "greedy"): steady}, clock)
    alone = _ScriptedSpeedActor(None, clock)
    windows = (SpeedWindow(batch_size=1, num_prompts=4, max_tokens=8, repeats=5),
               SpeedWindow(batch_size=16, num_prompts=32, max_tokens=8, repeats=5))
    results = [{"draft": "d", "wall_s": 0.0}, {"draft": None, "wall_s": 0.0}]
    stage._interleaved_speed(SimpleNamespace(get=lambda x: x), [draft, alone], results, [[1, 2]], windows,
                           (DecodeSampling("greedy", 0.0),), precision=0.05, max_s=30.0)
    runs = {r["batch_size"]: r for r in results[0]["speed"]}
    assert len(runs[1]["seconds"]) == 5 and 5 < len(runs[16]["seconds"]) < 12
    ratios = [100.0 * x for x in steady[:len(runs[16]["seconds"])]]
    assert imprecise({"b16": [r / 100.0 for r in ratios]}, 0.05) == []  # it stopped once precise
    assert imprecise({"b16": [r / 100.0 for r in ratios[:-1]]}, 0.05) == ["b16"]  # ... and not before
    beyond = results[0]["speed_beyond_repeats"]
    assert beyond["rounds"] == len(runs[16]["seconds"]) - 5 and beyond["window_pair_s"] == 2.0
    assert [u.split(":")[0] for u in beyond["unreachable"]] == ["batch 1 greedy"]
    assert [len(r["seconds"]) for r in results[1]["speed"]] == [5, len(runs[16]["seconds"])]


def test_speedup_interval_paired_and_unpaired():
    from eagle3.evaluate import speedup_interval

    w, wo = [150.0, 160.0, 155.0, 152.0], [100.0, 104.0, 101.0, 99.0]
    paired = speedup_interval(w, wo, paired=True, precision=0.05)
    ratios = [x / y for x, y in zip(w, wo)]
    assert paired["rounds"] == 4 and paired["ci95"][0] < sum(ratios) / 4 < paired["ci95"][1]
    assert paired["precise"] is True  # +-2.5% or so
    assert speedup_interval(w, wo, paired=True, precision=0.01)["precise"] is False
    assert speedup_interval(w, wo, paired=True, precision=0.0)["precise"] is False  # nothing asked
    # unpaired: around the ratio of the means, the two relative half-widths in quadrature
    un = speedup_interval(w, wo, paired=False, precision=0.05)
    r = spread(w)["mean"] / spread(wo)["mean"]
    assert un["ci95"][0] < r < un["ci95"][1] and un["ci95"][1] - r == pytest.approx(r - un["ci95"][0])
    assert speedup_interval([150.0], [100.0], paired=False, precision=0.05) == {"ci95": None, "rounds": 1,
                                                                                 "precise": False}


def test_merge_keeps_each_window_when_later_rounds_time_fewer():
    """Rounds beyond the repeats time only the windows still short of the precision: merge_speed
    joins runs by (batch_size, mode), not by position."""
    from eagle3.evaluate import merge_speed

    def run(batch, mode, seconds):
        return {"batch_size": batch, "mode": mode, "temperature": 0.0, "top_p": 1.0, "num_prompts": batch,
                "max_tokens": 8, "seconds": [seconds], "num_tokens": [8 * batch], "drafts": 1, "accepted": 1}

    base = [run(1, "greedy", 1.0), run(16, "greedy", 2.0)]
    merged = merge_speed([base, base, [run(16, "greedy", 4.0)], [run(16, "greedy", 2.0)]])
    assert [(m["batch_size"], len(m["seconds"])) for m in merged] == [(1, 2), (16, 4)]
    assert merged[1]["seconds"] == [2.0, 2.0, 4.0, 2.0] and merged[1]["drafts"] == 4


def test_eval_report_and_summary_give_the_interval_and_whether_it_is_within_the_precision():
    from eagle3.evaluate import merge_speed
    from ray_jobs.run import _eval_summary

    def part(rate):
        return [{"batch_size": 1, "mode": "greedy", "temperature": 0.0, "top_p": 1.0, "num_prompts": 2,
                 "max_tokens": 24, "seconds": [48 / rate], "num_tokens": [48], "drafts": 4, "accepted": 4}]

    def report(with_rates, without_rates, precision):
        engines = [{"num_speculative_tokens": 3, "draft": "d", "enforce_eager": False, "engine_start_s": 1.0,
                    "wall_s": 2.0, "acceptance": {"greedy": _acc(2.2, 3)}, "speed_interleaved": True,
                    "speed": merge_speed([part(r) for r in with_rates])},
                   {"num_speculative_tokens": 0, "draft": None, "enforce_eager": False, "engine_start_s": 1.0,
                    "wall_s": 2.0, "speed_interleaved": True, "speed": merge_speed([part(r) for r in without_rates])}]
        return eval_report(engines, samplings=eval_samplings(0.0, 1.0), sampling_source="test",
                           windows=speed_windows((1,), gpu=False), speed_k=3, num_prompts=2, max_tokens=24,
                           precision=precision)

    wide = report([130.0, 160.0, 110.0], [100.0, 100.0, 100.0], 0.05)
    sp = wide["speed"]["results"][0]["speedup"]
    assert wide["speed"]["precision"] == 0.05 and sp["rounds"] == 3 and sp["precise"] is False
    assert sp["ci95"][0] < 1.0 < 1.3 < sp["ci95"][1]
    assert any("95% interval" in x and "over 3 rounds, wider than +-5%" in x for x in _eval_summary(wide))
    tight = report([130.0, 131.0, 130.0, 129.5], [100.0, 100.5, 100.0, 99.5], 0.05)
    assert tight["speed"]["results"][0]["speedup"]["precise"] is True
    assert not any("wider than" in x for x in _eval_summary(tight))


def test_speed_precision_config():
    from eagle3.config import EvalConfig

    assert EvalConfig().speed_precision == 0.05
    assert EvalConfig().resolved_speed_max_s(gpu=True) == 120.0 and EvalConfig().resolved_speed_max_s(gpu=False) == 0.0
    assert EvalConfig(speed_max_s=30).resolved_speed_max_s(gpu=False) == 30
    with pytest.raises(ValueError, match="speed_precision"):
        EvalConfig(speed_precision=1.5)
    with pytest.raises(ValueError, match="speed_max_s"):
        EvalConfig(speed_max_s=-1.0)


class _ClockedEngine:
    """SpecDecodeEngine's timing loop (speed, _time_window, _rounds_beyond_repeats) on a clock the test owns: each _generate
    call advances it by the next of `durations` (cycled). Stands in for no engine: it tests our
    rounds and when they stop, not vLLM (the slow tier's jobs time real engines)."""

    def __init__(self, durations, monkeypatch):
        import eagle3.evaluate as ev

        self.durations, self.calls, self.now, self.draft_dir = durations, 0, 0.0, None
        monkeypatch.setattr(ev.time, "perf_counter", lambda: self.now)
        self.speed = ev.SpecDecodeEngine.speed.__get__(self)
        self._time_window = ev.SpecDecodeEngine._time_window.__get__(self)
        self._rounds_beyond_repeats = ev.SpecDecodeEngine._rounds_beyond_repeats.__get__(self)

    def _generate(self, prompts, *, max_tokens, temperature, top_p=1.0):
        from types import SimpleNamespace

        self.now += self.durations[self.calls % len(self.durations)]
        self.calls += 1
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * max_tokens)]) for _ in prompts]


def test_speed_keeps_each_generate_call_of_a_window(monkeypatch):
    """call_seconds: per timed window, the seconds of each of its generate calls (batch_size prompts
    each), in order, summing to the window's seconds, and kept in order when rounds are merged: what
    tells a window slow throughout from one slow call (session 26's 1.5B windows)."""
    from eagle3.evaluate import merge_speed

    window = SpeedWindow(batch_size=1, num_prompts=3, max_tokens=8, repeats=2)
    greedy = (DecodeSampling("greedy", 0.0),)
    # the untimed warm-up is the first call; then window 1 = 1 + 2 + 1 s, window 2 = 1 + 5 + 1 s
    e = _ClockedEngine([9.0, 1.0, 2.0, 1.0, 1.0, 5.0, 1.0], monkeypatch)
    [run] = e.speed([[1, 2]], [window], greedy)
    assert run["call_seconds"] == [[1.0, 2.0, 1.0], [1.0, 5.0, 1.0]]
    assert run["seconds"] == [sum(c) for c in run["call_seconds"]]
    e2 = _ClockedEngine([3.0], monkeypatch)
    [later] = e2.speed([[1, 2]], [window], greedy, rounds=[2], warmup=False, only=[(1, "greedy")])
    [merged] = merge_speed([[run], [later]])
    assert merged["call_seconds"] == [[1.0, 2.0, 1.0], [1.0, 5.0, 1.0], [3.0, 3.0, 3.0]]
    # ... and reach eval.json, beside each window's seconds (session 28's lease found them dropped there)
    base = e2.speed([[1, 2]], [window], greedy, rounds=[0, 1, 2], warmup=False, only=[(1, "greedy")])
    engines = [{"num_speculative_tokens": 3, "draft": "d", "enforce_eager": True, "acceptance": {"greedy": _acc(2.0, 3)},
                "speed": [merged]},
               {"num_speculative_tokens": 0, "draft": None, "enforce_eager": True, "speed": merge_speed([base])}]
    [res] = eval_report(engines, samplings=greedy, sampling_source="test", windows=(window,), speed_k=3,
                        num_prompts=1, max_tokens=8)["speed"]["results"]
    assert res["with_draft"]["call_seconds"] == merged["call_seconds"]
    assert res["without_draft"]["call_seconds"] == [[3.0, 3.0, 3.0]] * 3


def test_speed_times_more_rounds_until_precise_or_out_of_time(monkeypatch):
    window = SpeedWindow(batch_size=1, num_prompts=1, max_tokens=8, repeats=3)
    greedy = (DecodeSampling("greedy", 0.0),)
    # Noisy first rounds (1, 2, 1 s), then steady (1.5 s each): more rounds until the 95% interval
    # of the tokens/s is within 5% / sqrt(2) of its mean; the untimed warm-up is the first call.
    steady = [1.0, 1.0, 2.0, 1.0] + [1.5] * 200
    e = _ClockedEngine(steady, monkeypatch)
    [run] = e.speed([[1, 2]], [window], greedy, precision=0.05, max_s=1000.0)
    n = len(run["seconds"])
    assert run["seconds"][:3] == [1.0, 2.0, 1.0] and 3 < n < 200
    from eagle3.evaluate import imprecise

    rates = [8 / s for s in run["seconds"]]
    assert imprecise({"w": rates}, 0.05 / 2 ** 0.5) == [] and imprecise({"w": rates[:-1]}, 0.05 / 2 ** 0.5) == ["w"]
    assert run["beyond_repeats"] == {"rounds": n - 3, "given_up": None}
    # With 10 s to spend (~7 rounds of ~1.3 s), the spread of the first three rounds (8, 4, 8 tokens/s: std
    # 0.346 of the mean) needs (1.96 x 0.346 / (0.05 / sqrt 2))^2 = 369: no round is timed beyond the
    # repeats, and the run says why (the rule of the engines taking turns, reachable).
    e = _ClockedEngine(steady, monkeypatch)
    [run] = e.speed([[1, 2]], [window], greedy, precision=0.05, max_s=10.0)
    assert len(run["seconds"]) == 3
    assert run["beyond_repeats"]["rounds"] == 0 and run["beyond_repeats"]["given_up"] == "~369 rounds needed"
    # A smaller spread (8, 7.3, 8 tokens/s: ~9 rounds needed) is within reach of the same 10 s: timed on,
    # within the time.
    near = [1.0, 1.0, 1.1, 1.0] + [1.05] * 200
    e = _ClockedEngine(near, monkeypatch)
    [run] = e.speed([[1, 2]], [window], greedy, precision=0.05, max_s=10.0)
    assert 3 < len(run["seconds"]) and sum(run["seconds"][3:]) < 10.0 + 1.05
    assert run["beyond_repeats"] == {"rounds": len(run["seconds"]) - 3, "given_up": None}
    # eval.json keeps each engine's, where the engines were timed one after the other
    engines = [{"num_speculative_tokens": 3, "draft": "d", "enforce_eager": True, "acceptance": {"greedy": _acc(2.0, 3)},
                "speed": [run]}, {"num_speculative_tokens": 0, "draft": None, "enforce_eager": True, "speed": [run]}]
    [res] = eval_report(engines, samplings=greedy, sampling_source="test", windows=(window,), speed_k=3,
                        num_prompts=1, max_tokens=8, precision=0.05)["speed"]["results"]
    assert res["with_draft"]["beyond_repeats"] == res["without_draft"]["beyond_repeats"] == run["beyond_repeats"]
    # precision 0: the repeats alone
    e = _ClockedEngine(steady, monkeypatch)
    [run] = e.speed([[1, 2]], [window], greedy, precision=0.0, max_s=1000.0)
    assert len(run["seconds"]) == 3 and "beyond_repeats" not in run


def test_walk_rounds_replays_vllms_rounds():
    """A round drafts k tokens from start p, accepts the leading right ones (n), the target adds
    one, and the next round starts at p + n + 1."""
    from eagle3.train.rounds import walk_rounds

    every = [[True] * 8] * 3
    assert walk_rounds(every, 3) == (2, [2, 2, 2])  # starts 0 and 4; 8 is past the end
    # position 0 right, 1 wrong at every start: rounds accept one token each, starting 0, 2, 4, 6
    alternate = [[True] * 8, [False] * 8, [True] * 8]
    assert walk_rounds(alternate, 3) == (4, [4, 0, 0])
    # Easy stretches at both ends (step 0 right at starts 0-2 and 7-9), a hard one between (3-6
    # wrong): 6 of 10 starts right at position 0, but rounds start at 0, 4, 5, 6 and 7, three of
    # them in the hard stretch: 2 of 5 rounds (0.4) accept their first token.
    step0 = [True, True, True, False, False, False, False, True, True, True]
    hard = [step0, step0[1:] + [False], step0[2:] + [False, False]]
    assert walk_rounds(hard, 3) == (5, [2, 2, 2])
    assert walk_rounds(hard, 1) == (7, [4])  # k=1: starts 0, 2, 4, 5, 6, 7, 9
    assert walk_rounds([[]], 1) == (0, [0])


def test_draft_to_target_ids_reads_speculators_mapping():
    """The mapping as speculators builds it (build_vocab_mappings_from_distribution, which our
    trainer calls): draft id + d2t is the target id of each of the most frequent tokens, in order."""
    from types import SimpleNamespace

    import torch

    from compat.speculators_verifier import draft_to_target_ids
    from eagle3.train.data.vocab import draft_vocab_mapping_from_counts

    counts = torch.zeros(50, dtype=torch.long)
    counts[[3, 7, 11, 40, 41]] = torch.tensor([5, 9, 1, 7, 2])
    d2t, t2d = draft_vocab_mapping_from_counts(lambda: counts.numpy(), 4, 50)
    draft = SimpleNamespace(use_draft_vocab=True, d2t=d2t, t2d=t2d)
    assert draft_to_target_ids(draft).tolist() == [3, 7, 40, 41]  # the 4 most frequent, in id order
    assert draft_to_target_ids(SimpleNamespace(use_draft_vocab=False)) is None
    with pytest.raises(RuntimeError, match="vocabulary-mapping format changed"):
        draft_to_target_ids(SimpleNamespace(use_draft_vocab=True, d2t=d2t + 1, t2d=t2d))

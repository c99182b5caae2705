"""The pure parts of the eval stage's speedup (eagle3.evaluate): windows, spread, ratio, the
samplings measured, eval.json's assembly and the job summary's lines; and eval's config. The
engines themselves are covered by tests/test_e2e.py (the job) and tests/test_quality.py."""

from __future__ import annotations

import re

import pytest

from tests.helpers import job_config
from eagle3.evaluate import (DecodeSampling, SpeedWindow, eval_report, eval_samplings, ranges_apart,
                             resolve_enforce_eager, speed_windows, speedup, spread, timed_prompts)


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


def test_windows_decode_every_held_out_prompt_at_batch_1_on_a_gpu_in_whole_waves():
    gpu = speed_windows((1, 16), gpu=True, num_prompts=64, max_tokens=128)
    assert [(w.batch_size, w.num_prompts, w.num_waves, w.max_tokens, w.repeats) for w in gpu] == \
        [(1, 64, 64, 128, 3), (16, 64, 4, 128, 3)]
    # too few prompts for two waves of 16: the prompts are cycled to fill them
    assert speed_windows((16,), gpu=True, num_prompts=20, max_tokens=8)[0].num_prompts == 32
    cpu = speed_windows((1, 16), gpu=False, num_prompts=64, max_tokens=128)
    assert [(w.num_prompts, w.max_tokens, w.repeats) for w in cpu] == [(4, 24, 2), (64, 24, 2)]
    assert speed_windows((1,), gpu=True, num_prompts=8, max_tokens=8, repeats=5)[0].repeats == 5
    assert speed_windows((), gpu=True, num_prompts=8, max_tokens=8) == ()
    assert job_config({"eval.speed_repeats": 4}).eval.speed_repeats == 4
    with pytest.raises(ValueError, match=r"eval.speed_repeats=0: must be >= 1 rounds"):
        job_config({"eval.speed_repeats": 0})
    for gone in ("speed_precision", "speed_max_s", "speed_window_tokens"):
        with pytest.raises(ValueError, match=gone):
            job_config({f"eval.{gone}": 1})
    with pytest.raises(ValueError, match="num_prompts a multiple of batch_size"):
        SpeedWindow(batch_size=16, num_prompts=20, max_tokens=8, repeats=3)


def test_wave_speedup_pools_the_rounds_and_its_interval_spans_the_prompts():
    from eagle3.evaluate import wave_speedup

    # Three prompts at batch 1, two rounds: the draft doubles the first prompt's rate and leaves the
    # others as they are. The pooled ratio is between; the interval spans the prompts' own ratios.
    without = [[(100, 1.0), (100, 1.0), (100, 1.0)]] * 2
    with_draft = [[(100, 0.5), (100, 1.0), (100, 1.0)]] * 2
    sp = wave_speedup(with_draft, without)
    assert sp["ratio"] == pytest.approx(300 / 2.5 / 100)
    assert sp["waves"] == 3 and sp["rounds"] == 2 and sp["resamples"] > 0
    lo, hi = sp["ci95"]
    assert lo == pytest.approx(1.0) and hi == pytest.approx(2.0) and sp["ci95_excludes_one"] is False
    assert wave_speedup(with_draft, without) == sp  # seeded: the same interval every time
    # Every prompt 1.5x faster: the interval is the point.
    even = wave_speedup([[(90, 0.4), (60, 0.4)]], [[(60, 0.4), (40, 0.4)]])
    assert even["ci95"] == [pytest.approx(1.5), pytest.approx(1.5)] and even["ci95_excludes_one"] is True
    # One wave (e.g. a single wave of 16): a ratio, no interval.
    one = wave_speedup([[(160, 1.0)]], [[(160, 2.0)]])
    assert one["ratio"] == 2.0 and one["ci95"] is None and one["ci95_excludes_one"] is False
    with pytest.raises(ValueError, match="same waves"):
        wave_speedup([[(1, 1.0)]], [[(1, 1.0), (1, 1.0)]])


def test_samplings_are_greedy_and_the_served_one():
    assert eval_samplings(0.7, 0.9) == (DecodeSampling("greedy", 0.0, 1.0), DecodeSampling("sampled", 0.7, 0.9))
    assert eval_samplings(0.0, 0.9) == (DecodeSampling("greedy", 0.0, 1.0),)  # greedy regeneration: once


def test_enforce_eager_auto_is_graphs_on_gpu_only():
    assert resolve_enforce_eager("auto", gpu=True) is False and resolve_enforce_eager("auto", gpu=False) is True
    assert resolve_enforce_eager(True, gpu=True) is True and resolve_enforce_eager(False, gpu=False) is False


def test_speed_k_is_derived_and_checked():
    assert job_config().eval.resolved_speed_k == 3  # defaults: k in (1, 3)
    assert job_config({"eval.num_speculative_tokens": [1, 2]}).eval.resolved_speed_k == 2
    assert job_config({"eval.num_speculative_tokens": [1, 2], "eval.speed_k": 1}).eval.resolved_speed_k == 1
    assert job_config({"eval.speed_batch_sizes": []}).eval.resolved_speed_k is None


def _run(batch, mode, wave_rates, tokens_per_wave, al=None, rounds=2):
    """A timed run as SpecDecodeEngine.speed returns it: `rounds` rounds of waves, wave i at
    wave_rates[i] tokens/s with tokens_per_wave tokens."""
    waves_s = [[tokens_per_wave / r for r in wave_rates] for _ in range(rounds)]
    waves_t = [[tokens_per_wave] * len(wave_rates) for _ in range(rounds)]
    return {"batch_size": batch, "mode": mode, "temperature": 0.0 if mode == "greedy" else 0.7,
            "top_p": 1.0 if mode == "greedy" else 0.9, "num_prompts": batch * len(wave_rates), "max_tokens": 24,
            "num_tokens": [sum(t) for t in waves_t], "seconds": [sum(x) for x in waves_s],
            "wave_seconds": waves_s, "wave_tokens": waves_t,
            "tokens_per_s": spread([sum(t) / sum(x) for t, x in zip(waves_t, waves_s)]), "acceptance_length": al}


def _acc(al, k):
    return {"acceptance_length": al, "num_accepted_tokens_per_pos": [10] * k, "acceptance_rate_per_pos": [0.5] * k}


def _engines(with_speed, without_speed, interleaved=False):
    turns = {"speed_interleaved": True} if interleaved else {}
    return [
        {"num_speculative_tokens": 1, "draft": "d", "enforce_eager": True, "engine_start_s": 20.0, "wall_s": 30.0,
         "acceptance": {"greedy": _acc(1.6, 1), "sampled": _acc(1.3, 1)}},
        {"num_speculative_tokens": 3, "draft": "d", "enforce_eager": False, "engine_start_s": 40.0, "wall_s": 90.0,
         "acceptance": {"greedy": _acc(2.2, 3), "sampled": _acc(1.6, 3)}, "speed": with_speed} | turns,
        {"num_speculative_tokens": 0, "draft": None, "enforce_eager": False, "engine_start_s": 30.0, "wall_s": 60.0,
         "speed": without_speed} | turns,
    ]


def test_eval_report_pairs_each_window_with_the_baseline_and_the_summary_says_it():
    samplings = eval_samplings(0.7, 0.9)
    windows = speed_windows((1, 16), gpu=True, num_prompts=4, max_tokens=24)
    engines = _engines(
        [_run(1, "greedy", [150.0, 150.0, 160.0, 140.0], 20, 2.3), _run(1, "sampled", [90.0, 95.0, 100.0, 80.0], 20, 1.6),
         _run(16, "greedy", [1200.0, 1100.0], 300, 2.2), _run(16, "sampled", [900.0, 920.0], 300, 1.5)],
        [_run(1, "greedy", [100.0] * 4, 20), _run(1, "sampled", [100.0] * 4, 20),
         _run(16, "greedy", [1000.0] * 2, 300), _run(16, "sampled", [1000.0] * 2, 300)])
    ev = eval_report(engines, samplings=samplings, sampling_source="test", windows=windows, speed_k=3,
                     num_prompts=8, max_tokens=24)
    assert [a["num_speculative_tokens"] for a in ev["acceptance"]] == [1, 3]
    assert ev["samplings"] == {"greedy": {"temperature": 0.0, "top_p": 1.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}
    sp = ev["speed"]
    assert sp["num_speculative_tokens"] == 3 and sp["enforce_eager"] is False and sp["ignore_eos"] is False
    assert sp["interleaved"] is False and [w["num_prompts"] for w in sp["windows"]] == [4, 32]
    by = {(r["batch_size"], r["mode"]): r for r in sp["results"]}
    g1 = by[1, "greedy"]
    # both sides decoded the same prompts, wave for wave, round for round
    assert g1["with_draft"]["wave_tokens"] == g1["without_draft"]["wave_tokens"] == [[20] * 4] * 2
    assert g1["speedup"]["waves"] == 4 and g1["speedup"]["rounds"] == 2
    assert 1.0 < g1["speedup"]["ci95"][0] <= g1["speedup"]["ratio"] <= g1["speedup"]["ci95"][1]
    assert by[1, "sampled"]["speedup"]["ci95"][1] < 1.0  # every prompt slower with the draft
    assert by[16, "greedy"]["with_draft"]["acceptance_length"] == 2.2
    assert [e["measured"] for e in ev["engines"]] == [["acceptance"], ["acceptance", "speed"], ["speed"]]
    from ray_jobs.summary import _eval_summary

    lines = _eval_summary(ev)
    assert lines[0].endswith("(greedy / T=0.7 top_p=0.9; answers ending at EOS): k=1: 1.60 / 1.30, k=3: 2.20 / 1.60")
    assert "answers ending at EOS, 2 rounds, one engine after the other" in lines[1]
    assert any("batch   1 greedy" in x and "(100 -> 150 tokens/s; 1.4" in x and "AL 2.30; 4 prompts" in x
               and "slows" not in x for x in lines)
    assert any("batch   1 T=0.7 top_p=0.9" in x and "the draft slows this batch size" in x for x in lines)
    from ray_jobs.summary import format_summary

    text = format_summary({"seconds": {"total": 1}, "output_dir": "/o", "target": "/t", "draft": "/o/draft",
                           "stages": {"eval": ev}})
    assert ("\n  serve            vllm serve /t --speculative-config "
            """'{"method": "eagle3", "model": "/o/draft", "num_speculative_tokens": 3}'\n""") in text
    assert ("\n  verdict          the draft slows batch 1 (0.91x T=0.7 top_p=0.9); batch 16 (0.91x T=0.7 top_p=0.9): "
            "T=0.7 top_p=0.9: serve the target without it; greedy: no batch size slower\n") in text
    # Engines that timed different windows cannot be compared.
    engines[2]["speed"][0] = _run(1, "greedy", [100.0] * 4, 20, rounds=1)
    with pytest.raises(RuntimeError, match="different windows"):
        eval_report(engines, samplings=samplings, sampling_source="test", windows=windows, speed_k=3,
                    num_prompts=8, max_tokens=24)


def test_timed_prompts_leave_room_for_a_whole_answer_within_max_length():
    """The speed windows' prompts (the job's eval and benchmarks/served_speedup.py): room for
    max_tokens, k and 8 spare after each; a prompt without it within max_length is left out, and the
    engines' max_model_len is capped there."""
    prompts = [[1] * 10, [1] * 50, [1] * 100]
    kept, max_len = timed_prompts(prompts, max_tokens=20, k=3, max_length=100)
    assert [len(p) for p in kept] == [10, 50] and max_len == 100
    kept, max_len = timed_prompts(prompts, max_tokens=20, k=3)
    assert len(kept) == 3 and max_len == 131


def test_summary_rates_divide_to_the_printed_speedup_when_rounds_differ():
    """The summary's 'A -> B tokens/s' pool every round and wave as the ratio does: with a baseline
    whose second round ran at a quarter of the rate, a mean of the rounds' rates (625 -> 1,000
    tokens/s) would not divide to the 2.50x printed beside them."""
    samplings = eval_samplings(0.0, 1.0)
    windows = speed_windows((16,), gpu=True, num_prompts=32, max_tokens=24)
    without = _run(16, "greedy", [1000.0] * 2, 300)
    without["wave_seconds"][1] = [s * 4 for s in without["wave_seconds"][1]]  # round 2 at 250 tokens/s
    without["seconds"] = [sum(x) for x in without["wave_seconds"]]
    without["tokens_per_s"] = spread([600 / x for x in without["seconds"]])  # 1,000 and 250: mean 625
    engines = _engines([_run(16, "greedy", [1000.0] * 2, 300)], [without])
    ev = eval_report(engines, samplings=samplings, sampling_source="test", windows=windows, speed_k=3,
                     num_prompts=32, max_tokens=24)
    from ray_jobs.summary import _eval_summary

    (line,) = [x for x in _eval_summary(ev) if "batch  16 greedy" in x]
    rates = re.search(r"\((\d+) -> (\d+) tokens/s", line)
    ratio = float(re.search(r"greedy\s+([\d.]+)x", line)[1])
    assert (rates[1], rates[2], ratio) == ("400", "1000", 2.50)


def test_eval_report_without_speed_has_no_baseline():
    engines = [{"num_speculative_tokens": 1, "draft": "d", "enforce_eager": True, "engine_start_s": 20.0,
                "wall_s": 30.0, "acceptance": {"greedy": _acc(1.6, 1)}}]
    ev = eval_report(engines, samplings=eval_samplings(0.0, 1.0), sampling_source="test", windows=(), speed_k=None,
                     num_prompts=8, max_tokens=48)
    assert ev["speed"] is None and list(ev["samplings"]) == ["greedy"]
    from ray_jobs.summary import _eval_summary

    assert _eval_summary(ev) == ["  eval.json        acceptance length in vLLM (greedy; answers ending at EOS): k=1: 1.60"]
    ev = eval_report(engines, samplings=eval_samplings(0.0, 1.0), sampling_source="test", windows=(), speed_k=None,
                     num_prompts=8, max_tokens=48, ignore_eos=True)
    assert ev["ignore_eos"] is True and "(greedy; past EOS)" in _eval_summary(ev)[0]


class _RecordingSpeedActor:
    """An eval actor's `speed` as ray_jobs.evaluate._interleaved_speed calls it, recording each call
    in a log both actors share; each window runs at `rate` tokens/s. Stands in for no engine and no
    Ray: it tests the order of the rounds."""

    def __init__(self, name, rate, calls):
        from types import SimpleNamespace

        self.name, self.rate, self.calls = name, rate, calls
        self.speed = SimpleNamespace(remote=self._speed)

    def _speed(self, prompts, windows, samplings, *, rounds, warmup):
        self.calls.append((self.name, tuple(rounds), warmup))
        out = []
        for w in windows:
            for smp in samplings:
                tokens = [[w.max_tokens * w.batch_size] * w.num_waves for _ in rounds]
                secs = [[t / self.rate for t in r] for r in tokens]
                out.append({"batch_size": w.batch_size, "mode": smp.mode, "temperature": smp.temperature,
                            "top_p": smp.top_p, "num_prompts": w.num_prompts, "max_tokens": w.max_tokens,
                            "seconds": [sum(x) for x in secs], "num_tokens": [sum(t) for t in tokens],
                            "wave_seconds": secs, "wave_tokens": tokens, "drafts": 0, "accepted": 0})
        return out


def test_engines_side_by_side_take_turns_for_the_fixed_rounds_and_the_report_pairs_them():
    from types import SimpleNamespace

    import ray_jobs.evaluate as stage

    calls = []
    actors = [_RecordingSpeedActor("draft", 150.0, calls), _RecordingSpeedActor("alone", 100.0, calls)]
    results = [{"num_speculative_tokens": 3, "draft": "d", "enforce_eager": False, "engine_start_s": 1.0,
                "wall_s": 2.0, "acceptance": {"greedy": _acc(2.2, 3)}},
               {"num_speculative_tokens": 0, "draft": None, "enforce_eager": False, "engine_start_s": 1.0, "wall_s": 2.0}]
    windows = speed_windows((1, 16), gpu=True, num_prompts=4, max_tokens=8, repeats=3)
    stage._interleaved_speed(SimpleNamespace(get=lambda x: x), actors, results, [[1, 2]] * 4, windows,
                             eval_samplings(0.0, 1.0))
    assert calls == [("draft", (), True), ("alone", (), True),  # warm-up, untimed
                     ("draft", (0,), False), ("alone", (0,), False), ("alone", (1,), False), ("draft", (1,), False),
                     ("draft", (2,), False), ("alone", (2,), False)]
    assert all(r["speed_interleaved"] and len(r["speed"][0]["seconds"]) == 3 for r in results)
    ev = eval_report(results, samplings=eval_samplings(0.0, 1.0), sampling_source="test", windows=windows,
                     speed_k=3, num_prompts=4, max_tokens=8)
    assert ev["speed"]["interleaved"] is True
    r1 = ev["speed"]["results"][0]["speedup"]
    assert r1["paired_rounds"]["n"] == 3 and r1["ratio"] == pytest.approx(1.5)


class _ClockedEngine:
    """SpecDecodeEngine's timing loop (speed, _time_window) on a clock the test owns: each _generate
    call advances it by the next of `durations` (cycled) and answers each prompt with
    `answer_tokens` tokens, as an answer ending at EOS would. Stands in for no engine: it tests our
    rounds and what they record, not vLLM (the slow tier's jobs time real engines)."""

    def __init__(self, durations, monkeypatch, answer_tokens=5):
        import eagle3.evaluate.engine as ev

        self.durations, self.calls, self.now, self.draft_dir = durations, [], 0.0, None
        self.answer_tokens = answer_tokens
        monkeypatch.setattr(ev.time, "perf_counter", lambda: self.now)
        self.speed = ev.SpecDecodeEngine.speed.__get__(self)
        self._time_window = ev.SpecDecodeEngine._time_window.__get__(self)

    def _generate(self, prompts, *, max_tokens, temperature, top_p=1.0, ignore_eos=True):
        from types import SimpleNamespace

        self.now += self.durations[len(self.calls) % len(self.durations)]
        self.calls.append({"prompts": len(prompts), "ignore_eos": ignore_eos})
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * min(self.answer_tokens, max_tokens))])
                for _ in prompts]


def test_speed_times_answers_ending_at_eos_for_the_fixed_rounds_wave_by_wave(monkeypatch):
    from eagle3.evaluate import merge_speed

    e = _ClockedEngine([1.0, 2.0, 3.0], monkeypatch)
    windows = [SpeedWindow(batch_size=1, num_prompts=3, max_tokens=24, repeats=2),
               SpeedWindow(batch_size=2, num_prompts=4, max_tokens=24, repeats=2)]
    [b1, b2] = e.speed([[1], [2], [3]], windows, eval_samplings(0.0, 1.0))
    assert all(c["ignore_eos"] is False for c in e.calls)  # every call, warm-up included, ends at EOS
    # one untimed warm-up wave a window, then 2 rounds: 3 waves of 1 and 2 waves of 2 each round
    assert [c["prompts"] for c in e.calls] == [1, 2] + [1, 1, 1, 2, 2] * 2
    assert b1["wave_tokens"] == [[5, 5, 5]] * 2 and b2["wave_tokens"] == [[10, 10]] * 2
    assert b1["wave_seconds"][0] == [3.0, 1.0, 2.0] and b1["seconds"][0] == sum(b1["wave_seconds"][0])
    assert len(b1["seconds"]) == len(b2["seconds"]) == 2
    merged = merge_speed([[b1], [b1]])
    assert merged[0]["wave_seconds"] == b1["wave_seconds"] * 2


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

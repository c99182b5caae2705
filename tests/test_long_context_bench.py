"""The long-context and long-run benchmarks' CPU-checkable parts (benchmarks/long_context_bench.py,
the long-run additions of benchmarks/train_bench.py): the length stepping, the planned wall
times of the device commands, the per-step wait statistics, and the synthetic data and target
the long-context training reads, read back by the product's readers. No Ray, no DeepSpeed, no
vLLM.
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import long_context_bench as lcb
from benchmarks import train_bench as tb

LENGTHS = (1024, 2048, 4096, 8192)


def test_lengths_step_up_in_order_and_stop_at_the_first_failure():
    assert lcb.next_length([], LENGTHS, 0.0, 100.0) == (1024, "")
    tried = [{"length": 1024, "ok": True, "wall_s": 1.0}]
    assert lcb.next_length(tried, LENGTHS, 1.0, 100.0) == (2048, "")
    tried.append({"length": 2048, "ok": False, "wall_s": 2.0})
    n, why = lcb.next_length(tried, LENGTHS, 3.0, 100.0)
    assert n is None and "2048 tokens failed" in why
    done = [{"length": n, "ok": True, "wall_s": 1.0} for n in LENGTHS]
    assert lcb.next_length(done, LENGTHS, 4.0, 100.0) == (None, "all lengths tried")


def test_lengths_stop_before_one_predicted_to_end_past_the_budget():
    tried = [{"length": 1024, "ok": True, "wall_s": 10.0}, {"length": 2048, "ok": True, "wall_s": 20.0}]
    # next: 4096 tokens, predicted 20 s x 2^2 = 80 s
    assert lcb.next_length(tried, LENGTHS, 30.0, 110.0) == (4096, "")
    n, why = lcb.next_length(tried, LENGTHS, 30.0, 109.0)
    assert n is None and "predicted 80 s" in why and "past --budget-s 109" in why
    # with the training time known, only it scales: 15 s set-up + 5 s x 2^2 = 35 s
    tried[-1]["fit_s"] = 5.0
    assert lcb.next_length(tried, LENGTHS, 30.0, 65.0) == (4096, "")
    n, why = lcb.next_length(tried, LENGTHS, 30.0, 64.0)
    assert n is None and "predicted 35 s" in why


def test_part_extract_is_planned_for_every_pass_of_both_sides():
    one, three = (lcb.planned_seconds(lcb.PLANS["h200"], "extract", passes=p) for p in (1, 3))
    assert 0 < one < three
    with pytest.raises(ValueError, match="part='x'"):
        lcb.planned_seconds(lcb.PLANS["h200"], "x")


LONG_RUN = ["--shape", "1b", "--num-steps", "300", "--skip-steps", "50", "--drop-caches"]


@pytest.mark.parametrize("extra", [["--skip-speculators"], ["--skip-speculators", "--hs-dtype", "float8_e4m3fn"],
                                   ["--skip-ours", "--shards-dir", "/dev/shm/e3-long", "--hs-dtype", "float8_e4m3fn"]])
def test_long_run_commands_hold_twice_the_ring(extra):
    args = tb.parse_args(LONG_RUN + extra)
    s = tb.resolve_settings(args)
    assert s.num_train_prompts == 300 * s.samples_per_step and s.skip_steps == 50
    # the data set against our prefetch ring at the 1b shape (4 captured layers of hidden 2048)
    ext = {"bytes": s.num_prompts * s.prompt_len * 4 * 2048 * (1 if "float8_e4m3fn" in extra else 2)}
    ring = tb.data_vs_ring(s, args, ext, num_layers=4, hidden=2048)
    assert ring["data_over_ring"] >= 2.0


def test_the_plan_counts_every_repeat_of_each_trainer():
    one, two = (tb.parse_args(LONG_RUN + ["--repeats", r]) for r in ("1", "2"))
    alone = tb.parse_args(LONG_RUN + ["--repeats", "2", "--skip-speculators"])
    s = tb.resolve_settings(one)
    assert tb.planned_seconds(s, one) < tb.planned_seconds(s, two)
    assert tb.planned_seconds(s, alone) < tb.planned_seconds(s, two)


def test_window_stats_over_the_measured_steps_only():
    args = tb.parse_args(["--shape", "tiny", "--num-steps", "6", "--skip-steps", "2"])
    s = tb.resolve_settings(args)
    recs = [{"step": i, "input_wait_ms": w} for i, w in enumerate([100.0, 50.0, 0.5, 4.0, 0.0, 2.0], start=1)]
    st = tb.window_stats(recs, "input_wait_ms", s)
    assert st == {"median": 1.25, "mean": 1.625, "p90": 4.0, "max": 4.0, "sum": 6.5, "steps": 4, "steps_over_1ms": 2}
    assert tb.window_stats([], "input_wait_ms", s) is None


def test_synthetic_shards_read_back_as_samples_of_the_length(tmp_path):
    from eagle3.extract.codec import decode_rows
    from eagle3.schema import hs_layout
    from eagle3.extract.shards import ShardFile

    files = lcb.write_synthetic_shards(tmp_path, length=300, num_samples=2, layer_ids=[2, 4, 5, 8], hidden=16,
                                       vocab=1024)
    assert len(files) == 2
    for f in files:
        shard = ShardFile(f)
        assert hs_layout(shard.schema) == ([2, 4, 5, 8], 16, "bfloat16")
        (batch,) = list(shard.iter_batches())
        (row,) = list(decode_rows(batch))
        assert len(row.input_ids) == 300 and row.loss_mask.sum() == 300
        hs = row.hidden_states_as(torch.float32)
        assert tuple(hs.shape) == (300, 4, 16) and bool(torch.isfinite(hs).all())
        assert torch.equal(hs[256:], hs[:44])  # one 256-token block, repeated


def test_heads_only_target_holds_what_the_trainer_reads(tmp_path):
    from compat.speculators_verifier import read_text_model_tensors, verifier_text_config

    target = lcb.write_heads_target("tiny", tmp_path, max_positions=40000)
    cfg = verifier_text_config(target)
    assert cfg.max_position_embeddings == 40000 and cfg.hidden_size == 256
    tensors = read_text_model_tensors(target)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        "embed_tokens.weight": (1024, 256), "lm_head.weight": (1024, 256), "model.norm.weight": (256,)}


def test_command_line_lengths_and_budget_replace_the_plans():
    plan = lcb.resolve_plan(lcb.parse_args(["--part", "train", "--train-lengths", "65536,131072", "--budget-s", "300"]))
    assert plan.train_lengths == (65536, 131072) and plan.budget_s == 300 and plan.lengths == (8192, 16384, 32768)
    with pytest.raises(ValueError, match="--lengths='8k'"):
        lcb.resolve_plan(lcb.parse_args(["--part", "extract", "--lengths", "8k"]))


def test_a_cut_off_length_reports_the_last_phase_it_reached(tmp_path):
    trail = lcb.progress_path(tmp_path / "train-16384.json")
    assert lcb.last_reached(trail) == "before writing its data"
    trail.write_text(json.dumps({"phase": "data written", "s": 3.2}) + "\n"
                     + json.dumps({"phase": "engine built", "s": 35.4}) + "\n")
    assert lcb.last_reached(trail) == "after 'engine built' at 35 s, before its first step ended"
    with open(trail, "a") as f:
        f.write(json.dumps({"phase": "step", "s": 150.0, "step": 1}) + "\n")
        f.write(json.dumps({"phase": "step", "s": 151.2, "step": 2}) + "\n")
    assert lcb.last_reached(trail) == "after step 2 at 151 s (step 1 ended at 150 s)"


def test_extraction_config_takes_samples_longer_than_the_training_default(tmp_path):
    # a sample longer than train.data.micro_batch_tokens must not stop an extract-only config
    from benchmarks.extract_bench import disk_extract_config

    cfg = disk_extract_config(tmp_path, max_len=32776, hs_dtype="bfloat16", samples_per_shard=64, batched=32777,
                              cpu_kv_gib=2, block_size=None)
    assert cfg.prepare.max_length == 32776 and cfg.stages == ("extract",)
    assert cfg.train.data.micro_batch_tokens < 32776  # the training limit it no longer trips on



def test_every_side_is_timed_over_the_same_passes_and_the_order_turns():
    """extract_bench's rule for both sides: passes 2..P timed; (3)'s pass ends read from the shards'
    commit times, a shard that commits late still counting in its own pass."""
    from benchmarks.extract_bench import pass_ends, rotated, window_tok_s

    assert window_tok_s(100, [9.0, 1.0, 1.0]) == window_tok_s(100, [0.5, 1.0, 1.0])  # pass 1 is left out
    assert window_tok_s(100, [2.0]) > 0  # one pass: the pass itself
    # 2 passes of 4 rows, 2 rows a shard: shards 0-1 are pass 1, shards 2-3 pass 2; shard 0 commits last of pass 1
    committed = {0: {"committed_at": 12.0}, 1: {"committed_at": 11.0}, 2: {"committed_at": 14.0},
                 3: {"committed_at": 15.0}}
    assert pass_ends(committed, samples_per_shard=2, rows_per_pass=4, rows=8) == [12.0, 15.0]
    assert rotated(["plain", "store", "disk"], 0) == ["plain", "store", "disk"]
    assert rotated(["plain", "store", "disk"], 1) == ["disk", "store", "plain"]

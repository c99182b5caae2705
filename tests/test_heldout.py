"""The held-out split (eagle3.prepare.heldout): which conversations it holds, that prepare records it,
and that the training dataset leaves it out of the shards while the held-out view reads exactly
it (online mode's order with the split: tests/test_online.py). Fast tier: no Ray, no DeepSpeed,
no vLLM. The trainer's evaluation on the split: tests/test_train.py, and in the slow tier
tests/test_e2e.py and test_train.py's two-worker run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3 import tiny
from eagle3.config import PrepareConfig
from tests.helpers import job_config
from eagle3.prepare.heldout import (HELDOUT_FILE, choose_split, conversation_id, heldout_rows, is_heldout, read_split,
                                   split_key)

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo_conversations.jsonl"


def _ids(num_conversations: int, turns_every: int = 3) -> list[str]:
    """Sample ids as prepare writes them: 'c<i>', and '<id>#t1', '<id>#t2' for every
    turns_every-th conversation (a template that rewrites earlier turns: one sample per turn)."""
    out = []
    for i in range(num_conversations):
        out.extend([f"c{i}#t1", f"c{i}#t2"] if i % turns_every == 0 else [f"c{i}"])
    return out


def test_split_is_deterministic_and_keeps_a_conversation_on_one_side():
    ids = _ids(3000)
    split = choose_split(ids, 0.05, 8)
    again = choose_split(list(reversed(ids)), 0.05, 8)
    assert split == again  # the order samples come in does not matter
    assert conversation_id("a#t12") == "a" and conversation_id("a#b") == "a#b"
    assert split_key("c7") == split_key("c7") and split_key("c7") != split_key("c8")
    by_conversation: dict[str, set[bool]] = {}
    for s in ids:
        by_conversation.setdefault(conversation_id(s), set()).add(split.is_heldout(s))
    assert all(len(sides) == 1 for sides in by_conversation.values())
    held = {c for c, sides in by_conversation.items() if True in sides}
    assert split.num_heldout_conversations == len(held)
    assert split.num_heldout_samples == sum(split.is_heldout(s) for s in ids)
    # A conversation split into turns is held out with all its turns.
    assert any(split.is_heldout(f"c{i}#t1") for i in range(0, 3000, 3))


def test_split_respects_the_fraction_and_is_stable_as_conversations_leave():
    ids = _ids(20000)
    split = choose_split(ids, 0.02, 8)
    assert split.num_conversations == 20000
    # A uniform hash: 2% of 20,000 is 400, binomial sd ~20.
    assert 340 <= split.num_heldout_conversations <= 460, split
    # The fraction alone decides at this size: the threshold does not depend on the others, so a
    # conversation that regenerate or extract rejects moves no other across the split.
    assert choose_split(ids[: len(ids) // 2], 0.02, 8).threshold == split.threshold == int(0.02 * 2 ** 64)


def test_small_data_gets_the_minimum_but_at_most_half():
    ids = _ids(40)
    split = choose_split(ids, 0.02, 8)
    assert split.num_heldout_conversations == 8  # 0.02 of 40 would be ~1
    assert choose_split(ids, 0.02, 100).num_heldout_conversations == 20  # at most half
    assert choose_split(ids, 0.02, 0).threshold == int(0.02 * 2 ** 64)


def test_fraction_zero_disables_the_split():
    split = choose_split(_ids(100), 0.0, 8)
    assert split.threshold == 0 and split.num_heldout_conversations == split.num_heldout_samples == 0
    assert not any(is_heldout(s, 0) for s in _ids(100))


def test_config_fields_are_validated():
    src = str(DEMO)  # prepare.conversations has no default
    assert PrepareConfig(src).heldout_fraction == 0.02 and PrepareConfig(src).heldout_min_conversations == 8
    with pytest.raises(ValueError, match=r"prepare\.heldout_fraction=0\.7: must be in \[0, 0\.5\]"):
        PrepareConfig(src, heldout_fraction=0.7)
    with pytest.raises(ValueError, match=r"prepare\.heldout_fraction=-0\.1"):
        PrepareConfig(src, heldout_fraction=-0.1)
    with pytest.raises(ValueError, match=r"prepare\.heldout_min_conversations=-1: must be >= 0"):
        PrepareConfig(src, heldout_min_conversations=-1)
    with pytest.raises(ValueError, match=r"train\.eval_every_steps=0: must be >= 1"):
        job_config({"train.eval_every_steps": 0})
    with pytest.raises(ValueError, match=r"train\.eval_max_tokens=0"):
        job_config({"train.eval_max_tokens": 0})
    cfg = job_config({"prepare.heldout_fraction": 0, "train.eval_every_steps": 5})
    assert cfg.prepare.heldout_fraction == 0.0 and cfg.train.eval_every_steps == 5


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_tokenizer")
    tiny.build_tokenizer(tiny.corpus_texts(DEMO), d)
    return str(d)


def test_prepare_records_the_split_and_keeps_held_out_samples_in_the_tokens(tok_dir, tmp_path):
    from eagle3.prepare.tokens import prepare_dataset

    cfg = PrepareConfig(conversations=str(DEMO), max_length=512, num_eval_prompts=16, heldout_fraction=0.05)
    summary = prepare_dataset(cfg, tok_dir, str(tmp_path / "a"))
    split = read_split(tmp_path / "a")
    ids = pq.read_table(tmp_path / "a" / "tokens.parquet").column("sample_id").to_pylist()
    assert split == choose_split(ids, 0.05, 8)  # the file holds the rule's choice over the kept samples
    held = [s for s in ids if split.is_heldout(s)]
    assert len(held) == summary["num_heldout_samples"] == split.num_heldout_samples > 0
    # online mode's held-out rows (its engines extract them apart): the same samples, in order; none at 0
    table = pq.read_table(tmp_path / "a" / "tokens.parquet")
    assert heldout_rows(table, split.threshold).column("sample_id").to_pylist() == held
    assert heldout_rows(table, 0).num_rows == 0
    assert summary["num_heldout_conversations"] == split.num_heldout_conversations >= 8
    assert split.num_conversations == summary["num_conversations"]
    # The same split from the same data on another run; none with fraction 0.
    prepare_dataset(cfg, tok_dir, str(tmp_path / "b"))
    assert (tmp_path / "b" / HELDOUT_FILE).read_text() == (tmp_path / "a" / HELDOUT_FILE).read_text()
    off = prepare_dataset(PrepareConfig(conversations=str(DEMO), max_length=512, heldout_fraction=0), tok_dir,
                          str(tmp_path / "c"))
    assert off["num_heldout_samples"] == 0 and json.loads((tmp_path / "c" / HELDOUT_FILE).read_text())["threshold"] == 0


LAYER_IDS = [1, 2, 4]
HIDDEN = 8


def _write_shards(root: Path, ids: list[str], num_shards: int) -> list[str]:
    from eagle3.extract.codec import encode_hidden_states
    from eagle3.schema import hidden_states_schema
    from eagle3.extract.shards import write_shard_file

    rng = np.random.default_rng(0)
    schema = hidden_states_schema(layer_ids=LAYER_IDS, hidden_size=HIDDEN)
    files = []
    for s, chunk in enumerate(np.array_split(np.array(ids), num_shards)):
        rows = []
        for sid in chunk:
            T = int(rng.integers(3, 9))
            tok = [7] * T
            values, _ = encode_hidden_states(rng.standard_normal((T, len(LAYER_IDS), HIDDEN)).astype(np.float32),
                                             "bfloat16")
            rows.append({"sample_id": str(sid), "input_ids": tok, "loss_mask": [1] * T, "num_tokens": T,
                         "hidden_states": values.tobytes(), "hs_scale": None})
        path = root / f"shard-{s:06d}.arrow"
        write_shard_file(pa.Table.from_pylist(rows, schema=schema), path)
        files.append(str(path))
    return files


def test_datasets_leave_the_split_out_of_training_and_read_it_back(tmp_path):
    from eagle3.train.data.rows import HiddenStatesDataset
    from eagle3.train.data.vocab import token_frequencies

    ids = _ids(60)
    split = choose_split(ids, 0.1, 8)
    files = _write_shards(tmp_path, ids, num_shards=4)
    held = {s for s in ids if split.is_heldout(s)}
    trained: list[str] = []
    for rank in range(2):
        ds = HiddenStatesDataset(files, seed=3, rank=rank, world_size=2, shuffle_buffer_size=4,
                                 heldout_threshold=split.threshold)
        for epoch in range(2):
            order = ds.epoch_order(epoch)
            got = [ds.sample_id(k) for k in order]
            assert not set(got) & held and len(got) == len(set(got))
            if epoch == 0:
                trained += got
            assert sum(1 for _ in ds.rows(epoch)) == len(order)  # the rows read are the order's
    assert sorted(trained) == sorted(set(ids) - held)  # every other sample once per epoch, across ranks
    view = HiddenStatesDataset(files, shuffle_buffer_size=1, heldout_threshold=split.threshold, heldout=True)
    assert sorted(view.sample_id(k) for k in view.epoch_order(0)) == sorted(held) and view.num_samples == len(held)
    everything = HiddenStatesDataset(files, shuffle_buffer_size=1)
    assert everything.num_samples == len(ids)  # threshold 0: every row, as before the split existed
    # The draft vocabulary is counted on the training side only.
    counts = token_frequencies(files, 64, heldout_threshold=split.threshold)
    assert counts.sum() == sum(n for s, n in _lengths(files).items() if s not in held)
    assert token_frequencies(files, 64).sum() == sum(_lengths(files).values())
    with pytest.raises(ValueError, match="heldout=True needs a heldout_threshold"):
        HiddenStatesDataset(files, heldout=True)


def _lengths(files) -> dict[str, int]:
    from eagle3.extract.shards import read_shards

    t = read_shards(files)
    return dict(zip(t.column("sample_id").to_pylist(), t.column("num_tokens").to_pylist(), strict=True))


def test_summary_and_curves_show_heldout_beside_training_and_vllm(tmp_path):
    from actors.trainer import plot_curves
    from ray_jobs.summary import format_summary

    held = {"step": 20, "full_acc": [0.61, 0.42, 0.30], "cond_acc": [0.61, 0.7, 0.7],
            "train_full_acc": [0.72, 0.55, 0.41], "train_steps_averaged": 10, "num_positions": 812, "num_samples": 8}
    report = {"output_dir": "/o", "target": "/t", "seconds": {"total": 1.0}, "draft": "/o/draft",
              "stages": {"train": {"steps": 20, "loss_first": 9.0, "loss_last": 4.0, "tokens_per_s": 10.0,
                                   "tokens_this_run": 5, "heldout": held},
                         "eval": {"samplings": {"greedy": {"temperature": 0.0, "top_p": 1.0}}, "speed": None,
                                  "acceptance": [
                                      {"num_speculative_tokens": 1,
                                       "greedy": {"acceptance_length": 1.6, "acceptance_rate_per_pos": [0.6]}},
                                      {"num_speculative_tokens": 3,
                                       "greedy": {"acceptance_length": 2.1,
                                                  "acceptance_rate_per_pos": [0.58, 0.35, 0.2]}}]}}}
    text = format_summary(report)
    assert ("accuracy         per draft position at step 20: held-out 0.610 0.420 0.300 (812 positions, 8 samples), "
            "training 0.720 0.550 0.410, vLLM accepted (k=3, greedy) 0.580 0.350 0.200") in text
    held.update(first_tokens=128, first_full_acc=[0.5, 0.3, 0.2], first_num_positions=400)
    assert ("held-out 0.610 0.420 0.300 (812 positions, 8 samples; over the first 128 tokens of each turn "
            "0.500 0.300 0.200, 400 positions), training 0.720") in format_summary(report)
    # the same predictions counted per round, as vLLM counts its drafts, on a line of their own
    held.update(rounds_acc=[0.52, 0.31, 0.2], rounds_al=2.03, num_rounds=300)
    assert ("vLLM accepted (k=3, greedy) 0.580 0.350 0.200\n                   held-out in rounds of 3, as vLLM "
            "counts drafts: 0.520 0.310 0.200 (AL 2.03, 300 rounds)") in format_summary(report)
    # Training 0.110 above held out at position 1: short of data (a SmolLM2 draft measured 0.089 on its 1x data,
    # where 5x the data raised AL); level: more data alone will not help.
    assert ("short of data: the draft scores 0.110 more at position 1 on its training data than held out; more "
            "conversations (prepare.max_samples, a larger source) should raise it") in text
    held["train_full_acc"] = [0.63, 0.45, 0.31]
    assert "not short of data: training and held-out accuracy meet at position 1 (+0.020); more" in format_summary(report)
    from ray_jobs.summary import _bound_line

    assert _bound_line({"train": {"tokens": 7600}, "extract": {"num_tokens": 1000}}, held) == (
        "not short of data: training and held-out accuracy meet at position 1 (+0.020, 7.6 passes over 1000 "
        "tokens); more data alone will not raise it, more steps (train.num_steps) may")
    held["train_full_acc"] = [0.72, 0.55, 0.41]
    report["stages"]["train"]["heldout"] = None  # no split: no line
    assert "held-out" not in format_summary(report)

    rows = [{"step": s, "loss": 1.0 / s, "full_acc_0": 0.1 * s, "full_acc_1": 0.05 * s} for s in range(1, 5)]
    rows[1].update(heldout_full_acc_0=0.15, heldout_full_acc_1=0.1)
    rows[3].update(heldout_full_acc_0=0.3, heldout_full_acc_1=0.2)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_job_counts_heldout_accuracy_over_answers_as_long_as_its_evals():
    """train.heldout_first_tokens null: the job trains with eval.max_tokens there (JobConfig.train_config),
    so the summary's held-out figure and vLLM's acceptance count answers of the same length."""
    cfg = job_config({"eval.max_tokens": 128})
    assert cfg.train.heldout_first_tokens is None and cfg.train_config.heldout_first_tokens == 128
    assert job_config({"train.heldout_first_tokens": 0}).train_config.heldout_first_tokens == 0
    with pytest.raises(ValueError, match=r"train\.heldout_first_tokens=-1"):
        job_config({"train.heldout_first_tokens": -1})

"""The choice of the draft to export (eagle3.evaluate.selection) as files on disk: which candidate is
measured, which is kept, what draft/ holds at the end, the rows metrics.jsonl and curves.png gain.
The acceptance lengths here are given, not measured; tests/test_e2e.py measures real drafts in a
vLLM engine (test_the_better_of_two_drafts_is_exported)."""

import json

from eagle3.evaluate.selection import BEST, CANDIDATES, LAST, METRIC, DraftSelection, candidate_dir, selection_line


def _draft(path, weights: bytes):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["Eagle3Speculator"]}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def _selection(train, scores):
    """A selection whose measure reads the weights' bytes and gives the acceptance length `scores` holds."""
    seen = []

    def measure(draft_dir):
        weights = (train.parent / draft_dir).joinpath("model.safetensors").read_bytes()
        seen.append(weights)
        return scores[weights]

    return DraftSelection(train, measure, k=3, num_prompts=4, max_tokens=8), seen


def test_an_earlier_draft_that_beats_the_last_replaces_it(tmp_path):
    train, draft = tmp_path / "train", _draft(tmp_path / "draft", b"step 30")
    (draft / "provenance.json").write_text("{}")
    sel, seen = _selection(train, {b"step 10": 2.0, b"step 20": 2.5, b"step 30": 2.2})
    _draft(candidate_dir(train, 10), b"step 10")
    sel.consume()
    _draft(candidate_dir(train, 20), b"step 20")
    sel.consume()
    sel.consume()  # nothing waiting: nothing measured
    assert seen == [b"step 10", b"step 20"]
    assert (train / BEST / "model.safetensors").read_bytes() == b"step 20"
    record = sel.finish(draft, 30)
    assert (draft / "model.safetensors").read_bytes() == b"step 20"
    assert (draft / "provenance.json").exists()  # the export's own files stay
    assert (train / LAST / "model.safetensors").read_bytes() == b"step 30"
    assert not (train / BEST).exists() and not (train / CANDIDATES).exists()
    assert record["chosen_step"] == 20 and record["chosen_acceptance_length"] == 2.5
    assert record["last_acceptance_length"] == 2.2
    assert [m["step"] for m in record["measured"]] == [10, 20, 30]
    rows = [json.loads(line) for line in (train / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r[METRIC]) for r in rows] == [(10, 2.0), (20, 2.5), (30, 2.2)]
    assert "step 20 of 30" in selection_line(record) and str(train / LAST) in selection_line(record)


def test_the_last_draft_stays_where_none_beats_it_and_a_tie_keeps_it(tmp_path):
    train, draft = tmp_path / "train", _draft(tmp_path / "draft", b"step 30")
    sel, _ = _selection(train, {b"step 10": 2.2, b"step 30": 2.2})
    _draft(candidate_dir(train, 10), b"step 10")
    sel.consume()
    record = sel.finish(draft, 30)
    assert (draft / "model.safetensors").read_bytes() == b"step 30"
    assert record["chosen_step"] == 30 and "last_draft" not in record and not (train / LAST).exists()
    assert "the last step's" in selection_line(record)


def test_candidates_that_waited_behind_a_newer_one_are_dropped_unmeasured(tmp_path):
    train, draft = tmp_path / "train", _draft(tmp_path / "draft", b"step 30")
    sel, seen = _selection(train, {b"step 10": 3.0, b"step 20": 2.0, b"step 30": 2.1})
    _draft(candidate_dir(train, 10), b"step 10")
    _draft(candidate_dir(train, 20), b"step 20")
    (train / CANDIDATES / "step_0000025.partial").mkdir()  # still being written: not a candidate
    sel.consume()
    assert seen == [b"step 20"] and sel.skipped == [10]
    record = sel.finish(draft, 30)
    assert record["skipped_steps"] == [10] and record["chosen_step"] == 30


def test_plot_curves_draws_vllm_acceptance_beside_the_training_rows(tmp_path):
    from actors.trainer import plot_curves

    rows = [{"step": s, "loss": 3.0 / s, "full_acc_0": 0.1 * s} for s in (1, 2, 3)]
    rows += [{"step": 2, METRIC: 1.8, "selection_prompts": 4}, {"step": 3, METRIC: 2.0, "selection_prompts": 4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png is not None and png.stat().st_size > 0


def test_the_trainer_keeps_drafts_for_the_eval_stage_on_a_gpu_and_where_asked_on_the_cpu(tmp_path):
    """Where no engine starts beside training, the trainer keeps a draft every eval.select_every_steps
    for the eval stage to measure (ray_jobs.evaluate.candidates_for_eval): by default on a GPU (at
    train.eval_every_steps, or a multiple of it that keeps about 20 drafts on disk), on the CPU only
    when set; never without prompts beyond the eval's."""
    from ray_jobs.evaluate import candidates_for_eval
    from tests.helpers import job_config

    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "eval_prompts.jsonl").write_text(
        "".join(json.dumps({"prompt_token_ids": [1, 2, i]}) + "\n" for i in range(12)))
    (tmp_path / "train" / CANDIDATES / "step_0000005").mkdir(parents=True)  # an earlier run's

    def cfg(**more):
        return job_config({"output_dir": str(tmp_path), "prepare.num_eval_prompts": 12, "eval.num_prompts": 8,
                           "train.num_steps": 40, "train.eval_every_steps": 10, **more})

    every, fmt = candidates_for_eval(cfg(), tmp_path, gpu=True)
    assert every == 10 and fmt.format(step=20) == str(candidate_dir(tmp_path / "train", 20))
    assert not (tmp_path / "train" / CANDIDATES).exists()  # a run chooses among its own steps
    assert candidates_for_eval(cfg(), tmp_path, gpu=False) == (0, None)
    assert candidates_for_eval(cfg(**{"eval.select_every_steps": 5}), tmp_path, gpu=False)[0] == 5
    assert candidates_for_eval(cfg(**{"eval.select_every_steps": 0}), tmp_path, gpu=True) == (0, None)
    assert candidates_for_eval(cfg(**{"eval.num_prompts": 12}), tmp_path, gpu=True) == (0, None)
    assert candidates_for_eval(cfg(**{"eval.enabled": False}), tmp_path, gpu=True) == (0, None)
    # a long run keeps about 20 drafts, every few held-out evaluations: 7,200 steps at 100 -> every 400 (18)
    assert candidates_for_eval(cfg(**{"train.num_steps": 7200, "train.eval_every_steps": 100,
                                      "train.optimizer.warmup_steps": 50}), tmp_path, gpu=True)[0] == 400
    assert candidates_for_eval(cfg(**{"train.num_steps": 2000, "train.eval_every_steps": 100,
                                      "train.optimizer.warmup_steps": 50}), tmp_path, gpu=True)[0] == 100

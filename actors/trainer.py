"""Ray side of draft training: one Ray Train worker per DeepSpeed data-parallel rank.

Route: `ray.train.torch.TorchTrainer` (Ray Train V2 in Ray 2.60) with
ScalingConfig(num_workers, use_gpu) and TorchConfig(backend="gloo" on CPU, "nccl" on GPU).
Ray Train creates the torch.distributed process group; `deepspeed.initialize` (through
eagle3.train.deepspeed_backend) joins it. This worked with DeepSpeed 0.19 on CPU as is, so no
own placement group is needed. On CPU the workers get DS_ACCELERATOR=cpu through
RunConfig(worker_runtime_env=...) before anything imports deepspeed.

Each worker only does process setup and delegates to the plain eagle3.train.trainer.Eagle3Trainer:
build the draft, take the engine, resume, train cfg.num_steps, export. Rank 0 logs every
step; `ray.train.report` is called only with checkpoints and once at the end, because each
call is a barrier across workers that costs many times a small draft's step.

Checkpoints: when due (cfg.checkpoint.checkpoint_every, and after the last step) every rank writes its
DeepSpeed checkpoint files (model states on rank 0, its own ZeRO optimizer shard, and the
client state with every rank's data position and RNG states) to a local temporary directory
and reports it; Ray Train merges the ranks' files into one checkpoint directory of the run's
storage, `<out_dir>/ray_train/train/checkpoint_*`. Calling `run_training` again with the same
out_dir restores Ray Train's checkpoint manager from that storage, and every worker resumes
from `ray.train.get_checkpoint()` (same num_workers required: data positions are per rank; a resume
that cannot match is refused before any worker starts, from what was reported with the checkpoint).
Ray Train's own worker-failure retries (FailureConfig(max_failures=cfg.checkpoint.max_failures):
a dead worker process restarts the whole group) resume the same way, within the same job.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

from compat.ray_train import read_snapshot
from eagle3.train.config import TrainConfig

logger = logging.getLogger(__name__)

RUN_NAME = "train"


def train_loop_per_worker(config: dict) -> None:
    """Body of every Ray Train worker; `config` is built by run_training."""
    t_start = time.perf_counter()
    import ray.train

    from compat.process_group import mute_barrier_device_warning
    from eagle3.train import deepspeed_backend
    from eagle3.train.trainer import Eagle3Trainer

    logging.basicConfig(level=logging.INFO)
    mute_barrier_device_warning()  # torch's warning at every checkpoint's barrier (compat/process_group.py)
    cfg: TrainConfig = config["cfg"]
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    online = config.get("online")
    dataset = None
    if online is not None:  # train.source: online (ray_jobs/online.py): tables from the feed actor
        from eagle3.train.data.online import OnlineDataset

        dataset = OnlineDataset(online["feed"], online["tokens_path"], online["samples_per_shard"], online["layout"],
                                seed=cfg.seed, rank=rank, world_size=world_size,
                                shuffle_buffer_size=cfg.data.shuffle_buffer_size,
                                heldout_threshold=online["heldout_threshold"])
    if config.get("gpu_memory_fraction") is not None:
        import torch

        # train.online.gpu_split shared: this rank's GPU also holds an engine replica; stay within our share
        # (Ray Train made this worker's GPU the current device).
        torch.cuda.set_per_process_memory_fraction(config["gpu_memory_fraction"])
    trainer = Eagle3Trainer(cfg, config["target_dir"], config["data_files"], rank=rank, world_size=world_size,
                            dataset=dataset, heldout_threshold=config["heldout_threshold"])
    trainer.attach_engine(deepspeed_backend.initialize(trainer.model, cfg, world_size, use_gpu=config["use_gpu"]))
    workers = worker_placement(rank, world_size)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            trainer.load_checkpoint(ckpt_dir)

    def report_with_checkpoint(metrics: dict) -> None:
        with tempfile.TemporaryDirectory(prefix="eagle3-ckpt-") as tmp:
            trainer.save_checkpoint(tmp)
            # What a resume must match, also where the driver reads it before starting workers
            # (resume_refusal_before_workers); the checkpoint's own client state stays the workers' check.
            ray.train.report({**metrics, "world_size": world_size, "heldout_threshold": config["heldout_threshold"]},
                             checkpoint=ray.train.Checkpoint.from_directory(tmp))

    if config.get("provisional_draft_dir"):
        # eval.start_during_training: the draft as it stands, so that the eval's engines start now
        # with its config and shapes (ray_jobs/evaluate.py); they take the trained weights at the end.
        write_provisional_draft(trainer, config["provisional_draft_dir"])

    select_every = config.get("select_every_steps") or 0
    last: dict = {}
    progress = _Progress(cfg, config["metrics_path"], config.get("progress")) if rank == 0 else None
    profiler = StepProfiler(cfg.profiling.profile_steps, Path(config["metrics_path"]).parent / "profile",
                            done=trainer.global_step) if rank == 0 and cfg.profiling.profile_steps else None

    ids_log = _SampleIds(Path(config["metrics_path"]).parent / "sample_ids", rank, trainer.dataset) \
        if cfg.online.record_sample_ids else None

    def on_step(metrics: dict) -> None:
        ranges = metrics.pop("data_ranges")
        if ids_log is not None:  # before the checkpoint: a step in a checkpoint is in the record
            ids_log.write(metrics["step"], ranges)
        last.update(metrics)
        if profiler is not None:
            profiler.step()
        if rank == 0:
            if "heldout_full_acc_0" in metrics:
                # DEBUG keeps the training log quiet; metrics.jsonl, curves.png and the summary carry it
                accs = " ".join(f"{metrics[f'heldout_full_acc_{i}']:.3f}" for i in range(cfg.draft.ttt_steps))
                logger.debug("step %d held-out full_acc per TTT step %s (%d positions, %d samples, %.1f s)",
                            metrics["step"], accs, metrics["heldout_positions"], metrics["heldout_samples"],
                            metrics["heldout_eval_s"])
            progress.update(metrics)
        # The last step's checkpoint goes with the final report, after the export.
        if trainer.checkpoint_due() and trainer.global_step < cfg.num_steps:
            report_with_checkpoint(metrics)
        step = trainer.global_step
        if select_every and step % select_every == 0 and step < cfg.num_steps:
            # eval.select_every_steps: a candidate for the eval's draft engine to measure (eagle3.evaluate.selection)
            write_provisional_draft(trainer, config["candidate_dir_format"].format(step=step))

    t0 = time.perf_counter()
    trainer.fit(on_step=on_step)
    train_seconds = time.perf_counter() - t0
    if profiler is not None:
        profiler.close()
    if progress is not None:
        progress.close()
    trainer.export(config["draft_dir"])
    report_with_checkpoint({
        **last, "done": True, "steps": trainer.global_step, "loss_first": trainer.loss_first,
        "loss_last": trainer.loss_last, "tokens": trainer.tokens_seen, "tokens_this_run": trainer.run_tokens,
        "tokens_per_s": trainer.tokens_per_s, "train_seconds": train_seconds,
        "first_step_s": trainer.first_step_seconds, "steady_tokens_per_s": trainer.steady_tokens_per_s,
        "setup_s": t0 - t_start,
        "precision": "bf16 mixed" if deepspeed_backend.resolve_bf16(cfg, config["use_gpu"]) else "float32",
        "resumed_from_step": trainer.resumed_from_step, "draft_dir": config["draft_dir"], "workers": workers,
        "heldout": trainer.last_heldout,
    })


def worker_placement(rank: int, world_size: int) -> list[dict]:
    """Every rank's node, host, process and device, gathered over the training process group
    (so across nodes, through NCCL on GPUs): the record that says where training ran
    (benchmarks/two_node.py checks one worker per node). Collective: every rank calls it."""
    import os
    import socket

    import ray
    import torch
    import torch.distributed as dist

    mine = {"rank": rank, "node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
            "pid": os.getpid(), "backend": dist.get_backend() if dist.is_initialized() else None,
            "device": str(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu",
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if world_size == 1 or not dist.is_initialized():
        return [mine]
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return sorted(gathered, key=lambda w: w["rank"])


class _SampleIds:
    """train.online.record_sample_ids: per optimizer step, the sample ids this rank trained and those
    the engines rejected, one JSON line a step in <train>/sample_ids/rank-<r>.jsonl (appended;
    a step redone after a restart gets a later line, which is the one that counts)."""

    def __init__(self, directory: Path, rank: int, dataset):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"rank-{rank}.jsonl"
        self.rank, self.dataset = rank, dataset
        self._orders: dict[int, list] = {}

    def write(self, step: int, ranges: list) -> None:
        trained, rejected, epochs = [], [], set()
        for epoch, lo, hi in ranges:
            if epoch not in self._orders:
                self._orders = {epoch: self.dataset.epoch_order(epoch)}  # one epoch at a time
            epochs.add(epoch)
            for key in self._orders[epoch][lo:hi]:
                sid = self.dataset.sample_id(key)
                (rejected if sid in self.dataset.rejected else trained).append(sid)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "rank": self.rank, "epochs": sorted(epochs), "ranges": ranges,
                                "sample_ids": trained, "rejected": rejected}) + "\n")


class StepProfiler:
    """torch.profiler, on its own schedule, over optimizer steps [first, last] of a run that has
    `done` steps behind it (a resume): call step() after each optimizer step and close() at the
    end. Writes trace.json and top_ops.txt (the ops with the most self time, device time first
    where there is CUDA) into out_dir. Nothing is recorded when the run resumes past `first`."""

    def __init__(self, steps: list[int], out_dir: Path, done: int = 0):
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        self.first, self.last = steps
        self.out_dir = Path(out_dir)
        self.prof = None
        before = self.first - 1 - done  # profiler steps before the first recorded one
        if before < 0:
            logger.warning("train.profiling.profile_steps %s: this run starts at step %d, past them; not profiling",
                           steps, done + 1)
            return
        cuda = torch.cuda.is_available()
        self.sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        warmup = min(1, before)  # one warm-up step where there is one (torch warns without)
        self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                            schedule=schedule(wait=before - warmup, warmup=warmup, active=self.last - self.first + 1,
                                              repeat=1),
                            on_trace_ready=self._write)
        self.prof.start()

    def _write(self, prof) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out_dir / "trace.json"))
        (self.out_dir / "top_ops.txt").write_text(
            f"steps {self.first}..{self.last}\n" + prof.key_averages().table(sort_by=self.sort_by, row_limit=40))
        logger.info("profile of steps %d..%d written to %s", self.first, self.last, self.out_dir)

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None


class _Progress:
    """Rank 0's view of training for people: every step in metrics.jsonl (the curve plot) and the Ray
    gauges (loss, per-TTT-step accuracy, tokens/s: the dashboard); the latest step to the driver's
    progress bar (at most once a second), and a step line in this worker's log at most every
    train.log_every_s (a worker's output is forwarded to the job's, line by line)."""

    def __init__(self, cfg: TrainConfig, metrics_path: str, driver=None):
        from ray.util.metrics import Gauge

        self.num_steps, self.log_every_s = cfg.num_steps, cfg.log_every_s
        self.driver = driver  # actors.train_progress.ProgressActor: the driver's progress bar reads it
        self.t_logged = self.t_sent = float("-inf")
        self.loss = Gauge("eagle3_train_loss", "EAGLE-3 draft training loss (rank 0)")
        self.acc = Gauge("eagle3_train_accuracy", "Draft accuracy per TTT step (rank 0)", tag_keys=("ttt_step",))
        self.heldout = Gauge("eagle3_heldout_accuracy", "Draft accuracy per TTT step on the held-out split (rank 0)",
                             tag_keys=("ttt_step",))
        self.rate = Gauge("eagle3_train_tokens_per_s", "Training tokens/s (rank 0)")
        self.wait = Gauge("eagle3_train_input_wait_s", "Seconds the last step waited for its batches (rank 0)")
        self.file = open(metrics_path, "a")
        self.t_last = time.perf_counter()

    def update(self, m: dict) -> None:
        now = time.perf_counter()
        rate = m["tokens"] / max(now - self.t_last, 1e-9)
        self.t_last = now
        self.loss.set(m["loss"])
        self.rate.set(rate)
        self.wait.set(m["input_wait_s"])
        for k, v in m.items():
            if k.startswith("full_acc_"):
                self.acc.set(v, tags={"ttt_step": k.rsplit("_", 1)[1]})
            elif k.startswith("heldout_full_acc_"):
                self.heldout.set(v, tags={"ttt_step": k.rsplit("_", 1)[1]})
        self.file.write(json.dumps({**{k: v for k, v in m.items() if isinstance(v, (int, float))},
                                    "tokens_per_s": rate}) + "\n")
        self.file.flush()
        last = m["step"] >= self.num_steps
        if self.driver is not None and (last or now - self.t_sent >= 1.0):
            self.t_sent = now
            self.driver.update.remote({k: v for k, v in m.items() if isinstance(v, (int, float))} | {"tokens_per_s": rate})
        # One record per step (benchmarks/train_bench.py's step clock reads them all, at DEBUG), INFO when due.
        level = logging.DEBUG
        if last or now - self.t_logged >= self.log_every_s:
            self.t_logged, level = now, logging.INFO
        logger.log(level, "step %d/%d loss %.4f full_acc_0 %.3f lr %.2e tokens %d input_wait_ms %.1f", m["step"],
                   self.num_steps, m["loss"], m["full_acc_0"], m["lr"], m["tokens"], m["input_wait_s"] * 1e3)

    def close(self) -> None:
        self.file.close()


def plot_curves(metrics_path: Path, png_path: Path) -> Path | None:
    """Loss and per-TTT-step accuracy against step, from metrics.jsonl (all runs, resumes included):
    training accuracy as lines, held-out accuracy (the steps that measured it) dashed with markers,
    in the same colour per TTT step; and vLLM's acceptance length of the drafts the eval's engine
    measured during training (eagle3.evaluate.selection's rows), on its own axis."""
    from eagle3.evaluate.selection import METRIC

    every = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()] \
        if metrics_path.exists() else []
    rows = [r for r in every if "loss" in r]
    vllm_al = sorted((r["step"], r[METRIC]) for r in every if METRIC in r)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in rows]
    ax_loss.plot(steps, [r["loss"] for r in rows])
    ax_loss.set(xlabel="step", ylabel="loss", title="EAGLE-3 draft training loss")
    for key in sorted(k for k in rows[-1] if k.startswith("full_acc_")):
        i = key.rsplit("_", 1)[1]
        (line,) = ax_acc.plot(steps, [r.get(key) for r in rows], label=f"TTT step {i}", alpha=0.6)
        held = [(r["step"], r[f"heldout_{key}"]) for r in rows if f"heldout_{key}" in r]
        if held:
            ax_acc.plot(*zip(*held), "--o", color=line.get_color(), markersize=3, label=f"held-out, TTT step {i}")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="draft accuracy (loss-masked tokens)")
    handles, labels = ax_acc.get_legend_handles_labels()
    if vllm_al:
        ax_al = ax_acc.twinx()
        (al_line,) = ax_al.plot(*zip(*vllm_al), "-s", color="black", markersize=4,
                                label="vLLM acceptance length (greedy, held-out prompts)")
        ax_al.set(ylabel="acceptance length in vLLM")
        handles, labels = handles + [al_line], labels + [al_line.get_label()]
    ax_acc.legend(handles, labels, fontsize="small", loc="lower right", framealpha=0.8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def finished_run_summary(cfg: TrainConfig, out: Path, draft_dir: Path) -> dict | None:
    """The summary of a run in `out` that is done already: its latest registered checkpoint is the
    final report (done) at exactly cfg.num_steps, that checkpoint is on disk, and the draft was
    exported to draft_dir. None otherwise (a fresh run, one to resume, more steps asked, the draft
    missing or to go elsewhere): then Ray Train runs and resumes as usual.

    Read from Ray Train's checkpoint manager snapshot, the record a Ray Train resume restores
    itself; compat/ray_train.py owns its layout (and its test fails if that moves)."""
    snap = read_snapshot(out / "ray_train", RUN_NAME)
    latest = snap.latest if snap is not None else None
    if latest is None:
        return None
    m, ckpt = latest.metrics, latest.path
    if not (m.get("done") and m.get("steps") == cfg.num_steps):
        return None
    if not ckpt.is_dir() or Path(m.get("draft_dir", "")) != draft_dir or not (draft_dir / "config.json").exists():
        return None
    summary = {
        "loss_first": m["loss_first"], "loss_last": m["loss_last"], "steps": m["steps"], "tokens": m["tokens"],
        "tokens_this_run": 0, "tokens_per_s": 0.0, "train_seconds": 0.0, "first_step_s": None,
        "steady_tokens_per_s": None, "setup_s": None, "checkpoint": str(ckpt),
        "draft_dir": str(draft_dir), "resumed_from_step": m["steps"], "num_workers": cfg.num_workers, "skipped": True,
        "heldout": m.get("heldout"),
    }
    summary["curves_png"] = str(plot_curves(out / "metrics.jsonl", out / "curves.png"))
    return summary


def resume_refusal_before_workers(out: Path, num_workers: int, heldout_threshold: int) -> str | None:
    """Why the run in `out` cannot resume with num_workers ranks and heldout_threshold, judged from
    what Ray Train registered with its latest checkpoint (the ranks and the held-out threshold that
    train_loop_per_worker reports with each one), before any worker starts; None if it can, or
    when nothing is registered or the checkpoint was reported without them (then the workers judge
    the checkpoint itself, eagle3.train.trainer.resume_refusal, after their set-up)."""
    from eagle3.train.trainer import resume_refusal

    snap = read_snapshot(out / "ray_train", RUN_NAME)
    latest = snap.latest if snap is not None else None
    if latest is None or "world_size" not in latest.metrics:
        return None
    m = latest.metrics
    return resume_refusal(latest.path, m["world_size"], num_workers, m.get("heldout_threshold", 0), heldout_threshold)


def write_provisional_draft(trainer, out_dir: str) -> None:
    """Export the draft as it stands (every rank: a collective under ZeRO-3) into out_dir, which
    appears whole or not at all (written beside it, then renamed), replacing an earlier one: the
    provisional draft the eval's engines start from, and the candidates they measure."""
    import shutil

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if trainer.export(tmp) is not None:  # rank 0
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)


def scaling_config(num_workers: int, use_gpu: bool, gpus_per_worker: float = 1.0):
    """Ray Train's ScalingConfig: a whole GPU per worker, or with gpus_per_worker < 1 (online
    mode's shared GPUs, ray_jobs.online.split_gpus) that share of one, as Ray's fractional resource."""
    from ray.train import ScalingConfig

    if use_gpu and gpus_per_worker < 1:
        return ScalingConfig(num_workers=num_workers, use_gpu=True, resources_per_worker={"GPU": gpus_per_worker})
    return ScalingConfig(num_workers=num_workers, use_gpu=use_gpu)


def run_training(cfg: TrainConfig, data_files: list[str] | None, target_dir: str, out_dir: str,
                 draft_dir: str | None = None, *, use_gpu: bool | None = None, online: dict | None = None,
                 gpus_per_worker: float = 1.0, heldout_threshold: int = 0,
                 provisional_draft_dir: str | None = None, candidate_dir_format: str | None = None,
                 select_every_steps: int = 0) -> dict:
    """Train a draft on cfg.num_workers Ray Train workers; resume if out_dir holds a checkpoint.
    The data: committed shard files, or with data_files None, `online` (ray_jobs/online.py: the
    feed actor's handle, tokens_path, samples_per_shard, layout (layer_ids, hidden_size, hs_dtype)).

    Returns a summary: loss_first (step 1 of the whole run, kept across resumes), loss_last,
    steps, tokens (all ranks, whole run), tokens_per_s and train_seconds (this call's steps, rank
    0's wall time in fit: the first step, with the draft's torch.compile on CUDA, checkpoints and
    logging included), first_step_s and steady_tokens_per_s (that first step apart: None with
    fewer than 2 steps), setup_s (rank 0, from the worker's start to its first step: draft,
    DeepSpeed engine, input pipeline, resume), checkpoint (latest
    checkpoint directory, taken after the last step), draft_dir (the speculators-format export,
    eagle3.train.export; default <out_dir>/draft),
    resumed_from_step (None for a fresh run), num_workers, workers (each rank's node_id, host, pid, backend
    and device: actors.trainer.worker_placement), heldout (the last held-out evaluation, eagle3.train.trainer
    Eagle3Trainer._heldout_record: step, full_acc and cond_acc per TTT step, train_full_acc averaged
    over the steps since the evaluation before, num_positions, num_samples; None without a split:
    heldout_threshold 0, from prepared/heldout.json, eagle3.prepare.heldout). Also written to
    <out_dir>/train_summary.json. use_gpu None: when the Ray cluster has GPUs. gpus_per_worker < 1:
    each worker takes that share of one GPU (Ray resource and torch memory cap), the rest of it
    being an engine replica's (online mode's train.online.gpu_split shared), or the eval's engines'
    (eval.start_during_training). provisional_draft_dir: the workers export the draft there once set
    up, before the first step (write_provisional_draft). select_every_steps > 0: the workers also
    export the draft every that many steps (not the last) to candidate_dir_format.format(step=step),
    for the eval's engines to measure (eagle3.evaluate.selection).
    """
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if not data_files and online is None:
        raise ValueError("run_training got no hidden-states shard files; pass the extract stage's committed shards")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    finished = finished_run_summary(cfg, out, Path(draft_dir).resolve() if draft_dir else out / "draft")
    if finished is not None:  # a resubmitted finished job: no worker group to start
        logger.info("train: already at step %d of %d, skipped", finished["steps"], cfg.num_steps)
        (out / "train_summary.json").write_text(json.dumps(finished, indent=1))
        return finished
    refusal = resume_refusal_before_workers(out, cfg.num_workers, heldout_threshold)
    if refusal is not None:  # before the worker group: its set-up (DeepSpeed, the target's head) is the cost
        raise ValueError(refusal)
    if use_gpu is None:
        use_gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    # Ray sets OMP_NUM_THREADS=1 for a 1-CPU worker, and then each batch is read and packed by one
    # thread (benchmarks/batch_bench.py). Give each rank its share of the CPUs: per worker on a CPU
    # cluster, per GPU on a GPU cluster.
    res = ray.cluster_resources() if ray.is_initialized() else {}
    share = max(1, int(res.get("GPU", 0))) if use_gpu else cfg.num_workers
    env_vars = {"OMP_NUM_THREADS": str(max(1, int(res.get("CPU", 1)) // share))}
    if not use_gpu:
        env_vars["DS_ACCELERATOR"] = "cpu"
    from actors.train_progress import ProgressActor

    progress_actor = ray.remote(ProgressActor).options(num_cpus=0).remote()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg, "online": online,
                           "data_files": None if online else [str(Path(f).resolve()) for f in data_files],
                           "target_dir": str(Path(target_dir).resolve()),
                           "draft_dir": str(Path(draft_dir).resolve() if draft_dir else out / "draft"),
                           "use_gpu": use_gpu, "metrics_path": str(out / "metrics.jsonl"), "progress": progress_actor,
                           "heldout_threshold": heldout_threshold, "provisional_draft_dir": provisional_draft_dir,
                           "candidate_dir_format": candidate_dir_format,
                           "select_every_steps": select_every_steps if candidate_dir_format else 0,
                           "gpu_memory_fraction": gpus_per_worker if use_gpu and gpus_per_worker < 1 else None},
        scaling_config=scaling_config(cfg.num_workers, use_gpu, gpus_per_worker),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(
            name=RUN_NAME, storage_path=str(out / "ray_train"),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_checkpoints_to_keep),
            failure_config=FailureConfig(max_failures=cfg.checkpoint.max_failures),
            worker_runtime_env={"env_vars": env_vars},
        ),
    )
    from actors.train_progress import DriverProgress

    driver = DriverProgress(progress_actor, cfg.num_steps, cfg.log_every_s)
    try:
        result = trainer.fit()
    finally:
        driver.close()
        ray.kill(progress_actor)
    m = result.metrics or {}
    if not m.get("done"):
        raise RuntimeError(f"Ray Train finished without the final report (last metrics: {m}); see the worker logs")
    summary = {
        "loss_first": m["loss_first"], "loss_last": m["loss_last"], "steps": m["steps"], "tokens": m["tokens"],
        "tokens_this_run": m["tokens_this_run"], "tokens_per_s": m["tokens_per_s"], "train_seconds": m["train_seconds"],
        "first_step_s": m.get("first_step_s"), "steady_tokens_per_s": m.get("steady_tokens_per_s"),
        "setup_s": m.get("setup_s"), "precision": m.get("precision"),
        "checkpoint": result.checkpoint.path if result.checkpoint is not None else None,
        "draft_dir": m["draft_dir"], "resumed_from_step": m["resumed_from_step"], "num_workers": cfg.num_workers,
        "workers": m.get("workers"), "heldout": m.get("heldout"),
    }
    summary["curves_png"] = str(plot_curves(out / "metrics.jsonl", out / "curves.png"))
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1))
    logger.info("training done: %s", summary)
    return summary

"""The job: prepare -> [regenerate] -> extract -> train -> export -> eval, on the Ray cluster it runs in.

    python -m ray_jobs.run --config configs/demo.yaml
    ray job submit --working-dir . -- python -m ray_jobs.run --config configs/gpu_8b.yaml

Each stage writes under output_dir/<stage>/ with a provenance.json, and reuses what an
earlier run of the same job committed (extraction resumes shard by shard). The driver
imports neither vllm, torch nor deepspeed: heavy work runs in Ray tasks and actors.
Output layout:
    target/          the tiny demo target (only when target.model is null)
    prepared/        tokens.parquet, rejects.jsonl, eval_prompts.jsonl, heldout.json (the held-out split)
    regenerated/     (regenerate.enabled) data/shard-*.parquet conversations, committed/, tokens.parquet
    hidden_states/   data/shard-*.arrow, committed/, MANIFEST.json, rejects.jsonl
    train/           DeepSpeed checkpoints, metrics, loss plot
    draft/           the speculators-format EAGLE-3 draft (config.json, model.safetensors)
    report.json      the run summary printed at the end
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import JobConfig, load_job_config
from eagle3.provenance import write_provenance
from ray_jobs.target import resolve_target

log = logging.getLogger("eagle3")


def _prepare(cfg: JobConfig, target_dir: str, out: Path) -> dict:
    from eagle3.prepare.tokens import prepare_dataset_ray

    # The driver reads the source and assembles the output; Ray tasks on the cluster's CPUs tokenize.
    summary = prepare_dataset_ray(cfg.prepare, target_dir, str(out))
    write_provenance(out, cfg.to_dict(), "prepare", {"summary": summary})
    return summary


@dataclass
class EvalPlan:
    """The eval stage's engines and what they measure (eval_plan)."""

    engines: list
    """(k, draft directory or None, engine settings, whether it times the windows) each."""
    at_once: bool
    why: str
    share: float
    """Each engine's Ray GPU resource (1.0 one at a time)."""
    gpu: bool
    measure: dict
    windows: tuple
    samplings: tuple
    source: str
    speed_k: int | None


# Of each training worker's GPU, what the eval's engines take while the draft trains
# (eval.start_during_training); the worker keeps the rest (Ray resource and torch memory cap).
EVAL_GPU_RESERVE = 0.5


def eval_plan(cfg: JobConfig, target_dir: str, draft_dir: str, prompts: list[list[int]], *,
              during_training: bool = False) -> EvalPlan:
    """One engine (one Ray actor) per setting, started one at a time with the device to itself, or
    side by side (eval.engines_at_once: a small target's engines share its GPU; always while the
    draft trains, in EVAL_GPU_RESERVE of the GPU)."""
    import ray

    from eagle3.evaluate import eval_samplings, resolve_enforce_eager, speed_windows
    from eagle3.prepare.regenerate import resolve_sampling

    ev = cfg.eval
    gpu = ray.cluster_resources().get("GPU", 0) >= 1
    served = resolve_sampling(cfg.regenerate, target_dir)
    samplings = eval_samplings(served.temperature, served.top_p)
    source = ("regenerate.temperature/top_p where set, else the target's generation_config.json, else 1.0 "
              "(eagle3.prepare.regenerate.resolve_sampling)")
    speed_k = ev.resolved_speed_k
    windows = speed_windows(ev.speed_batch_sizes, gpu=gpu, max_tokens=ev.speed_window_tokens)
    serving_eager = resolve_enforce_eager(ev.enforce_eager, gpu=gpu)
    longest = max([ev.max_tokens] + [w.max_tokens for w in windows])
    room = longest + max(ev.num_speculative_tokens) + 8
    max_len = min(cfg.prepare.max_length, max(len(p) for p in prompts) + room)
    # The windows decode more tokens than acceptance does: only prompts with room for them.
    speed_prompts = [p for p in prompts if len(p) + room <= max_len]
    if windows and not speed_prompts:
        raise ValueError(f"no held-out prompt leaves room for {longest} generated tokens within prepare.max_length="
                         f"{cfg.prepare.max_length}: raise it, or set eval.speed_batch_sizes: [] (no throughput)")
    common = {"max_model_len": max_len, "dtype": cfg.target.dtype, "trust_remote_code": cfg.target.trust_remote_code}
    # vLLM sizes its CUDA graph captures by max_num_seqs (compat.vllm_engine.eagle3_engine_kwargs):
    # the timed engines never decode more than the largest batch at once.
    serving = {**common, "enforce_eager": serving_eager, "max_num_seqs": max(ev.speed_batch_sizes, default=16)}
    plan = [(k, draft_dir, serving if k == speed_k else {**common, "enforce_eager": True}, k == speed_k)
            for k in ev.num_speculative_tokens]
    if speed_k is not None:
        plan.append((0, None, serving, True))  # the target alone: the speedup's baseline
    if during_training:
        at_once, why = True, "started while the draft trains (eval.start_during_training)"
    else:
        at_once, why = engines_at_once(cfg, target_dir, len(plan), gpu=gpu)
    share = 1.0
    if at_once:
        from ray_jobs.extract import given_kv_cache_bytes, gpu_share

        room = EVAL_GPU_RESERVE if during_training else 1.0
        share = int(gpu_share(len(plan)) * room * 10_000) / 10_000
        if gpu:  # each engine its share of the device, and a KV cache of a set size (no profiling of the others)
            plan = [(k, d, {**e, "gpu_memory_utilization": cfg.extract.gpu_memory_utilization * room / len(plan),
                            "kv_cache_memory_bytes": given_kv_cache_bytes(cfg.extract)}, t) for k, d, e, t in plan]
    measure = {"prompts": prompts, "max_tokens": ev.max_tokens, "samplings": samplings, "speed_prompts": speed_prompts,
               "seed": ev.seed, "ignore_eos": ev.ignore_eos, "speed_precision": ev.speed_precision,
               "speed_max_s": ev.resolved_speed_max_s(gpu=gpu)}
    return EvalPlan(plan, at_once, why, share, gpu, measure, windows, samplings, source, speed_k)


def _evaluate(cfg: JobConfig, target_dir: str, draft_dir: str, prompts: list[list[int]],
              early: EarlyEval | None = None) -> dict:
    """The eval stage: its engines (eval_plan) started now, or while the draft trained (`early`),
    their acceptance measured side by side and their timed windows taken in turns (_measure_group);
    eval.json's dict (eagle3.evaluate.eval_report)."""
    import ray

    from eagle3.evaluate import eval_report

    started = early.take(draft_dir) if early is not None else None
    p = early.plan if started is not None else eval_plan(cfg, target_dir, draft_dir, prompts)
    log.info("eval: %d engine(s), %s (%s)", len(p.engines), "started side by side, timed in turns"
             if p.at_once else "one at a time", p.why)
    results = []
    for group in ([p.engines] if p.at_once else [[u] for u in p.engines]):
        results += _measure_group(ray, cfg, target_dir, group, gpu=p.gpu, share=p.share, measure=p.measure,
                                  windows=p.windows, started=started)
    out = {"target": target_dir, "draft": draft_dir} | eval_report(
        results, samplings=p.samplings, sampling_source=p.source, windows=p.windows, speed_k=p.speed_k,
        num_prompts=len(prompts), max_tokens=cfg.eval.max_tokens, ignore_eos=cfg.eval.ignore_eos,
        precision=cfg.eval.speed_precision)
    if started is not None:
        out["started_during_training"] = started["record"]
    return out


def _measure_group(ray, cfg: JobConfig, target_dir: str, group: list, *, gpu: bool, share: float, measure: dict,
                   windows, started: dict | None = None) -> list[dict]:
    """One group of the eval plan's engines ((k, draft, engine settings, timed) each): placed and
    started at once (or `started` already: EarlyEval.take's actors), then measured
    (eagle3.evaluate.measure): what times nothing (acceptance) side by side, timed windows with no
    other engine working, the two that time them taking turns (_interleaved_speed); then released.
    Each engine's result, with how long its actor and its engine took to start."""
    from actors.evaluator import place_evaluator

    if started is not None:
        actors, placed_at = started["actors"], started["placed_at"]
    else:
        placed_at = time.time()
        actors = [place_evaluator(cfg.extract.cpu_kvcache_space_gib, gpu=gpu, gpu_share=share) for _ in group]
    try:
        if started is None:
            ray.get([a.start.remote(target_dir, draft, num_speculative_tokens=k, **engine)
                     for a, (k, draft, engine, _) in zip(actors, group)])
        # Engines side by side that both time the windows (the draft's at speed_k and the target
        # alone) take turns, one round of every window each: a drift of the machine meets both.
        timed = [i for i, u in enumerate(group) if u[3]] if windows else []
        interleave = len(timed) > 1
        own_windows = [windows if i in timed and not interleave else () for i in range(len(group))]
        # Calls that time nothing (acceptance, and engines whose windows come in turns below) run side
        # by side; a call that times its windows runs alone.
        untimed = [i for i, w in enumerate(own_windows) if not w]
        by_engine = dict(zip(untimed, ray.get([actors[i].measure_started.remote(**measure, windows=())
                                               for i in untimed])))
        by_engine |= {i: ray.get(actors[i].measure_started.remote(**measure, windows=w))
                      for i, w in enumerate(own_windows) if w}
        done = [by_engine[i] for i in range(len(group))]
        if interleave:
            _interleaved_speed(ray, [actors[i] for i in timed], [done[i] for i in timed], measure["speed_prompts"],
                               windows, measure["samplings"], precision=measure["speed_precision"],
                               max_s=measure["speed_max_s"])
        ray.get([a.shutdown.remote() for a in actors])  # all at once: each engine takes seconds to stop
        for res, (_, draft, engine, _) in zip(done, group):
            # The wait before the engine (the actor's process start and imports, and its share of the
            # device), and of it the wait for the actor's first line.
            res["before_engine_s"] = res.pop("engine_started_at") - placed_at
            res["actor_start_s"] = res.pop("actor_created_at") - placed_at
            # of which the wait for the actor's process (for its share of the device, an earlier stage's to be
            # freed), negative where Ray gave it a worker process that was already running
            res["process_start_s"] = res.pop("process_started_at") - placed_at
            res["engines_at_once"] = len(group)
            log.info("eval: %s", _engine_line(res, draft, engine))
        return done
    finally:
        for a in actors:
            ray.kill(a)


def _engine_line(res: dict, draft: str | None, engine: dict) -> str:
    """'num_speculative_tokens=3 (engine CUDA graphs, started in 42 s, ...): greedy acceptance length 1.860, ...'."""
    what = ", ".join(f"{m} acceptance length {acc['acceptance_length']:.3f}" for m, acc in res.get("acceptance", {}).items())
    if "speed" in res:
        what += ("; " if what else "") + ", ".join(
            f"batch {r['batch_size']} {r['mode']} {r['tokens_per_s']['mean']:.0f} tokens/s" for r in res["speed"])
    name = f"num_speculative_tokens={res['num_speculative_tokens']}" if draft else "target alone"
    side = f"; {res['engines_at_once']} side by side" if res["engines_at_once"] > 1 else ""
    return (f"{name} (engine {'eager' if engine['enforce_eager'] else 'CUDA graphs'}, started in "
            f"{res['engine_start_s']:.0f} s, {res['before_engine_s']:.0f} s after its actor was placed{side}): {what}")


def _interleaved_speed(ray, actors: list, results: list[dict], prompts, windows, samplings, *, precision: float,
                       max_s: float) -> None:
    """The timed windows on engines that stand side by side (the draft's and the target alone's): their
    untimed warm-up waves (all at once), then round r of every window on each engine in turn (the order
    reversed every other round); after the windows' repeats, more rounds of the windows whose paired
    speedup is not yet known to within +-precision (eagle3.evaluate.imprecise), for at most max_s
    seconds. Merged per engine (eagle3.evaluate.merge_speed) into its result's "speed"; its wall_s
    gains the time."""
    from eagle3.evaluate import imprecise, merge_speed, reachable, rounds_to_precision

    t = time.perf_counter()  # the untimed warm-up waves, all engines at once
    ray.get([a.speed.remote(prompts, windows, samplings, rounds=[], warmup=True) for a in actors])
    spent = [time.perf_counter() - t] * len(actors)
    parts: list[list] = [[] for _ in actors]

    def one_round(r: int, only=None) -> None:
        for i in (range(len(actors)) if r % 2 == 0 else reversed(range(len(actors)))):
            t = time.perf_counter()
            parts[i].append(ray.get(actors[i].speed.remote(prompts, windows, samplings, rounds=[r], warmup=False,
                                                           only=only)))
            spent[i] += time.perf_counter() - t

    rounds = max(w.repeats for w in windows)
    t = time.perf_counter()
    for r in range(rounds):
        one_round(r)
    # one window at one sampling on both engines, for as long as the repeats took
    per_key_s = (time.perf_counter() - t) / (rounds * len(windows) * len(samplings))
    draft = next(i for i, res in enumerate(results) if res["draft"] is not None)
    alone = next(i for i, res in enumerate(results) if res["draft"] is None)
    started, extra, unreachable = time.perf_counter(), 0, []
    while precision > 0 and (left := max_s - (time.perf_counter() - started)) > 0:
        rates = [{(r["batch_size"], r["mode"]): [n / s for n, s in zip(r["num_tokens"], r["seconds"])]
                  for r in merge_speed(parts[i])} for i in (draft, alone)]
        ratios = {key: [x / y for x, y in zip(rates[0][key], rates[1][key])] for key in rates[0]}
        wide = imprecise(ratios, precision)
        # Rounds that cannot bring an interval to +-precision in the time left, at the spread of its
        # rounds so far, are not run: the machine's noise would only spend the stage's time.
        only = reachable(ratios, precision, left / (per_key_s * max(1, len(wide))))
        unreachable = [f"batch {b} {m}: ~{rounds_to_precision(ratios[b, m], precision):.0f} rounds needed"
                       for b, m in wide if (b, m) not in only]
        if not only:
            break
        one_round(rounds, only)
        rounds += 1
        extra += 1
    if unreachable:
        log.info("eval: %d round(s) beyond the repeats; not timed further, their intervals would not reach +-%g%% "
                 "in eval.speed_max_s=%gs at their spread (~%.1f s a window pair): %s", extra, precision * 100, max_s,
                 per_key_s, "; ".join(unreachable))
    for i, res in enumerate(results):
        res["speed"] = merge_speed(parts[i])
        res["speed_interleaved"] = True
        res["speed_beyond_repeats"] = {"rounds": extra, "unreachable": unreachable, "window_pair_s": round(per_key_s, 2)}
        res["wall_s"] += spent[i]


def engines_at_once(cfg: JobConfig, target_dir: str, num_engines: int, *, gpu: bool) -> tuple[bool, str]:
    """(whether the eval stage starts its engines side by side, why): eval.engines_at_once, where
    'auto' is true for several engines of a small target on a GPU (ray_jobs.extract.small_target:
    each engine start, ~70 s with CUDA graphs on an H200 for a 135M target, overlaps the others',
    and the memory of a few such engines is a small part of the device's)."""
    setting = cfg.eval.engines_at_once
    if num_engines < 2:
        return False, "one engine"
    if setting != "auto":
        return bool(setting), "eval.engines_at_once"
    if not gpu:
        return False, "auto: on the CPU (engines start in seconds there)"
    from eagle3.extract.extractor import target_text_config
    from ray_jobs.extract import small_target

    small, why = small_target(cfg.extract, target_text_config(target_dir), gpu=True)
    return small, f"auto: {why}"


class _Background:
    """fn(*args) in a daemon thread of the driver; result() joins it and returns its value or raises
    its error. Daemon: a job that stops (the doctor failed) does not wait for it."""

    def __init__(self, fn, *args):
        import threading

        self._out: dict = {}
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="job-background", daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        try:
            self._out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by result() in the driver's thread
            self._out["error"] = e

    def result(self):
        self._thread.join()
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


def eval_during_training(cfg: JobConfig, target_dir: str, *, gpu: bool) -> tuple[bool, str]:
    """(whether the eval's engines start while the draft trains, why): eval.start_during_training,
    for a job that trains (offline) and then evaluates. 'auto' is on where the engines would start
    side by side anyway (engines_at_once: a small target on a GPU) and one worker trains: the
    workers' GPUs are shared with the engines (EVAL_GPU_RESERVE), and two workers could land on
    one GPU, which NCCL refuses. Raises ValueError for a forced true that cannot work."""
    setting = cfg.eval.start_during_training
    if not ("train" in cfg.stages and "eval" in cfg.stages and cfg.eval.enabled):
        return False, "the job does not both train and evaluate"
    if setting is False:
        return False, "eval.start_during_training: false"
    blocker = None
    if cfg.train.source != "offline":
        blocker = "train.source is online: its engines already share the GPUs with the trainer"
    elif gpu and cfg.train.num_workers != 1:
        blocker = (f"train.num_workers={cfg.train.num_workers} on GPUs: each worker would keep only part of a GPU, "
                   "and Ray may place two on one (NCCL refuses two ranks on one GPU)")
    if blocker is not None:
        if setting is True:
            raise ValueError(f"eval.start_during_training: true cannot work here: {blocker}; set it to auto or false")
        return False, f"auto: {blocker}"
    if setting is True:
        return True, "eval.start_during_training: true"
    if not gpu:
        return False, "auto: on the CPU (the engines would take the trainer's cores)"
    n = len(cfg.eval.num_speculative_tokens) + (cfg.eval.resolved_speed_k is not None)
    return engines_at_once(cfg, target_dir, n, gpu=True)


class EarlyEval:
    """The eval's engines, started while the draft trains (eval.start_during_training): once the
    trainer is set up and has exported its provisional draft (actors.trainer.write_provisional_draft),
    placed beside the training workers (each on its EVAL_GPU_RESERVE share of the GPU) and started,
    the draft's from that provisional draft. take() hands them to the
    eval stage after training, each draft engine given the trained weights in place
    (compat.draft_reload); one that refuses them is started again from the trained draft."""

    def __init__(self, cfg: JobConfig, target_dir: str, out: Path, prompts: list[list[int]]):
        import shutil
        import threading

        self.cfg, self.target_dir = cfg, target_dir
        self.plan = eval_plan(cfg, target_dir, str(out / "draft"), prompts, during_training=True)
        self.provisional = out / "train" / "provisional_draft"
        shutil.rmtree(self.provisional, ignore_errors=True)  # an earlier run's: its shapes may not be this one's
        self.training_ended = threading.Event()
        self._cancelled = False
        self._actors: list = []
        self._bg = _Background(self._start)

    def _start(self) -> dict:
        import ray

        from actors.evaluator import place_evaluator

        # Placed once the trainer has written its provisional draft, i.e. once its workers hold their
        # resources: actors placed before them could take what the worker group needs (a cluster of 2
        # CPUs: 2 engines of 1 CPU each, and training never starts).
        t0 = time.perf_counter()
        while not (self.provisional / "config.json").exists() and not self.training_ended.is_set():
            time.sleep(0.5)
        provisional = (self.provisional / "config.json").exists()
        draft_at, placed_at = time.perf_counter() - t0, time.time()
        if self._cancelled:
            return {}
        self._actors = [place_evaluator(self.cfg.extract.cpu_kvcache_space_gib, gpu=self.plan.gpu,
                                        gpu_share=self.plan.share) for _ in self.plan.engines]
        # No provisional draft once training ended (a finished run resubmitted trains nothing): the trained one.
        source = str(self.provisional) if provisional else None
        ray.get([a.start.remote(self.target_dir, None if draft is None else source or draft, num_speculative_tokens=k,
                                **({"reloadable_draft": provisional} if draft is not None else {}), **engine)
                 for a, (k, draft, engine, _) in zip(self._actors, self.plan.engines)])
        return {"placed_at": placed_at, "provisional": source, "provisional_after_s": round(draft_at, 2),
                "ready_after_s": round(time.perf_counter() - t0, 2), "ready_at": time.time()}

    def cancel(self) -> None:
        """Training failed: release the engines (started or not)."""
        import ray

        self._cancelled = True
        self.training_ended.set()
        for a in self._actors:
            ray.kill(a)

    def take(self, draft_dir: str) -> dict | None:
        """After training: the started actors, each draft engine serving draft_dir's weights
        ({"actors", "placed_at", "record"}), or None where the engines did not start (logged; the
        eval then starts its own)."""
        import json

        import ray

        self.training_ended.set()
        ended_at = time.time()
        try:
            got = self._bg.result()
        except Exception as e:  # noqa: BLE001 - the eval goes on the usual way
            log.warning("eval: the engines started during training failed (%s); starting them now", e)
            for a in self._actors:
                ray.kill(a)
            return None
        record = {k: v for k, v in got.items() if k not in ("placed_at", "ready_at")}
        record["waited_after_training_s"] = round(max(0.0, got["ready_at"] - ended_at), 2)
        t = time.perf_counter()
        for i, (k, draft, engine, _) in enumerate(self.plan.engines):
            if draft is None or got["provisional"] is None:
                continue
            same = (json.loads((self.provisional / "config.json").read_text())
                    == json.loads((Path(draft_dir) / "config.json").read_text()))
            try:
                if not same:
                    raise RuntimeError("the trained draft's config.json differs from the provisional one's")
                ray.get(self._actors[i].reload_draft.remote(draft_dir))
            except Exception as e:  # noqa: BLE001 - compat.draft_reload.DraftReloadRefused, or the config
                log.warning("eval: the k=%d engine cannot take the trained draft in place (%s); starting it again "
                            "from %s", k, e, draft_dir)
                ray.kill(self._actors[i])
                from actors.evaluator import place_evaluator

                self._actors[i] = place_evaluator(self.cfg.extract.cpu_kvcache_space_gib, gpu=self.plan.gpu,
                                                  gpu_share=self.plan.share)
                ray.get(self._actors[i].start.remote(self.target_dir, draft_dir, num_speculative_tokens=k, **engine))
                record.setdefault("restarted", []).append(k)
        record["reload_s"] = round(time.perf_counter() - t, 2)
        log.info("eval: engines started during training: %s", record)
        return {"actors": self._actors, "placed_at": got["placed_at"], "record": record}


def _early_eval(cfg: JobConfig, target_dir: str, out: Path) -> EarlyEval | None:
    """The eval's engines, starting now while the draft trains, where eval_during_training says so."""
    import ray

    from eagle3.prepare.tokens import read_eval_prompts

    on, why = eval_during_training(cfg, target_dir, gpu=ray.cluster_resources().get("GPU", 0) >= 1)
    prompts = read_eval_prompts(out / "prepared")[: cfg.eval.num_prompts] if on else []
    if not prompts:
        log.info("eval: engines start after training (%s)", why if not on else "no held-out prompts")
        return None
    log.info("eval: engines start while the draft trains (%s)", why)
    return EarlyEval(cfg, target_dir, out, prompts)


def runs_prepare(cfg: JobConfig, out: Path) -> bool:
    """The prepare stage runs when listed, or when prepared/ has no tokens yet."""
    return "prepare" in cfg.stages or not (out / "prepared" / "tokens.parquet").exists()


def runs_regenerate(cfg: JobConfig) -> bool:
    """Regeneration runs (or resumes; a finished one is a no-op) before every extraction, not only
    when listed: extraction trains on the regenerated responses."""
    return cfg.regenerate.enabled and ("regenerate" in cfg.stages or "extract" in cfg.stages)


def check_inputs(cfg: JobConfig, out: Path) -> None:
    """Exits in seconds, before Ray starts or any model loads, when output_dir is a file, or when a
    stage that will run reads prepare.conversations and it is not there. Regeneration reads it even
    beside a finished prepared/: it rewrites each conversation from its system and user turns as
    written, not from the prepared token ids."""
    from eagle3.prepare.conversations import source_files

    if out.exists() and not out.is_dir():
        raise SystemExit(f"output_dir {out} is a file, not a directory: set output_dir to a new directory, or to "
                         f"an earlier job's to resume it")
    readers = []
    if runs_prepare(cfg, out):
        readers.append("prepare")
    if runs_regenerate(cfg) and not (out / "regenerated" / "tokens.parquet").exists():
        readers.append("regenerate")
    if readers:
        try:
            source_files(cfg.prepare.conversations)
        except ValueError as e:
            raise SystemExit(f"{' and '.join(readers)} will read the conversations, and cannot: {e}") from None


def run(cfg: JobConfig) -> dict:
    from ray_jobs.cluster import init_ray

    out = Path(cfg.output_dir).resolve()
    check_inputs(cfg, out)
    out.mkdir(parents=True, exist_ok=True)
    init_ray(cfg.ray.address, cfg.ray.num_cpus, dashboard_host=cfg.ray.dashboard_host, cache_dir=cfg.cache_dir)
    report: dict = {"output_dir": str(out), "stages": {}, "seconds": {}, "startup": {}}
    t0 = time.perf_counter()

    def timed(name, fn, *args, **kwargs):
        t = time.perf_counter()
        result = fn(*args, **kwargs)
        report["seconds"][name] = round(time.perf_counter() - t, 2)
        return result

    split = early = None
    if cfg.train.source == "online" and "train" in cfg.stages:
        import ray

        from ray_jobs.online import split_gpus

        # Once per job, here: a split that cannot work fails before any model loads; run_online places by it.
        split = split_gpus(cfg, int(ray.cluster_resources().get("GPU", 0)))
    target_dir = timed("target", resolve_target, cfg, out)
    report["target"] = target_dir
    # The doctor's tasks and prepare run side by side (prepare loads no model: a tokenizer, Ray tasks
    # over the conversations); the doctor's verdict comes first, and stops the job before any engine.
    # The doctor is submitted first: its disk estimate reads an earlier run's prepared tokens, if any.
    doctor = preparing = None
    if cfg.doctor:
        from ray_jobs.doctor import DoctorRun

        doctor = DoctorRun(cfg, target_dir)
    if runs_prepare(cfg, out):
        preparing = _Background(timed, "prepare", _prepare, cfg, target_dir, out / "prepared")
    if doctor is not None:
        ok, table, doctor_reports = doctor.result()
        report["seconds"]["doctor"] = round(doctor.seconds, 2)
        print(table, flush=True)
        report["startup"]["doctor_dry_run"] = [{"host": rep["host"], "startup_s": row.get("seconds")}
                                               for rep in doctor_reports for row in rep["rows"]
                                               if row["name"] == "dry run" and row.get("seconds") is not None]
        if not ok:
            raise SystemExit("doctor: a check failed (table above); no model was loaded (prepare ran beside the "
                             "doctor, nothing after it). Fix it, or set doctor: false")
    if preparing is not None:
        report["stages"]["prepare"] = preparing.result()

    tokens_path, tokens_source = out / "prepared" / "tokens.parquet", "prepared"
    if cfg.regenerate.enabled:
        if runs_regenerate(cfg):
            from ray_jobs.regenerate import run_regenerate

            summary = timed("regenerate", run_regenerate, cfg, str(tokens_path), target_dir, str(out / "regenerated"))
            write_provenance(out / "regenerated", cfg.to_dict(), "regenerate", {"summary": summary})
            report["stages"]["regenerate"] = {k: v for k, v in summary.items() if k != "files"}
        tokens_path, tokens_source = out / "regenerated" / "tokens.parquet", "regenerated"

    if cfg.train.source == "online" and "train" in cfg.stages:
        # Extraction runs inside training: tables go from the engines to the ranks through the object
        # store (ray_jobs/online.py); no extract stage, no shards unless train.online.epochs is keep
        # (and the held-out split's, hidden_states_heldout/).
        from ray_jobs.online import run_online

        summary = timed("train", run_online, cfg, str(tokens_path), target_dir, out, split, tokens_source=tokens_source)
        write_provenance(out / "train", cfg.to_dict(), "train", {"summary": summary})
        write_provenance(out / "draft", cfg.to_dict(), "export", {"trained_from": str(tokens_path), "source": "online"})
        report["stages"]["train"] = summary
        report["draft"] = str(out / "draft")
    elif "extract" in cfg.stages:
        from ray_jobs.extract import run_extract

        summary = timed("extract", run_extract, cfg, str(tokens_path), target_dir,
                        str(out / "hidden_states"), tokens_source=tokens_source)
        write_provenance(out / "hidden_states", cfg.to_dict(), "extract", {"summary": summary})
        report["stages"]["extract"] = {k: v for k, v in summary.items() if k != "files"}

    if cfg.train.source == "offline" and ("train" in cfg.stages or "export" in cfg.stages):
        from actors.trainer import run_training
        from eagle3.prepare.heldout import training_threshold
        from eagle3.extract.manifest import Manifest

        files = Manifest(out / "hidden_states", cfg.extract.file_format).committed_files()
        if not files:
            raise ValueError(f"no committed hidden-state shards under {out / 'hidden_states'}: run the extract stage first")
        early = _early_eval(cfg, target_dir, out)
        try:
            summary = timed("train", run_training, cfg.train_config, files, target_dir, str(out / "train"),
                            str(out / "draft"), heldout_threshold=training_threshold(out / "prepared"),
                            gpus_per_worker=1 - EVAL_GPU_RESERVE if early is not None and early.plan.gpu else 1.0,
                            provisional_draft_dir=str(early.provisional) if early is not None else None)
        except BaseException:
            if early is not None:
                early.cancel()
            raise
        write_provenance(out / "train", cfg.to_dict(), "train", {"summary": summary})
        write_provenance(out / "draft", cfg.to_dict(), "export", {"trained_from": files})
        report["stages"]["train"] = summary
        report["draft"] = str(out / "draft")

    if "eval" in cfg.stages and cfg.eval.enabled:
        from eagle3.prepare.tokens import read_eval_prompts

        prompts = read_eval_prompts(out / "prepared")[: cfg.eval.num_prompts]
        if not prompts:
            raise ValueError("no held-out prompts for eval: set prepare.num_eval_prompts > 0")
        results = timed("eval", _evaluate, cfg, target_dir, str(out / "draft"), prompts, early)
        if early is not None:
            import shutil

            shutil.rmtree(early.provisional, ignore_errors=True)  # the engines read it at their start only
        report["stages"]["eval"] = results
        (out / "eval.json").write_text(json.dumps(results, indent=1))

    report["seconds"]["total"] = round(time.perf_counter() - t0, 2)
    report["startup"].update(startup_record(report["stages"]))
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    write_provenance(out, cfg.to_dict(), "job", {"startup": report["startup"]})
    return report


def startup_record(stages: dict) -> dict:
    """What each stage paid before its work began: every engine start (seconds, host, compute dtype)
    of regenerate, extract, online training's feed and eval, and the trainer's set-up and first step
    (rank 0)."""
    rec: dict = {}
    for name in ("regenerate", "extract"):
        if stages.get(name, {}).get("engine_starts"):
            rec[name] = stages[name]["engine_starts"]
    online = (stages.get("train") or {}).get("online") or {}
    if online.get("engine_starts"):
        rec["online"] = online["engine_starts"]
    if "eval" in stages:
        rec["eval"] = [{"num_speculative_tokens": r["num_speculative_tokens"], "startup_s": r.get("engine_start_s"),
                        "dtype": r.get("dtype"), "in_process": r.get("in_process"),
                        "before_engine_s": r.get("before_engine_s"), "process_start_s": r.get("process_start_s"),
                        "engines_at_once": r.get("engines_at_once"),
                        "during_training": "started_during_training" in stages["eval"]}
                       for r in stages["eval"].get("engines", [])]
    t = stages.get("train")
    if t and t.get("setup_s") is not None:
        rec["train"] = {"setup_s": t["setup_s"], "first_step_s": t.get("first_step_s"), "precision": t.get("precision")}
    return rec


def _startup_line(startup: dict) -> str | None:
    """'doctor dry run 21s; extract engine 30s; eval engines 22s, 21s; trainer set-up 35s, first step 2.0s'."""
    parts = []
    for key, what in (("doctor_dry_run", "doctor dry run"), ("regenerate", "regenerate engine"),
                      ("extract", "extract engine"), ("online", "online engine"), ("eval", "eval engine")):
        starts = [s["startup_s"] for s in startup.get(key, []) if s.get("startup_s") is not None]
        if starts:
            side = any((s.get("engines_at_once") or 1) > 1 for s in startup.get(key, []))
            during = any(s.get("during_training") for s in startup.get(key, []))
            parts.append(f"{what}{'s' if len(starts) > 1 else ''} " + ", ".join(f"{v:.0f}s" for v in starts)
                         + (" side by side" if side else "") + (" while the draft trained" if during else ""))
    t = startup.get("train")
    if t:
        parts.append(f"trainer set-up {t['setup_s']:.0f}s"
                     + (f", first step {t['first_step_s']:.1f}s" if t.get("first_step_s") is not None else ""))
    return "; ".join(parts) or None


def _dtype_line(startup: dict) -> str | None:
    """The engines' compute dtypes (as resolved in their processes) and the trainer's precision."""
    dtypes = sorted({s["dtype"] for key in ("regenerate", "extract", "online", "eval") for s in startup.get(key, [])
                     if s.get("dtype")})
    parts = [f"engines {', '.join(dtypes)}"] if dtypes else []
    if startup.get("train", {}).get("precision"):
        parts.append(f"trainer {startup['train']['precision']}")
    return "; ".join(parts) or None


def _resumed(stage: dict) -> str:
    """What a resumed stage took from an earlier run, e.g. '; 6 of 19 shards already committed'."""
    skipped = stage.get("shards_skipped", 0)
    return f"; {skipped} of {stage['num_shards']} shards already committed" if skipped else ""


def _accuracy_lines(st: dict) -> list[str]:
    """The train/serve check, like with like: the draft's accuracy per draft position on the
    held-out conversations (speculators' full_acc_i: positions 0..i all right) beside the training
    accuracy (averaged over the steps before that evaluation) and vLLM's rate of drafts whose
    first i+1 tokens were all accepted (the eval with the largest k), on held-out prompts."""
    held = (st.get("train") or {}).get("heldout")
    if not held:
        return []

    def fmt(values) -> str:
        return "-" if values is None else " ".join(f"{v:.3f}" for v in values)

    lines = [f"  accuracy         per draft position at step {held['step']}: held-out {fmt(held['full_acc'])} "
             f"({held['num_positions']} positions, {held['num_samples']} samples"
             + (f"; over the first {held['first_tokens']} tokens of each turn {fmt(held['first_full_acc'])}, "
                f"{held['first_num_positions']} positions" if "first_tokens" in held else "")
             + f"), training {fmt(held['train_full_acc'])}"]
    # greedy: the trainer's accuracy is the draft's argmax against the target's
    evals = [r for r in (st.get("eval") or {}).get("acceptance", [])
             if (r.get("greedy") or {}).get("acceptance_rate_per_pos")]
    if evals:
        widest = max(evals, key=lambda r: r["num_speculative_tokens"])
        lines[-1] += (f", vLLM accepted (k={widest['num_speculative_tokens']}, greedy) "
                      f"{fmt(widest['greedy']['acceptance_rate_per_pos'])}")
    if "rounds_al" in held:  # the same held-out predictions counted per round, as vLLM counts its drafts
        lines.append(f"                   held-out in rounds of {len(held['rounds_acc'])}, as vLLM counts drafts: "
                     f"{fmt(held['rounds_acc'])} (AL {held['rounds_al']:.2f}, {held['num_rounds']} rounds)")
    if bound := _bound_line(st, held):
        lines.append(f"                   {bound}")
    return lines


# How much more the draft may score at its first position on its training data than on held-out
# conversations before the summary calls it short of data. Measured on SmolLM2 at 1,500 steps
# (benchmarks/results/job/job-h200-smollm2-sharegpt.md, session 23): 0.089 on 1.52M tokens, where 5x the
# data raised AL(k=3) from 1.85 to 1.94; 0.018 on 7.85M tokens, where held-out accuracy over the eval's
# first 128 tokens no longer moved.
DATA_BOUND_GAP = 0.05


def _bound_line(st: dict, held: dict) -> str | None:
    """What more of, data or steps, would raise the draft's accuracy: the gap between its training
    and held-out accuracy at the first draft position (whole turns), and its passes over the data."""
    train, heldout = held.get("train_full_acc"), held.get("full_acc")
    if not train or not heldout:
        return None
    gap = train[0] - heldout[0]
    t, data = st.get("train") or {}, (st.get("extract") or {}).get("num_tokens")
    passes = f", {t['tokens'] / data:.1f} passes over {data} tokens" if t.get("tokens") and data else ""
    if gap >= DATA_BOUND_GAP:
        return (f"short of data: the draft scores {gap:.3f} more at position 1 on its training data than held out"
                f"{passes}; more conversations (prepare.max_samples, a larger source) should raise it")
    return (f"not short of data: training and held-out accuracy meet at position 1 ({gap:+.3f}{passes}); more "
            "data alone will not raise it, more steps (train.num_steps) may")


def format_summary(report: dict) -> str:
    st = report["stages"]
    lines = [f"eagle3 job finished in {report['seconds']['total']:.0f}s; outputs under {report['output_dir']}"]
    lines.append(f"  target           {report['target']}")
    if "prepare" in st:
        p = st["prepare"]
        lines.append(f"  prepared/        {p['num_samples']} samples, {p['num_tokens']} tokens "
                     f"({p['num_loss_tokens']} in the loss), {p['num_rejected']} rejected; "
                     f"{p.get('num_heldout_conversations', 0)} conversations ({p.get('num_heldout_samples', 0)} "
                     "samples) held out of training")
    if "regenerate" in st:
        g = st["regenerate"]
        lines.append(f"  regenerated/     {g['num_samples']} conversations, {g['num_generated_tokens']} tokens generated, "
                     f"{g['num_rejected']} rejected{_resumed(g)}")
        if "num_turns_ended" in g:
            lines.append(f"                   {g['num_turns']} turns: {g['num_turns_ended']} ended by the target, "
                         f"{g['num_turns_cut']} cut ({g['num_turns_cut_at_max_tokens']} at regenerate.max_tokens)")
        for msg in g.get("untrusted", []):
            lines.append(f"                   WARNING {msg}")
    if "extract" in st:
        e = st["extract"]
        lines.append(f"  hidden_states/   {e['num_samples']} samples, {e['num_tokens']} tokens, {e['bytes'] / 1e6:.1f} MB, "
                     f"{e['bytes_per_token']:.0f} bytes/token, layers {e['layer_ids']}, {e['num_rejected']} rejected"
                     f"{_resumed(e)}")
    if "train" in st and "online" in st["train"]:
        o = st["train"]["online"]
        lines.append(f"  online           {o['num_extractions']} shard extractions ({o['num_reextracted']} redone, "
                     f"{o['num_lost']} lost), peak {o['peak_bytes_in_flight'] / 1e6:.1f} MB in flight (bound "
                     f"{o['max_inflight_bytes'] / 1e6:.1f} MB), engines waited {o['engine_idle_budget_s']:.0f}s "
                     f"for the trainer, the trainer {sum(o['trainer_wait_s']):.0f}s for engines")
    if "train" in st:
        t = st["train"]
        def loss(v):  # None: a checkpoint written before loss_last was kept in it
            return "-" if v is None else f"{v:.4f}"
        done = (f"{t.get('tokens_per_s', 0):.0f} tokens/s" if t.get("tokens_this_run", 1)
                else f"all done at step {t.get('resumed_from_step')} already, nothing trained in this run")
        if t.get("tokens_this_run", 1) and t.get("steady_tokens_per_s"):  # the first step compiles on CUDA
            done += f" ({t['steady_tokens_per_s']:.0f} after a first step of {t['first_step_s']:.1f}s)"
        lines.append(f"  train/           {t.get('steps')} steps, loss {loss(t.get('loss_first'))} -> "
                     f"{loss(t.get('loss_last'))}, {done}")
        lines.append(f"  draft/           speculators-format EAGLE-3 draft: {report.get('draft')}")
    lines.extend(_accuracy_lines(st))
    if "eval" in st:
        lines += _eval_summary(st["eval"])
    lines.append("  time per stage   " + ", ".join(f"{k} {v:.0f}s" for k, v in report["seconds"].items()))
    if (startup := _startup_line(report.get("startup", {}))) is not None:
        lines.append("  start-up         " + startup)
    if (dtypes := _dtype_line(report.get("startup", {}))) is not None:
        lines.append("  compute dtype    " + dtypes)
    return "\n".join(lines)


def _eval_summary(ev: dict) -> list[str]:
    """The eval lines of the summary: acceptance length per k and sampling, and the decode speedup
    per batch size and sampling, with the windows' range and whether it excludes 1."""
    modes = list(ev["samplings"])
    label = {m: "greedy" if m == "greedy" else f"T={s['temperature']:g} top_p={s['top_p']:g}"
             for m, s in ev["samplings"].items()}
    als = ", ".join(f"k={a['num_speculative_tokens']}: " + " / ".join(f"{a[m]['acceptance_length']:.2f}" for m in modes)
                    for a in ev["acceptance"])
    ending = "past EOS" if ev.get("ignore_eos") else "answers ending at EOS"
    lines = [f"  eval.json        acceptance length in vLLM ({' / '.join(label[m] for m in modes)}; {ending}): {als}"]
    sp = ev.get("speed")
    if sp:
        w = {x["batch_size"]: x for x in sp["windows"]}
        lines.append(f"  eval.json        decode speedup, draft at k={sp['num_speculative_tokens']} over the target "
                     f"alone ({'eager' if sp['enforce_eager'] else 'CUDA graphs'}; output tokens/s, each window "
                     f"timed {sp['windows'][0]['repeats']} times"
                     f"{', the engines taking turns' if sp.get('interleaved') else ''}):")
        for r in sp["results"]:
            s, x = r["speedup"], w[r["batch_size"]]
            al = r["with_draft"].get("acceptance_length")  # the windows run past EOS
            lines.append(f"                   batch {r['batch_size']:>3} {label[r['mode']]:<22} {s['ratio']:.2f}x "
                         f"({r['without_draft']['tokens_per_s']['mean']:.0f} -> {r['with_draft']['tokens_per_s']['mean']:.0f}"
                         f" tokens/s; windows {s['ratio_min']:.2f}-{s['ratio_max']:.2f}x"
                         f"{'' if s['exceeds_spread'] else ', within the spread'}"
                         + (f"; rounds paired {s['paired']['min']:.2f}-{s['paired']['max']:.2f}x"
                            f"{'' if s['paired_exceeds_one'] else ', across 1'}" if "paired" in s else "")
                         + _interval_text(s, sp.get("precision", 0.0))
                         + f"{f', AL {al:.2f}' if al else ''}; {x['num_prompts']} prompts x "
                         f"{x['max_tokens']} tokens past EOS)")
    return lines


def _interval_text(s: dict, precision: float) -> str:
    """'; 95% interval 1.23-1.68x over 5 rounds, wider than +-5%' for a summary's speedup line."""
    if not s.get("ci95"):
        return ""
    lo, hi = s["ci95"]
    short = f", wider than +-{precision * 100:g}%" if precision > 0 and not s["precise"] else ""
    return f"; 95% interval {lo:.2f}-{hi:.2f}x over {s['rounds']} rounds{short}"


def overrides_from(items: list[str]) -> dict:
    """--set KEY=VALUE items as load_job_config's overrides, each value parsed as YAML."""
    import yaml

    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    return overrides


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ray_jobs.run", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="YAML/JSON job config; omitted: the built-in demo defaults")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set train.num_steps=50 (value parsed as YAML)")
    ap.add_argument("--help-config", action="store_true",
                    help="print every config key with its type, default and meaning (docs/config.md), then exit")
    args = ap.parse_args(argv)
    if args.help_config:
        from eagle3.config_reference import reference

        print(reference(), end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        overrides = overrides_from(args.set)
    except ValueError as e:
        ap.error(str(e))
    cfg = load_job_config(args.config, overrides)
    report = run(cfg)
    print(format_summary(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

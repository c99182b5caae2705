"""The eval stage's driver: the draft's engines (and the target alone's) as Ray actors
(actors/evaluator.py), placed one at a time or side by side, or started while the draft trains
(EarlyEval, eval.start_during_training); their acceptance measured side by side, their timed
windows taken in turns (_interleaved_speed); eval.json's dict from eagle3.evaluate.eval_report.
What crosses this process: configs, prompts' token ids, results. Imports neither torch, vllm nor
deepspeed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import JobConfig
from ray_jobs.background import Background

log = logging.getLogger("eagle3")


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
    speed_ks: tuple = ()
    """Every k whose draft engine times the windows, speed_k first."""


# Of each training worker's GPU, what the eval's engines take while the draft trains
# (eval.start_during_training); the worker keeps the rest (Ray resource and torch memory cap).
EVAL_GPU_RESERVE = 0.5


def eval_plan(cfg: JobConfig, target_dir: str, draft_dir: str, prompts: list[list[int]], *,
              during_training: bool = False) -> EvalPlan:
    """One engine (one Ray actor) per setting, started one at a time with the device to itself, or
    side by side (eval.engines_at_once: a small target's engines share its GPU, a larger one's where
    they fit on it; always while the draft trains, in EVAL_GPU_RESERVE of the GPU)."""
    import ray

    from eagle3.evaluate import eval_samplings, resolve_enforce_eager, speed_windows, timed_prompts
    from eagle3.prepare.regenerate import resolve_sampling

    ev = cfg.eval
    gpu = ray.cluster_resources().get("GPU", 0) >= 1
    served = resolve_sampling(cfg.regenerate, target_dir)
    samplings = eval_samplings(served.temperature, served.top_p)
    source = ("regenerate.temperature/top_p where set, else the target's generation_config.json, else 1.0 "
              "(eagle3.prepare.regenerate.resolve_sampling)")
    speed_k, speed_ks = ev.resolved_speed_k, ev.resolved_speed_ks
    serving_eager = resolve_enforce_eager(ev.enforce_eager, gpu=gpu)
    speed_prompts, max_len = timed_prompts(prompts, max_tokens=ev.max_tokens, k=max(ev.num_speculative_tokens),
                                           max_length=cfg.prepare.max_length)
    if ev.speed_batch_sizes and not speed_prompts:
        raise ValueError(f"no held-out prompt leaves room for {ev.max_tokens} generated tokens within prepare.max_length="
                         f"{cfg.prepare.max_length}: raise it, or set eval.speed_batch_sizes: [] (no throughput)")
    windows = speed_windows(ev.speed_batch_sizes, gpu=gpu, num_prompts=len(speed_prompts), max_tokens=ev.max_tokens,
                            repeats=ev.speed_repeats)
    common = {"max_model_len": max_len, "dtype": cfg.target.dtype, "trust_remote_code": cfg.target.trust_remote_code}
    # vLLM sizes its CUDA graph captures by max_num_seqs (compat.vllm_engine.eagle3_engine_kwargs):
    # the timed engines never decode more than the largest batch at once.
    serving = {**common, "enforce_eager": serving_eager, "max_num_seqs": max(ev.speed_batch_sizes, default=16)}
    plan = [(k, draft_dir, serving if k in speed_ks else {**common, "enforce_eager": True}, k in speed_ks)
            for k in ev.num_speculative_tokens]
    if speed_k is not None:
        plan.append((0, None, serving, True))  # the target alone: the speedup's baseline
    if during_training:
        at_once, why = True, "started while the draft trains (eval.start_during_training)"
    else:
        at_once, why = engines_at_once(cfg, target_dir, len(plan), gpu=gpu,
                                       gpu_memory=lambda: smallest_gpu_bytes(ray))
    share = 1.0
    if at_once:
        from ray_jobs.extract import given_kv_cache_bytes, gpu_share

        device = EVAL_GPU_RESERVE if during_training else 1.0  # of the GPU, what the engines share
        share = gpu_share(len(plan) / device)
        if gpu:  # each engine its share of the device, and a KV cache of a set size (no profiling of the others)
            plan = [(k, d, {**e, "gpu_memory_utilization": cfg.extract.gpu_memory_utilization * device / len(plan),
                            "kv_cache_memory_bytes": given_kv_cache_bytes(cfg.extract)}, t) for k, d, e, t in plan]
    measure = {"prompts": prompts, "max_tokens": ev.max_tokens, "samplings": samplings, "speed_prompts": speed_prompts,
               "seed": ev.seed, "ignore_eos": ev.ignore_eos}
    return EvalPlan(plan, at_once, why, share, gpu, measure, windows, samplings, source, speed_k, speed_ks)


def evaluate(cfg: JobConfig, target_dir: str, draft_dir: str, prompts: list[list[int]],
              early: EarlyEval | None = None) -> dict:
    """The eval stage: its engines (eval_plan) started now, or while the draft trained (`early`),
    their acceptance measured side by side and their timed windows taken in turns (_measure_group);
    eval.json's dict (eagle3.evaluate.eval_report)."""
    import ray

    from eagle3.evaluate import eval_report

    started = early.take(draft_dir) if early is not None else None
    p = early.plan if started is not None else eval_plan(cfg, target_dir, draft_dir, prompts)
    # The candidates the trainer kept for this stage (candidates_for_eval), where no engine measured them
    # during training: the first group's draft engine does, before anything else is measured.
    pending = None if started is not None else _selection_after_training(cfg, draft_dir, p)
    if pending is not None:
        p.engines = [(k, d, {**e, "reloadable_draft": True} if d is not None else e, t) for k, d, e, t in p.engines]
    log.info("eval: %d engine(s), %s (%s)", len(p.engines), "started side by side, timed in turns"
             if p.at_once else "one at a time", p.why)
    results = []
    for group in ([p.engines] if p.at_once else [[u] for u in p.engines]):
        results += _measure_group(ray, cfg, target_dir, group, gpu=p.gpu, share=p.share, measure=p.measure,
                                  windows=p.windows, started=started, select=pending)
    out = {"target": target_dir, "draft": draft_dir} | eval_report(
        results, samplings=p.samplings, sampling_source=p.source, windows=p.windows, speed_k=p.speed_k,
        num_prompts=len(prompts), max_tokens=cfg.eval.max_tokens, ignore_eos=cfg.eval.ignore_eos,
        speed_ks=p.speed_ks)
    selection = None
    if started is not None:
        out["started_during_training"] = started["record"]
        selection = started["record"].pop("selection", None)
        if "selection_error" in started["record"]:
            out["selection_error"] = started["record"].pop("selection_error")
    elif pending is not None:
        selection = pending.get("record")
        if "error" in pending:
            out["selection_error"] = pending["error"]
    if selection is not None:
        out["selection"] = selection
    return out


# eval.select_every_steps null: at most about this many candidate drafts a run. Each waits on disk, a
# draft's size (its embeddings and LM head included), until the eval measures it.
SELECT_MAX_CANDIDATES = 20


def default_select_every(cfg: JobConfig) -> int:
    """eval.select_every_steps where it is null: every train.eval_every_steps steps (the held-out
    accuracy's, so that both curves share their steps), or the smallest multiple of it that keeps the
    run's candidates to about SELECT_MAX_CANDIDATES (train.num_steps resolved: run.train_length)."""
    base = cfg.train.eval_every_steps or 1
    per = -(-(cfg.train.num_steps or 0) // SELECT_MAX_CANDIDATES)
    return base * max(1, -(-per // base))


def candidates_for_eval(cfg: JobConfig, out: Path, *, gpu: bool) -> tuple[int, str | None]:
    """(every how many steps the trainer exports a candidate draft, where to) for a job whose eval engines
    start after training (no EarlyEval): the eval stage measures them all before it measures the draft
    (_selection_after_training). eval.select_every_steps null is on where a GPU decodes the selection
    prompts in seconds, off on the CPU; 0 is off. Also off without prompts beyond the eval's. An
    earlier run's candidates are removed."""
    from eagle3.evaluate.selection import DraftSelection, candidate_format

    every = cfg.eval.select_every_steps
    if every is None:
        every = default_select_every(cfg) if gpu else 0
    if not (every and "eval" in cfg.stages and cfg.eval.enabled and cfg.train.source == "offline"):
        return 0, None
    if not _selection_prompts(cfg, out / "prepared"):
        return 0, None
    DraftSelection.clear(out / "train")
    log.info("eval: the trainer keeps the draft every %d steps; the eval stage measures each and exports the best",
             every)
    return every, candidate_format(out / "train")


def _selection_prompts(cfg: JobConfig, prepared: Path) -> list[list[int]]:
    """The held-out prompts that choose the draft (eagle3.evaluate.selection.selection_prompts); where
    there are none, a log line says how to have some."""
    from eagle3.evaluate.selection import selection_prompts

    prompts = selection_prompts(prepared, num_eval_prompts=cfg.eval.num_prompts,
                                num_prompts=cfg.eval.select_num_prompts)
    if not prompts and cfg.eval.select_every_steps != 0:
        log.info("eval: no draft selection: prepared/eval_prompts.jsonl holds no prompt beyond the eval's %d (raise "
                 "prepare.num_eval_prompts)", cfg.eval.num_prompts)
    return prompts


def _selection_after_training(cfg: JobConfig, draft_dir: str, plan: EvalPlan) -> dict | None:
    """The eval stage's pending choice among candidates_for_eval's drafts on disk, or None where there
    are none (or no draft engine, or no selection prompts): {"train", "prompts", "draft_dir"}."""
    from eagle3.evaluate.selection import pending_candidates

    train = Path(draft_dir).parent / "train"
    if not pending_candidates(train) or not any(d is not None for _, d, _, _ in plan.engines):
        return None
    prompts = _selection_prompts(cfg, Path(draft_dir).parent / "prepared")
    if not prompts:
        return None
    return {"train": train, "prompts": prompts, "draft_dir": draft_dir}


def _select_in_group(ray, cfg: JobConfig, pending: dict, actors: list, group: list) -> None:
    """The first draft engine of `group` measures every candidate and the last step's draft
    (eagle3.evaluate.selection); draft_dir then holds the best, and every draft engine of the group
    takes it in place. Done once (pending["record"] or pending["error"]); a failure leaves the last
    step's draft, and the job goes on."""
    from eagle3.evaluate.selection import DraftSelection

    first = next(i for i, u in enumerate(group) if u[1] is not None)
    k = group[first][0]
    sel = DraftSelection(pending["train"], lambda d: draft_acceptance(
        actors[first], d, pending["prompts"], max_tokens=cfg.eval.max_tokens, ignore_eos=cfg.eval.ignore_eos),
        k=k, num_prompts=len(pending["prompts"]), max_tokens=cfg.eval.max_tokens)
    t = time.perf_counter()
    try:
        sel.consume_all()
        pending["record"] = sel.finish(pending["draft_dir"], cfg.train.num_steps)
        ray.get([actors[i].reload_draft.remote(pending["draft_dir"]) for i, u in enumerate(group) if u[1] is not None])
    except Exception as e:  # noqa: BLE001 - compat.draft_reload.DraftReloadRefused, an engine error
        log.warning("eval: choosing the draft failed (%s); the last step's draft is measured", e)
        pending["error"] = str(e)
        DraftSelection.clear(pending["train"])
        if "record" not in pending:  # the engines may hold a candidate: back to the last step's draft
            ray.get([actors[i].reload_draft.remote(pending["draft_dir"]) for i, u in enumerate(group)
                     if u[1] is not None])
    log.info("eval: draft chosen after training in %.1f s: %s", time.perf_counter() - t,
             {k: v for k, v in pending.get("record", {}).items() if k != "measured"})


def _measure_group(ray, cfg: JobConfig, target_dir: str, group: list, *, gpu: bool, share: float, measure: dict,
                   windows, started: dict | None = None, select: dict | None = None) -> list[dict]:
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
        if select is not None and "record" not in select and "error" not in select and \
                any(u[1] is not None for u in group):
            _select_in_group(ray, cfg, select, actors, group)
        # Engines side by side that time the windows (the draft's at each timed k and the target
        # alone) take turns, one round of every window each: a drift of the machine meets them all.
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
                               windows, measure["samplings"])
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


def _interleaved_speed(ray, actors: list, results: list[dict], prompts, windows, samplings) -> None:
    """The timed windows on engines that stand side by side (the draft's at each timed k and the
    target alone's): their untimed warm-up waves (all at once), then round r of every window on each
    engine in turn, the order reversed every other round, for the windows' fixed number of rounds.
    Merged per engine (eagle3.evaluate.merge_speed) into its result's "speed"; its wall_s gains the time."""
    from eagle3.evaluate import merge_speed

    t = time.perf_counter()  # the untimed warm-up waves, all engines at once
    ray.get([a.speed.remote(prompts, windows, samplings, rounds=[], warmup=True) for a in actors])
    spent = [time.perf_counter() - t] * len(actors)
    parts: list[list] = [[] for _ in actors]
    for r in range(max(w.repeats for w in windows)):
        for i in (range(len(actors)) if r % 2 == 0 else reversed(range(len(actors)))):
            t = time.perf_counter()
            parts[i].append(ray.get(actors[i].speed.remote(prompts, windows, samplings, rounds=[r], warmup=False)))
            spent[i] += time.perf_counter() - t
    for i, res in enumerate(results):
        res["speed"] = merge_speed(parts[i])
        res["speed_interleaved"] = True
        res["wall_s"] += spent[i]


def engines_at_once(cfg: JobConfig, target_dir: str, num_engines: int, *, gpu: bool,
                    gpu_memory: Callable[[], int | None] | None = None) -> tuple[bool, str]:
    """(whether the eval stage starts its engines side by side, why): eval.engines_at_once, where
    'auto' is true for several engines of a small target on a GPU (ray_jobs.extract.small_target:
    their starts overlap, and a few such engines take a small part of the device's memory), and for
    a larger one where they fit (engines_fit; gpu_memory() gives the GPU's bytes, asked only then):
    side by side, their timed windows take turns, and the speedup is one run's ratio."""
    setting = cfg.eval.engines_at_once
    if num_engines < 2:
        return False, "one engine"
    if setting != "auto":
        return bool(setting), "eval.engines_at_once"
    if not gpu:
        return False, "auto: on the CPU (engines start in seconds there)"
    from eagle3.extract.extractor import target_text_config
    from ray_jobs.extract import one_gpu_engines, small_target

    text_cfg = target_text_config(target_dir)
    small, why = small_target(cfg.extract, text_cfg, gpu=True)
    if small or gpu_memory is None or not one_gpu_engines(cfg.extract):
        return small, f"auto: {why}"
    fits, why = engines_fit(cfg, text_cfg, num_engines, gpu_memory())
    return fits, f"auto: {why}"


# Of an eval engine's memory beyond its weights and KV cache: the CUDA context, activations, CUDA graphs.
EVAL_ENGINE_OVERHEAD_BYTES = 3 << 30


def engines_fit(cfg: JobConfig, text_cfg: dict, num_engines: int, gpu_bytes: int | None) -> tuple[bool, str]:
    """(whether num_engines engines of the target fit side by side on one GPU of gpu_bytes, why):
    each gets extract.gpu_memory_utilization / num_engines of it (eval_plan), and needs its bf16
    weights, the KV cache the plan gives it (given_kv_cache_bytes) and EVAL_ENGINE_OVERHEAD_BYTES."""
    from ray_jobs.extract import approx_num_params, given_kv_cache_bytes

    params = approx_num_params(text_cfg)
    if not gpu_bytes:
        return False, f"a {params / 1e9:.2f}B-parameter target; the GPU's memory is unknown"
    need = num_engines * (2 * params + given_kv_cache_bytes(cfg.extract) + EVAL_ENGINE_OVERHEAD_BYTES)
    have = cfg.extract.gpu_memory_utilization * gpu_bytes
    gib = 1 << 30
    return need <= have, (f"{num_engines} engines of a {params / 1e9:.2f}B-parameter target need {need / gib:.1f} GiB, "
                          f"{'within' if need <= have else 'more than'} {cfg.extract.gpu_memory_utilization:g} of the "
                          f"GPU's {gpu_bytes / gib:.0f} GiB (extract.gpu_memory_utilization)")


def smallest_gpu_bytes(ray) -> int | None:
    """The memory of the smallest GPU of a GPU node of the cluster (nvidia-smi, in a task that takes
    a sliver of one GPU: no CUDA context), or None where it cannot be read."""
    from eagle3 import gpu_processes

    def total() -> int | None:
        try:
            gpus = gpu_processes.gpus()
        except (gpu_processes.NvidiaSmiMissing, RuntimeError, OSError):
            return None
        return min((g.total_mib for g in gpus if g.total_mib), default=0) << 20 or None

    try:
        return ray.get(ray.remote(num_cpus=0, num_gpus=0.0001)(total).remote(), timeout=120)
    except Exception as exc:  # noqa: BLE001 - a GPU that cannot be asked: the engines go one at a time
        log.warning("eval: could not read the GPU's memory (%s); the engines start one at a time", exc)
        return None


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
    check_start_during_training(cfg, gpu=gpu)
    if (blocker := _during_training_blocker(cfg, gpu=gpu)) is not None:
        return False, f"auto: {blocker}"
    if setting is True:
        return True, "eval.start_during_training: true"
    if not gpu:
        return False, "auto: on the CPU (the engines would take the trainer's cores)"
    n = len(cfg.eval.num_speculative_tokens) + (cfg.eval.resolved_speed_k is not None)
    return engines_at_once(cfg, target_dir, n, gpu=True)


def _during_training_blocker(cfg: JobConfig, *, gpu: bool) -> str | None:
    """Why the eval's engines cannot start while this job's draft trains, or None."""
    if cfg.train.source != "offline":
        return "train.source is online: its engines already share the GPUs with the trainer"
    if gpu and cfg.train.num_workers != 1:
        return (f"train.num_workers={cfg.train.num_workers} on GPUs: each worker would keep only part of a GPU, "
                "and Ray may place two on one (NCCL refuses two ranks on one GPU)")
    return None


def check_start_during_training(cfg: JobConfig, *, gpu: bool) -> None:
    """A forced eval.start_during_training: true that cannot work raises ValueError with the reason:
    at the job's start (ray_jobs.run, before any model loads) and again where the eval decides."""
    if (cfg.eval.start_during_training is True and "train" in cfg.stages and "eval" in cfg.stages
            and cfg.eval.enabled and (blocker := _during_training_blocker(cfg, gpu=gpu)) is not None):
        raise ValueError(f"eval.start_during_training: true cannot work here: {blocker}; set it to auto or false")


class EarlyEval:
    """The eval's engines, started while the draft trains (eval.start_during_training): once the
    trainer is set up and has exported its provisional draft (actors.trainer.write_provisional_draft),
    placed beside the training workers (each on its EVAL_GPU_RESERVE share of the GPU) and started,
    the draft's from that provisional draft. take() hands them to the
    eval stage after training, each draft engine given the trained weights in place
    (compat.draft_reload); one that refuses them is started again from the trained draft."""

    def __init__(self, cfg: JobConfig, target_dir: str, out: Path, prompts: list[list[int]],
                 select_prompts: list[list[int]] = ()):
        import shutil
        import threading

        from eagle3.evaluate.selection import DraftSelection, candidate_format

        self.cfg, self.target_dir = cfg, target_dir
        self.plan = eval_plan(cfg, target_dir, str(out / "draft"), prompts, during_training=True)
        self.provisional = out / "train" / "provisional_draft"
        shutil.rmtree(self.provisional, ignore_errors=True)  # an earlier run's: its shapes may not be this one's
        self.select_prompts = list(select_prompts)
        every = cfg.eval.select_every_steps
        self.select_every = (default_select_every(cfg) if every is None else every) if self.select_prompts else 0
        # The engine that measures the candidates: the timed k's, else the largest k's.
        drafts = [i for i, u in enumerate(self.plan.engines) if u[1] is not None]
        self._measurer = next((i for i in drafts if self.plan.engines[i][0] == self.plan.speed_k),
                              max(drafts, key=lambda i: self.plan.engines[i][0]))
        self.selection = None
        self.selection_error: str | None = None
        self.candidate_format: str | None = None
        """What run_training exports candidates to (None: no selection)."""
        if self.select_every:
            DraftSelection.clear(out / "train")
            self.candidate_format = candidate_format(out / "train")
            self.selection = DraftSelection(out / "train", self._measure, k=self.plan.engines[self._measurer][0],
                                            num_prompts=len(self.select_prompts), max_tokens=cfg.eval.max_tokens)
        self.training_ended = threading.Event()
        self._cancelled = False
        self._actors: list = []
        self._bg = Background(self._start)

    def _measure(self, draft_dir: str) -> float:
        return draft_acceptance(self._actors[self._measurer], draft_dir, self.select_prompts,
                                max_tokens=self.cfg.eval.max_tokens, ignore_eos=self.cfg.eval.ignore_eos)

    def _select(self) -> None:
        """Measure the waiting candidate, if any; a failure ends the selection (the last step's draft is
        exported), never the job."""
        if self.selection is None:
            return
        try:
            self.selection.consume()
        except Exception as e:  # noqa: BLE001 - compat.draft_reload.DraftReloadRefused, an engine error
            log.warning("eval: measuring a candidate draft failed (%s); the last step's draft will be exported", e)
            self.selection, self.selection_error = None, str(e)

    def _place(self):
        """An evaluator actor as the plan places its engines (actors.evaluator.place_evaluator)."""
        from actors.evaluator import place_evaluator

        return place_evaluator(self.cfg.extract.cpu_kvcache_space_gib, gpu=self.plan.gpu, gpu_share=self.plan.share)

    def _start(self) -> dict:
        import ray

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
        self._actors = [self._place() for _ in self.plan.engines]
        # No provisional draft once training ended (a finished run resubmitted trains nothing): the trained one.
        source = str(self.provisional) if provisional else None
        ray.get([a.start.remote(self.target_dir, None if draft is None else source or draft, num_speculative_tokens=k,
                                **({"reloadable_draft": provisional} if draft is not None else {}), **engine)
                 for a, (k, draft, engine, _) in zip(self._actors, self.plan.engines)])
        ready = {"placed_at": placed_at, "provisional": source, "provisional_after_s": round(draft_at, 2),
                 "ready_after_s": round(time.perf_counter() - t0, 2), "ready_at": time.time()}
        if not provisional:
            self.selection = None
        while not self.training_ended.wait(1.0):  # the candidates, as the trainer exports them
            self._select()
        self._select()  # one exported before the end
        return ready

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
        if self.selection is not None:  # the last step's draft against the best candidate: draft_dir holds the better
            try:
                record["selection"] = self.selection.finish(draft_dir, self.cfg.train.num_steps)
            except Exception as e:  # noqa: BLE001 - as in _select
                log.warning("eval: measuring the last step's draft failed (%s); it is exported as trained", e)
                self.selection_error = str(e)
        if self.selection_error is not None:
            record["selection_error"] = self.selection_error
        t = time.perf_counter()
        same = got["provisional"] is not None and (json.loads((self.provisional / "config.json").read_text())
                                                   == json.loads((Path(draft_dir) / "config.json").read_text()))
        for i, (k, draft, engine, _) in enumerate(self.plan.engines):
            if draft is None or got["provisional"] is None:
                continue
            try:
                if not same:
                    raise RuntimeError("the trained draft's config.json differs from the provisional one's")
                ray.get(self._actors[i].reload_draft.remote(draft_dir))
            except Exception as e:  # noqa: BLE001 - compat.draft_reload.DraftReloadRefused, or the config
                log.warning("eval: the k=%d engine cannot take the trained draft in place (%s); starting it again "
                            "from %s", k, e, draft_dir)
                ray.kill(self._actors[i])
                self._actors[i] = self._place()
                ray.get(self._actors[i].start.remote(self.target_dir, draft_dir, num_speculative_tokens=k, **engine))
                record.setdefault("restarted", []).append(k)
        record["reload_s"] = round(time.perf_counter() - t, 2)
        log.info("eval: engines started during training: %s", record)
        return {"actors": self._actors, "placed_at": got["placed_at"], "record": record}


def draft_acceptance(actor, draft_dir: str, prompts: list[list[int]], *, max_tokens: int, ignore_eos: bool) -> float:
    """An evaluator actor's engine (started with reloadable_draft) takes draft_dir's weights in place
    and decodes `prompts` greedily: vLLM's acceptance length of that draft (the draft selection's measure)."""
    import ray

    ray.get(actor.reload_draft.remote(draft_dir))
    got = ray.get(actor.acceptance.remote(prompts, max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos))
    return got["acceptance_length"]


def early_eval(cfg: JobConfig, target_dir: str, out: Path) -> EarlyEval | None:
    """The eval's engines, starting now while the draft trains, where eval_during_training says so."""
    import ray

    from eagle3.prepare.tokens import read_eval_prompts

    on, why = eval_during_training(cfg, target_dir, gpu=ray.cluster_resources().get("GPU", 0) >= 1)
    prompts = read_eval_prompts(out / "prepared")[: cfg.eval.num_prompts] if on else []
    if not prompts:
        log.info("eval: engines start after training (%s)", why if not on else "no held-out prompts")
        return None
    log.info("eval: engines start while the draft trains (%s)", why)
    early = EarlyEval(cfg, target_dir, out, prompts, _selection_prompts(cfg, out / "prepared"))
    if early.select_every:
        log.info("eval: the draft engine measures the draft every %d steps on %d held-out prompts; the best is "
                 "exported", early.select_every, len(early.select_prompts))
    return early

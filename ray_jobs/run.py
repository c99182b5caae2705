"""The job: prepare -> [regenerate] -> extract -> train -> export -> eval, on the Ray cluster it runs in.

    python -m ray_jobs.run --config configs/demo.yaml
    ray job submit --working-dir . -- python -m ray_jobs.run --config configs/gpu_8b.yaml

Each stage writes under output_dir/<stage>/ with a provenance.json, and reuses what an
earlier run of the same job committed (extraction resumes shard by shard). The driver
imports neither vllm, torch nor deepspeed: heavy work runs in Ray tasks and actors.
Output layout:
    target/          the tiny test target (only with target.model: tiny)
    prepared/        tokens.parquet, rejects.jsonl, eval_prompts.jsonl, heldout.json (the held-out split)
    regenerated/     (regenerate.enabled) data/shard-*.parquet conversations, committed/, tokens.parquet
    hidden_states/   data/shard-*.arrow, committed/, MANIFEST.json, rejects.jsonl
    train/           DeepSpeed checkpoints, metrics, loss plot
    draft/           the speculators-format EAGLE-3 draft (config.json, model.safetensors)
    report.json      the run's record; ray_jobs/summary.py formats the summary printed at the end
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from eagle3.config import JobConfig, load_job_config
from eagle3.provenance import write_provenance
from ray_jobs.background import Background
from ray_jobs.evaluate import (EVAL_GPU_RESERVE, candidates_for_eval, check_start_during_training, early_eval,
                               evaluate)
from ray_jobs.summary import format_summary
from ray_jobs.target import check_target, resolve_target

log = logging.getLogger("eagle3")


def _prepare(cfg: JobConfig, target_dir: str, out: Path) -> dict:
    from eagle3.prepare.tokens import prepare_dataset_ray

    # The driver reads the source and assembles the output; Ray tasks on the cluster's CPUs tokenize.
    summary = prepare_dataset_ray(cfg.prepare, target_dir, str(out))
    write_provenance(out, cfg.to_dict(), "prepare", {"summary": summary})
    return summary


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
    try:  # a hub id resolves here, before Ray: a model in no cache stops the job in seconds
        target_record = check_target(cfg)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out.mkdir(parents=True, exist_ok=True)
    init_ray(cfg.ray.address, cfg.ray.num_cpus, dashboard_host=cfg.ray.dashboard_host, cache_dir=cfg.cache_dir)
    report: dict = {"output_dir": str(out), "stages": {}, "seconds": {}, "startup": {}}
    t0 = time.perf_counter()

    def timed(name, fn, *args, **kwargs):
        t = time.perf_counter()
        result = fn(*args, **kwargs)
        report["seconds"][name] = round(time.perf_counter() - t, 2)
        return result

    import ray

    split = early = None
    if cfg.train.source == "online" and "train" in cfg.stages:
        from ray_jobs.online import split_gpus

        # Once per job, here: a split that cannot work fails before any model loads; run_online places by it.
        split = split_gpus(cfg, int(ray.cluster_resources().get("GPU", 0)))
    if cfg.eval.start_during_training is True:  # one that cannot work, too (online training never reaches early_eval)
        check_start_during_training(cfg, gpu=ray.cluster_resources().get("GPU", 0) >= 1)
    target_dir = timed("target", resolve_target, cfg, out)
    report["target"] = target_dir
    report["stages"]["target"] = {**target_record, "dir": target_dir}
    # The doctor's tasks and prepare run side by side (prepare loads no model: a tokenizer, Ray tasks
    # over the conversations); the doctor's verdict comes first, and stops the job before any engine.
    # The doctor is submitted first: its disk estimate reads an earlier run's prepared tokens, if any.
    doctor = preparing = None
    if cfg.doctor:
        from ray_jobs.doctor import DoctorRun

        doctor = DoctorRun(cfg, target_dir)
    if runs_prepare(cfg, out):
        preparing = Background(timed, "prepare", _prepare, cfg, target_dir, out / "prepared")
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

    length = None
    if "train" in cfg.stages or (cfg.train.source == "offline" and "export" in cfg.stages):
        cfg, length = train_length(cfg, tokens_path, out / "prepared")
    if cfg.train.source == "online" and "train" in cfg.stages:
        # Extraction runs inside training: tables go from the engines to the ranks through the object
        # store (ray_jobs/online.py); no extract stage, no shards unless train.online.epochs is keep
        # (and the held-out split's, hidden_states_heldout/).
        from ray_jobs.online import run_online

        summary = timed("train", run_online, cfg, str(tokens_path), target_dir, out, split, tokens_source=tokens_source)
        write_provenance(out / "train", cfg.to_dict(), "train", {"summary": summary})
        write_provenance(out / "draft", cfg.to_dict(), "export", {"trained_from": str(tokens_path), "source": "online"})
        report["stages"]["train"] = with_passes(summary, length)
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
        early = early_eval(cfg, target_dir, out)
        if early is not None:
            select_every, candidates = early.select_every, early.candidate_format
        else:  # the eval stage measures the kept drafts after training
            select_every, candidates = candidates_for_eval(cfg, out, gpu=ray.cluster_resources().get("GPU", 0) >= 1)
        try:
            summary = timed("train", run_training, cfg.train_config, files, target_dir, str(out / "train"),
                            str(out / "draft"), heldout_threshold=training_threshold(out / "prepared"),
                            gpus_per_worker=1 - EVAL_GPU_RESERVE if early is not None and early.plan.gpu else 1.0,
                            provisional_draft_dir=str(early.provisional) if early is not None else None,
                            candidate_dir_format=candidates, select_every_steps=select_every)
        except BaseException:
            if early is not None:
                early.cancel()
            raise
        write_provenance(out / "train", cfg.to_dict(), "train", {"summary": summary})
        write_provenance(out / "draft", cfg.to_dict(), "export", {"trained_from": files})
        report["stages"]["train"] = with_passes(summary, length)
        report["draft"] = str(out / "draft")

    if "eval" in cfg.stages and cfg.eval.enabled:
        from eagle3.prepare.tokens import read_eval_prompts

        prompts = read_eval_prompts(out / "prepared")[: cfg.eval.num_prompts]
        if not prompts:
            raise ValueError("no held-out prompts for eval: set prepare.num_eval_prompts > 0")
        results = timed("eval", evaluate, cfg, target_dir, str(out / "draft"), prompts, early)
        if early is not None:
            import shutil

            shutil.rmtree(early.provisional, ignore_errors=True)  # the engines read it at their start only
        report["stages"]["eval"] = results
        (out / "eval.json").write_text(json.dumps(results, indent=1))
        if "selection" in results:
            from actors.trainer import plot_curves

            plot_curves(out / "train" / "metrics.jsonl", out / "train" / "curves.png")  # with the last step's row
        from eagle3.serve import write_serving_file

        write_serving_file(out / "draft", target_dir, results)  # the k and the verdict the eval measured

    report["seconds"]["total"] = round(time.perf_counter() - t0, 2)
    report["startup"].update(startup_record(report["stages"]))
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    write_provenance(out, cfg.to_dict(), "job", {"startup": report["startup"]})
    return report


def train_length(cfg: JobConfig, tokens_path: Path, prepared: Path) -> tuple[JobConfig, dict]:
    """cfg with train.num_steps (and the warmup and evaluation that scale with it) set from
    train.num_epochs and the training tokens: the table extraction reads, less the held-out split."""
    import dataclasses

    import pyarrow.parquet as pq

    from eagle3.prepare.heldout import heldout_rows, training_threshold
    from eagle3.train.config import resolve_length

    if not tokens_path.exists():
        raise ValueError(f"no training tokens at {tokens_path} to count train.num_epochs against: run the prepare "
                         "stage (and regenerate, when enabled) first")
    table = pq.read_table(tokens_path, columns=["sample_id", "num_tokens"])
    held = heldout_rows(table, training_threshold(prepared))
    train_tokens = sum(table.column("num_tokens").to_pylist()) - sum(held.column("num_tokens").to_pylist())
    train, record = resolve_length(cfg.train, train_tokens)
    log.info("train: %d steps (%s), warmup %d, held-out accuracy every %d; %s training tokens, at most %d a step: "
             "%.2f passes at most", record["num_steps"], record["steps_from"], record["warmup_steps"],
             record["eval_every_steps"], train_tokens, record["tokens_per_step"], record["planned_passes"] or 0)
    return dataclasses.replace(cfg, train=train), record


def with_passes(summary: dict, length: dict | None) -> dict:
    """The train summary with how long training was asked to be and the passes over the data it made
    (tokens trained, whole run, over the training tokens)."""
    if length is None:
        return summary
    data = length["train_tokens"]
    return {**summary, "length": length, "passes": round(summary["tokens"] / data, 2) if data else None}


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


def argument_parser() -> argparse.ArgumentParser:
    """The job's command line (main)."""
    ap = argparse.ArgumentParser(prog="python -m ray_jobs.run", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="YAML/JSON job config (configs/demo.yaml: the demo); output_dir, target.model "
                    "and prepare.conversations must be set, there or with --set")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set train.num_steps=50 (value parsed as YAML)")
    ap.add_argument("--help-config", action="store_true",
                    help="print every config key with its type, default and meaning (docs/config.md), then exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser()
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

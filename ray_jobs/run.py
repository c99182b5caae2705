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
from pathlib import Path

from eagle3.config import JobConfig, load_job_config
from eagle3.provenance import write_provenance
from ray_jobs.background import Background
from ray_jobs.evaluate import EVAL_GPU_RESERVE, check_start_during_training, early_eval, evaluate
from ray_jobs.target import resolve_target

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
        early = early_eval(cfg, target_dir, out)
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
        results = timed("eval", evaluate, cfg, target_dir, str(out / "draft"), prompts, early)
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
    """What a resumed stage took from an earlier run, e.g. '; 6 of 19 shards already committed', and
    from a smaller input, e.g. '(kept from an input of 12000)'."""
    skipped = stage.get("shards_skipped", 0)
    grown = f" (kept from an input of {stage['grown']['num_samples']})" if stage.get("grown") else ""
    return f"; {skipped} of {stage['num_shards']} shards already committed{grown}" if skipped else ""


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
# conversations before the summary calls it short of data: above it, more data still raised AL on
# SmolLM2; below it, held-out accuracy no longer moved (benchmarks/RESULTS.md).
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
        lines.append(f"  eval.json        decode speedup, draft at k={sp['num_speculative_tokens']} over the target "
                     f"alone ({'eager' if sp['enforce_eager'] else 'CUDA graphs'}; output tokens/s on answers ending "
                     f"at EOS, {sp['results'][0]['speedup']['rounds']} rounds, "
                     f"{'the engines taking turns' if sp.get('interleaved') else 'one engine after the other'}; "
                     "95% interval over prompts):")
        for r in sp["results"]:
            s = r["speedup"]
            al = r["with_draft"].get("acceptance_length")
            ci = f"{s['ci95'][0]:.2f}-{s['ci95'][1]:.2f}x" if s.get("ci95") else "no interval (one wave)"
            slower = "  <- the draft slows this batch size" if s.get("ci95") and s["ci95"][1] < 1 else ""
            lines.append(f"                   batch {r['batch_size']:>3} {label[r['mode']]:<22} {s['ratio']:.2f}x "
                         f"({r['without_draft']['tokens_per_s']['mean']:.0f} -> {r['with_draft']['tokens_per_s']['mean']:.0f}"
                         f" tokens/s; {ci}{f', AL {al:.2f}' if al else ''}; {r['num_prompts']} prompts, answers of "
                         f"at most {r['max_tokens']} tokens){slower}")
    return lines


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
    ap.add_argument("--config", help="YAML/JSON job config; omitted: the built-in demo defaults")
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

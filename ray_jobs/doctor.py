"""Doctor: everything that can fail in seconds, checked before any weights load.

    python -m ray_jobs.doctor --config FILE      (exit 1 on a failed check, with what to do;
                                                  WARN rows, e.g. an untested version whose seams
                                                  passed, do not fail it)

Runs one task per alive node of the Ray cluster (node affinity), each reporting package
versions against the tested matrix, every compat seam, GPU hygiene and free disk at the
output path; the architecture-matched dry run (target config cut to 2 layers, dummy
weights, the exact extraction path) runs on one node per distinct node type. The job
(ray_jobs/run.py) runs the same checks first. Tasks use max_calls=1: the dry run starts an
engine, and its process must not be reused for other work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from eagle3.config import JobConfig, load_job_config


PREPARED_ESTIMATE = "prepared tokens.parquet"


def estimate_tokens(cfg: JobConfig) -> tuple[int, str]:
    tokens = Path(cfg.output_dir) / "prepared" / "tokens.parquet"
    if tokens.exists():
        import pyarrow.parquet as pq

        col = pq.read_table(tokens, columns=["num_tokens"]).column("num_tokens")
        return int(sum(col.to_pylist())), PREPARED_ESTIMATE
    from eagle3.prepare.conversations import source_bytes

    src, n = Path(cfg.prepare.conversations), cfg.prepare.max_samples
    if not src.exists():
        return 0, f"{src} not found"
    of = f"the first {n} records of {src}" if n is not None else str(src)
    return source_bytes(src, n) // 4, f"~4 bytes of {of} a token"


def count_tokens(cfg: JobConfig, target_dir: str, sample_records: int = 256) -> tuple[int, int | None, str]:
    """(prepared tokens, records, how) for the cost estimate: the prepared tokens where an earlier run
    left them, else the first sample_records records rendered with the target's own template (as
    prepare renders them, truncation included), scaled by the bytes of the records prepare will read;
    estimate_tokens' ~4 bytes a token where the tokenizer cannot load."""
    num, how = estimate_tokens(cfg)
    if how == PREPARED_ESTIMATE or not Path(cfg.prepare.conversations).exists():
        return num, None, how
    from eagle3.prepare.conversations import iter_records, source_bytes

    try:
        from eagle3.prepare.tokens import load_tokenizer, tokenize_chunk

        records = list(iter_records(cfg.prepare.conversations, sample_records,
                                    leading_assistant=cfg.prepare.leading_assistant))
        sampled = tokenize_chunk(cfg.prepare, load_tokenizer(target_dir), records)
        sample_bytes = source_bytes(cfg.prepare.conversations, len(records))
    except Exception as e:  # noqa: BLE001 - the estimate falls back, it never stops the doctor
        return num, cfg.prepare.max_samples, f"{how} (the tokenizer's sample failed: {type(e).__name__})"
    if not records or sample_bytes <= 0:
        return num, 0, how
    n = cfg.prepare.max_samples
    total_bytes = source_bytes(cfg.prepare.conversations, n)
    tokens = sum(sampled.samples.column("num_tokens").to_pylist())
    num_records = len(records) if total_bytes <= sample_bytes else round(len(records) * total_bytes / sample_bytes)
    num_records = min(num_records, n) if n is not None else num_records
    return round(tokens * total_bytes / sample_bytes), num_records, \
        f"the first {len(records)} records rendered with the target's template, scaled by bytes"


def compile_caches_filled(cache_dir: str | None) -> bool:
    """Whether an earlier job left vLLM's compile cache under cache_dir: engines then start warm."""
    if cache_dir is None:
        return False
    vllm_cache = Path(cache_dir).expanduser() / "vllm"
    return vllm_cache.is_dir() and any(vllm_cache.iterdir())


def cost_estimate(cfg: JobConfig, target_dir: str, num_gpus: int) -> dict:
    """eagle3.cost.estimate for this job, from what the driver can read cheaply."""
    from eagle3 import cost, doctor

    num_tokens, num_records, how = count_tokens(cfg, target_dir)
    config = json.loads((Path(target_dir) / "config.json").read_text())
    return cost.estimate(cfg, config, num_tokens, num_gpus, doctor.free_bytes(cfg.output_dir),
                         num_records=num_records, warm=compile_caches_filled(cfg.cache_dir), tokens_from=how)


def estimate_rows(est: dict) -> list[dict]:
    """The estimate as the doctor's rows: bytes, then each stage's seconds and the rate behind it."""
    from eagle3.doctor import Check, size_text

    if "error" in est:
        return [Check("cost estimate", True, f"not estimated: {est['error']}", warn=True).to_dict()]
    which = "warm" if est["warm"] else "cold"
    rows = [Check("cost: tokens", True, f"{est['num_tokens']:,} prepared ({est['tokens_from']}); "
                  f"{est['train_tokens_per_pass']:,} to train on, {est['generated_tokens']:,} to generate; "
                  f"{est['train_steps']:,} steps on {est['num_gpus']} GPU(s), {est['mode']}")]
    where = "the held-out split's shards (online)" if est["mode"] == "online" else "hidden states"
    free = "unknown" if est["free_disk_bytes"] is None else size_text(est["free_disk_bytes"])
    rows.append(Check("cost: disk", True, f"~{size_text(est['hidden_state_bytes'])} of {where} "
                      f"({est['bytes_per_token']} bytes a token; bf16 {size_text(est['bytes_bf16'])}, fp8 "
                      f"{size_text(est['bytes_fp8'])}); {free} free", "; or ".join(est["recommend"]),
                      warn=not est["fits"]))
    src = {"prepare": "prepare_s_per_record", "regenerate": "regen_s_per_token", "extract": "extract_s_per_token",
           "train": "train_s_per_token_per_hidden"}
    for stage, s in est["stages"].items():
        rate = est["rates"].get(src.get(stage, ""), {}).get("source")
        rows.append(Check(f"cost: {stage}", True, f"~{s:.0f}s (fixed {est['overheads']['seconds'][stage]:.0f}s "
                          f"{which}" + (f"; rate from {rate.split(',')[0]}" if rate else "") + ")"))
    rows.append(Check("cost: total", True, f"~{est['seconds']:.0f}s {which} (prepare beside the doctor; fixed "
                      f"costs: {est['overheads']['source'].split(' (')[0]}); its error on measured jobs: "
                      f"{cost_fit_file()}"))
    return [r.to_dict() for r in rows]


def cost_fit_file() -> str:
    from eagle3 import cost

    return f"benchmarks/results/{cost.FIT}"


def writes_hidden_states(cfg: JobConfig) -> bool:
    """Whether the job puts hidden states on disk: not when training runs online and re-extracts
    every epoch (ray_jobs/run.py then runs no extract stage), the mode for a data set whose hidden
    states would not fit."""
    online = cfg.train.source == "online" and "train" in cfg.stages
    return not (online and cfg.train.online.epochs == "reextract")


def rough_estimate(cfg: JobConfig, how: str) -> str | None:
    """Why the disk estimate of estimate_tokens is only rough, or None where it counts prepared tokens
    that extraction will read as they are."""
    if how != PREPARED_ESTIMATE:
        return "counted from the source's bytes"
    if cfg.regenerate.enabled and "extract" in cfg.stages:
        return "prepared answers, which the regenerate stage rewrites"
    return None


def node_report(cfg: JobConfig, target_dir: str, num_tokens: int, with_dry_run: bool, *,
                rough: str | None = None) -> dict:
    """One node's rows, and where its time went ({"seconds": {"checks", "dry_run", "total"}}). The
    dry run (an engine start: most of the doctor's time) runs in this task's main thread (vLLM's
    engine start installs signal handlers, which only the main thread may), the other checks
    (imports, source inspection, nvidia-smi, the disk) beside it in a thread, after vLLM and the
    target's model class are imported once for both (two threads importing the same modules at once
    can deadlock, or hand one a partially initialized module: compat.probes.import_target_model)."""
    import platform
    import threading

    from eagle3 import doctor
    from eagle3.extract.extractor import target_text_config

    t0 = time.perf_counter()
    host = platform.node()
    text = target_text_config(target_dir)
    try:
        layers = len(cfg.extract.layer_ids(text["num_hidden_layers"]))
    except ValueError as e:
        rows = doctor.check_seams(target_dir, cfg.target.trust_remote_code)
        rows.append(doctor.Check("aux layer ids", False, str(e), "set extract.aux_hidden_state_layer_ids to ids "
                                 "that exist in this target"))
        return {"host": host, "rows": [r.to_dict() for r in doctor.check_versions(rows) + rows]}
    checks: dict = {}

    def run_checks() -> None:
        t = time.perf_counter()
        try:
            rows = doctor.check_seams(target_dir, cfg.target.trust_remote_code)
            rows += doctor.check_gpus()
            rows.append(doctor.check_disk(cfg.output_dir, doctor.estimate_dataset_bytes(
                num_tokens, layers, text["hidden_size"], cfg.extract.hs_dtype) if writes_hidden_states(cfg) else None,
                rough=rough))
            checks["rows"] = rows
        except BaseException as e:  # noqa: BLE001 - re-raised in the task's thread below
            checks["error"] = e
        checks["seconds"] = time.perf_counter() - t

    if with_dry_run:
        try:
            import vllm  # noqa: F401 - once, here, for both threads (see the docstring)
        except ImportError:
            pass  # the version check's row says vLLM is missing, and the dry run's row fails with the cause
        else:
            from compat.probes import import_target_model

            import_target_model(target_dir)  # both threads load the model class: once, here, too
    thread = threading.Thread(target=run_checks, name="doctor-checks")
    thread.start()
    dry, t_dry = None, time.perf_counter()
    if with_dry_run:
        dry = doctor.dry_run(target_dir, cfg.extract, dtype=cfg.target.dtype,
                             trust_remote_code=cfg.target.trust_remote_code)
    t_dry = time.perf_counter() - t_dry
    thread.join()
    if "error" in checks:
        raise checks["error"]
    rows = checks["rows"] + ([dry] if dry is not None else [])
    # Versions last, listed first: an untested version is judged by this node's seams and dry run.
    rows = doctor.check_versions(rows) + rows
    return {"host": host, "rows": [r.to_dict() for r in rows], "finished_at": time.time(),
            "seconds": {"checks": round(checks["seconds"], 1), "dry_run": round(t_dry, 1) if with_dry_run else None,
                        "total": round(time.perf_counter() - t0, 1)}}


def run_doctor(cfg: JobConfig, target_dir: str, *, dry_run: bool = True) -> tuple[bool, str, list[dict]]:
    """Run the checks on every alive node; return (all ok, printable table, reports)."""
    return DoctorRun(cfg, target_dir, dry_run=dry_run).result()


class DoctorRun:
    """The doctor's tasks (one per alive node, node affinity), submitted on construction; `result()`
    waits for them. The job runs prepare meanwhile (no model loads there) and calls result() before
    the first engine starts."""

    def __init__(self, cfg: JobConfig, target_dir: str, *, dry_run: bool = True):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.submitted_at = time.time()
        self.seconds: float | None = None  # from submission to the last task's end, once result() returned
        self.num_tokens, self.how = estimate_tokens(cfg)
        self.estimate: dict | None = None  # eagle3.cost.estimate's dict, once the tasks are submitted
        task = ray.remote(max_calls=1, num_cpus=0)(node_report)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        # One dry run per node type (GPU count), on a node that has CPUs to start an engine.
        seen, self.refs = set(), []
        for n in sorted(nodes, key=lambda n: -n["Resources"].get("CPU", 0)):
            kind = n["Resources"].get("GPU", 0)
            do_dry = dry_run and n["Resources"].get("CPU", 0) >= 1 and kind not in seen
            seen.add(kind) if do_dry else None
            self.refs.append((n, task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
                                              num_gpus=min(1, kind) if do_dry and kind else 0)
                              .remote(cfg, target_dir, self.num_tokens, do_dry, rough=rough_estimate(cfg, self.how))))
        # Estimated here, in the driver, while the tasks run; an estimate never stops the doctor.
        try:
            self.estimate = cost_estimate(cfg, target_dir, int(sum(n["Resources"].get("GPU", 0) for n in nodes)))
        except Exception as e:  # noqa: BLE001
            self.estimate = {"error": f"{type(e).__name__}: {str(e)[:200]}"}

    def result(self) -> tuple[bool, str, list[dict]]:
        """(all ok, printable table, reports); `seconds`: from the tasks' submission to the last one's
        end (the job may call this later, after prepare)."""
        import ray

        reports = []
        for node, ref in self.refs:
            rep = ray.get(ref)
            rep["node_ip"] = node["NodeManagerAddress"]
            reports.append(rep)
        ok, table = format_reports(reports, estimate_rows(self.estimate) if self.estimate is not None else ())
        where = "; ".join(f"{r['node_ip']}: checks {r['seconds']['checks']:.0f}s"
                          + (f" beside the dry run {r['seconds']['dry_run']:.0f}s" if r["seconds"]["dry_run"] is not None
                             else "") + f", task {r['seconds']['total']:.0f}s" for r in reports if r.get("seconds"))
        ends = [r.get("finished_at") or time.time() for r in reports]
        self.seconds = (max(ends) if ends else time.time()) - self.submitted_at
        return ok, (f"{table} in {self.seconds:.0f}s ({where}; dataset estimate from {self.how}: "
                    f"{self.num_tokens} tokens)"), reports


def format_row(r: dict) -> list[str]:
    mark = "FAIL" if not r["ok"] else "WARN" if r.get("warn") else "PASS"
    lines = [f"  {mark}  {r['name']:<44} {r['detail']}"]
    if mark != "PASS" and r["fix"]:
        lines.append(f"        -> {r['fix'].splitlines()[0]}")
    return lines


def format_reports(reports: list[dict], estimate: Sequence[dict] = ()) -> tuple[bool, str]:
    """The printable table and whether every row passed: a WARN row (ok, worth reading: e.g. an
    untested version whose seams passed) is counted in the summary and never fails the doctor.
    estimate: the whole job's cost rows (estimate_rows), printed after the nodes'; they never fail it."""
    ok, warnings, lines = True, 0, []
    for rep in reports:
        lines.append(f"node {rep['node_ip']} ({rep['host']})")
        for r in rep["rows"]:
            ok &= r["ok"]
            warnings += bool(r["ok"] and r.get("warn"))
            lines += format_row(r)
    if estimate:
        lines.append("estimate (the whole job, before it starts)")
        for r in estimate:
            warnings += bool(r.get("warn"))
            lines += format_row(r)
    lines.append(f"doctor: {'all checks passed' if ok else 'FAILED'} on {len(reports)} node(s)"
                 + (f", {warnings} warning(s) (WARN rows)" if warnings else ""))
    return ok, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ray_jobs.doctor", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="YAML/JSON job config (omitted: the demo defaults)")
    ap.add_argument("--no-dry-run", action="store_true", help="skip the engine dry run")
    ap.add_argument("--json", help="also write the reports to this file")
    args = ap.parse_args(argv)
    cfg = load_job_config(args.config)
    from ray_jobs.cluster import init_ray
    from ray_jobs.target import resolve_target

    init_ray(cfg.ray.address, cfg.ray.num_cpus, dashboard_host=cfg.ray.dashboard_host, cache_dir=cfg.cache_dir)
    target_dir = resolve_target(cfg, Path(cfg.output_dir).resolve())
    ok, table, reports = run_doctor(cfg, target_dir, dry_run=not args.no_dry_run)
    print(table, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Checks that take seconds and run before any weights load: one node's report.

Owns: package versions against the tested matrix, the compat seams' probes, GPU hygiene,
free disk against the dataset's estimated size, and the architecture-matched dry run
(the target's own config.json cut to 2 decoder layers, random weights via vLLM's dummy
loader, through the exact extraction code path). Each check returns a `Check` row;
ray_jobs/doctor.py runs this on every node and prints the table.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

DRY_RUN_LAYERS = 2


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False  # ok but worth reading
    seconds: float | None = None  # the check's own time, where it starts something (the dry run's engine)

    def to_dict(self) -> dict:
        return asdict(self)


def check_versions(others: Sequence[Check] = ()) -> list[Check]:
    """One row per package of the tested matrix. A version outside the range is judged by its seams
    (compat.versions.UNTESTED): a warning naming the range when every probe tagged with
    the package (compat.probes.SEAMS) passed among `others` (this node's rows), and the dry run too
    where it ran here; a failure naming what failed otherwise, or when the package is a hard stop."""
    from compat.probes import SEAMS
    from compat.versions import TESTED, UNTESTED, in_tested_range, installed, outside_declared

    rows = []
    for name in TESTED:
        ok, detail = in_tested_range(name)
        if ok:
            rows.append(Check(f"version {name}", True, detail))
            continue
        lo, hi = TESTED[name]
        version, policy = installed(name), UNTESTED[name]
        to_tested = f"install {name}>={lo},<{hi} (README, 'Tested versions')"
        if version is None:
            rows.append(Check(f"version {name}", False, detail, to_tested))
            continue
        if name != "speculators" and (pinned := outside_declared(name, version)):
            detail = f"{detail}; {pinned}"
        if not policy.decided_by_seams:
            rows.append(Check(f"version {name}", False, f"{detail}; untested {name} is a hard stop: {policy.why}",
                              f"{to_tested}, or run make test on {name} {version} and widen compat.versions.TESTED"))
            continue
        judged = [r for r in others if set(policy.judged_with or (name,)) & set(SEAMS.get(r.name, ()))]
        judged += [r for r in others if r.name == "dry run" and policy.dry_run]
        failed = [r.name for r in judged if not r.ok]
        if failed or not judged:
            why = f"failed: {', '.join(failed)}" if failed else "no probe of it ran"
            rows.append(Check(f"version {name}", False, f"{detail}; untested, and its seams decide: {why}",
                              f"{to_tested}, or port the failed seams (their rows say how; compat/README.md)"))
            continue
        dry = "" if not policy.dry_run or any(r.name == "dry run" for r in others) else \
            " (the dry run did not run on this node)"
        rows.append(Check(f"version {name}", True, f"{detail}; untested, allowed because its seams passed: "
                          f"{', '.join(r.name.removeprefix('seam ') for r in judged)}{dry}",
                          "nothing to do; to call it tested, run make test on it and widen compat.versions.TESTED",
                          warn=True))
    return rows


def check_seams(target_dir: str | None, trust_remote_code: bool) -> list[Check]:
    """The compat probes; a failed one names the installed version of what it checks."""
    from compat import probes
    from compat.versions import installed

    rows = []
    for name, ok, detail, fix in probes.run_all(target_dir, trust_remote_code):
        if not ok and probes.SEAMS.get(name):
            detail = f"[{', '.join(f'{p} {installed(p)}' for p in probes.SEAMS[name])}] {detail}"
        rows.append(Check(name, ok, detail, fix))
    return rows


def check_gpus(min_free_fraction: float = 0.9) -> list[Check]:
    """Memory in use on each GPU of the node and the processes holding it, each named (a vLLM
    engine core, a Ray worker, one of our actors; orphaned or not) with the command that stops
    it: a crashed engine's zombie keeps its memory, and the next engine start fails only after a
    long wait. Every GPU of the node, not only those of CUDA_VISIBLE_DEVICES: the job's engines will
    use them all (eagle3.gpu_processes)."""
    from eagle3 import gpu_processes as gp

    try:
        gpus, procs = gp.query()
    except gp.NvidiaSmiMissing:
        if gp.nvidia_gpus_present():
            return [Check("gpu hygiene", True, "NVIDIA GPUs present but nvidia-smi is not on PATH: GPU hygiene "
                          "not checked", "put nvidia-smi on PATH (NVIDIA driver utilities) to check it", warn=True)]
        return [Check("gpu hygiene", True, "no NVIDIA GPU and no nvidia-smi on this node (CPU engine): skipped")]
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return [Check("gpu hygiene", False, f"[nvidia-smi] {e}", "fix the NVIDIA driver (nvidia-smi must run) "
                      "before starting engines")]
    own_raylet = gp.own_raylet_pid()
    rows = []
    for gpu in gpus:
        holders = [gp.describe(p, own_raylet=own_raylet) for p in procs
                   if p.gpu_uuid == gpu.uuid and p.pid != os.getpid()]
        busy = gpu.total_mib > 0 and gpu.used_mib / gpu.total_mib > 1 - min_free_fraction
        ok = not busy and not holders
        detail = (f"{gpu.used_mib / 1024:.1f} of {gpu.total_mib / 1024:.0f} GiB in use; holders: "
                  + ("; ".join(h.describe() for h in holders) if holders else "none"))
        if holders:
            fix = "; ".join(f"pid {h.pid}: {h.fix}" for h in holders)
        elif busy:
            fix = ("memory in use by processes nvidia-smi does not list (another container or VM on this GPU?): "
                   "free it where it runs")
        else:
            fix = ""
        rows.append(Check(f"gpu {gpu.index} hygiene", ok, detail, fix))
    return rows


def estimate_dataset_bytes(num_tokens: int, num_layers: int, hidden_size: int, hs_dtype: str) -> int:
    """Bytes of the hidden-state shards of num_tokens tokens: what a shard stores a token
    (eagle3.schema.stored_bytes_per_token), its input id (4) and loss mask (1)."""
    from eagle3.schema import stored_bytes_per_token

    return num_tokens * (stored_bytes_per_token(num_layers=num_layers, hidden_size=hidden_size, hs_dtype=hs_dtype) + 5)


def existing_parent(path: str) -> Path:
    """path, or its nearest parent that exists (an output directory not made yet)."""
    probe = Path(path).resolve()
    while not probe.exists():
        probe = probe.parent
    return probe


def free_bytes(path: str) -> int:
    """Bytes free on the file system that path (or its nearest existing parent) is on."""
    return shutil.disk_usage(existing_parent(path)).free


def size_text(num_bytes: float) -> str:
    """'63.6 GB', '1.3 MB': decimal units, three significant figures at most."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes:.0f} bytes"


def check_disk(output_dir: str, estimated_bytes: int | None, margin: float = 1.2, *, rough: str | None = None) -> Check:
    """Room under output_dir for the hidden states; estimated_bytes None: the job writes none
    (online training that re-extracts every epoch), and the row only reports the free space.
    rough: why the estimate is only rough (counted from the source's bytes, or from prepared answers
    the regenerate stage will rewrite); a rough estimate that does not fit is a warning, not a stop:
    the extract stage checks again with the exact token count before its engines start
    (ray_jobs.extract.check_room)."""
    probe = existing_parent(output_dir)
    free = shutil.disk_usage(probe).free
    if estimated_bytes is None:
        return Check("disk space", True, f"{size_text(free)} free at {probe}; no hidden states are written "
                     "(train.source online, train.online.epochs reextract)")
    ok = free >= estimated_bytes * margin
    detail = (f"{size_text(free)} free at {probe}; the dataset needs ~{size_text(estimated_bytes)} "
              f"(+{round((margin - 1) * 100)}% margin)")
    fix = "" if ok else ("point output_dir at a larger volume, use extract.hs_dtype=float8_e4m3fn (half), "
                         "or extract fewer samples")
    if ok or rough is None:
        return Check("disk space", ok, detail, fix)
    return Check("disk space", True, f"{detail}, a rough estimate ({rough}): the extract stage checks the exact "
                 "size before its engines start", fix, warn=True)


def cut_config(target_dir: str, out_dir: str, num_layers: int = DRY_RUN_LAYERS) -> str:
    """Copy the target's config.json (and tokenizer files) with the language model cut to
    `num_layers` decoder layers; MoE and multimodal settings are kept as they are."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cut = copy.deepcopy(cfg)
    text = cut
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(cut.get(key), dict) and "num_hidden_layers" in cut[key]:
            text = cut[key]
    text["num_hidden_layers"] = num_layers
    for key in ("layer_types", "mlp_only_layers"):
        if isinstance(text.get(key), list):
            text[key] = text[key][:num_layers]
    if "first_k_dense_replace" in text:  # DeepSeek-style: keep one dense layer and one MoE layer
        text["first_k_dense_replace"] = min(text["first_k_dense_replace"], 1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cut, indent=1))
    for p in Path(target_dir).iterdir():
        if p.suffix in (".py", ".jinja") or p.name.startswith(("tokenizer", "special_tokens", "generation_config",
                                                                 "preprocessor_config", "chat_template")):
            shutil.copy(p, out / p.name)
    return str(out)


def dry_run(target_dir: str, extract_cfg, *, dtype: str, trust_remote_code: bool, num_tokens: int = 16) -> Check:
    """One sample through the exact extraction path on the cut target; shapes checked."""
    import dataclasses

    import pyarrow as pa

    from eagle3.extract.codec import decode_rows
    from eagle3.extract.extractor import Extractor, target_text_config
    from eagle3.schema import TOKENS_SCHEMA, hs_layout

    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="eagle3-dryrun-")
    extractor = None
    try:
        cut = cut_config(target_dir, tmp)
        text = target_text_config(cut)
        n = text["num_hidden_layers"]
        full_aux = extract_cfg.layer_ids(target_text_config(target_dir)["num_hidden_layers"])[:-1]
        # The job's aux ids on the cut model: id 0 (the embeddings) only if the job captures it, since
        # DeepSeek-V2/V3 (Kimi-K2.x) in vLLM 0.26-0.32 crash on id 0 (residual is None before layer 0);
        # every other id becomes a decoder layer of the cut model.
        cut_aux = tuple(sorted({0 if k == 0 else min(k, n - 1) for k in full_aux}))
        # One step holds a whole prefill, up to the engine's max_model_len: max_length + 1
        # (compat.vllm_engine.prefill_max_model_len).
        max_length = max(256, num_tokens)
        # Eager and a KV cache of a fixed size (vLLM >= 0.11; a GPU engine then skips the memory
        # profiling): the path's shapes are under test, not its speed.
        cfg = dataclasses.replace(extract_cfg, aux_hidden_state_layer_ids=cut_aux or (0,),
                                  load_format="dummy", num_replicas=1, gpu_memory_utilization=0.3,
                                  max_num_batched_tokens=max_length + 1, max_num_seqs=4, enforce_eager=True,
                                  replicas_per_gpu=1, kv_cache_memory_bytes=1 << 30)
        t_engine = time.perf_counter()
        extractor = Extractor(cut, cfg, max_length=max_length, dtype=dtype, trust_remote_code=trust_remote_code)
        engine_s = time.perf_counter() - t_engine
        ids = [(7 * i + 3) % min(int(text.get("vocab_size", 1000)), 1000) for i in range(num_tokens)]
        tokens = pa.Table.from_pylist([{"sample_id": "dry-run", "input_ids": ids, "loss_mask": [1] * num_tokens,
                                        "num_tokens": num_tokens}], schema=TOKENS_SCHEMA)
        table, stats = extractor.extract(tokens)
        layer_ids, _, _ = hs_layout(table.schema)
        hs = next(decode_rows(table)).hidden_states
        want = (num_tokens, len(layer_ids), text["hidden_size"])
        ok = tuple(hs.shape) == want and stats.num_samples == 1
        return Check("dry run", ok,
                     f"{json.loads((Path(cut) / 'config.json').read_text()).get('architectures') or text.get('architectures')} "
                     f"cut to {n} layers, dummy weights, backend {cfg.backend}: hidden states {tuple(hs.shape)} "
                     f"(want {want}), layers {layer_ids}, {extractor.dtype}, engine up in {engine_s:.0f}s, "
                     f"{time.perf_counter() - t0:.0f}s in all",
                     "" if ok else "the extraction path returned wrong shapes: report it with this table",
                     seconds=round(engine_s, 2))
    except Exception as e:  # noqa: BLE001 - a doctor reports every failure as a row, with its cause
        return Check("dry run", False, f"{type(e).__name__}: {str(e)[:400]}",
                     "the extraction path fails on this architecture before any weights load; the traceback "
                     "follows\n" + traceback.format_exc()[-1500:])
    finally:
        if extractor is not None:
            extractor.close()
        shutil.rmtree(tmp, ignore_errors=True)

"""Doctor: the architecture-matched dry run through the real vLLM CPU engine (a dense Llama, a
Qwen3-MoE, and Kimi-K2.5's multimodal wrapper around a DeepSeek-V3 MLA + MoE text model), the
full doctor as a command on a real local Ray cluster, and the failures that must stop a job in
seconds, each with what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_configs  # noqa: E402

def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    # An in-process engine earlier in this pytest process sets this; a child decides for itself.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def _doctor(tmp_path: Path, target: str, address: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    # ray.address: the session's shared cluster (conftest's shared_ray), one node.
    cfg = {"output_dir": str(tmp_path / "out"), "target": {"model": target}, "ray": {"address": address},
           "prepare": {"conversations": str(REPO / "data" / "demo_conversations.jsonl")}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    report = tmp_path / "doctor.json"
    out = subprocess.run([sys.executable, "-m", "ray_jobs.doctor", "--config", str(tmp_path / "job.yaml"),
                          "--json", str(report), *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=300)
    return out, report


def _rows(report: Path) -> dict[str, dict]:
    reports = json.loads(report.read_text())
    assert len(reports) == 1  # one node
    return {r["name"]: r for r in reports[0]["rows"]}


# --- dry run -----------------------------------------------------------------------------------------
# The dense Llama's dry run is the full doctor's own (test_doctor_passes_on_tiny_target), not a
# second engine. Each dry run starts its engine in a fresh child process, as the doctor does (a
# max_calls=1 Ray task): vLLM sets up its parallel state once per process, so e.g. a MoE engine
# after a dense one in the same process fails ("expert parallel group is not initialized").

DRY_RUN_CHILD = """
import json, sys
from eagle3.config import ExtractConfig
from eagle3.doctor import dry_run

if __name__ == "__main__":
    cfg = ExtractConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[2]).items()})
    check = dry_run(sys.argv[1], cfg, dtype="bfloat16", trust_remote_code=False)
    print("CHECK " + json.dumps(check.to_dict()))
"""


def _dry_run(tmp_path: Path, target: str, **extract) -> dict:
    script = tmp_path / "dry_run_child.py"
    script.write_text(DRY_RUN_CHILD)
    out = subprocess.run([sys.executable, str(script), target, json.dumps(extract)], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("CHECK ")]
    assert lines, f"rc {out.returncode}\n{out.stderr[-4000:]}"
    check = json.loads(lines[-1][len("CHECK "):])
    assert check["ok"], f"{check['detail']}\n{check['fix']}"
    assert check["name"] == "dry run" and "dummy weights, backend vllm" in check["detail"]
    return check


@pytest.mark.slow
def test_dry_run_moe(tmp_path):
    """Qwen3-MoE (4 experts, top-2) cut to 2 layers; aux id 0 (the embeddings) asked for and kept."""
    target = model_configs.write_qwen3_moe_target(tmp_path / "qwen3-moe")
    check = _dry_run(tmp_path, target, aux_hidden_state_layer_ids=[0, 3, 5])
    assert check["detail"].startswith("['Qwen3MoeForCausalLM'] cut to 2 layers")
    assert "hidden states (16, 3, 256) (want (16, 3, 256)), layers [0, 1, 2]" in check["detail"]


@pytest.mark.slow
def test_dry_run_multimodal_wrapper_kimi_k25(tmp_path):
    """Kimi-K2.5's wrapper (language model in `text_config`, a MoonViT vision tower) around a
    DeepSeek-V3 text model: MLA attention, one dense layer then MoE layers with a shared expert.

    With the 'shm' sink, i.e. a multiprocess engine: on vLLM 0.32's CPU backend an in-process engine
    for this architecture dies at start, because vLLM's kimi_k25 module imports numba/llvmlite and
    the CPU kernel-override scan trips over llvmlite
    (tests/test_compat.py::test_cpu_kernel_override_scan_breaks_on_llvmlite)."""
    target = model_configs.write_kimi_k25_target(tmp_path / "kimi-k25")
    check = _dry_run(tmp_path, target, sink="shm")
    assert check["detail"].startswith("['KimiK25ForConditionalGeneration'] cut to 2 layers")
    # The text model's hidden size (256), not the vision tower's (128).
    assert "hidden states (16, 2, 256) (want (16, 2, 256)), layers [1, 2]" in check["detail"]


# --- the full doctor -----------------------------------------------------------------------------

@pytest.mark.slow
def test_doctor_passes_on_tiny_target(tiny_target, tmp_path, shared_ray):
    out, report = _doctor(tmp_path, tiny_target, shared_ray)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = out.stdout
    for name in ("version vllm", "version speculators", "version torch", "seam vllm hidden-states connector",
                 "seam vllm engine args + step + metrics", "seam vllm spec-decode metric names",
                 "seam speculators draft config -> vLLM eagle3", "seam ray train storage layout",
                 "target architecture", "trust_remote_code",
                 "gpu hygiene", "disk space", "dry run"):
        assert f"  PASS  {name}" in table, f"no PASS row for {name!r} in\n{table}"
    assert "FAIL" not in table and "doctor: all checks passed on 1 node(s)" in table
    rows = _rows(report)
    assert all(r["ok"] for r in rows.values())
    # The dense dry run (the doctor's, with the job's default extract settings): the tiny Llama
    # (8 layers) cut to 2; default aux ids (2, 4, 5) land on layer 1, plus the last.
    dry = rows["dry run"]["detail"]
    assert dry.startswith("['LlamaForCausalLM'] cut to 2 layers") and "dummy weights, backend vllm" in dry
    assert "hidden states (16, 2, 256) (want (16, 2, 256)), layers [1, 2]" in dry
    assert rows["target architecture"]["detail"] == "LlamaForCausalLM: implements SupportsEagle3"


@pytest.mark.slow  # uses Ray
def test_doctor_fails_on_architecture_without_eagle3_naming_the_row_and_why(tiny_target, tmp_path, shared_ray):
    """Mixtral is served by vLLM but cannot give aux hidden states (no SupportsEagle3): the doctor exits 1,
    its table and its JSON report fail that one row, with the reason under it."""
    target = model_configs.write_mixtral_target(tmp_path / "mixtral", tokenizer_from=tiny_target)
    out, report = _doctor(tmp_path, target, shared_ray, "--no-dry-run")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "  FAIL  target architecture" in out.stdout and "MixtralForCausalLM: does NOT implement SupportsEagle3" in out.stdout
    assert "        -> vLLM cannot capture aux hidden states of this architecture" in out.stdout
    assert "doctor: FAILED on 1 node(s)" in out.stdout
    rows = _rows(report)
    assert [n for n, r in rows.items() if not r["ok"]] == ["target architecture"]
    assert "dry run" not in rows  # --no-dry-run: the verdict comes from the checks alone, no engine started


@pytest.mark.slow  # uses Ray
def test_doctor_fails_on_remote_code_without_trust_naming_the_fix(tiny_target, tmp_path, shared_ray):
    """A target that ships its own code (auto_map) while target.trust_remote_code is off (the default): the
    doctor exits 1 with that one row failed and the setting that lets it run."""
    target = model_configs.write_remote_code_target(tmp_path / "remote", tiny_target)
    out, report = _doctor(tmp_path, target, shared_ray, "--no-dry-run")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "  FAIL  trust_remote_code" in out.stdout
    assert "        -> read that code, then set target.trust_remote_code: true" in out.stdout
    rows = _rows(report)
    assert [n for n, r in rows.items() if not r["ok"]] == ["trust_remote_code"]
    assert "doctor: FAILED on 1 node(s)" in out.stdout and "dry run" not in rows


def test_disk_check_fails_when_the_dataset_does_not_fit(tmp_path):
    import shutil

    from eagle3.doctor import check_disk, estimate_dataset_bytes

    free = shutil.disk_usage(tmp_path).free
    assert check_disk(str(tmp_path / "not" / "yet"), estimate_dataset_bytes(1000, 4, 256, "bfloat16")).ok
    row = check_disk(str(tmp_path / "not" / "yet"), free)  # fits, but not with the 20% margin
    assert not row.ok and row.name == "disk space"
    assert f"free at {tmp_path}" in row.detail and "(+20% margin)" in row.detail
    assert "point output_dir at a larger volume" in row.fix and "float8_e4m3fn" in row.fix
    # fp8 storage halves the hidden-state bytes (plus a per-token, per-layer scale): the fix is real.
    bf16, fp8 = (estimate_dataset_bytes(10**6, 4, 4096, d) for d in ("bfloat16", "float8_e4m3fn"))
    assert fp8 < 0.51 * bf16


def test_a_rough_disk_estimate_warns_and_extraction_checks_the_exact_size(tmp_path):
    """The doctor runs beside prepare, so its disk estimate is rough: ~4 bytes of the source a token
    (1.5x prepare's count on 2,400 ShareGPT records), or prepared answers that regeneration rewrites.
    On an H200, 12,000 ShareGPT records estimated ~95 GB of SmolLM2 hidden states against
    63 GB free, and their regenerated tokens took 36.2 GB: such an estimate that does not fit warns;
    the extract stage then checks the tokens it reads, and stops before its engines where they do
    not fit."""
    import shutil

    from tests.helpers import job_config
    from eagle3.doctor import check_disk
    from ray_jobs.doctor import PREPARED_ESTIMATE, rough_estimate
    from ray_jobs.extract import check_room

    free = shutil.disk_usage(tmp_path).free
    row = check_disk(str(tmp_path), 2 * free, rough="counted from the source's bytes")
    assert row.ok and row.warn and "a rough estimate (counted from the source's bytes)" in row.detail
    assert "the extract stage checks the exact size" in row.detail and "float8_e4m3fn" in row.fix
    assert not check_disk(str(tmp_path), 2 * free).ok  # prepared tokens, extracted as they are: a stop
    fits = check_disk(str(tmp_path), free // 4, rough="counted from the source's bytes")
    assert fits.ok and not fits.warn
    cfg = job_config({})
    assert rough_estimate(cfg, "~4 bytes of x.json a token") == "counted from the source's bytes"
    assert rough_estimate(cfg, PREPARED_ESTIMATE) is None
    regen = job_config({"regenerate.enabled": True})
    assert rough_estimate(regen, PREPARED_ESTIMATE) == "prepared answers, which the regenerate stage rewrites"

    per_token = 4 * 576 * 2 + 5  # SmolLM2: 4 layers of 576 in bf16, the token id and its loss mask
    check_room(str(tmp_path / "hs"), free // per_token // 2, 4, 576, "bfloat16")  # half the disk: goes on
    with pytest.raises(ValueError, match=r"extract: no room for the hidden states of \d+ tokens: .* GB free at "
                                         r".*float8_e4m3fn.*Nothing was extracted"):
        check_room(str(tmp_path / "hs"), free // per_token, 4, 576, "bfloat16")  # all of it, less than the margin


def test_dataset_estimate_reads_only_the_records_prepare_will_take(tmp_path):
    """prepare.max_samples cuts the source: the doctor's disk estimate counts those records only (an
    H200 job on 2,400 of ShareGPT's records was stopped for the whole 125 MB file's 145 GB)."""
    from tests.helpers import job_config
    from ray_jobs.doctor import estimate_tokens

    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "q" * 100},
                                                  {"from": "gpt", "value": "a" * (300 + i)}]} for i in range(50)]
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(records))
    whole, how = estimate_tokens(job_config({"prepare.conversations": str(src), "output_dir": str(tmp_path)}))
    assert whole == src.stat().st_size // 4 and how == f"~4 bytes of {src} a token"
    cut, how = estimate_tokens(job_config({"prepare.conversations": str(src), "output_dir": str(tmp_path),
                                                      "prepare.max_samples": 10}))
    assert cut == sum(len(json.dumps(r)) for r in records[:10]) // 4
    assert 0.15 * whole < cut < 0.25 * whole and how == f"~4 bytes of the first 10 records of {src} a token"


def test_disk_check_asks_no_room_when_training_online_writes_no_hidden_states(tmp_path):
    """Online training that re-extracts every epoch writes no hidden states (a data set whose
    hidden states would not fit is its use): the doctor must not stop it for disk space."""
    from tests.helpers import job_config
    from eagle3.doctor import check_disk
    from ray_jobs.doctor import writes_hidden_states

    online = {"train.source": "online", "train.online.gpu_split": "separate"}
    assert not writes_hidden_states(job_config(online))
    assert writes_hidden_states(job_config({**online, "train.online.epochs": "keep"}))
    assert writes_hidden_states(job_config({}))  # offline: the extract stage's shards
    assert writes_hidden_states(job_config({**online, "stages": ["prepare", "extract"]}))
    row = check_disk(str(tmp_path), None)
    assert row.ok and "no hidden states are written" in row.detail and "GB free at" in row.detail


# --- untested versions: judged by their seams ----------------------------------------------------
# The version number is faked (compat.versions.installed); the probes are the real ones, run against
# the installed packages, since the question is the policy: what the doctor does with what they find.

def _fake_versions(monkeypatch, **fake: str):
    from packaging.version import Version

    from compat import versions

    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: Version(fake[name]) if name in fake else real(name))


def _rows_by_name(rows) -> dict:
    return {r.name: r for r in rows}


def test_a_torch_or_transformers_past_speculators_pins_says_so_in_its_row(monkeypatch):
    """torch 2.15 and transformers 5.23 (faked) lie outside both the tested matrix and speculators'
    own declared ranges; the version row says the second too, since pip would refuse that pair."""
    from eagle3.doctor import check_seams, check_versions

    _fake_versions(monkeypatch, torch="2.15.0", transformers="5.23.0")
    rows = _rows_by_name(check_versions(check_seams(None, False)))
    assert "speculators 0.9.0 declares torch<=2.14.1,>=2.9.0, which excludes torch 2.15.0" in rows["version torch"].detail
    assert "which excludes transformers 5.23.0" in rows["version transformers"].detail
    assert "declares" not in rows["version vllm"].detail


def test_untested_vllm_whose_seams_pass_runs_with_a_warning(monkeypatch):
    """An untested vLLM (faked 0.40.0; the real probes pass on the installed one) is a WARN row that
    names the range and the seams that decided it; the doctor's verdict stays 'passed' (exit 0)."""
    from compat.versions import TESTED
    from eagle3.doctor import Check, check_seams, check_versions
    from ray_jobs.doctor import format_reports

    assert all(r.ok and not r.warn for r in check_versions())  # the installed stack is in the matrix
    seams = check_seams(None, False)
    assert all(r.ok for r in seams), [(r.name, r.detail) for r in seams if not r.ok]
    _fake_versions(monkeypatch, vllm="0.40.0")
    rows = _rows_by_name(check_versions(seams))
    lo, hi = TESTED["vllm"]
    row = rows["version vllm"]
    assert row.ok and row.warn
    assert row.detail == (f"vllm 0.40.0 (OUTSIDE tested >={lo},<{hi}); untested, allowed because its seams passed: "
                          "vllm hidden-states connector, vllm engine args + step + metrics, vllm spec-decode metric "
                          "names, speculators draft config -> vLLM eagle3 (the dry run did not run on this node)")
    assert [n for n, r in rows.items() if not r.ok or r.warn] == ["version vllm"]

    # With this node's dry run passed, it is named among the deciders; a node's table with the WARN
    # row passes, and says how many warnings it has.
    dry = Check("dry run", True, "['LlamaForCausalLM'] cut to 2 layers ...")
    row = _rows_by_name(check_versions([*seams, dry]))["version vllm"]
    assert row.ok and row.warn and row.detail.endswith("speculators draft config -> vLLM eagle3, dry run")
    ok, table = format_reports([{"node_ip": "10.0.0.1", "host": "h", "rows": [
        r.to_dict() for r in check_versions([*seams, dry]) + [*seams, dry]]}])
    assert ok and table.endswith("doctor: all checks passed on 1 node(s), 1 warning(s) (WARN rows)")
    assert "  WARN  version vllm" in table and "FAIL" not in table

    # A failed dry run decides it the other way: the version row fails and names it.
    dry = Check("dry run", False, "RuntimeError: ...", "the extraction path fails ...")
    row = _rows_by_name(check_versions([*seams, dry]))["version vllm"]
    assert not row.ok and row.detail.endswith("; untested, and its seams decide: failed: dry run")
    assert row.fix.startswith(f"install vllm>={lo},<{hi}")
    ok, table = format_reports([{"node_ip": "10.0.0.1", "host": "h", "rows": [
        r.to_dict() for r in check_versions([*seams, dry]) + [*seams, dry]]}])
    assert not ok and table.endswith("doctor: FAILED on 1 node(s)")


def test_untested_torch_and_ray_are_judged_by_the_probes_that_reach_them(monkeypatch):
    """torch by vLLM's probes (vLLM pins torch exactly) and the dry run; Ray by the Ray Train
    storage-layout probe. Without any such row, an untested version is not waved through."""
    from eagle3.doctor import check_seams, check_versions

    seams = check_seams(None, False)
    _fake_versions(monkeypatch, torch="2.99.0", ray="2.99.0")
    rows = _rows_by_name(check_versions(seams))
    assert rows["version torch"].ok and rows["version torch"].warn
    assert "allowed because its seams passed: vllm hidden-states connector" in rows["version torch"].detail
    assert rows["version ray"].ok and rows["version ray"].warn
    assert rows["version ray"].detail.endswith("allowed because its seams passed: ray train storage layout")
    bare = _rows_by_name(check_versions([]))
    assert not bare["version ray"].ok and bare["version ray"].detail.endswith("its seams decide: no probe of it ran")


def test_untested_speculators_and_deepspeed_are_hard_stops(monkeypatch):
    """Nothing reaches speculators' export format or DeepSpeed's training seams in seconds: an
    untested version of either fails, whatever the probes say, with the reason and the fix."""
    from compat.versions import TESTED
    from eagle3.doctor import check_seams, check_versions

    seams = check_seams(None, False)
    _fake_versions(monkeypatch, speculators="0.10.0", deepspeed="0.20.1")
    rows = _rows_by_name(check_versions(seams))
    assert [n for n, r in rows.items() if not r.ok] == ["version speculators", "version deepspeed"]
    spec = rows["version speculators"]
    lo, hi = TESTED["speculators"]
    assert spec.detail.startswith(f"speculators 0.10.0 (OUTSIDE tested >={lo},<{hi}); untested speculators is a "
                                  "hard stop: ") and "export format vLLM reads" in spec.detail
    assert spec.fix.startswith(f"install speculators>={lo},<{hi} (README, 'Tested versions'), or run make test on "
                               "speculators 0.10.0")
    assert "first met when training starts" in rows["version deepspeed"].detail


def test_node_report_lists_versions_first_judged_by_the_nodes_own_checks(monkeypatch, tmp_path):
    """What each Ray task of the doctor runs (ray_jobs.doctor.node_report), called directly: no
    Ray, no engine (dry run off), a Qwen3-MoE config as the target. The version rows come first,
    and an untested vLLM is judged by this node's real probes, the target-architecture one too."""
    from tests.helpers import job_config
    from ray_jobs.doctor import format_reports, node_report

    target = model_configs.write_qwen3_moe_target(tmp_path / "qwen3-moe")
    cfg = job_config({"output_dir": str(tmp_path / "out"), "target.model": target})
    _fake_versions(monkeypatch, vllm="0.40.0")
    rep = node_report(cfg, target, num_tokens=1000, with_dry_run=False)
    names = [r["name"] for r in rep["rows"]]
    assert names[:6] == [f"version {p}" for p in ("vllm", "speculators", "ray", "deepspeed", "torch", "transformers")]
    assert "dry run" not in names and "target architecture" in names
    vllm = rep["rows"][0]
    assert vllm["ok"] and vllm["warn"], vllm
    assert vllm["detail"].endswith("speculators draft config -> vLLM eagle3, target architecture "
                                   "(the dry run did not run on this node)")
    ok, table = format_reports([{**rep, "node_ip": "127.0.0.1"}])
    assert ok and table.endswith("doctor: all checks passed on 1 node(s), 1 warning(s) (WARN rows)"), table


IMPORT_CHILD = """
import sys
from compat.probes import import_target_model
before = [m for m in ("vllm.model_executor.models.qwen3_moe", "vllm.model_executor.layers.fused_moe.fused_moe")
          if m in sys.modules]
name = import_target_model(sys.argv[1])
print(before, name, [m for m in ("vllm.model_executor.models.qwen3_moe",
                                 "vllm.model_executor.layers.fused_moe.fused_moe") if m in sys.modules])
"""


def test_the_target_model_class_is_imported_before_the_doctors_two_threads(tmp_path):
    """On an H200 with vLLM 0.26.0 the doctor's checks thread and its dry run imported the MoE layers
    at once, and one got a partially initialized module. node_report now
    imports the target's model class in its main thread first: here, in a fresh process, that import
    brings the MoE target's module and vLLM's fused-MoE module, which neither thread then imports
    half-done. A bad config gives None (the architecture row reports why)."""
    target = model_configs.write_qwen3_moe_target(tmp_path / "qwen3-moe")
    out = subprocess.run([sys.executable, "-c", IMPORT_CHILD, target], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == ("[] vllm.model_executor.models.qwen3_moe "
                                                   "['vllm.model_executor.models.qwen3_moe', "
                                                   "'vllm.model_executor.layers.fused_moe.fused_moe']")
    from compat.probes import import_target_model

    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"architectures": ["NoSuchModel"]}))
    assert import_target_model(str(tmp_path / "bad")) is None


def _moved_connector_module():
    """A real copy of vLLM's example_hidden_states_connector module whose connector class is a real
    copy of ExampleHiddenStatesConnector with `_submit_async_write` renamed (as an upstream rename
    would leave it): what compat/hidden_states_connector.py overrides is gone."""
    import types

    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as m

    real = m.ExampleHiddenStatesConnector
    ns = {k: v for k, v in vars(real).items() if k not in ("__dict__", "__weakref__")}
    ns["_submit_write"] = ns.pop("_submit_async_write")
    moved = types.ModuleType(m.__name__)
    moved.__dict__.update(vars(m))
    moved.ExampleHiddenStatesConnector = type(real)(real.__name__, real.__bases__, ns)
    return m, moved


@pytest.mark.parametrize("version", ["0.40.0", None])  # untested (faked), and the installed one
def test_a_moved_seam_fails_naming_seam_version_and_fix(monkeypatch, version):
    import vllm.distributed.kv_transfer.kv_connector.v1 as v1

    from compat import versions
    from eagle3.doctor import check_seams, check_versions

    real, moved = _moved_connector_module()
    monkeypatch.setitem(sys.modules, real.__name__, moved)
    monkeypatch.setattr(v1, "example_hidden_states_connector", moved)
    if version:
        _fake_versions(monkeypatch, vllm=version)
    seams = check_seams(None, False)
    rows = _rows_by_name(check_versions(seams) + seams)
    seam = rows["seam vllm hidden-states connector"]
    assert not seam.ok
    assert seam.detail == f"[vllm {versions.installed('vllm')}] moved or gone: ['_submit_async_write']"
    assert seam.fix == "update compat/hidden_states_connector.py for this vLLM (see compat/README.md)"
    if version:  # untested and a seam moved: the version row fails too, naming the seam
        assert [n for n, r in rows.items() if not r.ok] == ["version vllm", "seam vllm hidden-states connector"]
        assert rows["version vllm"].detail.endswith("its seams decide: failed: seam vllm hidden-states connector")
    else:  # a tested version: the seam row alone fails
        assert [n for n, r in rows.items() if not r.ok] == ["seam vllm hidden-states connector"]


# --- the cost estimate (eagle3.cost), as the doctor prints it --------------------------------------


def test_cost_rows_print_bytes_and_stages_and_warn_where_the_disk_is_short(tmp_path):
    """The estimate's rows follow the nodes' in the doctor's table, in its row format; a disk too small for
    the hidden states is a WARN naming fp8 or online mode, never a failure of the doctor."""
    from eagle3 import cost
    from eagle3.config import load_job_config
    from ray_jobs.doctor import estimate_rows, format_reports

    cfg = load_job_config(None, {"target.model": str(tmp_path), "prepare.conversations": str(tmp_path / "c.json"),
                                 "output_dir": str(tmp_path), "regenerate.enabled": False, "train.num_steps": 100})
    smol = {"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152, "intermediate_size": 1536,
            "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}
    short = estimate_rows(cost.estimate(cfg, smol, 1_000_000, 1, 3 * 10 ** 9, tokens_from="a sample"))
    names = [r["name"] for r in short]
    assert names[:2] == ["cost: tokens", "cost: disk"] and names[-1] == "cost: total" and "cost: train" in names
    disk = short[1]
    assert disk["ok"] and disk["warn"] and "float8_e4m3fn" in disk["fix"] and "4.61 GB" in disk["detail"]
    node = {"node_ip": "127.0.0.1", "host": "h", "rows": [{"name": "disk space", "ok": True, "detail": "x", "fix": ""}]}
    ok, table = format_reports([node], short)
    assert ok and "estimate (the whole job, before it starts)" in table and "WARN  cost: disk" in table
    assert table.endswith("doctor: all checks passed on 1 node(s), 1 warning(s) (WARN rows)")
    roomy = estimate_rows(cost.estimate(cfg, smol, 1_000_000, 1, 10 ** 12))
    assert not any(r.get("warn") for r in roomy)
    assert estimate_rows({"error": "ValueError: x"})[0]["warn"]


def test_cost_token_count_falls_back_to_bytes_without_a_tokenizer_and_caches_say_warm(tmp_path):
    from eagle3.config import load_job_config
    from ray_jobs.doctor import compile_caches_filled, count_tokens

    src = tmp_path / "c.json"
    src.write_text(json.dumps([{"id": f"c{i}", "conversations": [{"from": "human", "value": "q" * 100},
                                                                 {"from": "gpt", "value": "a" * 300}]}
                               for i in range(20)]))
    cfg = load_job_config(None, {"target.model": str(tmp_path), "prepare.conversations": str(src),
                                 "output_dir": str(tmp_path / "out")})
    tokens, _, how = count_tokens(cfg, str(tmp_path))  # no tokenizer in tmp_path
    assert tokens == src.stat().st_size // 4 and "the tokenizer's sample failed" in how
    assert not compile_caches_filled(str(tmp_path / "cache")) and not compile_caches_filled(None)
    (tmp_path / "cache" / "vllm" / "torch_compile_cache").mkdir(parents=True)
    assert compile_caches_filled(str(tmp_path / "cache"))


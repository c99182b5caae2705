"""Security defaults: the dashboard and job server listen on loopback unless configured, no
data file is unpickled (a checkpoint crafted with a pickle payload is refused), a sample id
never becomes part of a path, and the Ray auth token stays out of the job's output, logs and
report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO


class _Payload:
    """Pickles as a call to exec: loading the file writes `marker` (what an attacker's file would
    do with a shell command instead)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _payload_file(path: Path, marker: Path) -> Path:
    import torch

    torch.save({"module": {"w": torch.zeros(2)}, "global_steps": 1, "x": _Payload(marker)}, path)
    return path


def test_checkpoint_file_with_a_pickle_payload_is_refused_unrun(tmp_path):
    import torch

    from compat.deepspeed_checkpoint import _engine_class

    marker = tmp_path / "payload-ran"
    path = _payload_file(tmp_path / "mp_rank_00_model_states.pt", marker)
    with pytest.raises(ValueError, match="mp_rank_00_model_states.pt.*not loaded.*would run code") as err:
        _engine_class()().load(str(path), map_location="cpu")
    assert "exec" in str(err.value)  # the refused callable is named
    assert not marker.exists()
    # The same file through DeepSpeed's stock reader runs the payload: the refusal above is ours.
    torch.load(path, weights_only=False)
    assert marker.read_text() == "ran"


def test_checkpoint_state_of_ours_loads_through_the_safe_reader(tmp_path):
    """What DeepSpeed and eagle3.train.trainer put in a checkpoint (tensors, torch.Size, OrderedDict,
    numpy/python/torch RNG states, DeepSpeed's loss scaler, ZeRO stage, fragment addresses)."""
    import random
    from collections import OrderedDict

    import numpy as np
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from compat.deepspeed_checkpoint import _engine_class

    state = {"param_shapes": [OrderedDict(w=torch.Size([2, 3]))], "module": OrderedDict(w=torch.ones(2, 3)),
             "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
             "loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients,
             "param_slice_mappings": [OrderedDict(w=fragment_address(numel=6, start=0))], "ds_version": "0.19.8"}
    torch.save(state, tmp_path / "ckpt.pt")
    got = _engine_class()().load(str(tmp_path / "ckpt.pt"), map_location="cpu")
    assert got["param_shapes"] == state["param_shapes"] and torch.equal(got["module"]["w"], state["module"]["w"])
    assert got["rng"]["python"] == state["rng"]["python"]
    assert np.array_equal(got["rng"]["numpy"][1], state["rng"]["numpy"][1])
    assert torch.equal(got["rng"]["torch"], state["rng"]["torch"])
    assert got["loss_scaler"].cur_scale == 1.0 and got["zero_stage"] == ZeroStageEnum.gradients
    assert got["param_slice_mappings"][0]["w"] == fragment_address(numel=6, start=0)


def test_dashboard_host_defaults_to_loopback_and_must_be_an_address():
    from tests.helpers import job_config

    assert job_config().ray.dashboard_host == "127.0.0.1"
    with pytest.raises(ValueError, match="ray.dashboard_host.*127.0.0.1"):
        job_config(overrides={"ray.dashboard_host": " "})


# ---------------------------------------------------------------------------------------------
# real DeepSpeed, real Ray

@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_resume_reads_a_real_checkpoint_and_refuses_one_with_a_payload(tiny_target, tmp_path, zero_stage):
    """A real DeepSpeed engine (eagle3.train.deepspeed_backend) resumes from the checkpoint it wrote;
    the same checkpoint with its model-states file swapped for one carrying a payload is refused
    and the payload does not run (fails if DeepSpeed stops reading through checkpoint_engine)."""
    from tests.test_train import _capture_hidden_states, _conversation_tokens, _trainer, small_cfg, write_shards
    from transformers import AutoTokenizer

    samples = _conversation_tokens(AutoTokenizer.from_pretrained(tiny_target), 8)
    files = write_shards(tmp_path / "hs", samples, _capture_hidden_states(Path(tiny_target), samples), num_shards=1)
    cfg = small_cfg(num_steps=2, checkpoint={"checkpoint_every": 2}, optimizer={"zero_stage": zero_stage})
    _trainer(tiny_target, files, cfg).fit(checkpoint_dir=tmp_path / "ckpt")
    assert _trainer(tiny_target, files, cfg).load_checkpoint(tmp_path / "ckpt") == 2
    marker = tmp_path / "payload-ran"
    # Each file of the checkpoint tampered in turn: model states (ZeRO-3: zero_pp_rank_0_mp_rank_00_...)
    # and the rank's ZeRO optimizer states.
    tampered = sorted((tmp_path / "ckpt" / "step_00000002").glob("*.pt"))
    assert {p.name.endswith(("model_states.pt", "optim_states.pt")) for p in tampered} == {True} and len(tampered) == 2
    for path in tampered:
        original = path.read_bytes()
        _payload_file(path, marker)
        with pytest.raises(ValueError, match=f"{path.name}.*not loaded"):
            _trainer(tiny_target, files, cfg).load_checkpoint(tmp_path / "ckpt")
        assert not marker.exists()
        path.write_bytes(original)


@pytest.mark.slow
def test_local_cluster_dashboard_and_job_server_listen_on_loopback(ray_local):
    """The session's shared cluster (conftest's shared_ray) is a local cluster as a job starts one:
    ray_jobs.cluster.init_ray with its defaults, in a process of its own. Looked at here instead of
    a cluster of this test's own, whose start and stop took 7-14 s of the suite."""
    import psutil

    ray = ray_local
    url = ray.get_runtime_context().dashboard_url if hasattr(ray.get_runtime_context(), "dashboard_url") \
        else ray._private.worker.global_worker.node.address_info["webui_url"]
    host, port = url.replace("http://", "").rsplit(":", 1)
    session = ray._private.worker.global_worker.node.get_session_dir_path()  # that cluster's processes only
    dashboards = [p for p in psutil.process_iter(["cmdline"])
                  if session in " ".join(p.info["cmdline"] or []) and "dashboard/dashboard.py" in " ".join(p.info["cmdline"])]
    assert len(dashboards) == 1, [p.info["cmdline"][:3] for p in dashboards]
    bound = {(c.laddr.ip, c.laddr.port) for c in dashboards[0].net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN}
    assert host == "127.0.0.1"
    # The HTTP server (dashboard and the job API that `ray job submit` posts to) on loopback only.
    assert [ip for ip, p in bound if p == int(port)] == ["127.0.0.1"], bound


def _files_under(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            yield Path(dirpath) / name


@pytest.mark.slow
def test_job_keeps_sample_ids_out_of_paths_and_the_auth_token_out_of_its_outputs(tiny_target, tmp_path):
    """prepare + extract (hf backend) through the real driver on a local cluster with token
    authentication on, on conversations whose ids are paths: no file or directory is named after
    an id (anywhere under the run's temp root), the ids come back verbatim in the shards and
    rejects, and the token is in no output, log or report of the job, nor in its printed output."""
    import pyarrow.parquet as pq

    from eagle3.extract.manifest import Manifest
    from eagle3.extract.shards import read_shards

    tag = os.urandom(4).hex()
    root = Path(tempfile.mkdtemp(prefix=f"e3sec-{tag}-"))  # the ids climb out of out/ into here
    out = root / "a" / "b" / "out"
    evil = [f"../../escaped-{tag}", f"../../../../../../../../../tmp/escaped-{tag}-abs", f"/tmp/escaped-{tag}-root",
            f"..\\..\\escaped-{tag}-win", f"escaped-{tag}/../../x"]
    demo = [json.loads(line) for line in (REPO / "data" / "demo_conversations.jsonl").read_text().splitlines()[:8]]
    data = root / "conversations.jsonl"
    data.write_text("".join(json.dumps({**rec, "id": evil[i % len(evil)] + f"-{i}"}) + "\n"
                            for i, rec in enumerate(demo)))
    token = os.urandom(16).hex()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ray_jobs.run", "--config", "configs/demo.yaml", "--set", f"output_dir={out}",
             "--set", f"target.model={tiny_target}", "--set", f"prepare.conversations={data}",
             "--set", "prepare.num_eval_prompts=1", "--set", "stages=[prepare, extract]", "--set", "doctor=false",
             "--set", "extract.backend=hf", "--set", "extract.samples_per_shard=4", "--set", "ray.num_cpus=2"],
            cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        ids = set(pq.read_table(out / "prepared" / "tokens.parquet", columns=["sample_id"]).column("sample_id").to_pylist())
        table = read_shards(Manifest(out / "hidden_states").committed_files(), columns=["sample_id"])
        assert set(table.column("sample_id").to_pylist()) == ids and len(ids) >= 5
        assert any(i.startswith("../../escaped-") for i in ids) and any(i.startswith("/tmp/escaped-") for i in ids)
        named = [p for p in _files_under(root) if "escaped" in p.name or "passwd" in p.name]
        named += [p for p in Path("/tmp").glob(f"escaped-{tag}*")]
        assert not named, named
        ray_tmp = Path(env.get("RAY_TMPDIR", os.environ["RAY_TMPDIR"]))
        logs = list(ray_tmp.glob("ray/session_2*/logs/*"))
        assert len(logs) > 5, logs  # the cluster's own logs (the job's driver and workers) are searched too
        leaks = [str(p) for base in (out, ray_tmp) for p in _files_under(base)
                 if p.is_file() and not p.is_symlink() and token.encode() in p.read_bytes()]
        assert token not in proc.stdout and token not in proc.stderr
        assert not leaks, leaks
        assert token not in (out / "report.json").read_text()
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)

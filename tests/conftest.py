"""Shared fixtures: the tiny seeded target (built once per session) and CPU-engine settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo_conversations.jsonl"

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> str:
    from eagle3.tiny import build_tiny_target

    return str(build_tiny_target(tmp_path_factory.mktemp("tiny-target"), DEMO, size=1, seed=0))


@pytest.fixture
def ray_local():
    """A real local Ray cluster for one test (2 CPUs), shut down after it."""
    import ray

    from ray_jobs.cluster import init_ray

    init_ray(num_cpus=2)
    yield ray
    ray.shutdown()

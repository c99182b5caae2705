"""On the GPU: the eval's plan reads the GPU's memory through a Ray task (nvidia-smi, no CUDA
context), the figure that decides whether a larger target's engines start side by side."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_eval_reads_the_gpus_memory_through_a_ray_task():
    import ray
    import torch

    from ray_jobs.evaluate import smallest_gpu_bytes

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        got = smallest_gpu_bytes(ray)
    finally:
        ray.shutdown()
    smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    assert got is not None and abs(got - smallest) < 2 << 30, (got, smallest)

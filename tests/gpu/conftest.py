"""GPU tier: runs on the device machine (vLLM 0.26, CUDA); skipped where there is no CUDA."""

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA (the GPU tier runs on the device machine)")
        for item in items:
            if "tests/gpu" in str(item.fspath):
                item.add_marker(skip)

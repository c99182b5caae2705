"""On the GPU: fp8 shards reach the device as stored (e4m3 bytes and scales, half the bytes of
bf16) and are dequantised there, to exactly the batch the host path builds."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

pytestmark = pytest.mark.gpu

LAYER_IDS = [2, 4, 5, 8]
HIDDEN = 256


def fp8_shard(path, lengths=(37, 120, 90, 64, 200), seed=0) -> str:
    from eagle3.extract.codec import encode_hidden_states
    from eagle3.schema import hidden_states_schema
    from eagle3.extract.shards import write_shard_file

    rng = np.random.default_rng(seed)
    cols = {"sample_id": [], "input_ids": [], "loss_mask": [], "num_tokens": [], "hidden_states": [], "hs_scale": []}
    for i, T in enumerate(lengths):
        values, scale = encode_hidden_states(rng.standard_normal((T, len(LAYER_IDS), HIDDEN)).astype(np.float32) * 3,
                                             "float8_e4m3fn")
        row = (f"s{i}", rng.integers(0, 1000, T).tolist(), rng.integers(0, 2, T).tolist(), T, values.tobytes(),
               scale.tolist())
        for k, v in zip(cols, row, strict=True):
            cols[k].append(v)
    schema = hidden_states_schema(layer_ids=LAYER_IDS, hidden_size=HIDDEN, hs_dtype="float8_e4m3fn")
    write_shard_file(pa.Table.from_pydict(cols, schema=schema), str(path), None, True)
    return str(path)


def test_fp8_batches_dequantised_on_the_gpu_equal_the_host_path(tmp_path):
    import torch

    from eagle3.train.data.packing import PackedBatches
    from eagle3.train.data.rows import HiddenStatesDataset
    from eagle3.train.data.staging import MODEL_INPUTS, device_inputs

    files = [fp8_shard(tmp_path / "shard-000000.arrow")]
    ds = HiddenStatesDataset(files, shuffle_buffer_size=1)
    cuda = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float32):
        host = PackedBatches(ds, micro_batch_tokens=256, hidden_states_dtype=dtype, pin_memory=True)
        stored = PackedBatches(ds, micro_batch_tokens=256, hidden_states_dtype=dtype, pin_memory=True,
                               dequantize=False)
        for _ in range(3):
            want, got = next(host), next(stored)
            assert got["hidden_states"].dtype == torch.float8_e4m3fn and got["hidden_states"].is_pinned()
            on_gpu = device_inputs(got, cuda, dtype)
            for key in MODEL_INPUTS:
                assert on_gpu[key].device.type == "cuda", key
                assert torch.equal(on_gpu[key].cpu(), want[key]), (dtype, key)


def test_device_batches_copy_on_a_side_stream_and_equal_the_in_line_copy(tmp_path):
    """The trainer's staged batches (copied and dequantised on a side stream while the step
    computes) are the same tensors as an in-line copy, once the compute stream has waited."""
    import torch

    from eagle3.train.data.packing import PackedBatches
    from eagle3.train.data.rows import HiddenStatesDataset
    from eagle3.train.data.staging import MODEL_INPUTS, DeviceBatches, device_inputs

    ds = HiddenStatesDataset([fp8_shard(tmp_path / "shard-000000.arrow")], shuffle_buffer_size=1)
    cuda = torch.device("cuda")
    want = PackedBatches(ds, micro_batch_tokens=256, pin_memory=True, dequantize=False)
    staged = DeviceBatches(PackedBatches(ds, micro_batch_tokens=256, pin_memory=True, dequantize=False), cuda,
                           torch.bfloat16)
    assert staged.stream is not None
    for _ in range(3):
        staged.stage()
        torch.cuda._sleep(10_000_000)  # the compute stream is busy while the copy runs
        _, got, _ = next(staged)
        ref = device_inputs(next(want), cuda, torch.bfloat16)
        for key in MODEL_INPUTS:
            assert torch.equal(got[key], ref[key]), key


def test_worker_ring_is_page_locked_and_device_batches_from_it_equal_the_host_path(tmp_path):
    """The trainer's GPU source: DataLoader workers pack into a ring page-locked in this process
    (cudaHostRegister), so its batches are pinned without a pinning copy; over several turns of
    the ring (depth 2: 4 slots), the device inputs staged from it equal the in-line path's."""
    import torch

    from eagle3.train.data.packing import PackedBatches
    from eagle3.train.data.prefetch import WorkerPrefetcher
    from eagle3.train.data.rows import HiddenStatesDataset
    from eagle3.train.data.staging import MODEL_INPUTS, DeviceBatches, device_inputs

    ds = HiddenStatesDataset([fp8_shard(tmp_path / "shard-000000.arrow", lengths=(37, 120, 90, 64, 200) * 4)],
                             shuffle_buffer_size=1)
    cuda = torch.device("cuda")
    want = PackedBatches(ds, micro_batch_tokens=256, pin_memory=True, dequantize=False)
    ring = WorkerPrefetcher(PackedBatches(ds, micro_batch_tokens=256, dequantize=False), depth=2, page_lock=True)
    assert ring.ring.page_locked and ring.ring.num_slots == 4
    staged = DeviceBatches(ring, cuda, torch.bfloat16)
    for i in range(12):
        host, got, _ = next(staged)
        assert host["hidden_states"].is_pinned(), i
        staged.stage()
        torch.cuda._sleep(10_000_000)  # the compute stream is busy while the next copy runs
        ref = device_inputs(next(want), cuda, torch.bfloat16)
        for key in MODEL_INPUTS:
            assert torch.equal(got[key], ref[key]), (i, key)
    ring.close()
    assert not ring.ring.page_locked

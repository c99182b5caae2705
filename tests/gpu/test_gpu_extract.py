"""On the GPU (vLLM 0.26 there): hidden states against a transformers reference in bf16, the
compat probes on that vLLM, and the doctor's dry run."""

from __future__ import annotations

import pytest

from eagle3.config import ExtractConfig

pytestmark = pytest.mark.gpu


def test_compat_probes_pass_on_this_vllm(gpu_target):
    from compat.probes import run_all
    from compat.versions import installed

    rows = run_all(gpu_target, trust_remote_code=False)
    failed = [r for r in rows if not r[1]]
    assert not failed, f"vLLM {installed('vllm')}: {failed}"


def test_hidden_states_match_transformers_bf16_on_gpu(gpu_target, log_dir):
    import torch

    from eagle3.extract.extractor import Extractor, HFBackend
    from tests.test_extract import decoded_rows, tokens_table

    lengths = (7, 41, 73, 300)
    tokens = tokens_table(lengths)
    free, total = torch.cuda.mem_get_info()  # this process's CUDA context exists from here on
    used_before = total - free
    with Extractor(gpu_target, ExtractConfig(backend="vllm", gpu_memory_utilization=0.3), max_length=512) as ex:
        used_engine = total - torch.cuda.mem_get_info()[0]
        table, stats = ex.extract(tokens)
    # Closed: the in-process engine's weights and KV cache (0.3 of the device) are back on the device.
    used_after = total - torch.cuda.mem_get_info()[0]
    release = (f"device memory in use: {used_before / 2**30:.1f} GiB before the engine, "
               f"{used_engine / 2**30:.1f} with it, {used_after / 2**30:.1f} after close; "
               f"torch reserves {torch.cuda.memory_reserved() / 2**20:.0f} MiB")
    print(release)
    assert used_engine - used_before > 0.2 * total, release  # the engine did take its share
    assert used_after - used_before < 2 * 2**30, release
    assert stats.num_samples == len(lengths)
    assert table.column("input_ids").to_pylist() == tokens.column("input_ids").to_pylist()
    ref_backend = HFBackend(gpu_target, ex.layer_ids, dtype="bfloat16", device="cuda")
    refs = ref_backend.hidden_states(tokens.column("input_ids").to_pylist())
    worst = 0.0
    for (hs, layer_ids), ref in zip(decoded_rows(table), refs):
        ref = ref.float()
        assert hs.shape == ref.shape
        for j in range(len(layer_ids)):
            scale = ref[:, j].abs().max().item()
            err = (hs[:, j] - ref[:, j]).abs().max().item()
            worst = max(worst, err / scale)
            # bf16 vs bf16 with different kernels (vLLM's fused ops vs transformers' eager):
            # a few bf16 ulps of the largest value per layer.
            assert err <= 0.04 * scale, f"layer {layer_ids[j]}: {err:.4f} vs max {scale:.3f}"
    print(f"worst relative max-abs error over layers and samples: {worst:.4f}")
    with open(log_dir / "gpu_hs_error.txt", "w") as f:  # kept in EAGLE3_TEST_LOG_DIR
        f.write(f"vLLM vs transformers, bf16 on GPU, lengths {lengths}: worst rel max-abs err {worst:.4f}\n"
                f"{release}\n")


def test_a_second_extraction_engine_starts_in_the_process_after_the_first_is_closed(gpu_target):
    """vLLM 0.26 on the GPU: once the first in-process extraction engine is closed (compat.vllm_engine.
    Engine), a second one with other aux layers starts in the same process and captures its own
    layers (before release it found the first one's KV connector: "Expected 1 CacheOnlyAttentionLayer,
    got 0"), and both give the same hidden states for the layers they share."""
    from eagle3.extract.extractor import Extractor
    from tests.test_extract import decoded_rows, tokens_table

    tokens = tokens_table((9, 120))
    rows = []
    for aux in ((2, 6), (1, 2, 9)):
        cfg = ExtractConfig(backend="vllm", gpu_memory_utilization=0.3, aux_hidden_state_layer_ids=aux)
        with Extractor(gpu_target, cfg, max_length=256) as ex:
            table, _ = ex.extract(tokens)
        rows.append(list(decoded_rows(table)))
    (hs_a, ids_a), (hs_b, ids_b) = rows[0][1], rows[1][1]
    assert ids_a == [2, 6, 12] and ids_b == [1, 2, 9, 12], (ids_a, ids_b)
    for shared in (2, 12):  # same model, same batch: equal up to the kernels vLLM picks
        a, b = hs_a[:, ids_a.index(shared)], hs_b[:, ids_b.index(shared)]
        assert (a - b).abs().max().item() <= 0.01 * a.abs().max().item(), shared


def test_doctor_dry_run_on_gpu(gpu_target):
    """In its own process, as the doctor runs it (max_calls=1 tasks: a process that ends frees its
    engine whatever happened to it)."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from eagle3.doctor import dry_run; from eagle3.config import ExtractConfig; "
            f"r = dry_run({gpu_target!r}, ExtractConfig(), dtype='bfloat16', trust_remote_code=False); "
            "print('ROW' + json.dumps(r.to_dict()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = next(x for x in out.stdout.splitlines() if x.startswith("ROW"))
    row = json.loads(line[3:])
    assert row["ok"], row["detail"] + row["fix"]
    # the 2-layer cut: the job's aux ids fold onto decoder layer 1, the last layer is 2
    assert "hidden states (16, 2, 512)" in row["detail"] and "layers [1, 2]" in row["detail"], row["detail"]
    from eagle3.doctor import check_gpus

    rows = check_gpus(min_free_fraction=0.0)
    assert rows and all("GiB in use" in r.detail for r in rows)

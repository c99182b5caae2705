"""Training stage: streaming dataset, DeepSpeed config/engine, Eagle3Trainer, checkpoint/resume,
export, multimodal verifier weights, and the Ray Train route.

Everything runs on real objects: a tiny seeded Llama target (eagle3.tiny), hidden states
captured from it with transformers (aux layers from `output_hidden_states`, the last layer
before the final norm with a forward hook), real DeepSpeed on the CPU (gloo) and a real
local Ray cluster. Tests that start DeepSpeed or Ray are marked slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.extract.codec import encode_hidden_states
from eagle3.schema import hidden_states_schema
from eagle3.config import config_from_dict
from eagle3.train.config import LOSS_NAMES, DataConfig, DraftConfig, OptimizerConfig, ProfilingConfig, TrainConfig

REPO = Path(__file__).resolve().parents[1]
CONVERSATIONS = REPO / "data" / "demo_conversations.jsonl"
LAYER_IDS = [2, 4, 5, 8]  # (2, n // 2, n - 3) aux ids for the 8-layer tiny target, then the last layer
NUM_SAMPLES = 24
RESUME_RTOL = 1e-4  # stated bound; measured on CPU: 0.0 (bit-identical curves) in fp32 and in bf16


# ---------------------------------------------------------------------------------------------
# fixtures: tiny target + synthetic hidden states


def _conversation_tokens(tok, max_samples: int) -> list[tuple[list[int], list[int]]]:
    """input_ids and an assistant-only loss mask for the first conversations of the demo file."""
    assistant, end = tok.convert_tokens_to_ids(["<|assistant|>", "<|end|>"])
    out = []
    for line in CONVERSATIONS.read_text().splitlines()[:max_samples]:
        rec = json.loads(line)
        msgs = rec.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"]),
                                        "content": m["value"]} for m in rec["conversations"]]
        ids = list(tok.apply_chat_template(msgs, tokenize=True)["input_ids"])
        mask, inside = [], False
        for t in ids:
            mask.append(1 if inside else 0)
            if t == assistant:
                inside = True
            elif t == end:
                inside = False
        out.append((ids, mask))
    return out


def _capture_hidden_states(target_dir: Path, samples) -> list[np.ndarray]:
    """[T, len(LAYER_IDS), H] float32 per sample: aux layers from output_hidden_states, the last
    layer from a hook on the last decoder layer (transformers 5 norms hidden_states[-1])."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    captured = {}

    def hook(_module, _args, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = model.model.layers[-1].register_forward_hook(hook)
    out = []
    try:
        with torch.no_grad():
            for ids, _ in samples:
                res = model(torch.tensor([ids]), output_hidden_states=True)
                layers = [res.hidden_states[i][0] for i in LAYER_IDS[:-1]] + [captured["last"][0]]
                out.append(torch.stack(layers, dim=1).numpy())
    finally:
        handle.remove()
    return out


def write_shards(out_dir: Path, samples, hidden, num_shards: int, *, row_group_size: int = 3) -> list[str]:
    schema = hidden_states_schema(layer_ids=LAYER_IDS, hidden_size=hidden[0].shape[-1])
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for s, idx in enumerate(np.array_split(np.arange(len(samples)), num_shards)):
        rows = {"sample_id": [], "input_ids": [], "loss_mask": [], "num_tokens": [], "hidden_states": [],
                "hs_scale": []}
        for i in idx:
            ids, mask = samples[i]
            values, _ = encode_hidden_states(hidden[i], "bfloat16")
            rows["sample_id"].append(f"s{i:04d}")
            rows["input_ids"].append(ids)
            rows["loss_mask"].append(mask)
            rows["num_tokens"].append(len(ids))
            rows["hidden_states"].append(values.tobytes())
            rows["hs_scale"].append(None)
        path = out_dir / f"shard-{s:06d}.parquet"
        pq.write_table(pa.Table.from_pydict(rows, schema=schema), path, row_group_size=row_group_size)
        files.append(str(path))
    return files


@pytest.fixture(scope="module")
def tiny(tiny_target, tmp_path_factory):
    """(target_dir, shard files, samples, float32 hidden states) shared by this module; the
    target is conftest's session-wide eagle3.tiny.build_tiny_target(size=1, seed=0)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("train")
    target = Path(tiny_target)
    samples = _conversation_tokens(AutoTokenizer.from_pretrained(str(target)), NUM_SAMPLES)
    hidden = _capture_hidden_states(target, samples)
    files = write_shards(root / "hs", samples, hidden, num_shards=2)
    return target, files, samples, hidden


def small_cfg(**kw) -> TrainConfig:
    """The tests' small config; a section given as a mapping (optimizer={"zero_stage": 3}) is merged
    into this one's keys of that section, a top-level key replaces."""
    base = {"num_steps": 12, "optimizer": {"lr": 3e-3, "warmup_steps": 2, "zero_stage": 2, "bf16": False},
            "draft": {"draft_vocab_size": 512}, "data": {"micro_batch_tokens": 256, "shuffle_buffer_size": 8},
            "checkpoint": {"checkpoint_every": 100}}
    for key, value in kw.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return config_from_dict(TrainConfig, base, "train")


def _bf16(x):
    import torch

    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)


def _global_index(files) -> dict[tuple[int, int], int]:
    """(shard, row) -> sample index, for shards written by write_shards."""
    out, i = {}, 0
    for s, f in enumerate(files):
        for r in range(pq.ParquetFile(f).metadata.num_rows):
            out[(s, r)] = i
            i += 1
    return out


# ---------------------------------------------------------------------------------------------
# config


def test_train_config_validation_names_field_value_and_fix():
    with pytest.raises(ValueError, match=r"train\.optimizer\.zero_stage=4: not one of 0, 1, 2, 3"):
        OptimizerConfig(zero_stage=4)
    with pytest.raises(ValueError, match=r"train\.draft\.loss='kl'.*kl_div"):
        DraftConfig(loss="kl")
    with pytest.raises(ValueError, match=r"train\.optimizer\.min_lr=0\.1: must be in \[0, lr=0\.0003\]"):
        OptimizerConfig(min_lr=0.1)
    with pytest.raises(ValueError, match=r"train\.optimizer\.warmup_steps=30: must be in \[0, num_steps=20\]"):
        TrainConfig(num_steps=20, optimizer=OptimizerConfig(warmup_steps=30))
    with pytest.raises(ValueError, match=r"train\.draft\.draft_attn_impl='flash'"):
        DraftConfig(draft_attn_impl="flash")
    with pytest.raises(ValueError, match=r"train\.data\.data_workers=-1: must be >= 0"):
        DataConfig(data_workers=-1)
    with pytest.raises(ValueError, match=r"train\.profiling\.profile_steps=\[3, 2\]: use \[first, last\]"):
        ProfilingConfig(profile_steps=[3, 2])
    with pytest.raises(ValueError, match=r"train\.profiling\.profile_steps=\[5, 30\].*num_steps=20"):
        TrainConfig(num_steps=20, profiling=ProfilingConfig(profile_steps=[5, 30]))
    with pytest.raises(ValueError, match=r"train\.optimizer=\{'lr': 0\.1\}: expected OptimizerConfig, found dict"):
        TrainConfig(optimizer={"lr": 0.1})  # in Python, a section is its dataclass (a file's mapping is built into one)
    draft = TrainConfig().draft
    assert draft.ttt_steps == 3 and draft.draft_attn_impl is None  # None: resolve_draft_attn_impl's choice


def test_default_draft_attention_leaves_flex_past_the_length_it_was_measured_to_compile_at():
    from eagle3.train.config import FLEX_ATTN_MAX_TOKENS, resolve_draft_attn_impl

    assert FLEX_ATTN_MAX_TOKENS == 8192  # flex trained 8,192 (-short.md); 16,384 did not compile (-flex.md)
    assert resolve_draft_attn_impl(None, 8192, cuda=True) == "simple_flex_attention"
    assert resolve_draft_attn_impl(None, 16384, cuda=True) == "sdpa"  # trained to 49,152 (-sdpa-48k.md)
    assert resolve_draft_attn_impl(None, 1024, cuda=False) == "sdpa"
    assert resolve_draft_attn_impl("simple_flex_attention", 32768, cuda=True) == "simple_flex_attention"  # asked for


def test_loss_names_are_speculators_eager_losses():
    from speculators.losses.utils import _EAGER_LOSS_FN_MAP

    assert sorted(LOSS_NAMES) == sorted(_EAGER_LOSS_FN_MAP)


# ---------------------------------------------------------------------------------------------
# dataset


def test_dataset_yields_shifted_aligned_samples(tiny):
    import torch

    from eagle3.train.data.rows import HiddenStatesDataset

    target, files, samples, hidden = tiny
    ds = HiddenStatesDataset(files, seed=0, shuffle_buffer_size=8)
    assert ds.aux_layer_ids == [2, 4, 5] and ds.hidden_size == 256 and ds.num_samples == NUM_SAMPLES
    index = _global_index(files)
    order = ds.epoch_order(0)
    got = list(ds.samples(0))
    assert len(got) == NUM_SAMPLES
    for key, sample in zip(order, got, strict=True):
        ids, mask = samples[index[key]]
        hs = hidden[index[key]]
        T = len(ids)
        assert sample["input_ids"].dtype == torch.long and sample["input_ids"].tolist() == ids[1:]
        assert sample["loss_mask"].dtype == torch.bool and sample["loss_mask"].tolist() == [bool(m) for m in mask[1:]]
        assert sample["hidden_states"].dtype == torch.bfloat16
        assert sample["hidden_states"].shape == (T - 1, 3 * 256)
        # g_t (aux layers, concatenated in layer order) pairs with x_{t+1} and y_{t+1}
        assert torch.equal(sample["hidden_states"], _bf16(hs[:-1, :3, :]).reshape(T - 1, 3 * 256))
        assert torch.equal(sample["verifier_last_hidden_states"], _bf16(hs[1:, 3, :]))
        assert sample["position_ids"].tolist() == list(range(1, T))
        assert sample["lengths"].tolist() == [T - 1]


def test_dataset_shuffle_is_seeded_epoch_dependent_and_bounded(tiny):
    from eagle3.train.data.rows import HiddenStatesDataset

    _, files, _, _ = tiny
    a = HiddenStatesDataset(files, seed=0, shuffle_buffer_size=8)
    b = HiddenStatesDataset(files, seed=0, shuffle_buffer_size=8)
    assert a.epoch_order(0) == b.epoch_order(0)
    assert [s["input_ids"].tolist() for s in a.samples(1)] == [s["input_ids"].tolist() for s in b.samples(1)]
    assert a.epoch_order(0) != a.epoch_order(1)
    assert a.epoch_order(0) != HiddenStatesDataset(files, seed=1, shuffle_buffer_size=8).epoch_order(0)
    assert sorted(a.epoch_order(0)) == sorted(_global_index(files))
    # buffer of 1 = no shuffle within shards: shard order permuted, rows in file order
    flat = HiddenStatesDataset(files, seed=0, shuffle_buffer_size=1).epoch_order(0)
    assert [r for s, r in flat if s == flat[0][0]] == list(range(NUM_SAMPLES // 2))


def test_dataset_ranks_are_disjoint_and_cover(tiny, tmp_path):
    from eagle3.train.data.rows import HiddenStatesDataset

    _, _, samples, hidden = tiny
    files = write_shards(tmp_path / "five", samples[:10], hidden[:10], num_shards=5, row_group_size=1)
    everything = set(_global_index(files))
    for world in (2, 3):
        for epoch in (0, 1):
            parts = [set(HiddenStatesDataset(files, seed=3, rank=r, world_size=world).epoch_order(epoch))
                     for r in range(world)]
            assert sum(len(p) for p in parts) == len(everything) and set().union(*parts) == everything
    with pytest.raises(ValueError, match="5 shard files for 6 data-parallel ranks"):
        HiddenStatesDataset(files, rank=0, world_size=6)


def test_packed_batches_resume_from_state_across_epochs(tiny):
    import torch

    from eagle3.train.data.packing import PackedBatches
    from eagle3.train.data.rows import HiddenStatesDataset

    _, files, _, _ = tiny
    ds = HiddenStatesDataset(files, seed=0, shuffle_buffer_size=8)
    stream = PackedBatches(ds, micro_batch_tokens=256, hidden_states_dtype=torch.float32)
    for _ in range(3):
        first = next(stream)
    assert first["hidden_states"].shape == (1, 256, 3 * 256) and first["hidden_states"].dtype == torch.float32
    assert first["document_ids"].shape == (1, 256) and first["document_ids"].max() >= 1  # several samples packed
    state = stream.state_dict()
    rest = [next(stream) for _ in range(12)]  # crosses into epoch 1
    assert stream.state_dict()["epoch"] >= 1
    resumed = PackedBatches(ds, micro_batch_tokens=256, hidden_states_dtype=torch.float32, state=state)
    for want in rest:
        got = next(resumed)
        for k in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "document_ids",
                  "position_ids"):
            assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("kind", ["thread", "1 worker", "3 workers"])
def test_prefetcher_gives_the_same_batches_and_the_consumed_position(tiny, kind):
    import functools

    import torch

    from eagle3.train.data.packing import PackedBatches
    from eagle3.train.data.prefetch import Prefetcher, WorkerPrefetcher
    from eagle3.train.data.rows import HiddenStatesDataset

    prefetcher = {"thread": Prefetcher, "1 worker": WorkerPrefetcher,  # the same contract
                  "3 workers": functools.partial(WorkerPrefetcher, num_workers=3)}[kind]

    _, files, _, _ = tiny
    ds = HiddenStatesDataset(files, seed=0, shuffle_buffer_size=8)

    def packed():
        return PackedBatches(ds, micro_batch_tokens=256, hidden_states_dtype=torch.float32)

    plain, states = packed(), []
    want = []
    for _ in range(10):
        want.append(next(plain))
        states.append(plain.state_dict())
    ahead = prefetcher(packed(), depth=3)
    for i in range(7):
        got = next(ahead)
        assert torch.equal(got["hidden_states"], want[i]["hidden_states"])
        assert torch.equal(got["document_ids"], want[i]["document_ids"])
        # the position after the batch returned, although up to 3 more are built already
        assert ahead.state_dict() == states[i]
    ahead.load_state_dict(states[1])  # batches built ahead are dropped
    for i in (2, 3, 4):
        assert torch.equal(next(ahead)["input_ids"], want[i]["input_ids"])
        assert ahead.state_dict() == states[i]
    ahead.close()


def test_batches_are_built_in_a_worker_process_unless_shared_memory_is_short(tiny, caplog, monkeypatch):
    """The trainer's batches come from a DataLoader worker process (packed into the shared ring),
    or from a thread with a warning where /dev/shm cannot hold the queue; both give the same batches."""
    import torch

    import eagle3.train.data.pipeline
    from eagle3.train.data.pipeline import batch_source
    from eagle3.train.data.prefetch import Prefetcher, WorkerPrefetcher
    from eagle3.train.data.rows import HiddenStatesDataset

    _, files, _, _ = tiny
    ds = HiddenStatesDataset(files, seed=0, shuffle_buffer_size=8)
    worker = batch_source(ds, 256, torch.float32, 3, 2, on_gpu=False, dequantize=True)
    assert isinstance(worker, WorkerPrefetcher)
    first = next(worker)
    ring = worker.ring.buffer
    assert ring.data_ptr() <= first["hidden_states"].data_ptr() < ring.data_ptr() + ring.numel()
    assert worker.ring.nbytes <= eagle3.train.data.pipeline.shm_free_bytes()  # what it checked
    monkeypatch.setattr(eagle3.train.data.pipeline, "shm_free_bytes", lambda: worker.ring.nbytes - 1)  # one byte short
    with caplog.at_level("WARNING"):
        thread = batch_source(ds, 256, torch.float32, 3, 2, on_gpu=False, dequantize=True)
    assert isinstance(thread, Prefetcher) and "/dev/shm" in caplog.text
    same = next(thread)
    assert torch.equal(same["hidden_states"], first["hidden_states"])
    worker.close()
    thread.close()


def test_worker_batches_stay_valid_until_the_second_next_after_them(tiny):
    """WorkerPrefetcher's batches are views of a ring that its workers reuse (the batches DataLoader
    has in flight, plus 2 slots): each batch must be unchanged until the second next() after it,
    over several turns of the ring."""
    import torch

    from eagle3.train.data.packing import PackedBatches
    from eagle3.train.data.prefetch import WorkerPrefetcher
    from eagle3.train.data.rows import HiddenStatesDataset

    _, files, _, _ = tiny
    ds = HiddenStatesDataset(files, seed=0, shuffle_buffer_size=8)
    plain = PackedBatches(ds, micro_batch_tokens=256, hidden_states_dtype=torch.float32)
    want = [next(plain) for _ in range(12)]
    ahead = WorkerPrefetcher(PackedBatches(ds, micro_batch_tokens=256, hidden_states_dtype=torch.float32),
                             depth=1, num_workers=2)
    assert ahead.ring.num_slots == 4  # 2 in flight (one a worker) + the 2 the consumer holds
    held = []
    for i in range(12):
        held.append(next(ahead))
        for j in range(max(0, i - 1), i + 1):  # this batch and the one before it
            for k in ("hidden_states", "verifier_last_hidden_states", "input_ids", "loss_mask"):
                assert torch.equal(held[j][k], want[j][k]), (i, j, k)
    ahead.close()


@pytest.mark.slow  # starts DeepSpeed
def test_step_profiler_records_the_asked_steps(tiny, tmp_path):
    """train.profiling.profile_steps [2, 3]: a trace and a table of the ops of steps 2 and 3 exactly, with the
    trainer's own ranges (eagle3.forward, ...) in them."""
    import json

    from actors.trainer import StepProfiler

    target, files, _, _ = tiny
    trainer = _trainer(target, files, small_cfg(num_steps=4))
    profiler = StepProfiler([2, 3], tmp_path / "profile")
    trainer.fit(on_step=lambda m: profiler.step())
    profiler.close()
    top = (tmp_path / "profile" / "top_ops.txt").read_text()
    # the table is the top 40 ops by self time, where a range's own time can rank anywhere (it failed
    # once beside another xdist worker's job): the ranges are asserted in the trace
    assert top.startswith("steps 2..3") and "Self CPU time total" in top
    events = json.loads((tmp_path / "profile" / "trace.json").read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("name") == "eagle3.forward") == 2  # one micro-batch a step, 2 steps
    assert sum(1 for e in events if e.get("name") == "eagle3.optimizer_step") == 2


def test_data_workers_default_to_a_share_of_the_cpus():
    from eagle3.train.data.pipeline import data_workers

    auto = DataConfig()
    assert data_workers(auto, cpus=2, local_ranks=1) == 1  # never fewer than one
    assert data_workers(auto, cpus=16, local_ranks=1) == 4  # the H200 host
    assert data_workers(auto, cpus=16, local_ranks=2) == 2
    assert data_workers(auto, cpus=128, local_ranks=8) == 4  # nor more than four
    assert data_workers(DataConfig(data_workers=0), cpus=16, local_ranks=1) == 0


def test_prefetch_depth_fits_the_memory_budget_unless_set():
    import torch

    from eagle3.train.data.pipeline import prefetch_depth

    auto = DataConfig(micro_batch_tokens=8192)
    # 4 captured layers of a 1B target (hidden 2048): 134 MB a batch, 15 in 2 GiB
    assert prefetch_depth(auto, 4, 2048, torch.bfloat16) == 15
    assert prefetch_depth(auto, 4, 7168, torch.bfloat16) == 4  # 470 MB a batch
    assert prefetch_depth(auto, 4, 7168, torch.float32) == 2  # never fewer than 2
    assert prefetch_depth(auto, 4, 256, torch.bfloat16) == 16  # nor more than 16
    assert prefetch_depth(DataConfig(micro_batch_tokens=8192, prefetch_batches=0), 4, 2048, torch.bfloat16) == 0
    assert prefetch_depth(DataConfig(micro_batch_tokens=8192, prefetch_batches=3), 4, 2048, torch.bfloat16) == 3


def test_token_frequencies_reads_only_token_columns(tiny, tmp_path):
    from eagle3.train.data.rows import HiddenStatesDataset
    from eagle3.train.data.vocab import token_frequencies

    _, files, samples, _ = tiny
    want = np.zeros(796, dtype=np.int64)
    for ids, mask in samples:
        np.add.at(want, np.array(ids)[np.array(mask, dtype=bool)], 1)
    assert np.array_equal(token_frequencies(files, 796), want)
    # A shard whose hidden_states bytes are garbage still counts: that column is never read.
    schema = hidden_states_schema(layer_ids=LAYER_IDS, hidden_size=256)
    ids, mask = samples[0]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pydict({"sample_id": ["x"], "input_ids": [ids], "loss_mask": [mask],
                                         "num_tokens": [len(ids)], "hidden_states": [b"\0\0"], "hs_scale": [None]},
                                        schema=schema), bad)
    assert token_frequencies([str(bad)], 796).sum() == sum(mask)
    with pytest.raises(ValueError, match="row 0: hidden_states holds 1 values"):
        list(HiddenStatesDataset([str(bad)]).samples(0))


def test_dataset_fp8_is_dequantised(tiny, tmp_path):
    import torch

    from eagle3.train.data.rows import HiddenStatesDataset

    _, _, samples, hidden = tiny
    schema = hidden_states_schema(layer_ids=LAYER_IDS, hidden_size=256, hs_dtype="float8_e4m3fn")
    ids, mask = samples[0]
    values, scale = encode_hidden_states(hidden[0], "float8_e4m3fn")
    path = tmp_path / "fp8.parquet"
    pq.write_table(pa.Table.from_pydict({"sample_id": ["a"], "input_ids": [ids], "loss_mask": [mask],
                                         "num_tokens": [len(ids)], "hidden_states": [values.tobytes()],
                                         "hs_scale": [scale.tolist()]}, schema=schema), path)
    (sample,) = list(HiddenStatesDataset([str(path)]).samples(0))
    want = torch.from_numpy(hidden[0][1:, 3, :])
    got = sample["verifier_last_hidden_states"].float()
    assert sample["verifier_last_hidden_states"].dtype == torch.bfloat16
    assert (got - want).abs().max() <= 0.08 * want.abs().max()


def test_fp8_batches_equal_the_batches_of_samples_dequantised_on_the_host(tiny, tmp_path):
    """fp8 shards are dequantised where the batch is packed (eagle3.train.data.packing.pack); the
    batches equal speculators' CollateFn over samples dequantised by eagle3.extract.codec (the path the
    trainer used before), in bf16 and in float32."""
    import torch
    from speculators.train.data import CollateFn

    from compat.speculators_batch import speculators_sample
    from eagle3.extract.codec import decode_hidden_states, dequantize_fp8
    from eagle3.train.data.packing import PackedBatches
    from eagle3.train.data.rows import HiddenStatesDataset
    from eagle3.train.data.staging import MODEL_INPUTS, device_inputs

    _, _, samples, hidden = tiny
    schema = hidden_states_schema(layer_ids=LAYER_IDS, hidden_size=256, hs_dtype="float8_e4m3fn")
    cols = {"sample_id": [], "input_ids": [], "loss_mask": [], "num_tokens": [], "hidden_states": [], "hs_scale": []}
    host = []
    for i in range(6):
        ids, mask = samples[i]
        values, scale = encode_hidden_states(hidden[i], "float8_e4m3fn")
        for k, v in zip(cols, (f"s{i}", ids, mask, len(ids), values.tobytes(), scale.tolist()), strict=True):
            cols[k].append(v)
        q, q_scale = decode_hidden_states(values, scale, len(ids), len(LAYER_IDS), 256, "float8_e4m3fn")
        hs = dequantize_fp8(q, q_scale, dtype=torch.float32)
        host.append(speculators_sample(np.asarray(ids), np.asarray(mask), hs.to(torch.bfloat16)))
    path = tmp_path / "fp8.parquet"
    pq.write_table(pa.Table.from_pydict(cols, schema=schema), path)
    ds = HiddenStatesDataset([str(path)], shuffle_buffer_size=1)  # file order
    for dtype in (torch.bfloat16, torch.float32):
        got = next(PackedBatches(ds, micro_batch_tokens=256, hidden_states_dtype=dtype))
        packed = got["document_ids"].max().item() + 1
        assert packed >= 2
        want = CollateFn(max_len=256, hidden_size=256, num_target_layers=3, dtype=dtype)(host[:packed])
        for key in ("hidden_states", "verifier_last_hidden_states", "input_ids", "loss_mask", "document_ids"):
            assert torch.equal(got[key], want[key]), (dtype, key)
        # the GPU trainer's path: e4m3 as stored in the batch, dequantised where the inputs land
        stored = next(PackedBatches(ds, micro_batch_tokens=256, hidden_states_dtype=dtype, dequantize=False))
        assert stored["hidden_states"].dtype == torch.float8_e4m3fn
        assert stored["hidden_states"].shape == got["hidden_states"].shape
        on_device = device_inputs(stored, torch.device("cpu"), dtype)
        assert sorted(on_device) == sorted(MODEL_INPUTS)
        for key in MODEL_INPUTS:
            assert torch.equal(on_device[key], got[key]), (dtype, key)


# ---------------------------------------------------------------------------------------------
# DeepSpeed config


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("use_gpu", [False, True])
def test_deepspeed_config_per_zero_stage(stage, use_gpu):
    from deepspeed.runtime.config import DeepSpeedConfig

    from eagle3.precision import cpu_has_native_bf16
    from eagle3.train.deepspeed_backend import deepspeed_config

    cfg = TrainConfig(num_steps=100, data=DataConfig(gradient_accumulation_steps=4),
                      optimizer=OptimizerConfig(zero_stage=stage, warmup_steps=10, lr=1e-3, min_lr=1e-4, grad_clip=0.5))
    ds = deepspeed_config(cfg, world_size=2, use_gpu=use_gpu)
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["train_batch_size"] == 8 and ds["gradient_accumulation_steps"] == 4
    native = use_gpu or cpu_has_native_bf16()
    assert ds["bf16"]["enabled"] is native  # auto: bf16 on GPU and on a CPU with native bf16, else fp32
    assert ds["scheduler"]["type"] == "WarmupCosineLR"
    assert ds["scheduler"]["params"]["cos_min_ratio"] == pytest.approx(0.1)
    assert ("optimizer" in ds) is use_gpu  # CPU: client torch AdamW
    # DeepSpeed's own parsing and batch-size check (it sees world size 1 without a process group)
    parsed = DeepSpeedConfig(deepspeed_config(cfg, world_size=1, use_gpu=use_gpu))
    assert parsed.zero_optimization_stage == stage and parsed.gradient_clipping == 0.5
    assert parsed.train_batch_size == 4 and parsed.bfloat16_config.enabled is native
    assert parsed.scheduler_name == "WarmupCosineLR" and parsed.scheduler_params["warmup_num_steps"] == 10
    if use_gpu:
        assert parsed.optimizer_name == "adamw" and parsed.optimizer_params["weight_decay"] == 0.01
    on = replace(cfg, optimizer=replace(cfg.optimizer, bf16=True))
    assert deepspeed_config(on, 1, use_gpu=False)["bf16"]["enabled"] is True
    off = replace(cfg, optimizer=replace(cfg.optimizer, bf16=False))
    assert deepspeed_config(off, 1, use_gpu=True)["bf16"]["enabled"] is False


@pytest.mark.parametrize("flags", [frozenset(), frozenset({"avx512_bf16"}), frozenset({"amx_bf16"})])
def test_trainer_precision_auto_follows_the_cpus_native_bf16(flags, monkeypatch):
    """train.optimizer.bf16 null on the CPU: bf16 where the CPU computes it natively (the engines'
    rule, eagle3.precision), fp32 where it would be emulated or oneDNN is capped below it."""
    import eagle3.precision as precision
    from eagle3.train.deepspeed_backend import resolve_bf16

    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: flags)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    cfg = TrainConfig(num_steps=10)
    assert resolve_bf16(cfg, use_gpu=False) is bool(flags)
    assert resolve_bf16(cfg, use_gpu=True) is True
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert resolve_bf16(cfg, use_gpu=False) is False


# ---------------------------------------------------------------------------------------------
# verifier weights of multimodal targets (compat/speculators_verifier.py)


def _multimodal_target(src: Path, dst: Path, decoy: bool = False) -> dict:
    """A llava-style copy of the tiny target: config with text_config, weights under
    `language_model.`, plus vision-tower keys; decoy adds a shorter key ending in
    embed_tokens.weight (another tower's) that a suffix match prefers."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    original = load_file(str(src / "model.safetensors"))
    tensors = {f"language_model.{k}": v for k, v in original.items()}
    tensors["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    tensors["multi_modal_projector.linear_1.weight"] = torch.zeros(8, 8)
    if decoy:
        tensors["audio_tower.embed_tokens.weight"] = torch.randn_like(original["model.embed_tokens.weight"])
    save_file(tensors, str(dst / "model.safetensors"))
    text = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text,
        "image_token_index": 5,
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 8, "intermediate_size": 16,
                          "num_attention_heads": 2, "num_hidden_layers": 1, "image_size": 28, "patch_size": 14},
    }))
    for f in src.glob("tokenizer*"):
        shutil.copy(f, dst)
    return original


@pytest.mark.parametrize("decoy", [False, True])
def test_multimodal_target_weights_loaded_from_language_model(tiny, tmp_path, decoy):
    import torch

    from eagle3.train.trainer import Eagle3Trainer

    target, files, _, _ = tiny
    mm = tmp_path / "mm"
    original = _multimodal_target(target, mm, decoy=decoy)
    trainer = Eagle3Trainer(small_cfg(), mm, files)
    model = trainer.model
    t2d = model.t2d.bool()
    assert torch.equal(model.embed_tokens.weight, original["model.embed_tokens.weight"].float())
    assert torch.equal(model.lm_head.weight, original["lm_head.weight"].float()[t2d])
    assert torch.equal(model.verifier_lm_head.weight, original["lm_head.weight"].float()[t2d])
    assert torch.equal(model.verifier_norm.weight, original["model.norm.weight"].float())
    assert trainer.target_vocab_size == 796 and model.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]


def test_compat_speculators_suffix_resolution_seam(tiny, tmp_path):
    """Fails when speculators changes how it finds verifier tensors: then revisit
    compat/speculators_verifier.py (ensure_text_verifier_weights may be removable)."""
    import torch
    from speculators.utils.loading import load_model_layers

    from compat.speculators_verifier import ensure_text_verifier_weights, read_text_model_tensors

    target, _, _, _ = tiny
    plain = tmp_path / "plain"
    original = _multimodal_target(target, plain, decoy=False)
    got = load_model_layers(["embed_tokens.weight", "lm_head.weight", "model.norm.weight"], str(plain))
    assert torch.equal(got["embed_tokens.weight"], original["model.embed_tokens.weight"])  # prefix handled
    decoy = tmp_path / "decoy"
    _multimodal_target(target, decoy, decoy=True)
    got = load_model_layers(["embed_tokens.weight"], str(decoy))
    # speculators 0.9: the shortest suffix match wins, i.e. the other tower's tensor
    assert not torch.equal(got["embed_tokens.weight"], original["model.embed_tokens.weight"])
    text_model = read_text_model_tensors(str(decoy))
    assert torch.equal(text_model["embed_tokens.weight"], original["model.embed_tokens.weight"])

    class Draft(torch.nn.Module):  # the four frozen tensors the seam touches, nothing else
        use_draft_vocab = False

        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(796, 256)
            self.lm_head = torch.nn.Linear(256, 796, bias=False)
            self.verifier_lm_head = torch.nn.Linear(256, 796, bias=False)
            self.verifier_norm = torch.nn.LayerNorm(256, bias=False)

    draft = Draft()
    draft.embed_tokens.weight.data.copy_(got["embed_tokens.weight"])
    draft.lm_head.weight.data.copy_(original["lm_head.weight"])
    draft.verifier_lm_head.weight.data.copy_(original["lm_head.weight"])
    draft.verifier_norm.weight.data.copy_(original["model.norm.weight"])
    assert ensure_text_verifier_weights(draft, str(decoy)) == ["embed_tokens.weight"]
    assert torch.equal(draft.embed_tokens.weight, original["model.embed_tokens.weight"].float())


class _DraftCaller:
    """The draft module called as the DeepSpeed engine calls it, counting the calls: evaluate_heldout's
    division of batches among ranks without DeepSpeed (what DeepSpeed adds, the all-reduce and
    ZeRO's gathering, runs in test_ray_train_two_workers_checkpoint_resume_export)."""

    def __init__(self, module):
        import torch

        self.module, self.device, self.calls = module, torch.device("cpu"), 0

    def __call__(self, **inputs):
        self.calls += 1
        return self.module(**inputs)


def test_heldout_evaluation_divides_the_batches_among_ranks(tiny):
    from speculators.losses import resolve_loss_config

    from compat.speculators_loss import loss_implementation
    from eagle3.prepare.heldout import choose_split
    from eagle3.train.trainer import Eagle3Trainer

    target, files, samples, _ = tiny
    split = choose_split([f"s{i:04d}" for i in range(NUM_SAMPLES)], 0.3, 6)
    held_tokens = sum(len(ids) - 1 for i, (ids, _) in enumerate(samples) if split.is_heldout(f"s{i:04d}"))
    # 256-token micro-batches: the held-out samples take several, an odd number of them or not.
    cfg = small_cfg(eval_max_tokens=10 ** 6)
    got = {}
    for world, rank in ((1, 0), (2, 0), (2, 1)):
        trainer = Eagle3Trainer(cfg, target, files, rank=rank, world_size=world, heldout_threshold=split.threshold)
        trainer.engine = _DraftCaller(trainer.model)
        trainer.device = trainer.engine.device
        trainer.loss_config = resolve_loss_config(cfg.draft.loss, loss_implementation())
        assert trainer.heldout_dataset.num_samples == split.num_heldout_samples
        got[world, rank] = (trainer.evaluate_heldout(), trainer.engine.calls, trainer.model.training)
    whole, calls, training = got[1, 0]
    print(f"\nheld-out: {split.num_heldout_samples} samples, {calls} batches; rank shares {got[2, 0][1]} and "
          f"{got[2, 1][1]} forwards; full_acc_0 {whole['heldout_full_acc_0']:.3f} (untrained draft)")
    assert whole["heldout_samples"] == split.num_heldout_samples and training  # train mode restored
    assert calls >= 2 and whole["heldout_positions"] <= held_tokens
    (r0, calls0, _), (r1, calls1, _) = got[2, 0], got[2, 1]
    assert calls0 == calls1 == -(-calls // 2)  # the same number of forwards on every rank (ZeRO-3)
    # Without a process group each rank's result is its own share: together they are the whole.
    assert r0["heldout_samples"] + r1["heldout_samples"] == whole["heldout_samples"]
    assert r0["heldout_positions"] + r1["heldout_positions"] == whole["heldout_positions"]
    joint = (r0["heldout_full_acc_0"] * r0["heldout_positions"] + r1["heldout_full_acc_0"] * r1["heldout_positions"])
    assert abs(joint / whole["heldout_positions"] - whole["heldout_full_acc_0"]) < 1e-9
    # A bound of one token reads one batch: rank 1's forward is then the uncounted one.
    trainer.cfg, trainer.engine.calls = replace(cfg, eval_max_tokens=1), 0
    res = trainer.evaluate_heldout()
    assert trainer.engine.calls == 1 and res["heldout_samples"] == res["heldout_positions"] == 0
    # heldout_first_tokens: a second forward per batch, counting only the first n tokens of each turn
    trainer = Eagle3Trainer(replace(cfg, heldout_first_tokens=4), target, files, heldout_threshold=split.threshold)
    trainer.engine = _DraftCaller(trainer.model)
    trainer.device = trainer.engine.device
    trainer.loss_config = resolve_loss_config(cfg.draft.loss, loss_implementation())
    first = trainer.evaluate_heldout()
    assert trainer.engine.calls == 2 * calls and first["heldout_first_tokens"] == 4
    assert first["heldout_full_acc_0"] == pytest.approx(whole["heldout_full_acc_0"])  # the whole-answer figure unchanged
    assert 0 < first["heldout_first_positions"] < first["heldout_positions"]
    assert 0 <= first["heldout_first_full_acc_2"] <= first["heldout_first_full_acc_0"] <= 1


def test_first_of_each_run_keeps_the_first_n_tokens_of_each_turn():
    import torch

    from eagle3.train.trainer import first_of_each_run

    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    assert first_of_each_run(mask, 2).int().tolist() == [[1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1]]
    assert torch.equal(first_of_each_run(mask, 4), mask)
    assert not first_of_each_run(mask, 0).any()
    assert not first_of_each_run(torch.zeros(1, 5, dtype=torch.bool), 3).any()


# ---------------------------------------------------------------------------------------------
# real DeepSpeed, one process

K = 6  # steps before the kill; the full run is 2K


def _trainer(target, files, cfg):
    from eagle3.train import deepspeed_backend
    from eagle3.train.trainer import Eagle3Trainer

    trainer = Eagle3Trainer(cfg, target, files)
    trainer.attach_engine(deepspeed_backend.initialize(trainer.model, cfg, 1))
    return trainer


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """An uninterrupted ZeRO-2 fp32 run of 2K steps, checkpointing every K."""
    target, files, _, _ = tiny
    cfg = small_cfg(num_steps=2 * K, checkpoint={"checkpoint_every": K})
    trainer = _trainer(target, files, cfg)
    ckpt = tmp_path_factory.mktemp("ckpt")
    history = trainer.fit(checkpoint_dir=ckpt)
    return trainer, history, ckpt


@pytest.mark.slow
def test_deepspeed_training_reduces_loss(trained):
    trainer, history, ckpt = trained
    losses = [m["loss"] for m in history]
    print(f"\nZeRO-2 fp32, {len(losses)} steps: loss first {losses[0]:.4f} last {losses[-1]:.4f}; "
          f"full_acc_0 last {history[-1]['full_acc_0']:.3f}")
    assert [m["step"] for m in history] == list(range(1, 2 * K + 1))
    assert losses[-1] < 0.5 * losses[0]
    assert history[0]["lr"] == 0.0 and history[-1]["lr"] < history[4]["lr"]  # warmup, then cosine decay
    assert all(0.0 <= m["full_acc_0"] <= 1.0 for m in history) and history[-1]["full_acc_0"] > 0.1
    # every step reports how long it waited for its batches, a finite count of seconds; its value: the test below
    assert all(isinstance(m["input_wait_s"], float) and 0.0 <= m["input_wait_s"] < float("inf") for m in history)
    assert sorted(p.name for p in Path(ckpt).iterdir()) == ["latest", "step_00000006", "step_00000012",
                                                             "zero_to_fp32.py", "zero_to_torch.py"]


class LateBatches:
    """A batch source for DeviceBatches: the given batches, each `delay` s late (the first `first`
    s late, if given), with its position in PackedBatches' form (the trainer records each
    micro-batch's sample range from it). With a `clock` (a FakeClock), a late batch moves that
    clock on instead of sleeping."""

    def __init__(self, batches, delay: float, *, first: float | None = None, clock=None):
        self.batches, self.delay, self.first, self.taken, self.clock = iter(batches), delay, first, 0, clock

    def __next__(self):
        late = self.first if self.taken == 0 and self.first is not None else self.delay
        if self.clock is None:
            time.sleep(late)
        else:
            self.clock.now += late
        self.taken += 1
        return next(self.batches)

    def state_dict(self):
        return {"epoch": 0, "samples_seen": self.taken}


class FakeClock:
    """time.perf_counter for eagle3.train.data.staging: it moves only when a LateBatches source is
    late, so what the staging code measures is the source's lateness and nothing else."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.slow  # starts DeepSpeed
def test_input_wait_is_the_time_a_step_waits_for_its_batches_and_nothing_else(tiny, monkeypatch):
    """input_wait_s counts the time train_step is blocked on its batch source, and nothing else. The
    staging code's clock moves only inside the source, so the step's forward, backward and optimizer
    step (real DeepSpeed) take no time on it: a source 0.3 s late per batch gives 0.3 s for each batch
    the step took (2 micro-batches and the next one staged: 3), a ready one exactly 0."""
    from eagle3.train.data import staging
    from eagle3.train.data.staging import DeviceBatches

    target, files, _, _ = tiny
    cfg = small_cfg(num_steps=4, data={"prefetch_batches": 0, "gradient_accumulation_steps": 2})
    trainer = _trainer(target, files, cfg)
    source = trainer.batches.source
    ready = [next(source) for _ in range(6)]  # each step takes 2 and stages the next step's first

    clock = FakeClock()
    monkeypatch.setattr(staging, "time", clock)
    late = LateBatches(ready[:3], 0.3, clock=clock)
    trainer.batches = DeviceBatches(late, trainer.device, trainer.batches.dtype)
    slow = trainer.train_step()
    on_time = LateBatches(ready[3:], 0.0, clock=clock)
    trainer.batches = DeviceBatches(on_time, trainer.device, trainer.batches.dtype)
    fast = trainer.train_step()
    assert late.taken == on_time.taken == 3
    assert slow["input_wait_s"] == pytest.approx(0.3 * late.taken)
    assert fast["input_wait_s"] == 0.0  # the step's own compute is not counted


@pytest.mark.slow  # starts DeepSpeed
def test_first_step_is_timed_apart_from_the_steady_rate(tiny):
    """tokens_per_s is over the run's whole time in fit, its first step included (on CUDA that
    step compiles the draft's forward); first_step_seconds is that step's time, with a first batch
    1 s late in it, and steady_tokens_per_s the rate over the other steps; None until a second step. The
    tokens counted are the fed batches' own (their non-padding positions), step by step."""
    from eagle3.train.data.staging import DeviceBatches

    target, files, _, _ = tiny
    cfg = small_cfg(num_steps=4, data={"prefetch_batches": 0})
    trainer = _trainer(target, files, cfg)
    source = trainer.batches.source
    ready = [next(source) for _ in range(5)]  # 4 steps and the batch staged after the last

    fed = [int((batch["document_ids"] >= 0).sum()) for batch in ready[:4]]  # one micro-batch a step
    trainer.batches = DeviceBatches(LateBatches(ready, 0.0, first=1.0), trainer.device, trainer.batches.dtype)
    assert trainer.steady_tokens_per_s is None
    history = trainer.fit()
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    assert [m["tokens"] for m in history] == fed and all(n > 0 for n in fed)
    assert trainer.run_tokens == sum(fed) and trainer.first_step_tokens == fed[0]
    # The first step holds the 1 s late batch; the run holds it and three more steps.
    assert trainer.first_step_seconds >= 1.0 and trainer.run_seconds > trainer.first_step_seconds
    # Which rate is larger is a timing, not asserted here (beside another worker's job the first step was
    # not the slowest); each is a positive rate, over the run's seconds its tokens are the fed ones.
    assert 0 < trainer.tokens_per_s < float("inf") and 0 < trainer.steady_tokens_per_s < float("inf")
    assert trainer.tokens_per_s * trainer.run_seconds == pytest.approx(sum(fed))
    assert trainer.steady_tokens_per_s * (trainer.run_seconds - trainer.first_step_seconds) == pytest.approx(sum(fed[1:]))


def test_device_batches_stage_one_ahead_and_checkpoint_the_returned_position(tiny):
    """A staged batch is taken from the source but not counted: state_dict() is the position
    after the last batch returned, and loading a position drops the staged batch."""
    import torch

    from eagle3.train.data.packing import PackedBatches
    from eagle3.train.data.rows import HiddenStatesDataset
    from eagle3.train.data.staging import DeviceBatches

    target, files, _, _ = tiny
    ds = HiddenStatesDataset(files, seed=0, shuffle_buffer_size=4)
    plain = PackedBatches(ds, 256)
    want = [next(plain) for _ in range(4)]
    staged = DeviceBatches(PackedBatches(ds, 256), torch.device("cpu"), torch.float32)
    batch, inputs, _ = next(staged)
    assert torch.equal(batch["input_ids"], want[0]["input_ids"])
    assert torch.equal(inputs["hidden_states"], want[0]["hidden_states"])
    at_one = staged.state_dict()
    staged.stage()
    assert staged.state_dict() == at_one != staged.source.state_dict()
    assert torch.equal(next(staged)[0]["input_ids"], want[1]["input_ids"])
    staged.stage()
    staged.load_state_dict(at_one)
    assert torch.equal(next(staged)[0]["input_ids"], want[1]["input_ids"])
    assert torch.equal(next(staged)[0]["input_ids"], want[2]["input_ids"])


KILL_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from eagle3.train import deepspeed_backend
    from eagle3.config import config_from_dict
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import Eagle3Trainer

    args = json.loads(sys.argv[1])
    cfg = config_from_dict(TrainConfig, args["cfg"], "train")
    trainer = Eagle3Trainer(cfg, args["target"], args["files"])
    trainer.attach_engine(deepspeed_backend.initialize(trainer.model, cfg, 1))
    losses = []

    def on_step(m):
        losses.append(m["loss"])
        with open(args["losses"], "w") as f:
            json.dump(losses, f)
        if m["step"] == args["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash right after the checkpoint at this step

    trainer.fit(checkpoint_dir=args["ckpt"], on_step=on_step)
""")


@pytest.mark.slow
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_resume_after_kill_reproduces_loss_curve(tiny, trained, tmp_path, bf16):
    from dataclasses import asdict

    target, files, _, _ = tiny
    cfg = replace(trained[0].cfg, optimizer=replace(trained[0].cfg.optimizer, bf16=bf16))
    if bf16:
        uninterrupted = [m["loss"] for m in _trainer(target, files, cfg).fit()]
    else:
        uninterrupted = [m["loss"] for m in trained[1]]
    args = {"cfg": asdict(cfg), "target": str(target), "files": files, "ckpt": str(tmp_path / "ckpt"),
            "losses": str(tmp_path / "losses.json"), "kill_at": K}
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, json.dumps(args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    before = json.loads((tmp_path / "losses.json").read_text())
    assert len(before) == K
    resumed = _trainer(target, files, cfg)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == K
    after = [m["loss"] for m in resumed.fit()]
    curve = np.array(before + after)
    rel = np.abs(curve - np.array(uninterrupted)) / np.abs(np.array(uninterrupted))
    print(f"\nresume after kill at step {K} ({'bf16' if bf16 else 'fp32'}): losses {uninterrupted[0]:.4f} -> "
          f"{uninterrupted[-1]:.4f}, max rel loss diff over {2 * K} steps = {rel.max():.3g}")
    assert len(after) == K and rel.max() <= RESUME_RTOL
    assert resumed.loss_first == pytest.approx(uninterrupted[0])


@pytest.mark.slow
def test_export_reloads_with_speculators_and_matches(tiny, trained, tmp_path):
    import torch
    from safetensors import safe_open
    from speculators.models.eagle3.core import Eagle3DraftModel

    from eagle3.train.deepspeed_backend import gather_full_state_dict

    target, _, _, _ = tiny
    trainer = trained[0]
    out = trainer.export(tmp_path / "draft")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "config.py", "model.safetensors",
                                                      "provenance.json", "serving.json"]
    config = json.loads((out / "config.json").read_text())
    print("\nexported config.json keys:", sorted(config))
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(Path(target).resolve())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["draft_vocab_size"] == 512
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    trained_sd = gather_full_state_dict(trainer.engine.module)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert keys == set(trained_sd) - {"verifier_lm_head.weight", "verifier_norm.weight"}
    reloaded = Eagle3DraftModel.from_pretrained(str(out))
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, trained_sd[name]), name  # incl. verifier_* re-read from the target
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["stage"] == "export" and provenance["config"]["train"]["num_steps"] == 2 * K


@pytest.mark.slow
def test_zero3_engine_export_gathers_partitioned_weights(tiny, tmp_path):
    import torch
    from speculators.models.eagle3.core import Eagle3DraftModel

    target, files, _, _ = tiny
    trainer = _trainer(target, files, small_cfg(num_steps=2, optimizer={"zero_stage": 3}))
    history = trainer.fit()
    assert len(history) == 2
    assert trainer.engine.module.fc.weight.numel() == 0  # partitioned: the module holds a placeholder
    reference = trainer.engine._zero3_consolidated_16bit_state_dict()  # DeepSpeed's own gather
    out = trainer.export(tmp_path / "draft3")
    reloaded = Eagle3DraftModel.from_pretrained(str(out)).state_dict()
    assert reloaded["fc.weight"].shape == (256, 768)
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "norm.weight", "embed_tokens.weight"):
        assert torch.equal(reloaded[name], reference[name]), name


# ---------------------------------------------------------------------------------------------
# Ray Train route


@pytest.mark.slow
def test_ray_train_two_workers_checkpoint_resume_export(tiny, tmp_path, ray_local):
    """On the session's shared cluster (conftest's ray_local; it had a cluster of its own, ~6-10 s
    to start and stop): nothing here kills or inspects the cluster's processes."""
    from actors.trainer import run_training

    from eagle3.prepare.heldout import choose_split
    from eagle3.extract.shards import read_shards

    target, files, _, _ = tiny
    out = tmp_path / "run"
    # A held-out split of the shards' samples (9 of 24), measured every 2 steps on both ranks' share.
    ids = read_shards(files, columns=["sample_id"]).column("sample_id").to_pylist()
    split = choose_split(ids, 0.25, 6)
    cfg = small_cfg(num_workers=2, num_steps=4, checkpoint={"checkpoint_every": 2}, eval_every_steps=2,
                    online={"record_sample_ids": True})
    first = run_training(cfg, files, str(target), str(out), heldout_threshold=split.threshold)
    print(f"\nRay Train, 2 workers: {first}")
    assert first["steps"] == 4 and first["resumed_from_step"] is None
    assert [(w["rank"], w["backend"]) for w in first["workers"]] == [(0, "gloo"), (1, "gloo")]  # where each rank ran
    assert first["loss_last"] < first["loss_first"]
    ckpt = Path(first["checkpoint"])
    assert sorted(p.name for p in (ckpt / "step_00000004").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # both ranks' shards merged by Ray Train
    assert (Path(first["draft_dir"]) / "model.safetensors").exists()
    assert json.loads((out / "train_summary.json").read_text()) == first
    # Same out_dir, more steps: Ray Train restores its checkpoint manager, workers resume at 4.
    second = run_training(replace(cfg, num_steps=6), files, str(target), str(out), heldout_threshold=split.threshold)
    print(f"Ray Train resumed: {second}")
    assert second["resumed_from_step"] == 4 and second["steps"] == 6
    assert second["loss_first"] == first["loss_first"] and second["tokens"] > first["tokens"]
    assert Path(second["checkpoint"], "step_00000006").is_dir()
    # Held-out accuracy at steps 2 and 4, then 6 after the resume: the batches of all 9 held-out
    # samples divided between the ranks and all-reduced; no rank trained one of them.
    curve = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve if "heldout_full_acc_0" in r] == [2, 4, 6]
    assert {r["heldout_samples"] for r in curve if "heldout_samples" in r} == {split.num_heldout_samples}
    assert first["heldout"]["step"] == 4 and second["heldout"]["step"] == 6
    assert second["heldout"]["num_positions"] > 0 and len(second["heldout"]["full_acc"]) == 3
    trained = set()
    for rank in (0, 1):
        for line in (out / "sample_ids" / f"rank-{rank}.jsonl").read_text().splitlines():
            trained.update(json.loads(line)["sample_ids"])
    assert trained and not {s for s in trained if split.is_heldout(s)}
    # What a resume must match went with the checkpoint to Ray Train's record, so that a resume under
    # another split is refused by the driver, before any worker: a ValueError, not Ray Train's error
    # about its worker group.
    from actors.trainer import RUN_NAME
    from compat.ray_train import read_snapshot

    latest = read_snapshot(out / "ray_train", RUN_NAME).latest
    assert (latest.metrics["world_size"], latest.metrics["heldout_threshold"]) == (2, split.threshold)
    with pytest.raises(ValueError, match="held-out threshold"):
        run_training(replace(cfg, num_steps=8, checkpoint=replace(cfg.checkpoint, max_failures=0)), files,
                     str(target), str(out), heldout_threshold=0)


def _registered(out: Path, metrics: dict) -> None:
    """A Ray Train record of one registered checkpoint under out, in the layout compat.ray_train
    reads (checked against a real run by tests/test_compat.py), with these metrics."""
    from actors.trainer import RUN_NAME
    from compat.ray_train import SNAPSHOT_FILENAME, run_dir

    root = run_dir(out / "ray_train", RUN_NAME)
    (root / "checkpoint_1").mkdir(parents=True)
    result = {"checkpoint_dir_name": "checkpoint_1", "metrics": metrics}
    (root / SNAPSHOT_FILENAME).write_text(json.dumps({"checkpoint_results": [result], "latest_checkpoint_result": result}))


def test_resume_that_cannot_match_is_refused_before_any_worker(tmp_path):
    """A resume with other ranks or another held-out split is refused from Ray Train's record of the
    latest checkpoint (what train_loop_per_worker reports with it), by the driver: run_training raises
    before it asks Ray for anything (no cluster here; a worker's refusal would come as Ray Train's
    error). A fresh run, a matching one, and a checkpoint reported without the two pass to the workers."""
    from actors.trainer import resume_refusal_before_workers, run_training

    assert resume_refusal_before_workers(tmp_path / "fresh", 2, 7) is None
    old = tmp_path / "old"
    _registered(old, {"step": 4})  # reported before the driver's check existed: the workers judge it
    assert resume_refusal_before_workers(old, 2, 7) is None
    out = tmp_path / "run"
    _registered(out, {"step": 4, "world_size": 2, "heldout_threshold": 7})
    assert resume_refusal_before_workers(out, 2, 7) is None
    assert "resume with train.num_workers=2" in resume_refusal_before_workers(out, 1, 7)
    assert "held-out threshold 7, this run has 0" in resume_refusal_before_workers(out, 2, 0)
    with pytest.raises(ValueError, match="written by 2 ranks, this run has 4"):
        run_training(small_cfg(num_workers=4, num_steps=8), ["unused.parquet"], "unused-target", str(out),
                     use_gpu=False, heldout_threshold=7)


def test_draft_vocab_size_is_at_most_the_targets():
    """train.draft.draft_vocab_size caps the draft head: a target with fewer tokens keeps its whole
    vocabulary (no mapping), as the demo's 1,024 does for the tests' 796-token tiny target."""
    from eagle3.train.config import resolve_draft_vocab_size

    assert resolve_draft_vocab_size(None, 151936) == 32000
    assert resolve_draft_vocab_size(None, 796) == 796
    assert resolve_draft_vocab_size(1024, 49152) == 1024
    assert resolve_draft_vocab_size(1024, 796) == 796

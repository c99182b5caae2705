"""Dummy-weight Llama shapes for benchmarks (config.json only: vLLM's load_format="dummy"
gives random weights of that shape, which is right for throughput and wrong for accuracy), and
`build_shape_target`: a shape with seeded random weights saved and a small tokenizer, for
benchmarks that run the whole job (prepare needs a tokenizer; the trainer reads the weights)."""

from __future__ import annotations

import json
from pathlib import Path

SHAPES = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab)
    "tiny": (256, 8, 4, 2, 512, 1024),
    "smol": (576, 30, 9, 3, 1536, 49152),  # SmolLM2-135M's shape
    "1b": (2048, 16, 32, 8, 8192, 128256),
    "8b": (4096, 32, 32, 8, 14336, 128256),
}


def write_shape(name: str, out_dir: str | Path, max_positions: int = 8192) -> str:
    """config.json of shape `name` in `out_dir`; max_positions: the position table (rope), at
    least the longest sample the engine or trainer will see."""
    hidden, layers, heads, kv, inter, vocab = SHAPES[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "intermediate_size": inter, "vocab_size": vocab, "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    }, indent=1))
    return str(out)


def build_shape_target(shape: str, out_dir: str | Path, conversations: str | Path, seed: int = 0) -> str:
    """`shape` with seeded random bf16 weights (the trainer reads the embeddings and lm_head from
    the files, so vLLM's dummy weights are not enough) and a BPE tokenizer with the demo's chat
    template trained on `conversations` (JSONL); its vocabulary is that tokenizer's (about 1,000),
    not the shape's: prepare needs a tokenizer, and ids past it could not be decoded. Random
    weights: right for throughput and plumbing, meaningless for acceptance. Reused when built
    already with the same settings."""
    import torch
    from transformers import LlamaForCausalLM

    from eagle3.tiny import build_tokenizer, corpus_texts, llama_config

    out = Path(out_dir)
    stamp = out / "shape_target.json"
    want = {"shape": shape, "seed": seed, "tokenizer_corpus": Path(conversations).name}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return str(out)
    hidden, layers, heads, kv, inter, _ = SHAPES[shape]
    tok = build_tokenizer(corpus_texts(conversations), out)
    cfg = llama_config(tok, max_position_embeddings=4096, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out))
    stamp.write_text(json.dumps(want))
    return str(out)

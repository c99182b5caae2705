"""Dummy-weight Llama shapes for benchmarks (config.json only: vLLM's load_format="dummy"
gives random weights of that shape, which is right for throughput and wrong for accuracy)."""

from __future__ import annotations

import json
from pathlib import Path

SHAPES = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab)
    "tiny": (256, 8, 4, 2, 512, 1024),
    "smol": (576, 30, 9, 3, 1536, 49152),  # SmolLM2-135M's shape (the issue-28 job's target)
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

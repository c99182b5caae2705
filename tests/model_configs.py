"""Tiny target configs of the architectures the doctor must handle, written as HF model
directories without weights (the dry run loads vLLM's dummy weights).

Each builder writes `config.json` and, when given a tiny target, copies its tokenizer files
next to it, so a directory looks like a real checkpoint to everything that reads one
(transformers' AutoConfig, vLLM's config parser, our cut_config). The extraction engine itself
runs with skip_tokenizer_init=True and needs no tokenizer.

Sizes keep a vLLM CPU engine start under ~30 s on 2 cores: hidden 256, head_dim 64 (the CPU
attention backend has no kernel for head_dim 16), 4 decoder layers, 4 experts, top-2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

VOCAB_SIZE = 1024  # the tiny target's tokenizer (eagle3/tiny.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _write(out_dir: str | Path, cfg: dict, tokenizer_from: str | Path | None) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_from) / name
            if src.exists():
                shutil.copy(src, out / name)
    return str(out)


def qwen3_moe_config(num_layers: int = 8) -> dict:
    """Qwen3-MoE text model: every layer sparse, 4 experts, top-2."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }


def write_qwen3_moe_target(out_dir: str | Path, tokenizer_from: str | Path | None = None, num_layers: int = 8) -> str:
    return _write(out_dir, qwen3_moe_config(num_layers), tokenizer_from)


def deepseek_v3_text_config(num_layers: int = 8) -> dict:
    """Kimi-K2's text model (DeepSeek-V3: MLA attention, one dense layer, then MoE layers with a
    shared expert). kv_lora_rank 512 + qk_rope_head_dim 64 is the latent size (576) the CPU MLA
    kernels are built for; everything else is small."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "q_lora_rank": 64,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }


def kimi_k25_config(num_layers: int = 8) -> dict:
    """Kimi-K2.5's wrapper: the language model under `text_config` (its weights would sit under
    `language_model.`), a MoonViT vision tower of one small layer, and the projector."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": deepseek_v3_text_config(num_layers),
        "vision_config": {
            "model_type": "kimi_k25_vision",
            "patch_size": 14,
            "pos_emb_height": 8,
            "pos_emb_width": 8,
            "pos_emb_time": 4,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "hidden_size": 128,
            "intermediate_size": 256,
            "hidden_act": "gelu_pytorch_tanh",
            "merge_kernel_size": [2, 2],
        },
        "projection_hidden_size": 128,
        "image_token_id": VOCAB_SIZE - 4,
        "video_token_id": VOCAB_SIZE - 3,
        "vision_start_token_id": VOCAB_SIZE - 2,
        "vision_end_token_id": VOCAB_SIZE - 1,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def write_kimi_k25_target(out_dir: str | Path, tokenizer_from: str | Path | None = None, num_layers: int = 8) -> str:
    return _write(out_dir, kimi_k25_config(num_layers), tokenizer_from)


def mixtral_config(num_layers: int = 8) -> dict:
    """A MoE architecture that vLLM serves but that does not implement SupportsEagle3."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "dtype": "bfloat16",
    }


def write_mixtral_target(out_dir: str | Path, tokenizer_from: str | Path | None = None) -> str:
    return _write(out_dir, mixtral_config(), tokenizer_from)


def write_remote_code_target(out_dir: str | Path, base_dir: str | Path) -> str:
    """`base_dir`'s config with an `auto_map` and the module it names: a target whose own Python
    code transformers would run (trust_remote_code)."""
    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig",
                       "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    out = _write(out_dir, cfg, base_dir)
    (Path(out) / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n    model_type = 'custom'\n")
    return out

"""Builds the tiny, seeded Llama-architecture target used by the demo, CI and tests.

Owns: a BPE tokenizer trained locally on the shipped conversations, a chat template that
marks roles with special tokens, and a randomly initialised Llama saved in HF format.
Does not own: anything a real target needs (those come from the user's model directory).
Nothing is downloaded; the same seed and `size` give the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

# `size` is the one knob: 1 is what CI and the demo use (8 layers, hidden 256, head_dim 64,
# a head size every vLLM CPU attention backend supports). Larger sizes scale width and depth.
_SHAPES = {
    1: dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2),
    2: dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4),
}


def corpus_texts(conversations_path: str | Path) -> list[str]:
    """Every message text of a JSONL conversation file (OpenAI or ShareGPT shape)."""
    texts = []
    for line in Path(conversations_path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        for m in rec.get("messages") or rec.get("conversations") or []:
            texts.append(m.get("content") or m.get("value") or "")
    return texts


def build_tokenizer(texts: list[str], out_dir: str | Path, vocab_size: int = 1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_target(out_dir: str | Path, conversations_path: str | Path, *, size: int = 1, seed: int = 0) -> Path:
    """Write a tokenizer + seeded random Llama (bf16 safetensors) to `out_dir`; return it.

    Reuses `out_dir` when it already holds a model built with the same size and seed.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in _SHAPES:
        raise ValueError(f"tiny model size={size} is not one of {sorted(_SHAPES)}")
    out = Path(out_dir)
    stamp = out / "tiny_build.json"
    want = {"size": size, "seed": seed, "conversations": str(Path(conversations_path).resolve())}
    if stamp.exists() and json.loads(stamp.read_text()) == want and (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(corpus_texts(conversations_path), out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="bfloat16",
        initializer_range=0.05,
        **_SHAPES[size],
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out))
    stamp.write_text(json.dumps(want))
    return out

"""Builds the tiny, seeded Llama-architecture target used by the demo, CI and tests.

Owns: a BPE tokenizer trained locally on the shipped conversations, a chat template that
marks roles with special tokens, and a seeded Llama saved in HF format, briefly trained on
those conversations (`pretrain_steps`) so that its greedy text looks like them: a random
target's greedy text is degenerate, and a draft trained on conversations would then be
evaluated on text unlike anything it saw.
Does not own: anything a real target needs (those come from the user's model directory).
Nothing is downloaded; the same seed and `size` give the same bytes. `build_tokenizer` and
`llama_config` are shared with `benchmarks.make_target` (the ShareGPT-trained targets).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from eagle3.prepare.chat_template import TEMPLATES

# The tiny target's template and tokens are TEMPLATES["simple"]: one definition.
CHAT_TEMPLATE = TEMPLATES["simple"].template
SPECIAL_TOKENS = list(TEMPLATES["simple"].special_tokens)

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


def build_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 1024, *,
                    special_tokens: Sequence[str] = SPECIAL_TOKENS, chat_template: str = CHAT_TEMPLATE,
                    bos_token: str | None = "<|bos|>", eos_token: str = "<|end|>", pad_token: str = "<|pad|>",
                    added_tokens: Sequence[str] = ()):
    """Train a byte-level BPE tokenizer on `texts`, give it `chat_template`, save it to `out_dir`.

    `special_tokens` come first in the vocabulary, in order; those not named as bos, eos or
    pad are registered as additional special tokens, so the template's role markers are never
    split. `added_tokens` become single, non-special ids (text such as think tags that a
    parser reads back). The defaults are the tiny target's (its bytes must not change).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    named = {bos_token, eos_token, pad_token}
    missing = sorted(t for t in named if t is not None and t not in special_tokens)
    if missing:
        raise ValueError(f"build_tokenizer: bos/eos/pad tokens {missing} are not among special_tokens "
                         f"{list(special_tokens)}; list them there")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if added_tokens:
        tok.add_tokens(list(added_tokens))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        additional_special_tokens=[t for t in special_tokens if t not in named],
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return fast


def llama_config(tok, *, max_position_embeddings: int = 4096, initializer_range: float = 0.05, **shape):
    """A Llama config for `tok` (vocab size and its bos/eos/pad ids), bf16, untied embeddings;
    `shape` gives hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="bfloat16",
        initializer_range=initializer_range,
        **shape,
    )


def _pretrain(model, tok, conversations_path, steps: int, seed: int) -> None:
    """Next-token training on the rendered conversations: seeded windows of 128 tokens, batch 16,
    AdamW 3e-3."""
    import torch

    from eagle3.prepare.conversations import load_conversations

    texts = [tok.apply_chat_template(msgs, tokenize=False) for _, msgs in load_conversations(conversations_path)]
    data = torch.tensor([i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"]])
    seq, batch = 128, 16
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts])
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def build_tiny_target(out_dir: str | Path, conversations_path: str | Path, *, size: int = 1, seed: int = 0,
                      pretrain_steps: int = 100, chat_template: str = "simple") -> Path:
    """Write a tokenizer + seeded Llama (bf16 safetensors) to `out_dir`; return it.

    `chat_template` names one of `eagle3.prepare.chat_template.TEMPLATES` ("qwen3": a template that
    rewrites earlier turns, so the whole job runs on one). Reuses `out_dir` when it already
    holds a model built with the same settings.
    """
    from eagle3.prepare.chat_template import TEMPLATES

    import torch
    from transformers import LlamaForCausalLM

    if size not in _SHAPES:
        raise ValueError(f"tiny model size={size} is not one of {sorted(_SHAPES)}")
    out = Path(out_dir)
    stamp = out / "tiny_build.json"
    want = {"size": size, "seed": seed, "pretrain_steps": pretrain_steps,
            "conversations": str(Path(conversations_path).resolve())}
    if chat_template not in TEMPLATES:
        raise ValueError(f"tiny target chat_template={chat_template!r}: expected one of {sorted(TEMPLATES)}")
    if chat_template != "simple":  # the simple template's stamp (and bytes) stay as they were
        want["chat_template"] = chat_template
    if stamp.exists() and json.loads(stamp.read_text()) == want and (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(corpus_texts(conversations_path), out, **TEMPLATES[chat_template].tokenizer_kwargs())
    torch.manual_seed(seed)
    cfg = llama_config(tok, **_SHAPES[size])
    model = LlamaForCausalLM(cfg)
    if pretrain_steps:
        _pretrain(model, tok, conversations_path, pretrain_steps, seed)
    model.to(torch.bfloat16).save_pretrained(str(out))
    stamp.write_text(json.dumps(want))
    return out

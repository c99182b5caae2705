"""Chat templates that behave like the families users train drafts for, written here (not
copied from any model), and a tokenizer to render them with, trained locally in well under a
second. Each family's `generated` says what the target writes for an assistant turn: the text
a correct mask covers, turn by turn.

Families not in eagle3.prepare.chat_template.TEMPLATES (which holds what a local target is built with)
live here: they only test how masks are found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from eagle3.prepare.chat_template import TEMPLATES, ChatTemplate

# Prefix-stable: every turn renders the same whatever follows (Llama-3's layout).
LLAMA3_LIKE = ChatTemplate(
    template=(
        "{{ '<|bot|>' }}"
        "{%- for m in messages -%}"
        "{{ '<|head|>' + m['role'] + '<|/head|>\\n\\n' + m['content'] + '<|eot|>' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|head|>assistant<|/head|>\\n\\n' }}{%- endif -%}"
    ),
    special_tokens=("<|pad|>", "<|bot|>", "<|head|>", "<|/head|>", "<|eot|>"),
    eos_token="<|eot|>", pad_token="<|pad|>", bos_token="<|bot|>",
)

# Strips the reasoning from every assistant turn it renders, and opens the reasoning in the
# generation prompt (DeepSeek-R1's layout): the target writes "{reasoning}\n</think>\n\n{answer}".
DEEPSEEK_R1_LIKE = ChatTemplate(
    template=(
        "{{ '<|bos|>' }}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}{{ m['content'] }}"
        "{%- elif m['role'] == 'user' -%}{{ '<|User|>' + m['content'] }}"
        "{%- else -%}"
        "{%- set answer = m['content'] -%}"
        "{%- if '</think>' in answer -%}{%- set answer = answer.split('</think>')[-1] -%}{%- endif -%}"
        "{{ '<|Assistant|>' + answer + '<|eos|>' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|Assistant|><think>\\n' }}{%- endif -%}"
    ),
    special_tokens=("<|bos|>", "<|User|>", "<|Assistant|>", "<|eos|>"),
    eos_token="<|eos|>", pad_token="<|eos|>", bos_token="<|bos|>",
    added_tokens=("<think>", "</think>"),
)

# Channels (gpt-oss's harmony layout): the turn being generated writes its reasoning in an
# analysis message, then the answer in a final message closed by <|return|>; in history only
# the final message is kept, closed by <|end|>.
HARMONY_LIKE = ChatTemplate(
    template=(
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'assistant' -%}"
        "{%- if loop.last and not add_generation_prompt -%}"
        "{%- if m['reasoning_content'] is defined and m['reasoning_content'] -%}"
        "{{ '<|start|>assistant<|channel|>analysis<|message|>' + m['reasoning_content'] + '<|end|>' }}"
        "{%- endif -%}"
        "{{ '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|return|>' }}"
        "{%- else -%}"
        "{{ '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' }}"
        "{%- endif -%}"
        "{%- else -%}"
        "{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|start|>assistant' }}{%- endif -%}"
    ),
    special_tokens=("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"),
    eos_token="<|return|>", pad_token="<|startoftext|>",
)


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a loss mask."""
    out, start = [], None
    for k, v in enumerate(list(mask) + [0]):
        if v and start is None:
            start = k
        elif not v and start is not None:
            out.append((start, k))
            start = None
    return out


def _think(reasoning: str, answer: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{answer}"


@dataclass(frozen=True)
class Family:
    name: str
    template: ChatTemplate
    kwargs: dict
    generated: Callable[[str, str], str]
    """(reasoning, answer) -> the text the target writes after the generation prompt, end of turn included."""


FAMILIES = {
    "llama3": Family("llama3", LLAMA3_LIKE, {}, lambda r, a: (_think(r, a) if r else a) + "<|eot|>"),
    "qwen3-thinking": Family("qwen3-thinking", TEMPLATES["qwen3"], {"enable_thinking": True},
                             lambda r, a: _think(r, a) + "<|im_end|>"),
    "qwen3-no-thinking": Family("qwen3-no-thinking", TEMPLATES["qwen3"], {"enable_thinking": False},
                                lambda r, a: a + "<|im_end|>"),
    "deepseek-r1": Family("deepseek-r1", DEEPSEEK_R1_LIKE, {}, lambda r, a: f"{r}\n</think>\n\n{a}<|eos|>"),
    "harmony": Family("harmony", HARMONY_LIKE, {},
                      lambda r, a: (f"<|channel|>analysis<|message|>{r}<|end|><|start|>assistant" if r else "")
                      + f"<|channel|>final<|message|>{a}<|return|>"),
}

CORPUS = [
    "The Nile flows north into the Mediterranean.", "Tell me something about rivers.",
    "The Danube crosses ten countries. Also, 20 plus 71 is 91.", "You are a concise assistant.",
    "Let me think: the user asks about rivers, so name a long one.", "system user assistant analysis final",
]


def make_tokenizer(t: ChatTemplate, vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on CORPUS, with the template's tokens and template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(t.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if t.added_tokens:
        tok.add_tokens([AddedToken(a, special=False, normalized=False) for a in t.added_tokens])
    named = {t.bos_token, t.eos_token, t.pad_token}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=t.bos_token, eos_token=t.eos_token,
                                   pad_token=t.pad_token,
                                   additional_special_tokens=[s for s in t.special_tokens if s not in named])
    fast.chat_template = t.template
    return fast

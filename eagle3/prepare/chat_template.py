"""Chat templates -> training samples: token ids and the assistant-only loss mask.

Owns: rendering a conversation with the target's own chat template, locating the tokens the
target generates in each assistant turn, cutting over-length conversations at turn
boundaries, and the templates a locally built target can be given (`TEMPLATES`). Does not
own: reading records (`eagle3.prepare.conversations`), writing files or the stage's counts
(`eagle3.prepare.tokens`).

What a turn is trained on. The draft is used while the target generates assistant turn i:
the target's context is then messages[:i] rendered with the generation prompt, followed by
the tokens it generates. So turn i's training tokens are exactly that: the prompt of
messages[:i], then the turn as the template writes it when it is the turn being generated
(its last message), reasoning included, then the end-of-turn token. The mask covers what
follows the generation prompt (the reasoning and the answer) through the end-of-turn
token, never role headers, system or user text. No `{% generation %}` markers are needed.

Templates that rewrite earlier turns (a Qwen3-like empty think block on the last turn
only, DeepSeek-R1-like reasoning stripped from history, harmony-like analysis channels
dropped from history, a last turn closed by a different token) render turn i one way
while it is generated and another way once later turns follow. Rendering the whole
conversation once would train every earlier turn on the history form, a context the
target never generates in (an answer without the reasoning it wrote first): a train/serve
mismatch of exactly the kind users of other trainers report as low acceptance. So each
turn is rendered as the turn being generated, and turns share one sample only where that
is exact: turn j rides in a sample iff turn j's own token list is a prefix of the
sample's. A prefix-stable template (Llama-3-like, ChatML) therefore gives one sample per
conversation, as before; a template that rewrites every earlier turn gives one sample per
assistant turn. Cost of being exact: k turns of similar length cost about (k + 1) / 2
times the conversation's tokens to extract and train (the repeated prefixes carry no
loss); the loss tokens are the same. The summary's num_tokens against num_loss_tokens
shows it.

Reasoning is read from a message's `reasoning_content` or from a `<think>...</think>`
block opening its content. A template that renders it is trusted with its form. Where the
template drops it from the turn being generated (DeepSeek-R1-like templates strip it from
every turn and open `<think>\\n` in the generation prompt), the turn is rebuilt around the
template's own header and end-of-turn text with the reasoning written as
`<think>\\n{reasoning}\\n</think>\\n\\n{answer}`, the form those families generate and vLLM's
reasoning parsers split `reasoning_content` from; the rebuilt turn must continue the
template's generation prompt or the conversation is rejected. With the template kwarg
`enable_thinking=False` the target is served without reasoning, so reasoning a record
carries is not what it generates there: it is removed before rendering.

A conversation that cannot be rendered this way is a `RenderReject` whose `kind` names
the behaviour (prepare counts rejects by kind); nothing is guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3.config import OverLength

# Stands in for an assistant message's content so that the template's own header and
# end-of-turn text around the content can be read off the rendered string.
_PROBE = "EAGLE3PROBECONTENT"

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class RenderReject(ValueError):
    """A conversation that cannot become a training sample. `kind` is a short stable key for
    counting (too_long, no_assistant_turn, template_error, template_rewrites_turn,
    template_hides_content, token_boundary; several_samples from tokenize_conversation only);
    the message says what was found and what to do."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Sample:
    id_suffix: str
    """'' when the conversation is one sample; else '#t<k>', k = the 1-based number (among the
    conversation's assistant turns) of the last turn the sample trains: unique within the
    conversation and the same on every run."""
    input_ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True)
class Rendered:
    samples: list[Sample]
    num_turns: int
    """Assistant turns in the conversation."""
    num_turns_cut: int
    """Assistant turns left out by over_length='truncate' (0 when nothing was cut)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A template a locally built target can be given, with the tokens it needs (the
    arguments of `eagle3.tiny.build_tokenizer`)."""

    template: str
    special_tokens: tuple[str, ...]
    """Added as special tokens, first in the vocabulary, in this order: single ids, never split
    or merged with text. bos, eos and pad are among them."""
    eos_token: str
    """The token that ends an assistant turn: the target's eos."""
    pad_token: str
    bos_token: str | None = None
    """None: the template writes no bos (Qwen3's layout)."""
    added_tokens: tuple[str, ...] = ()
    """Added as single, non-special tokens (think tags: text a reasoning parser reads)."""

    def tokenizer_kwargs(self) -> dict:
        """`eagle3.tiny.build_tokenizer`'s keyword arguments for a tokenizer with this template."""
        return {"special_tokens": list(self.special_tokens), "chat_template": self.template,
                "eos_token": self.eos_token, "pad_token": self.pad_token, "bos_token": self.bos_token,
                "added_tokens": list(self.added_tokens)}


TEMPLATES: dict[str, ChatTemplate] = {
    # The tiny demo target's template (eagle3.tiny builds with it): prefix-stable, one sample
    # per conversation.
    "simple": ChatTemplate(
        template=("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
        special_tokens=("<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"),
        eos_token="<|end|>", pad_token="<|pad|>", bos_token="<|bos|>",
    ),
    # Behaves like the Qwen3 family (written here): ChatML turns; the assistant turn after the
    # last user message is written with its think block (empty when there is no reasoning),
    # earlier turns without; `enable_thinking=False` puts an empty think block in the
    # generation prompt. Reasoning comes from reasoning_content or a <think> block in content.
    "qwen3": ChatTemplate(
        template=(
            "{%- set ns = namespace(last_user=-1) -%}"
            "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
            "{%- endif -%}{%- endfor -%}"
            "{%- for m in messages -%}"
            "{%- if m['role'] == 'assistant' -%}"
            "{%- set answer = m['content'] -%}"
            "{%- set thought = m['reasoning_content'] if m['reasoning_content'] is defined and m['reasoning_content'] "
            "else '' -%}"
            "{%- if '</think>' in answer -%}"
            "{%- set thought = answer.split('</think>')[0].split('<think>')[-1] -%}"
            "{%- set answer = answer.split('</think>')[-1] -%}"
            "{%- endif -%}"
            "{{ '<|im_start|>assistant\\n' }}"
            "{%- if loop.index0 > ns.last_user and (loop.last or thought) -%}"
            "{{ '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' }}"
            "{%- endif -%}"
            "{{ answer.lstrip('\\n') + '<|im_end|>\\n' }}"
            "{%- else -%}"
            "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{%- endif -%}"
            "{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
            "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
            "{%- endif -%}"
        ),
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        added_tokens=(THINK_OPEN, THINK_CLOSE),
    ),
}


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    return ids


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _common_suffix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(reversed(a), reversed(b)):
        if x != y:
            break
        n += 1
    return n


def _split_reasoning(m: dict) -> tuple[str, str]:
    """(reasoning, answer) of an assistant message: reasoning_content, else a think block
    opening the content."""
    content = m["content"]
    reasoning = m.get("reasoning_content") or ""
    if THINK_CLOSE in content:
        head, answer = content.rsplit(THINK_CLOSE, 1)
        if not reasoning:
            reasoning = head.split(THINK_OPEN, 1)[-1]
        return reasoning, answer
    return reasoning, content


def _without_reasoning(m: dict) -> dict:
    out = {k: v for k, v in m.items() if k != "reasoning_content"}
    out["content"] = _split_reasoning(m)[1].lstrip("\n")
    return out


def _as_generated(m: dict) -> str:
    """The content of an assistant turn as reasoning families generate it."""
    reasoning, answer = _split_reasoning(m)
    if not reasoning.strip():
        return answer
    reasoning, answer = reasoning.strip("\n"), answer.lstrip("\n")
    return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{answer}"


class _Renderer:
    def __init__(self, tokenizer, chat_template_kwargs: dict[str, Any] | None):
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})

    @property
    def thinking_off(self) -> bool:
        return self.kwargs.get("enable_thinking") is False

    def text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        # Nothing before a conversation's first message: a template's rendering of [] (often
        # just bos or nothing) is not something the target is ever shown.
        if not messages:
            return ""
        from jinja2.exceptions import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **self.kwargs)
        except TemplateError as e:
            raise RenderReject("template_error", f"chat template refused the conversation: {e}") from None

    def ids(self, text: str) -> list[int]:
        # Chat templates write their own special tokens (bos, headers); letting the
        # tokenizer add more would double them.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


@dataclass
class _Turn:
    number: int          # 1-based among the conversation's assistant turns
    ids: list[int]       # the conversation through this turn, as the target generates it
    start: int           # [start, end): the mask span in ids
    end: int


def _turn(r: _Renderer, messages: list[dict], i: int, number: int, specials: set[int]) -> _Turn:
    """Assistant message i rendered as the turn being generated, with its mask span."""
    m = messages[i]
    hist = r.text(messages[:i], add_generation_prompt=False)
    prev = r.text(messages[:i], add_generation_prompt=True) if i else ""
    probe = r.text(messages[:i] + [{"role": "assistant", "content": _PROBE}], add_generation_prompt=False)
    if not probe.startswith(hist) or probe.count(_PROBE) != 1:
        raise RenderReject(
            "template_hides_content",
            f"chat template does not write assistant message {i}'s content once, verbatim, after the "
            "messages before it, so its tokens cannot be located; give the target a template that renders "
            "message content as is")
    at = probe.index(_PROBE)
    header, suffix = probe[len(hist):at], probe[at + len(_PROBE):]

    reasoning, _ = _split_reasoning(m)
    cur = r.text(messages[: i + 1], add_generation_prompt=False)
    turn_text = None
    # The template's own rendering of the turn, when it continues the generation prompt and
    # keeps the reasoning: its form is the target's.
    if cur.startswith(prev) and (not reasoning.strip() or reasoning.strip() in cur[len(prev):]):
        turn_text = cur[len(prev):]
    else:
        rebuilt = hist + header + _as_generated(m) + suffix
        if rebuilt.startswith(prev):
            turn_text = rebuilt[len(prev):]
    if turn_text is None:
        gen_prompt = prev[len(hist):] if prev.startswith(hist) else prev
        shown = cur[len(hist):] if cur.startswith(hist) else cur
        raise RenderReject(
            "template_rewrites_turn",
            f"chat template's generation prompt for assistant message {i} ends in {gen_prompt[-40:]!r}, but the "
            f"turn it renders ({shown[:60]!r}...) does not continue it, even with the message's reasoning "
            f"written as <think>...</think> (reasoning given: {bool(reasoning.strip())}): the target never "
            "generates this turn from that prompt; regenerate the responses with the target or fix the template")

    prev_ids = r.ids(prev)
    ids = r.ids(prev + turn_text)
    if prev == hist:
        # The template ignores add_generation_prompt: the turn's header is rendered inside it
        # and is not generated text.
        start = _common_prefix_len(r.ids(prev + header), ids) if header.strip() else len(prev_ids)
    elif ids[: len(prev_ids)] == prev_ids:
        start = len(prev_ids)
    else:
        raise RenderReject(
            "token_boundary",
            f"the tokenizer merges the end of the generation prompt before assistant message {i} with the "
            "turn's first characters, so the prompt's tokens are not a prefix of the turn's; the target is "
            "served the prompt tokenized alone, so this turn cannot be trained as it is served")
    end = len(ids)
    if suffix:
        # Aligning from the end tolerates a content token that merged with the suffix's
        # first characters: that token stays in the mask rather than dropping content.
        suffix_ids = r.ids(suffix)
        common = min(_common_suffix_len(suffix_ids, ids[start:]), len(suffix_ids))
        end = len(ids) - common + _end_of_turn_len(r.tokenizer, suffix_ids[len(suffix_ids) - common:], specials)
    return _Turn(number, ids, start, end)


def _end_of_turn_len(tokenizer, suffix_ids: list[int], specials: set[int]) -> int:
    """How many leading suffix tokens belong in the mask: through the end-of-turn special
    token when the template puts one right after the content (whitespace aside), since the
    draft must learn to predict it; the separator text after it is never generated."""
    for k, t in enumerate(suffix_ids):
        if t in specials:
            return k + 1
        if tokenizer.decode([t]).strip():
            return 0
    return 0


def _too_long(n: int, max_length: int) -> RenderReject:
    return RenderReject("too_long", f"{n} tokens > prepare.max_length={max_length}")


def _all_tokens(r: _Renderer, messages: list[dict], max_length: int | None, over_length: OverLength) -> Rendered:
    """assistant_only_loss=False: the whole conversation, every token in the loss."""
    ids = r.ids(r.text(messages, add_generation_prompt=False))
    ends = [k + 1 for k, m in enumerate(messages) if m["role"] == "assistant"]
    cut = 0
    if max_length is not None and len(ids) > max_length:
        if over_length == "reject" or not ends:
            raise _too_long(len(ids), max_length)
        for kept in range(len(ends), 0, -1):
            ids = r.ids(r.text(messages[: ends[kept - 1]], add_generation_prompt=False))
            if len(ids) <= max_length:
                cut = len(ends) - kept
                break
        else:
            raise RenderReject("too_long", f"the first assistant turn ends at {len(ids)} tokens > "
                                           f"prepare.max_length={max_length}; no whole turn fits")
    return Rendered([Sample("", ids, [1] * len(ids))], len(ends), cut)


def render_conversation(tokenizer, messages: list[dict], *, max_length: int | None = None,
                        over_length: OverLength = "truncate", assistant_only_loss: bool = True,
                        chat_template_kwargs: dict[str, Any] | None = None) -> Rendered:
    """The training samples of one conversation (see the module docstring for how turns are
    rendered and grouped). Raises RenderReject.

    over_length, when a sample would exceed max_length tokens: 'truncate' keeps every
    assistant turn whose sample fits and leaves out the rest (for a prefix-stable template
    that is the conversation cut after the last whole assistant turn that fits; a turn is
    never cut inside), rejecting only when none fits; 'reject' rejects the conversation.
    chat_template_kwargs go to the template as the target is served with them
    (e.g. {"enable_thinking": False}).
    """
    r = _Renderer(tokenizer, chat_template_kwargs)
    if r.thinking_off:
        messages = [_without_reasoning(m) if m["role"] == "assistant" else m for m in messages]
    if not assistant_only_loss:
        return _all_tokens(r, messages, max_length, over_length)
    positions = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not positions:
        raise RenderReject("no_assistant_turn", "0 loss tokens (no assistant content to learn from)")
    specials = _special_ids(tokenizer)
    turns = [_turn(r, messages, i, n, specials) for n, i in enumerate(positions, 1)]

    longest = max(len(t.ids) for t in turns)
    cut = 0
    if max_length is not None and longest > max_length:
        if over_length == "reject":
            raise _too_long(longest, max_length)
        kept = [t for t in turns if len(t.ids) <= max_length]
        if not kept:
            raise RenderReject("too_long", f"the first assistant turn ends at {len(turns[0].ids)} tokens > "
                                           f"prepare.max_length={max_length}; no whole turn fits")
        cut, turns = len(turns) - len(kept), kept

    # Groups: the whole conversation's rendering first (every turn fits in it when the
    # template is prefix-stable), then one per turn that fits in none before it. Later turns
    # seed groups first, so an earlier turn joins the longest sample it is a prefix of.
    whole = r.ids(r.text(messages, add_generation_prompt=False))
    groups: list[tuple[list[int], list[_Turn]]] = [(whole, [])]
    for t in reversed(turns):
        n = len(t.ids)
        for ids, members in groups:
            # The last token first: most groups differ there, and the slice copy is avoided.
            if len(ids) >= n and ids[n - 1] == t.ids[-1] and ids[:n] == t.ids:
                members.append(t)
                break
        else:
            groups.append((t.ids, [t]))
    groups = sorted(((ids, members) for ids, members in groups if members), key=lambda g: g[1][0].number)
    samples = []
    for ids, members in groups:
        ids = ids[: max(len(t.ids) for t in members)]
        mask = [0] * len(ids)
        for t in members:
            mask[t.start:t.end] = [1] * (t.end - t.start)
        suffix = f"#t{members[0].number}" if len(groups) > 1 else ""
        samples.append(Sample(suffix, ids, mask))
    return Rendered(samples, len(positions), cut)


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int | None = None,
                          assistant_only_loss: bool = True,
                          chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation that is one sample: `render_conversation` with
    over_length='reject'. Raises RenderReject (a ValueError) when the conversation is too long,
    cannot be rendered, or needs several samples because the template rewrites earlier turns
    (then call render_conversation, which returns them all)."""
    out = render_conversation(tokenizer, messages, max_length=max_length, over_length="reject",
                              assistant_only_loss=assistant_only_loss, chat_template_kwargs=chat_template_kwargs)
    if len(out.samples) != 1:
        raise RenderReject("several_samples",
                           "the chat template is not prefix-stable: it renders earlier assistant turns "
                           f"differently once later turns follow, so this conversation is {len(out.samples)} samples "
                           f"({[s.id_suffix for s in out.samples]}); use render_conversation")
    return out.samples[0].input_ids, out.samples[0].loss_mask


def prompt_ids(tokenizer, messages: list[dict], chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of `messages` ending in the template's generation prompt: what the target is
    given before it writes the next assistant turn."""
    r = _Renderer(tokenizer, chat_template_kwargs)
    if r.thinking_off:
        messages = [_without_reasoning(m) if m["role"] == "assistant" else m for m in messages]
    return r.ids(r.text(messages, add_generation_prompt=True))


def eval_prompt(tokenizer, messages: list[dict], chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of the conversation up to its first assistant turn, ending in the template's
    generation prompt: what the target sees before it answers."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return prompt_ids(tokenizer, messages[:first], chat_template_kwargs)

"""Chat templates -> token ids and the assistant-only loss mask.

Owns: rendering a conversation with the target's own chat template, and locating each
assistant turn's tokens in it. Does not own: reading records (`eagle3.conversations`),
writing files or the stage's counts (`eagle3.prepare`).

The loss mask is found by incremental rendering, which needs no `{% generation %}`
markers in the template: the tokens that messages[:i] + generation prompt and
messages[:i+1] do not share are assistant turn i. This only holds when the template is
prefix-stable (rendering more messages never changes the tokens of earlier ones); a
sample whose template breaks that is rejected with the reason, never guessed at.
"""

from __future__ import annotations

# Stands in for an assistant message's content so that the template's own header and
# end-of-turn text around the content can be read off the rendered string.
_PROBE = "EAGLE3PROBECONTENT"


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


class _Renderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not messages:
            return ""
        from jinja2.exceptions import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise ValueError(f"chat template refused the conversation: {e}") from None

    def ids(self, text: str) -> list[int]:
        # Chat templates write their own special tokens (bos, headers); letting the
        # tokenizer add more would double them.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _assistant_span(r: _Renderer, messages: list[dict], i: int, input_ids: list[int],
                    specials: set[int]) -> tuple[int, int]:
    """[start, end) of assistant message i's content (+ end-of-turn token) in input_ids."""
    prev_text = r.text(messages[:i], add_generation_prompt=True)
    cur_text = r.text(messages[: i + 1], add_generation_prompt=False)
    prev_ids, cur_ids = r.ids(prev_text), r.ids(cur_text)
    if cur_ids != input_ids[: len(cur_ids)] or prev_ids != cur_ids[: len(prev_ids)]:
        which = ("messages[:{i}] + generation prompt is not a prefix of messages[:{j}]"
                 if prev_ids != cur_ids[: len(prev_ids)] else "messages[:{j}] is not a prefix of the whole conversation")
        raise ValueError(
            f"chat template is not prefix-stable at message {i} (assistant): the token list of "
            f"{which.format(i=i, j=i + 1)}, so the assistant tokens cannot be located; "
            "use a template whose earlier turns render the same whatever follows, or prepare with "
            "assistant_only_loss=false"
        )

    probe_text = r.text(messages[:i] + [{"role": "assistant", "content": _PROBE}], add_generation_prompt=False)
    if not probe_text.startswith(prev_text) or probe_text.count(_PROBE) != 1:
        raise ValueError(
            f"chat template renders assistant message {i} so that its content cannot be located: "
            "messages[:i] + generation prompt is not a text prefix of messages[:i] + an assistant message"
        )
    at = probe_text.index(_PROBE)
    header, suffix = probe_text[len(prev_text):at], probe_text[at + len(_PROBE):]

    start = len(prev_ids)
    # A template that ignores add_generation_prompt (or emits only part of the header
    # there) renders the rest of the header inside the turn; it must not be trained on.
    if header.strip():
        start = max(start, _common_prefix_len(r.ids(prev_text + header), cur_ids))
    end = len(cur_ids)
    if suffix:
        # Aligning from the end tolerates a content token that merged with the suffix's
        # first characters: that token stays in the mask rather than dropping content.
        suffix_ids = r.ids(suffix)
        common = min(_common_suffix_len(suffix_ids, cur_ids[start:]), len(suffix_ids))
        aligned = suffix_ids[len(suffix_ids) - common:]
        end = len(cur_ids) - common + _end_of_turn_len(r.tokenizer, aligned, specials)
    return start, end


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


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int | None = None,
                          assistant_only_loss: bool = True) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation rendered with the tokenizer's chat template.

    loss_mask is 1 on the tokens of every assistant message's content and on the
    end-of-turn token the template writes right after it, 0 on role headers and on
    system/user text. Raises ValueError (the caller rejects the sample) when the sample
    has more than max_length tokens or the template is not prefix-stable.
    """
    r = _Renderer(tokenizer)
    input_ids = r.ids(r.text(messages, add_generation_prompt=False))
    if max_length is not None and len(input_ids) > max_length:
        raise ValueError(f"{len(input_ids)} tokens > prepare.max_length={max_length}")
    if not assistant_only_loss:
        return input_ids, [1] * len(input_ids)
    mask = [0] * len(input_ids)
    specials = _special_ids(tokenizer)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, end = _assistant_span(r, messages, i, input_ids, specials)
            mask[start:end] = [1] * (end - start)
    return input_ids, mask


def eval_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation up to its first assistant turn, ending in the template's
    generation prompt: what the target sees before it answers."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    r = _Renderer(tokenizer)
    return r.ids(r.text(messages[:first], add_generation_prompt=True))

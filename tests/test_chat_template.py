"""Assistant masks for templates that keep, rewrite or strip earlier turns (tests/templates.py):
every masked token is what the target writes in that turn, and the tokens before it are the
prompt the target is served for that turn."""

from __future__ import annotations

import typing

import pytest
from templates import FAMILIES, LLAMA3_LIKE, make_tokenizer, spans

from eagle3 import tiny
from eagle3.prepare.chat_template import TEMPLATES, RenderReject, prompt_ids, render_conversation, tokenize_conversation
from eagle3.config import TinyChatTemplate

SYSTEM = {"role": "system", "content": "You are a concise assistant."}


def conversation(num_turns: int, reasoning: str | None) -> list[dict]:
    """system, then num_turns (user, assistant) pairs. reasoning: None, 'field'
    (reasoning_content) or 'content' (a <think> block opening the content)."""
    conv = [SYSTEM]
    for k in range(num_turns):
        conv.append({"role": "user", "content": f"Tell me something about rivers, part {k}."})
        answer = f"The Danube crosses ten countries. Also, {20 + k} plus 71 is {91 + k}."
        thought = f"Let me think: part {k} asks about rivers."
        if reasoning == "field":
            conv.append({"role": "assistant", "content": answer, "reasoning_content": thought})
        elif reasoning == "content":
            conv.append({"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"})
        else:
            conv.append({"role": "assistant", "content": answer})
    return conv


def truth(m: dict) -> tuple[str, str]:
    """(reasoning, answer) the record means, whichever way it carries them."""
    if "</think>" in m["content"]:
        head, answer = m["content"].split("</think>\n\n")
        return head.removeprefix("<think>\n").removesuffix("\n"), answer
    return m.get("reasoning_content", ""), m["content"]


def trained_turns(tok, rendered) -> list[tuple[str, list[int], list[int]]]:
    """(masked text, tokens before it, the sample's ids) per masked span, samples in order."""
    return [(tok.decode(s.input_ids[a:b]), s.input_ids[:a], s.input_ids)
            for s in rendered.samples for a, b in spans(s.loss_mask)]


_TOKENIZERS: dict[str, object] = {}


def tokenizer_for(family) -> object:
    if family.name not in _TOKENIZERS:
        _TOKENIZERS[family.name] = make_tokenizer(family.template)
    return _TOKENIZERS[family.name]


# (family, the reasoning forms it is tested with, whether it rewrites earlier turns: one sample per turn)
CASES = [
    ("llama3", [None, "content"], False),
    ("qwen3-thinking", [None, "field", "content"], True),
    ("qwen3-no-thinking", [None, "field", "content"], True),
    ("deepseek-r1", ["field", "content"], True),
    ("harmony", [None, "field"], True),
]


@pytest.mark.parametrize("num_turns", [1, 2, 5])
@pytest.mark.parametrize("family,reasoning,rewrites",
                         [(f, r, w) for f, forms, w in CASES for r in forms],
                         ids=[f"{f}-{r or 'plain'}" for f, forms, _ in CASES for r in forms])
def test_mask_is_each_turn_as_the_target_writes_it_after_its_served_prompt(family, reasoning, rewrites, num_turns):
    fam = FAMILIES[family]
    tok = tokenizer_for(fam)
    conv = conversation(num_turns, reasoning)
    out = render_conversation(tok, conv, max_length=None, chat_template_kwargs=fam.kwargs)

    assistant_at = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    turns = trained_turns(tok, out)
    assert [text for text, _, _ in turns] == [fam.generated(*truth(conv[i])) for i in assistant_at]
    # What precedes each trained turn is exactly the prompt the target is served for it.
    for (_, before, _), i in zip(turns, assistant_at):
        assert before == prompt_ids(tok, conv[:i], fam.kwargs)
    for s in out.samples:
        masked = tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if m])
        assert "rivers, part" not in masked and SYSTEM["content"] not in masked

    want = num_turns if rewrites else 1
    assert len(out.samples) == want and out.num_turns == num_turns and out.num_turns_cut == 0
    suffixes = [s.id_suffix for s in out.samples]
    assert suffixes == ([""] if want == 1 else [f"#t{k}" for k in range(1, num_turns + 1)])


def test_unmasked_tokens_hold_every_header_and_user_text_prefix_stable():
    fam = FAMILIES["llama3"]
    tok = tokenizer_for(fam)
    conv = conversation(5, None)
    [s] = render_conversation(tok, conv).samples
    unmasked = tok.decode([t for t, m in zip(s.input_ids, s.loss_mask) if not m])
    assert unmasked.count("<|head|>assistant<|/head|>\n\n") == 5 and unmasked.count("<|head|>user<|/head|>") == 5
    assert all(m["content"] in unmasked for m in conv if m["role"] != "assistant")
    assert not any(m["content"] in unmasked for m in conv if m["role"] == "assistant")
    # One sample: the conversation's own rendering, as before turns were rendered one by one.
    assert s.input_ids == tok.apply_chat_template(conv, tokenize=True)["input_ids"]


def test_reasoning_free_turn_for_a_template_that_opens_reasoning_in_its_prompt_is_a_named_reject():
    fam = FAMILIES["deepseek-r1"]
    tok = tokenizer_for(fam)
    with pytest.raises(RenderReject, match=r"generation prompt for assistant message 2 ends in '<\|Assistant\|><think>\\n'"
                                           r".*does not continue it.*reasoning given: False") as e:
        render_conversation(tok, conversation(2, None))
    assert e.value.kind == "template_rewrites_turn"


def test_reasoning_a_template_ignores_is_kept_in_the_think_form():
    # A Llama-3-like template does not render reasoning_content: the turn being trained is
    # written with it as <think> ... </think>, and the history shows the answer alone, so
    # each turn is its own sample.
    fam = FAMILIES["llama3"]
    tok = tokenizer_for(fam)
    conv = conversation(2, "field")
    out = render_conversation(tok, conv)
    assert [t for t, _, _ in trained_turns(tok, out)] == [fam.generated(*truth(conv[i])) for i in (2, 4)]
    assert [s.id_suffix for s in out.samples] == ["#t1", "#t2"]
    assert "Let me think: part 0" not in tok.decode(out.samples[1].input_ids)


def lengths(tok, fam, conv) -> list[int]:
    """Tokens through each assistant turn, as that turn is trained, turn by turn."""
    out = []
    for i, m in enumerate(conv):
        if m["role"] == "assistant":
            out.append(len(render_conversation(tok, conv[: i + 1], chat_template_kwargs=fam.kwargs).samples[-1].input_ids))
    return out


@pytest.mark.parametrize("family", ["llama3", "qwen3-thinking"])
def test_truncate_keeps_the_whole_turns_that_fit_and_reject_rejects(family):
    fam = FAMILIES[family]
    tok = tokenizer_for(fam)
    conv = conversation(5, None)
    ends = lengths(tok, fam, conv)
    assert ends == sorted(ends) and len(set(ends)) == 5
    limit = ends[2] + 1  # turns 1..3 fit, turn 4 does not
    full = render_conversation(tok, conv, chat_template_kwargs=fam.kwargs)
    cut = render_conversation(tok, conv, max_length=limit, over_length="truncate", chat_template_kwargs=fam.kwargs)

    assert cut.num_turns == 5 and cut.num_turns_cut == 2
    assert all(len(s.input_ids) <= limit for s in cut.samples)
    assert [t for t, _, _ in trained_turns(tok, cut)] == [t for t, _, _ in trained_turns(tok, full)][:3]
    if family == "llama3":
        # The conversation cut after turn 3: a prefix of the whole sample, its mask likewise.
        [s], [whole] = cut.samples, full.samples
        assert len(s.input_ids) == ends[2] and s.input_ids == whole.input_ids[: ends[2]]
        assert s.loss_mask == whole.loss_mask[: ends[2]] and s.id_suffix == ""
    else:
        assert [s.id_suffix for s in cut.samples] == ["#t1", "#t2", "#t3"]
        assert [s.input_ids for s in cut.samples] == [s.input_ids for s in full.samples][:3]

    with pytest.raises(RenderReject, match=rf"^{ends[4]} tokens > prepare.max_length={limit}$") as e:
        render_conversation(tok, conv, max_length=limit, over_length="reject", chat_template_kwargs=fam.kwargs)
    assert e.value.kind == "too_long"
    with pytest.raises(RenderReject, match=rf"first assistant turn ends at {ends[0]} tokens > prepare.max_length=8") as e:
        render_conversation(tok, conv, max_length=8, chat_template_kwargs=fam.kwargs)
    assert e.value.kind == "too_long"


def test_all_token_loss_truncates_at_a_turn_end():
    tok = tokenizer_for(FAMILIES["llama3"])
    conv = conversation(5, None)
    ends = lengths(tok, FAMILIES["llama3"], conv)
    out = render_conversation(tok, conv + [{"role": "user", "content": "Thanks."}], max_length=ends[1] + 3,
                              assistant_only_loss=False)
    [s] = out.samples
    assert s.loss_mask == [1] * ends[1] and out.num_turns_cut == 3
    assert tok.decode(s.input_ids).endswith("71 is 92.<|eot|>")


def test_samples_are_the_same_on_every_run():
    fam = FAMILIES["harmony"]
    tok = tokenizer_for(fam)
    conv = conversation(5, "field")
    a, b = render_conversation(tok, conv), render_conversation(tok, [dict(m) for m in conv])
    assert a == b and len({s.id_suffix for s in a.samples}) == 5


def test_templates_that_cannot_be_handled_are_rejects_that_name_the_behaviour():
    tok = make_tokenizer(LLAMA3_LIKE)
    conv = conversation(2, None)
    tok.chat_template = LLAMA3_LIKE.template.replace("m['content']", "(m['content'] | lower)")
    with pytest.raises(RenderReject, match="does not write assistant message 2's content once, verbatim") as e:
        render_conversation(tok, conv)
    assert e.value.kind == "template_hides_content"

    # The generation prompt names another role than the turns it renders.
    tok.chat_template = LLAMA3_LIKE.template.replace("'<|head|>assistant<|/head|>", "'<|head|>model<|/head|>")
    with pytest.raises(RenderReject, match=r"ends in '<\|head\|>model<\|/head\|>\\n\\n'.*does not continue it") as e:
        render_conversation(tok, conv)
    assert e.value.kind == "template_rewrites_turn"

    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(RenderReject, match="chat template refused the conversation: no system role") as e:
        render_conversation(tok, conv)
    assert e.value.kind == "template_error"

    with pytest.raises(RenderReject, match=r"0 loss tokens") as e:
        render_conversation(make_tokenizer(LLAMA3_LIKE), conv[:2])
    assert e.value.kind == "no_assistant_turn"


def test_tokenize_conversation_keeps_one_sample_conversations_and_points_to_the_successor():
    fam = FAMILIES["qwen3-thinking"]
    tok = tokenizer_for(fam)
    one = conversation(1, "field")
    ids, mask = tokenize_conversation(tok, one, 512, True, fam.kwargs)
    [s] = render_conversation(tok, one, chat_template_kwargs=fam.kwargs).samples
    assert (ids, mask) == (s.input_ids, s.loss_mask)
    with pytest.raises(RenderReject, match=r"is 2 samples \(\['#t1', '#t2'\]\); use render_conversation"):
        tokenize_conversation(tok, conversation(2, "field"), 512, True, fam.kwargs)


def test_templates_a_target_is_built_with():
    q = TEMPLATES["qwen3"]
    tok = make_tokenizer(q)
    assert all(len(tok(t, add_special_tokens=False)["input_ids"]) == 1 for t in q.special_tokens + q.added_tokens)
    conv = conversation(2, None)
    assert tok.decode(prompt_ids(tok, conv[:2])).endswith("<|im_start|>assistant\n")
    assert tok.decode(prompt_ids(tok, conv[:2], {"enable_thinking": False})).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # The job config names these templates for the tiny target (target.tiny_chat_template).
    assert sorted(typing.get_args(TinyChatTemplate)) == sorted(TEMPLATES)
    assert q.tokenizer_kwargs()["bos_token"] is None and q.tokenizer_kwargs()["eos_token"] == "<|im_end|>"


def test_tiny_target_tokenizer_with_the_qwen3_like_template(tmp_path):
    """The tiny target's tokenizer built with the Qwen3-like template: turns render as ChatML
    and end in <|im_end|>, its eos."""
    from transformers import AutoTokenizer

    out = tiny.build_tokenizer(["hello there", "how are you"] * 20, tmp_path, 300,
                               **TEMPLATES["qwen3"].tokenizer_kwargs())
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.eos_token == "<|im_end|>" == out.eos_token
    conv = conversation(2, None)
    text = loaded.apply_chat_template(conv, tokenize=False)
    assert text.count("<|im_start|>assistant") == 2 and text.endswith("<|im_end|>\n")



def test_prepare_trains_every_turn_of_a_qwen3_like_target_and_counts_cuts_and_rejects(tmp_path):
    import json

    from eagle3.config import PrepareConfig
    from eagle3.prepare.tokens import prepare_dataset, read_tokens

    fam = FAMILIES["qwen3-thinking"]
    tok = make_tokenizer(fam.template)
    tok.save_pretrained(tmp_path / "tok")
    five = conversation(5, "field")
    ends = lengths(tok, fam, five)
    records = [{"id": "held", "messages": conversation(2, None)},   # the eval prompt
               {"id": "three", "messages": conversation(3, "content")},
               {"id": "five", "messages": five},                   # turns 4 and 5 do not fit
               {"id": "question", "messages": five[:2]},           # no assistant turn
               {"id": "huge", "messages": [five[1], {"role": "assistant", "content": "rivers " * 300}]}]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = PrepareConfig(conversations=str(src), max_length=ends[2], num_eval_prompts=1,
                        chat_template_kwargs=fam.kwargs)
    summary = prepare_dataset(cfg, str(tmp_path / "tok"), str(tmp_path / "out"))

    rows = read_tokens(tmp_path / "out").to_pylist()
    assert [r["sample_id"] for r in rows] == ["three#t1", "three#t2", "three#t3", "five#t1", "five#t2", "five#t3"]
    # Written as render_conversation renders them (whose masks the tests above check).
    by_id = {r["sample_id"]: r for r in rows}
    whole = render_conversation(tok, five, chat_template_kwargs=fam.kwargs).samples
    for k in range(3):
        assert (by_id[f"five#t{k + 1}"]["input_ids"], by_id[f"five#t{k + 1}"]["loss_mask"]) == \
            (whole[k].input_ids, whole[k].loss_mask)
    [held] = [json.loads(x) for x in (tmp_path / "out" / "eval_prompts.jsonl").read_text().splitlines()]
    assert held == {"sample_id": "held", "prompt_token_ids": prompt_ids(tok, records[0]["messages"][:2])}
    assert summary["num_records"] == 5 and summary["num_conversations"] == 2 and summary["num_samples"] == 6
    # Counted over the good records, the held-out one included (its 2 turns are 2 samples too).
    assert summary["num_truncated"] == 1 and summary["num_turns_cut"] == 2 and summary["num_split"] == 3
    assert summary["num_rejected_by_reason"] == {"no_assistant_turn": 1, "too_long": 1}

    rejected = prepare_dataset(PrepareConfig(conversations=str(src), max_length=ends[2], num_eval_prompts=1,
                                             over_length="reject", chat_template_kwargs=fam.kwargs),
                               str(tmp_path / "tok"), str(tmp_path / "out2"))
    assert [r["sample_id"] for r in read_tokens(tmp_path / "out2").to_pylist()] == ["three#t1", "three#t2", "three#t3"]
    assert rejected["num_truncated"] == 0 and rejected["num_rejected_by_reason"] == {"no_assistant_turn": 1,
                                                                                       "too_long": 2}

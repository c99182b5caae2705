"""Conversation sources: files of chat records -> (sample_id, messages), with reasons for rejects.

Owns: reading OpenAI `messages` and ShareGPT `conversations` records, normalising roles to
system/user/assistant, sample ids, and the reason a record is unusable. Does not own:
rendering or masks (`eagle3.chat_template`), writing tokens (`eagle3.prepare`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class Record:
    sample_id: str | None
    messages: list[dict] | None
    source: str
    line: int
    reason: str | None = None

    def reject(self, reason: str) -> dict:
        return {"sample_id": self.sample_id, "source": self.source, "line": self.line, "reason": reason}


def _jsonl_files(path: str | Path) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(".jsonl"))
        if not files:
            raise ValueError(f"prepare.conversations={str(path)!r} is a directory without *.jsonl files; "
                             "point it at a JSONL file or a directory that holds some")
        return files
    if not p.is_file():
        raise ValueError(f"prepare.conversations={str(path)!r} does not exist; "
                         "give a JSONL file or a directory of *.jsonl files")
    return [p]


def _parse_messages(rec: dict) -> list[dict] | str:
    """Normalised [{"role", "content"}] list, or the reason the record is unusable."""
    if "messages" in rec:
        raw, key, role_key, content_key, roles = rec["messages"], "messages", "role", "content", {r: r for r in ROLES}
    elif "conversations" in rec:
        raw, key, role_key, content_key, roles = rec["conversations"], "conversations", "from", "value", SHAREGPT_ROLES
    else:
        return f"no 'messages' (OpenAI) or 'conversations' (ShareGPT) list; found keys {sorted(rec)}"
    if not isinstance(raw, list) or not raw:
        return f"'{key}' must be a non-empty list, found {raw!r:.80}"
    out = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict):
            return f"{key}[{j}] must be an object, found {type(m).__name__}"
        if role_key not in m or content_key not in m:
            return f"{key}[{j}] needs keys '{role_key}' and '{content_key}', found {sorted(m)}"
        role, content = m[role_key], m[content_key]
        if role not in roles:
            return f"{key}[{j}] has unknown {role_key} {role!r}; expected one of {sorted(roles)}"
        if not isinstance(content, str):
            return f"{key}[{j}] {content_key} must be a string, found {type(content).__name__}"
        out.append({"role": roles[role], "content": content})
    return out


def _sample_id(rec: dict, default: str) -> str | None:
    if "id" not in rec or rec["id"] is None:
        return default
    rid = rec["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        return None
    return str(rid)


def iter_records(path: str | Path, max_records: int | None = None) -> Iterator[Record]:
    """Every non-blank line as a record, good or not, in file order; at most max_records."""
    seen: dict[str, str] = {}
    count = 0
    for f in _jsonl_files(path):
        with open(f, "rb") as fh:
            for line_no, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                if max_records is not None and count >= max_records:
                    return
                count += 1
                source = f"{f.name}:{line_no}"
                fallback_id = f"{f.stem}-{line_no}"
                try:
                    rec = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    yield Record(None, None, source, line_no, f"line {line_no}: not UTF-8 ({e})")
                    continue
                except json.JSONDecodeError as e:
                    yield Record(None, None, source, line_no, f"line {line_no}: invalid JSON ({e})")
                    continue
                if not isinstance(rec, dict):
                    yield Record(None, None, source, line_no,
                                  f"line {line_no}: expected a JSON object, found {type(rec).__name__}")
                    continue
                sample_id = _sample_id(rec, fallback_id)
                if sample_id is None:
                    yield Record(None, None, source, line_no,
                                  f"line {line_no}: 'id' must be a non-empty string or an integer, found {rec['id']!r}")
                    continue
                messages = _parse_messages(rec)
                if isinstance(messages, str):
                    yield Record(sample_id, None, source, line_no, f"line {line_no}: {messages}")
                    continue
                if sample_id in seen:
                    yield Record(sample_id, None, source, line_no,
                                  f"line {line_no}: duplicate sample id {sample_id!r}, first seen at {seen[sample_id]}")
                    continue
                seen[sample_id] = source
                yield Record(sample_id, messages, source, line_no)


def load_conversations(path: str | Path, rejects: list[dict] | None = None,
                       max_records: int | None = None) -> Iterator[tuple[str, list[dict]]]:
    """Yield (sample_id, messages) for every usable record of a JSONL file or directory.

    A bad record does not stop the read: it is appended to `rejects` as
    {"sample_id", "source", "line", "reason"} (or logged as a warning when no list is
    given), so one broken line in a million does not cost the whole dataset.
    `max_records` counts records read, good or bad, so the same setting always covers
    the same lines of the file.
    """
    for r in iter_records(path, max_records):
        if r.reason is None:
            yield r.sample_id, r.messages
        elif rejects is not None:
            rejects.append(r.reject(r.reason))
        else:
            log.warning("rejected %s: %s", r.source, r.reason)

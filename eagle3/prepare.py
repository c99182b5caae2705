"""Prepare stage: conversations (JSONL) -> chat template -> input_ids + loss_mask (Arrow).

Owns: reading OpenAI `messages` and ShareGPT `conversations` records, the loss mask over
assistant turns, the rejects file, and writing `tokens.parquet` under `TOKENS_SCHEMA`.
Does not own: the schema itself (`eagle3.schema`), the tokenizer or its chat template
(they come from the target's directory), provenance files (the driver writes them).

The loss mask is found by incremental rendering, which needs no `{% generation %}`
markers in the template: the tokens that messages[:i] + generation prompt and
messages[:i+1] do not share are assistant turn i. This only holds when the template is
prefix-stable (rendering more messages never changes the tokens of earlier ones); a
sample whose template breaks that is rejected with the reason, never guessed at.

Imports neither torch nor transformers at module level: drivers import this module
before deciding where the work runs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.config import PrepareConfig
from eagle3.schema import TOKENS_SCHEMA, check_schema

log = logging.getLogger(__name__)

TOKENS_FILE = "tokens.parquet"
REJECTS_FILE = "rejects.jsonl"
EVAL_PROMPTS_FILE = "eval_prompts.jsonl"

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}

# Stands in for an assistant message's content so that the template's own header and
# end-of-turn text around the content can be read off the rendered string.
_PROBE = "EAGLE3PROBECONTENT"

_WRITE_BATCH_ROWS = 1024


@dataclass(frozen=True)
class _Record:
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


def _iter_records(path: str | Path, max_records: int | None = None) -> Iterator[_Record]:
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
                    yield _Record(None, None, source, line_no, f"line {line_no}: not UTF-8 ({e})")
                    continue
                except json.JSONDecodeError as e:
                    yield _Record(None, None, source, line_no, f"line {line_no}: invalid JSON ({e})")
                    continue
                if not isinstance(rec, dict):
                    yield _Record(None, None, source, line_no,
                                  f"line {line_no}: expected a JSON object, found {type(rec).__name__}")
                    continue
                sample_id = _sample_id(rec, fallback_id)
                if sample_id is None:
                    yield _Record(None, None, source, line_no,
                                  f"line {line_no}: 'id' must be a non-empty string or an integer, found {rec['id']!r}")
                    continue
                messages = _parse_messages(rec)
                if isinstance(messages, str):
                    yield _Record(sample_id, None, source, line_no, f"line {line_no}: {messages}")
                    continue
                if sample_id in seen:
                    yield _Record(sample_id, None, source, line_no,
                                  f"line {line_no}: duplicate sample id {sample_id!r}, first seen at {seen[sample_id]}")
                    continue
                seen[sample_id] = source
                yield _Record(sample_id, messages, source, line_no)


def load_conversations(path: str | Path, rejects: list[dict] | None = None,
                       max_records: int | None = None) -> Iterator[tuple[str, list[dict]]]:
    """Yield (sample_id, messages) for every usable record of a JSONL file or directory.

    A bad record does not stop the read: it is appended to `rejects` as
    {"sample_id", "source", "line", "reason"} (or logged as a warning when no list is
    given), so one broken line in a million does not cost the whole dataset.
    `max_records` counts records read, good or bad, so the same setting always covers
    the same lines of the file.
    """
    for r in _iter_records(path, max_records):
        if r.reason is None:
            yield r.sample_id, r.messages
        elif rejects is not None:
            rejects.append(r.reject(r.reason))
        else:
            log.warning("rejected %s: %s", r.source, r.reason)


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


def _atomic_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


class _TokensWriter:
    """Streams rows to a hidden temporary file; `commit` renames it into place."""

    def __init__(self, final: Path):
        self.final, self.tmp = final, _atomic_path(final)
        self.writer = pq.ParquetWriter(str(self.tmp), TOKENS_SCHEMA)
        self.rows: dict[str, list] = {f.name: [] for f in TOKENS_SCHEMA}

    def add(self, sample_id: str, input_ids: list[int], loss_mask: list[int]) -> None:
        self.rows["sample_id"].append(sample_id)
        self.rows["input_ids"].append(input_ids)
        self.rows["loss_mask"].append(loss_mask)
        self.rows["num_tokens"].append(len(input_ids))
        if len(self.rows["sample_id"]) >= _WRITE_BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.rows["sample_id"]:
            self.writer.write_table(pa.Table.from_pydict(self.rows, schema=TOKENS_SCHEMA))
            self.rows = {k: [] for k in self.rows}

    def commit(self) -> None:
        self.flush()
        self.writer.close()
        os.replace(self.tmp, self.final)

    def abort(self) -> None:
        self.writer.close()
        self.tmp.unlink(missing_ok=True)


def _write_jsonl_atomic(final: Path, rows: list[dict]) -> None:
    tmp = _atomic_path(final)
    with open(tmp, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    os.replace(tmp, final)


def eval_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation up to its first assistant turn, ending in the template's
    generation prompt: what the target sees before it answers."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    r = _Renderer(tokenizer)
    return r.ids(r.text(messages[:first], add_generation_prompt=True))


def read_eval_prompts(out_dir: str | Path) -> list[list[int]]:
    path = Path(out_dir) / EVAL_PROMPTS_FILE
    return [json.loads(line)["prompt_token_ids"] for line in path.read_text().splitlines() if line.strip()]


def prepare_dataset(cfg: PrepareConfig, tokenizer_dir: str, out_dir: str) -> dict[str, Any]:
    """Write out_dir/tokens.parquet (TOKENS_SCHEMA) and out_dir/rejects.jsonl; return counts.

    Over-long samples are rejected rather than truncated: a truncated conversation
    teaches the draft turns that end where the target would not have ended them.
    Both files appear under their final names only once complete.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer in {tokenizer_dir!r} has no chat_template; prepare renders every "
                         "conversation with the target's own template, so use a chat/instruct model's "
                         "tokenizer or add a chat_template to its tokenizer_config.json")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A re-run invalidates the previous output: if this run fails, no stale tokens file
    # should sit next to this run's rejects and pass for its result.
    (out / TOKENS_FILE).unlink(missing_ok=True)

    rejects: list[dict] = []
    eval_prompts: list[dict] = []
    num_samples = num_tokens = num_loss_tokens = max_tokens = 0
    writer = _TokensWriter(out / TOKENS_FILE)
    try:
        for rec in _iter_records(cfg.conversations, cfg.max_samples):
            if rec.reason is not None:
                rejects.append(rec.reject(rec.reason))
                continue
            try:
                input_ids, loss_mask = tokenize_conversation(tokenizer, rec.messages, cfg.max_length,
                                                             cfg.assistant_only_loss)
            except ValueError as e:
                rejects.append(rec.reject(f"line {rec.line}: {e}"))
                continue
            n_loss = sum(loss_mask)
            if n_loss == 0:
                rejects.append(rec.reject(f"line {rec.line}: 0 loss tokens (no assistant content to learn from)"))
                continue
            if len(eval_prompts) < cfg.num_eval_prompts:
                eval_prompts.append({"sample_id": rec.sample_id, "prompt_token_ids": eval_prompt(tokenizer, rec.messages)})
                continue
            writer.add(rec.sample_id, input_ids, loss_mask)
            num_samples += 1
            num_tokens += len(input_ids)
            num_loss_tokens += n_loss
            max_tokens = max(max_tokens, len(input_ids))
        _write_jsonl_atomic(out / REJECTS_FILE, rejects)
        _write_jsonl_atomic(out / EVAL_PROMPTS_FILE, eval_prompts)
        if num_samples == 0:
            first = "; ".join(f"{r['source']}: {r['reason']}" for r in rejects[:3])
            raise ValueError(f"prepare kept 0 samples of {len(rejects)} records from {cfg.conversations!r}; "
                             f"see {out / REJECTS_FILE} (first reasons: {first})")
        writer.commit()
    except BaseException:
        writer.abort()
        raise

    summary = {"num_samples": num_samples, "num_rejected": len(rejects), "num_eval_prompts": len(eval_prompts),
               "num_tokens": num_tokens,
               "num_loss_tokens": num_loss_tokens, "max_tokens": max_tokens}
    log.info("prepare: %s -> %s: %s", cfg.conversations, out / TOKENS_FILE, summary)
    if rejects:
        log.warning("prepare rejected %d records; reasons in %s", len(rejects), out / REJECTS_FILE)
    return summary


def read_tokens(path: str | Path) -> pa.Table:
    """Read a tokens.parquet (or the directory holding one), refusing other schema versions."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENS_FILE
    table = pq.read_table(str(p))
    try:
        check_schema(table.schema, "tokens")
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
    want = [(f.name, f.type) for f in TOKENS_SCHEMA]
    found = [(f.name, f.type) for f in table.schema]
    if found != want:
        raise ValueError(f"{p}: expected columns {want}, found {found}; re-run the prepare stage")
    return table

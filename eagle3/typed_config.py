"""Type checking of the frozen config dataclasses against their own type hints.

Owns: `check_types`, which every config's `__post_init__` calls first, so that a value of the
wrong type is refused with the field's dotted name, the value and the fix before any range
check compares it (`'>' not supported between 'str' and 'int'` named no field), whether the
config came from a file, a `--set` override or Python code; `choices`, the one place a
`Literal` hint's allowed values are read from; and `fail`, the shape of every other refusal.
Does not own: the range and cross-field checks (each config's `__post_init__`) or the
cross-stage limits (`eagle3.config.JobConfig`). Imports neither torch nor vllm.

Hints understood: bool, int, float, str, None, `X | Y`, `Literal[...]`, `tuple[T, ...]`,
`tuple[A, B]`, `list[T]`, `dict[K, V]`, `Any` and nested config dataclasses. A hint outside
these raises TypeError at the first construction, so a new field cannot skip the check.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

# YAML 1.2 (and JSON) read 3e-4 as a float; PyYAML follows YAML 1.1, which wants a dot in the
# mantissa, and hands `lr: 3e-4` over as the string "3e-4". For a field whose hint is float the
# intent is not in doubt, and refusing the most common way of writing a learning rate would
# teach nothing, so such a string is read as the float it spells. Only this spelling is read:
# not "nan", "inf", "1_000" or " 3 ", which float() would also take.
_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")

_hints_cache: dict[type, dict[str, Any]] = {}


def field_hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a config dataclass's fields (strings under
    `from __future__ import annotations`, resolved in the class's module)."""
    if cls not in _hints_cache:
        hints = typing.get_type_hints(cls)
        _hints_cache[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _hints_cache[cls]


def choices(hint: Any) -> tuple:
    """The values a Literal hint allows (also inside `X | None`), in their declared order."""
    if get_origin(hint) is Literal:
        return get_args(hint)
    if _is_union(hint):
        return tuple(c for arg in get_args(hint) for c in (choices(arg) if arg is not type(None) else (None,)))
    raise TypeError(f"{hint!r} is not a Literal")


def fail(section: str, name: str, value: Any, fix: str) -> None:
    """Refuse a config value: ValueError `config section.name=value: fix`, the one shape of every
    range and cross-field error (the stage configs' `__post_init__` and eagle3.config's limits
    across stages)."""
    raise ValueError(f"config {section}.{name}={value!r}: {fix}")


def check_types(obj: Any, section: str) -> None:
    """Check every field of the dataclass instance `obj` against its hint; raise ValueError
    naming `section.field`, the value and the fix. Normalises in place what a file cannot
    spell exactly: a YAML list for a tuple field, an int or a float-spelling string for a float
    field."""
    for name, hint in field_hints(type(obj)).items():
        value = getattr(obj, name)
        where = f"{section}.{name}" if section else name
        try:
            new = _conform(hint, value)
        except _Mismatch as m:
            raise ValueError(f"config {where}={value!r}: {m}") from None
        if new is not value:
            object.__setattr__(obj, name, new)  # frozen: set once, before anyone reads it


class _Mismatch(Exception):
    """A value that does not fit its hint; the message says what was expected and the fix."""


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


def _mismatch(hint: Any, value: Any) -> _Mismatch:
    return _Mismatch(f"expected {_describe(hint)}, found {_kind(value)}; {_fix(hint)}")


def _not_a_choice(hint: Any, value: Any) -> _Mismatch:
    listed = ", ".join("null" if c is None else repr(c) for c in choices(hint))
    return _Mismatch(f"not one of {listed}; write one of those")


def _conform(hint: Any, value: Any) -> Any:
    """The value as stored, or _Mismatch."""
    if hint is Any:
        return value
    if hint is type(None) or hint is None:
        if value is not None:
            raise _mismatch(hint, value)
        return value
    if _is_union(hint):
        args = get_args(hint)
        # An exact match first, so that a string in `str | float` stays a string.
        fits = []
        for arg in args:
            try:
                fits.append(_conform(arg, value))
            except _Mismatch:
                continue
            if fits[-1] is value:
                return value
        if fits:
            return fits[0]
        # A list given for `list[int] | None`: say which item is wrong, not just "a list or null".
        same_kind = [a for a in args if get_origin(a) in (list, tuple) and isinstance(value, (list, tuple))]
        if len(same_kind) == 1:
            return _conform(same_kind[0], value)
        if any(get_origin(a) is Literal for a in args) and all(
                get_origin(a) is Literal or a is type(None) for a in args):
            raise _not_a_choice(hint, value)
        raise _mismatch(hint, value)
    origin = get_origin(hint)
    if origin is Literal:
        # True == 1 in Python: a Literal[0, 1, 2, 3] must not accept True.
        if not any(value == c and type(value) is type(c) for c in get_args(hint)):
            raise _not_a_choice(hint, value)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise _mismatch(hint, value)
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _mismatch(hint, value)
        return value
    if hint is float:
        if isinstance(value, float):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value):
            return float(value)
        raise _mismatch(hint, value)
    if hint is str:
        if not isinstance(value, str):
            raise _mismatch(hint, value)
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise _mismatch(hint, value)
        args = get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise _Mismatch(f"expected {_describe(hint)}, found {len(value)} items")
            item_hints = args
        else:
            item_hints = (args[0] if args else Any,) * len(value)
        items = []
        for i, (h, v) in enumerate(zip(item_hints, value)):
            try:
                items.append(_conform(h, v))
            except _Mismatch as m:
                raise _Mismatch(f"item {i} ({v!r}): {m}") from None
        if isinstance(value, origin) and all(a is b for a, b in zip(items, value)):
            return value
        return origin(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise _mismatch(hint, value)
        key_hint, value_hint = get_args(hint) or (Any, Any)
        for k, v in value.items():
            try:
                _conform(key_hint, k)
                _conform(value_hint, v)
            except _Mismatch as m:
                raise _Mismatch(f"key {k!r}: {m}") from None
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            raise _mismatch(hint, value)
        return value
    raise TypeError(f"eagle3.typed_config cannot check the hint {hint!r}; add it to _conform")


def _describe(hint: Any) -> str:
    if hint is type(None) or hint is None:
        return "null"
    if _is_union(hint):
        return " or ".join(_describe(a) for a in get_args(hint))
    origin = get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join("null" if c is None else repr(c) for c in get_args(hint))
    if origin in (tuple, list):
        args = get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} items ({', '.join(_describe(a) for a in args)})"
        return f"a list (each item {_describe(args[0])})" if args else "a list"
    if origin is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", repr(hint)))


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _fix(hint: Any) -> str:
    args = [a for a in get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    if float in args:
        return "write a number, e.g. 0.0003 or 3.0e-4"
    if int in args:
        return "write a whole number without quotes, e.g. 8192"
    if bool in args:
        return "write true or false without quotes"
    if any(get_origin(a) in (list, tuple) for a in args):
        return "write a YAML list, e.g. [2, 4]"
    if str in args:
        return "quote it, e.g. \"...\""
    return f"write {_describe(hint)}"

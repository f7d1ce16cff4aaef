"""Lossless JSON: the only values taskloop records (inputs, outputs, check results, cache values).

A value is lossless when ``json.loads(dumps(v)) == v`` *and* has the same types: None, bool,
int, finite float other than -0.0, str, list, and dict with str keys, nested. Tuples, sets,
bytes, NaN, datetimes or subclasses would come back different, so they are refused up front
with the path of the offending element. So are the values JSON text cannot carry at all: a str
(or key) with a lone surrogate, which UTF-8 cannot encode, and an int with more digits than
Python converts to text (``sys.get_int_max_str_digits()``, 4300 by default).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

_MAX_DEPTH = 200
LOSSLESS_FIX = "use None, bool, int, finite float, str, list or dict with str keys"


def lossless_problem(value: Any, path: str = "$", depth: int = 0) -> str | None:
    """Return a description of the first non-lossless element, or None when the value is fine."""
    if depth > _MAX_DEPTH:
        return f"{path} is nested deeper than {_MAX_DEPTH} levels (a cycle?)"
    kind = type(value)
    if value is None or kind is bool:
        return None
    if kind is int:
        return _int_problem(value, path)
    if kind is str:
        problem = text_problem(value)
        return None if problem is None else f"{path} {problem}"
    if kind is float:
        if not math.isfinite(value):
            return f"{path} is {value!r}, which JSON cannot hold"
        if value == 0.0 and math.copysign(1.0, value) < 0:
            return f"{path} is -0.0, which JSON turns into 0"
        return None
    if kind is list:
        for i, item in enumerate(value):
            problem = lossless_problem(item, f"{path}[{i}]", depth + 1)
            if problem:
                return problem
        return None
    if kind is dict:
        for k, item in value.items():
            if type(k) is not str:
                return f"{path} has a key {k!r} of type {type(k).__name__}; keys must be str"
            problem = text_problem(k)
            if problem is not None:
                return f"{path} has a key {k!r} that {problem}"
            problem = lossless_problem(item, f"{path}.{k}", depth + 1)
            if problem:
                return problem
        return None
    return f"{path} is a {kind.__name__}"


def text_problem(text: str) -> str | None:
    """Why a str cannot be stored as UTF-8 (it holds a lone surrogate), or None when it can."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"contains the lone surrogate {text[exc.start]!r} (at index {exc.start}), which UTF-8 cannot encode"
    return None


def utf8_safe(text: str) -> str:
    """``text`` with every lone surrogate written as a ``\\udXXX`` escape, so that it can be stored
    (used for what taskloop records on its own, such as an exception's message: never for values)."""
    if text_problem(text) is None:
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def utf8_safe_json(value: Any, depth: int = 0) -> Any:
    """``value`` with ``utf8_safe`` applied to every str in it (keys included), a few levels deep."""
    if isinstance(value, str):
        return utf8_safe(value)
    if depth > _MAX_DEPTH:
        return value
    if isinstance(value, dict):
        return {utf8_safe(k) if isinstance(k, str) else k: utf8_safe_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [utf8_safe_json(v, depth + 1) for v in value]
    return value


def _int_problem(value: int, path: str) -> str | None:
    limit = sys.get_int_max_str_digits()
    # fast path: fewer than 3 * limit bits means fewer than `limit` digits (8**limit < 10**limit)
    if not limit or value.bit_length() <= 3 * limit or abs(value) < 10**limit:
        return None
    return f"{path} is an int of more than {limit} digits, which Python will not turn into JSON text"


def require_lossless(value: Any, what: str, error: type[Exception], path: str = "$") -> None:
    """Raise ``error`` if ``value`` is not lossless JSON; ``what`` is the subject of the message
    (e.g. ``"run input"``)."""
    problem = lossless_problem(value, path)
    if problem is not None:
        raise error(not_lossless(what, problem))


def not_lossless(what: str, problem: str) -> str:
    """The message for a value that is not lossless JSON: what, where and why, and the fix."""
    return f"{what} must be lossless JSON values: {problem}; {LOSSLESS_FIX}"


def dumps(value: Any) -> str:
    """Compact JSON, the form taskloop stores (no spaces, UTF-8 kept as is)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical(value: Any) -> str:
    """Canonical JSON (sorted keys, compact): the input of every fingerprint."""
    return json.dumps(
        value, separators=(",", ":"), ensure_ascii=False, allow_nan=False, sort_keys=True
    )


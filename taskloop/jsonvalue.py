"""Lossless JSON: the only values taskloop records (inputs, outputs, check results, cache values).

A value is lossless when ``json.loads(dumps(v)) == v`` *and* has the same types: None, bool,
int, finite float other than -0.0, str, list, and dict with str keys, nested. Tuples, sets,
bytes, NaN, datetimes or subclasses would come back different, so they are refused up front
with the path of the offending element.
"""

from __future__ import annotations

import json
import math
from typing import Any

_MAX_DEPTH = 200
_FIX = "use None, bool, int, finite float, str, list or dict with str keys"


def lossless_problem(value: Any, path: str = "$", depth: int = 0) -> str | None:
    """Return a description of the first non-lossless element, or None when the value is fine."""
    if depth > _MAX_DEPTH:
        return f"{path} is nested deeper than {_MAX_DEPTH} levels (a cycle?)"
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return None
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
            problem = lossless_problem(item, f"{path}.{k}", depth + 1)
            if problem:
                return problem
        return None
    return f"{path} is a {kind.__name__}"


def require_lossless(value: Any, what: str, error: type[Exception], path: str = "$") -> None:
    """Raise ``error`` if ``value`` is not lossless JSON; ``what`` is the subject of the message
    (e.g. ``"run input"``)."""
    problem = lossless_problem(value, path)
    if problem is None:
        return
    raise error(f"{what} must be lossless JSON values: {problem}; {_FIX}")


def dumps(value: Any) -> str:
    """Compact JSON, the form taskloop stores (no spaces, UTF-8 kept as is)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical(value: Any) -> str:
    """Canonical JSON (sorted keys, compact): the input of every fingerprint."""
    return json.dumps(
        value, separators=(",", ":"), ensure_ascii=False, allow_nan=False, sort_keys=True
    )


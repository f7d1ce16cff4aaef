"""Hypothesis strategies shared by the fuzz tests: hostile text, names, JSON-ish values, garbage."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from hypothesis import strategies as st

# The name rule of SPEC §2, written out here (not imported) so the tests check the code against it.
SPEC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
# The run-id rule the client documents (1-200 characters from [A-Za-z0-9._:-], a letter or digit first).
SPEC_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}\Z")

# Characters that break things: line breaks (log forging), NUL, lone surrogates (not UTF-8),
# separators taskloop uses in keys and fields, terminal escapes, non-ASCII letters and digits.
NASTY_CHARS = ["\n", "\r", "\x00", "\t", "\ud800", "\udfff", "\u2028", "\x1b", "é", "٣", "💥", " ", "-", ".", "_",
               ":", "@", "/", "{", "}", "*", "'", '"', "\\"]
ANY_CHAR = st.characters(exclude_categories=())  # every code point, lone surrogates included


def hostile_text(min_size: int = 0, max_size: int = 24) -> st.SearchStrategy[str]:
    """Any text, biased towards the characters that break parsers, logs and encoders."""
    return st.text(st.one_of(st.sampled_from(NASTY_CHARS), ANY_CHAR), min_size=min_size, max_size=max_size)


def valid_names(max_size: int = 24) -> st.SearchStrategy[str]:
    return st.from_regex(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{max_size - 1}}}", fullmatch=True)


def names() -> st.SearchStrategy[str]:
    """Mostly valid names, often not: what a careless or hostile caller passes as a key or name."""
    invalid = st.one_of(hostile_text(max_size=12), st.sampled_from(["", "a b", "a\nb", "-a", "a@1", "é"]))
    return st.integers(0, 5).flatmap(lambda n: invalid if n == 0 else valid_names())


def is_utf8_text(value: object) -> bool:
    """A non-empty str that UTF-8 can encode."""
    if not isinstance(value, str) or not value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Opaque:
    """An object JSON knows nothing about."""

    def __repr__(self) -> str:
        return "<Opaque>"


def _power_of_ten(exponent: int) -> int:
    return 10**exponent


def huge_ints() -> st.SearchStrategy[int]:
    """Ints around Python's limit for int <-> str conversion (4300 digits by default), both signs.
    (Built, not listed: Hypothesis cannot repr an int past the limit in a strategy.)"""
    return st.builds(lambda e, sign: sign * _power_of_ten(e), st.sampled_from([400, 4299, 4300, 4301, 5000]),
                     st.sampled_from([1, -1]))


# Values that are not what any option expects: the wrong type, out of range, not JSON.
SOME_GARBAGE: st.SearchStrategy[Any] = st.one_of(  # anything but None
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**53, 2**53 - 1, 2**31, 2**31 - 1]),
    huge_ints(),
    st.floats(allow_nan=True, allow_infinity=True),
    hostile_text(),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.tuples(st.integers()),
    st.frozensets(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.builds(Opaque),
)
GARBAGE: st.SearchStrategy[Any] = st.one_of(st.none(), SOME_GARBAGE)
# garbage that is not even iterable
NOT_ITERABLE: st.SearchStrategy[Any] = st.one_of(
    st.booleans(), st.integers(), huge_ints(), st.floats(allow_nan=True), st.builds(Opaque))


def json_leaves() -> st.SearchStrategy[Any]:
    """Scalars JSON can hold losslessly."""
    return st.one_of(
        st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10**300), max_value=10**300),
        st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not (f == 0 and math.copysign(1, f) < 0)),
        st.text(max_size=40),
    )


def lossless_json(max_leaves: int = 25) -> st.SearchStrategy[Any]:
    """Lossless JSON values (None, bool, int, finite float but -0.0, str, list, dict with str keys)."""
    return st.recursive(
        json_leaves(),
        lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
        max_leaves=max_leaves,
    )


def _hostile_leaves() -> st.SearchStrategy[Any]:
    return st.one_of(
        json_leaves(),
        st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 2**64, True, False]),
        huge_ints(),
        hostile_text(),
        st.binary(max_size=6),
        st.frozensets(st.integers(), max_size=3),
        st.sets(st.integers(), max_size=3),
        st.builds(Opaque),
        st.builds(bytearray, st.binary(max_size=3)),
    )


def jsonish(max_leaves: int = 20) -> st.SearchStrategy[Any]:
    """JSON-ish Python values, often not lossless: NaN, inf, -0.0, huge ints, lone surrogates,
    non-str keys, bytes, sets, tuples, opaque objects, nested a few levels."""
    keys = st.one_of(st.text(max_size=8), hostile_text(max_size=4), st.integers(), st.booleans(), st.none(),
                     st.floats(allow_nan=True), st.tuples(st.integers()), st.binary(max_size=3))
    return st.recursive(
        _hostile_leaves(),
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.tuples(inner, inner),
            st.dictionaries(st.text(max_size=8), inner, max_size=4),
            st.dictionaries(keys, inner, max_size=3),
        ),
        max_leaves=max_leaves,
    )


def nested(depth: int, leaf: Any = 0, kind: str = "list") -> Any:
    """``leaf`` inside ``depth`` lists (or dicts ``{"a": ...}``), built without recursion."""
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


def deep_values() -> st.SearchStrategy[Any]:
    """Values nested from a few levels to far past any sane limit (10,000)."""
    return st.builds(nested, st.one_of(st.integers(0, 300), st.sampled_from([199, 200, 201, 1000, 10_000])),
                     json_leaves(), st.sampled_from(["list", "dict"]))


def is_lossless(value: Any) -> bool:
    """What SPEC §3.8 calls lossless JSON, decided by a round trip through the json module (not
    by taskloop's own check): it comes back equal with the same types, and its text is UTF-8."""
    if _depth(value) > 200:  # taskloop's documented nesting limit (and same_json recurses)
        return False
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
        text.encode("utf-8")
        back = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return False
    return same_json(value, back) and not _has_negative_zero(value)


def _has_negative_zero(value: Any) -> bool:
    if isinstance(value, float):
        return value == 0 and math.copysign(1, value) < 0
    if isinstance(value, list):
        return any(_has_negative_zero(v) for v in value)
    if isinstance(value, dict):
        return any(_has_negative_zero(v) for v in value.values())
    return False


def _depth(value: Any) -> int:
    """The deepest level of any element (the value itself is at 0), iteratively: any depth."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if isinstance(item, (list, dict)):
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def same_json(a: Any, b: Any) -> bool:
    """Equal, and of the same JSON types all the way down (1 is not 1.0, True is not 1)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[key], b[key]) for key in a)
    return bool(a == b)

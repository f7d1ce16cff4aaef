"""Lossless JSON (SPEC section 3, point 8): taskloop/base/jsonvalue.py."""

from __future__ import annotations

import enum
import json
import math
import re
from typing import Any

import pytest

from taskloop.base.errors import InvalidInput, InvalidOutput
from taskloop.base.jsonvalue import canonical, dumps, lossless_problem, require_lossless

LOSSLESS_MSG = "must be lossless JSON values"


class Color(enum.IntEnum):
    RED = 1


class Name(str):
    pass


LOSSLESS = [
    None,
    True,
    False,
    0,
    -7,
    2**80,
    0.0,
    1.5,
    -2.25,
    1e300,
    "",
    "héllo ✓",
    [],
    {},
    [None, True, 1, 1.5, "s", [], {}],
    {"a": {"b": [1, {"c": None}]}, "": [[[]]]},
    {"fix": {"rounds": [{"round": 1, "check": {"done": False, "feedback": "again"}}]}},
]


@pytest.mark.parametrize("value", LOSSLESS, ids=repr)
def test_lossless_values_are_accepted(value: Any) -> None:
    assert lossless_problem(value) is None
    assert require_lossless(value, "outputs", InvalidOutput) is None
    assert require_lossless(value, "run input", InvalidInput) is None
    # and they really round-trip with the same types
    assert json.loads(dumps(value)) == value
    assert json.dumps(json.loads(dumps(value)), sort_keys=True) == json.dumps(value, sort_keys=True)


@pytest.mark.parametrize(
    ("value", "path", "detail"),
    [
        ((1, 2), "$", "is a tuple"),
        ({1, 2}, "$", "is a set"),
        (frozenset(), "$", "is a frozenset"),
        (b"raw", "$", "is a bytes"),
        (bytearray(b"x"), "$", "is a bytearray"),
        (float("nan"), "$", "nan"),
        (float("inf"), "$", "inf"),
        (float("-inf"), "$", "-inf"),
        (-0.0, "$", "is -0.0"),
        (object(), "$", "is a object"),
        (Color.RED, "$", "is a Color"),
        (Name("x"), "$", "is a Name"),
        (1 + 2j, "$", "is a complex"),
        ({1: "a"}, "$", "has a key 1 of type int; keys must be str"),
        ({("a",): 1}, "$", "of type tuple; keys must be str"),
        ({"a": [0, (1,)]}, "$.a[1]", "is a tuple"),
        ({"a": [0, float("nan")]}, "$.a[1]", "nan"),
        ([{"b": -0.0}], "$[0].b", "is -0.0"),
        ({"a": {"b": {2: "x"}}}, "$.a.b", "has a key 2"),
        ([[1, [2, {"k": {3}}]]], "$[0][1][1].k", "is a set"),
    ],
    ids=lambda v: re.sub(r" at 0x[0-9a-f]+", "", repr(v)),  # the same ids in every process (pytest-xdist)
)
def test_non_lossless_values_are_refused_with_their_path(value: Any, path: str, detail: str) -> None:
    problem = lossless_problem(value)
    assert problem is not None
    assert problem.startswith(f"{path} ")
    assert detail in problem


def test_the_first_problem_is_reported() -> None:
    assert lossless_problem([1, (2,), {3}]) == "$[1] is a tuple"


def test_a_custom_root_path_prefixes_every_path() -> None:
    problem = lossless_problem({"a": [b"x"]}, path="$input")
    assert problem is not None and problem.startswith("$input.a[0] ")


def test_cyclic_values_are_refused_without_recursing_forever() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    problem = lossless_problem(cycle)
    assert problem is not None
    assert "nested deeper than" in problem


def test_finite_floats_are_accepted_but_negative_zero_is_not() -> None:
    assert lossless_problem(0.0) is None
    assert lossless_problem(-1e-300) is None
    assert lossless_problem(math.copysign(0.0, -1)) == "$ is -0.0, which JSON turns into 0"


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"a": [1, (2,)]}, "$.a[1]"),
        ([float("inf")], "$[0]"),
        ({"x": {1: 2}}, "$.x"),
        ({"s": {"nested"}}, "$.s"),
    ],
    ids=repr,
)
def test_require_lossless_outputs_raises_invalid_output(value: Any, path: str) -> None:
    with pytest.raises(InvalidOutput, match=LOSSLESS_MSG) as info:
        require_lossless(value, "outputs", InvalidOutput)
    message = str(info.value)
    assert message.startswith("outputs must be lossless JSON values: ")
    assert f"{path} " in message
    assert not isinstance(info.value, InvalidInput)
    assert isinstance(info.value, ValueError)


def test_require_lossless_run_input_raises_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="run input must be lossless JSON values") as info:
        require_lossless({"topic": ("x", "y")}, "run input", InvalidInput)
    assert "$.topic" in str(info.value)
    assert not isinstance(info.value, InvalidOutput)
    assert isinstance(info.value, ValueError)


def test_require_lossless_names_the_fix() -> None:
    with pytest.raises(InvalidOutput, match="use None, bool, int, finite float, str, list or dict"):
        require_lossless(b"bytes", "outputs", InvalidOutput)


def test_dumps_and_canonical() -> None:
    value = {"b": [1, 2.5, None], "a": "é"}
    assert dumps(value) == '{"b":[1,2.5,null],"a":"é"}'
    assert canonical(value) == '{"a":"é","b":[1,2.5,null]}'
    assert canonical({"a": 1, "b": 2}) == canonical({"b": 2, "a": 1})
    with pytest.raises(ValueError):
        dumps(float("nan"))

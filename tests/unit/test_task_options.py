"""The options every task declaration shares (define/tasks.py's ``TaskOptions``: after, condition,
timeout_ms, retry, cache, queue, limits) are checked by one function, ``task_options``: each
declaration that takes one refuses it with the same message, checks them in the same order, and
keeps the same value of it."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

import taskloop as tl
from taskloop.define.tasks import TaskOptions
from tests.unit.test_definitions import attempt, check, run

KEY = "step"  # tl.step names its task "step" until define_graph_workflow names it: all alike
RATE = tl.RateLimit("unit-task-options", rate=5, per_s=1)
ALL = {"after", "condition", "timeout_ms", "retry", "cache", "queue", "limits"}


def body(ctx: Any, state: Any) -> Any:
    return state


# each declaration, and the shared options it takes (a loop's retry= is another option: a loop task
# and a loop step refuse it, tl.loop's retries the model's judgement)
DECLARATIONS: dict[str, tuple[Callable[..., tl.Task], set[str]]] = {
    "define_task": (lambda **given: tl.define_task(KEY, run, **given), ALL),
    "define_loop_task": (lambda **given: tl.define_loop_task(KEY, max_rounds=2, attempt=attempt, check=check,
                                                             **given), ALL - {"retry"}),
    "tl.loop": (lambda **given: tl.loop(KEY, body, **given), ALL - {"condition", "retry"}),
    "tl.step(run)": (lambda **given: tl.step(run, **given).task, ALL - {"after", "condition"}),
    "tl.step(attempt, check)": (lambda **given: tl.step(attempt=attempt, check=check, max_rounds=2, **given).task,
                                ALL - {"after", "condition", "retry"}),
}


def taking(option: str) -> list[str]:
    return [name for name, (_, takes) in DECLARATIONS.items() if option in takes]


def refusal(name: str, **given: Any) -> str:
    build, _ = DECLARATIONS[name]
    with pytest.raises(tl.DefinitionError) as info:
        build(**given)
    return str(info.value)


def test_the_table_covers_every_shared_option() -> None:
    assert set(TaskOptions.__annotations__) == ALL
    assert all(len(taking(option)) >= 2 for option in ALL)  # each is shared


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("after", "a", "task step: after must be a list of tasks, e.g. after=['a']"),
        ("after", ["a", "a"], "task step: after lists a task twice; list each dependency once"),
        ("condition", 1, "task step: condition must be a callable (ctx) -> bool"),
        ("timeout_ms", 0, "task step: timeout_ms must be an integer from 1 to 2147483647 (milliseconds), got 0"),
        ("retry", {"attempts": 3}, "task step: retry must be a tl.Retry(...), got {'attempts': 3}"),
        ("retry", tl.Retry(attempts=2, accepts=lambda error: True), "task step: retry.accepts must accept (error, "),
        ("cache", "key", "task step: cache must be a tl.Cache(...), got 'key'"),
        ("cache", tl.Cache(key=lambda: 1), "task step: cache.key must accept (ctx)"),
        ("queue", "", "task step: queue must be a non-empty queue name, got ''"),
        ("limits", RATE, "task step: limits must be a list of limits, e.g. limits=[unit-task-options]"),
    ],
)
def test_every_declaration_refuses_a_shared_option_alike(option: str, value: Any, message: str) -> None:
    messages = {name: refusal(name, **{option: value}) for name in taking(option)}

    assert len(set(messages.values())) == 1, messages
    assert next(iter(messages.values())).startswith(message)


@pytest.mark.parametrize(
    ("given", "first"),
    [
        ({"condition": 1, "timeout_ms": 0}, "condition"),
        ({"timeout_ms": 0, "cache": "key"}, "timeout_ms"),
        ({"cache": "key", "queue": ""}, "cache"),
        ({"queue": "", "retry": 3}, "queue"),
        ({"retry": 3, "after": "a"}, "retry"),
        ({"after": "a", "limits": RATE}, "after"),
    ],
)
def test_every_declaration_checks_the_shared_options_in_one_order(given: dict[str, Any], first: str) -> None:
    for name in [name for name in DECLARATIONS if set(given) <= DECLARATIONS[name][1]]:
        assert re.match(rf"task step: {first}\b", refusal(name, **given)), name


def test_every_declaration_keeps_the_shared_options_alike() -> None:
    upstream = tl.define_task("upstream", run)
    retry, cache = tl.Retry(attempts=2), tl.Cache(key=lambda ctx: 1)
    given: dict[str, Any] = {"after": [upstream, "other"], "condition": lambda ctx: True, "timeout_ms": 500,
                             "retry": retry, "cache": cache, "queue": "models", "limits": [RATE]}
    kept = {**given, "after": ("upstream", "other"), "limits": (RATE,)}

    for name, (build, takes) in DECLARATIONS.items():
        task = build(**{option: given[option] for option in takes})
        assert {option: getattr(task, option) for option in takes} == {option: kept[option] for option in takes}, name

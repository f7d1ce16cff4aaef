"""The checks every declaration shares (plain tasks, loop tasks, gates, graph steps, workflows
and graph workflows ask here, so one rule gives one message; the options of tasks are checked
by tasks.py's task_options). Each raises DefinitionError with a message that names the field
and the fix."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from taskloop.base import names
from taskloop.base.errors import DefinitionError
from taskloop.base.jsonvalue import text_problem
from taskloop.base.text import shown
from taskloop.define.options import Budget


def is_text(value: object) -> bool:
    """A non-empty str that UTF-8 can encode (no lone surrogate): what prompts, actors and queue
    names must be, since they are stored in Redis or in the definition fingerprint."""
    return isinstance(value, str) and bool(value) and text_problem(value) is None


def got(value: object) -> str:
    """``, got <value>`` for a message; for a str with a lone surrogate, why it is refused."""
    problem = text_problem(value) if isinstance(value, str) else None
    return f", got a string that {problem}" if problem else f", got {shown(value)}"


def items_of(value: object, message: str) -> tuple[Any, ...]:
    """The items of an iterable argument (a list, tuple, generator ...), or DefinitionError(message)."""
    if isinstance(value, str | bytes):
        raise DefinitionError(message)
    try:
        return tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise DefinitionError(f"{message}{got(value)}") from None


def check_name(key: object, what: str = "task key") -> str:
    if not names.is_name(key):
        raise DefinitionError(f"{what} {shown(key)} is invalid: it must {names.NAME_RULE}")
    assert isinstance(key, str)
    return key


def check_version(version: object, owner: str) -> str:
    """A workflow's (or a transition handler's) version."""
    problem = names.version_problem(version)
    if problem is not None:
        raise DefinitionError(f"{owner}: version must be a non-empty string, e.g. version='1'{got(version)}: "
                              f"at most {names.MAX_LENGTH} printable characters ({problem})")
    assert isinstance(version, str)
    return version


def check_callable(value: object, message: str) -> None:
    if not callable(value):
        raise DefinitionError(message)


def check_signature(owner: str, role: str, fn: Callable[..., Any], params: tuple[str, ...]) -> None:
    """The callback must accept the arguments taskloop calls it with (checked now, not at run time)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins cannot be inspected: nothing to check
        return
    try:
        signature.bind(*params)
    except TypeError:
        name = getattr(fn, "__qualname__", repr(fn))
        takes = ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in signature.parameters.values())
        raise DefinitionError(
            f"{owner}: {role} must accept ({', '.join(params)}), but {name}({takes}) does not; "
            f"define it as def {role}({', '.join(params)}): ..."
        ) from None


def check_no_retry(owner: str, retry: object, subject: str = "loop tasks have") -> None:
    """A loop has no retry option: a round is the retry (a loop task, a loop step of a graph)."""
    if retry is not None:
        raise DefinitionError(
            f"{owner}: {subject} no retry option (a round is the retry); remove retry= or raise max_rounds"
        )


def check_budget(owner: str, budget: object) -> Budget | None:
    if budget is not None and not isinstance(budget, Budget):
        raise DefinitionError(f"{owner}: budget must be a tl.Budget(...), got {shown(budget)}")
    return budget


def check_observers(owner: str, observers: Iterable[Callable[..., Any]]) -> tuple[Callable[..., Any], ...]:
    found = items_of(observers, f"{owner}: observers must be a list of callables (event) -> None")
    for observer in found:
        check_callable(observer, f"{owner}: observers must be callables (event) -> None")
    return found


def check_flag(owner: str, flag: str, value: object) -> bool:
    if type(value) is not bool:
        raise DefinitionError(f"{owner}: {flag} must be True or False, got {shown(value)}")
    return value

"""Names and ids: what a task key, a workflow, step or handler name, a version, a run id and a
graph action key may be. One rule each; every entry point (definitions, ``client.start``, the
messages workers take) asks here, and wraps the answer in its own error type.

A name or a version is at most ``MAX_LENGTH`` characters: they are stored with every run and
quoted in its events and in metric labels, so an unbounded one would escape the payload caps.
"""

from __future__ import annotations

import re

from taskloop.base.errors import InvalidInput
from taskloop.base.text import shown

MAX_LENGTH = 200  # characters of a name, a version or a run id

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}"
NAME_PATTERN = re.compile(_NAME + r"\Z")
NAME_RULE = (f"match [A-Za-z0-9][A-Za-z0-9._-]* (start with a letter or digit; then letters, digits, '.', '_' or "
             f"'-') and be at most {MAX_LENGTH} characters long")
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}\Z")
RUN_ID_RULE = f"1-{MAX_LENGTH} characters from [A-Za-z0-9._:-], starting with a letter or digit"
ACTION_SEPARATOR = "@"
ACTION_KEY = re.compile(rf"({_NAME}){ACTION_SEPARATOR}([1-9][0-9]{{0,8}})\Z")
VERSION_RULE = f"a non-empty string of at most {MAX_LENGTH} printable characters, e.g. '1' or '2026-11'"


def is_name(value: object) -> bool:
    """A task key, a workflow, step or transition handler name."""
    return isinstance(value, str) and NAME_PATTERN.match(value) is not None


def is_run_id(value: object) -> bool:
    return isinstance(value, str) and RUN_ID_PATTERN.match(value) is not None


def is_task_key(value: object) -> bool:
    """The key of a task record: a task's name, or a graph action (``review@2``)."""
    return isinstance(value, str) and (NAME_PATTERN.match(value) is not None or ACTION_KEY.match(value) is not None)


def version_problem(value: object) -> str | None:
    """Why ``value`` cannot be a workflow (or handler) version, or None when it can."""
    if not isinstance(value, str) or not value:
        return "it is not a non-empty string"
    if len(value) > MAX_LENGTH:
        return f"it is {len(value):,} characters long"
    if not value.isprintable():
        return "it holds a character that is not printable (a control character, a line break, a lone surrogate ...)"
    return None


def action_key(step: str, n: int) -> str:
    """The key of the ``n``-th activation of graph step ``step``: ``review@2``."""
    return f"{step}{ACTION_SEPARATOR}{n}"


def step_of(key: str) -> str | None:
    """The step a graph action key belongs to (None when ``key`` is not an action key)."""
    found = ACTION_KEY.match(key)
    return found.group(1) if found else None


def check_run_id(run_id: object) -> str:
    """A run id given to the client (InvalidInput otherwise: it is never sent to Redis)."""
    if not is_run_id(run_id):
        raise InvalidInput(f"run_id {shown(run_id, 80)} is invalid: use {RUN_ID_RULE} (or pass run_id=None for a "
                           "generated one)")
    assert isinstance(run_id, str)
    return run_id

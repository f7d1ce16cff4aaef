"""Fleet flow control declarations (SPEC §10): ``RateLimit`` and ``Concurrency``.

A limit is shared by name: every task, in every workflow, that names ``"openai"`` counts against
the same window in Redis. Two declarations under one name must therefore agree; a second one
with other numbers is refused at definition time (``LIMITS`` remembers them per process). An
operator lowers or raises a limit's numbers at run time with ``taskloop limits set`` (the
override lives in Redis and wins over the declaration, for every worker at once).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from taskloop.base import names
from taskloop.base.errors import DefinitionError
from taskloop.base.text import shown

UNITS = ("starts", "tokens")
MAX_RATE = 1_000_000  # starts (or tokens) per window
MAX_WINDOW_S = 86_400.0  # one day
MAX_SLOTS = 100_000


@dataclass(frozen=True, eq=False)
class RateLimit:
    """At most ``rate`` phase starts (``unit="starts"``) or reported tokens (``unit="tokens"``:
    the input and output tokens of ``ctx.report_usage``) in any window of ``per_s`` seconds,
    across the whole fleet."""

    name: str
    rate: int
    per_s: float = 1.0
    unit: Literal["starts", "tokens"] = "starts"

    def __post_init__(self) -> None:
        _check_name(self.name, "RateLimit")
        if type(self.rate) is not int or not 1 <= self.rate <= MAX_RATE:
            raise DefinitionError(f"RateLimit {self.name}: rate must be an integer from 1 to {MAX_RATE:,} "
                                  f"({self.unit} per window), got {shown(self.rate)}")
        per_s = self.per_s
        if isinstance(per_s, bool) or not isinstance(per_s, int | float) or not math.isfinite(per_s) \
                or not 0.001 <= per_s <= MAX_WINDOW_S:
            raise DefinitionError(f"RateLimit {self.name}: per_s must be a number of seconds from 0.001 to "
                                  f"{MAX_WINDOW_S:,.0f}, got {shown(per_s)}")
        object.__setattr__(self, "per_s", float(per_s))
        if self.unit not in UNITS:
            raise DefinitionError(f"RateLimit {self.name}: unit must be one of {list(UNITS)}, got {shown(self.unit)}")

    kind = "rate"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "rate", "rate": self.rate, "per_s": self.per_s, "unit": self.unit}


@dataclass(frozen=True, eq=False)
class Concurrency:
    """At most ``limit`` phases running at once across the fleet, per value of ``key(ctx)`` (a
    string or an integer, e.g. the document or tenant a run works on); without ``key``, one
    count for the whole fleet."""

    name: str
    limit: int
    key: Callable[[Any], Any] | None = field(default=None)

    def __post_init__(self) -> None:
        _check_name(self.name, "Concurrency")
        if type(self.limit) is not int or not 1 <= self.limit <= MAX_SLOTS:
            raise DefinitionError(f"Concurrency {self.name}: limit must be an integer from 1 to {MAX_SLOTS:,} "
                                  f"(phases running at once), got {shown(self.limit)}")
        if self.key is not None and not callable(self.key):
            raise DefinitionError(f"Concurrency {self.name}: key must be a callable (ctx) -> str, e.g. "
                                  f"key=lambda ctx: ctx.input['doc_id'], got {shown(self.key)}")

    kind = "concurrency"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "concurrency", "limit": self.limit, "keyed": self.key is not None}


Limit = RateLimit | Concurrency


class _Declared:
    """The limits this process has seen, by name: one name, one set of numbers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, dict[str, Any]] = {}

    def note(self, limit: Limit, owner: str) -> None:
        described = limit.describe()
        with self._lock:
            seen = self._by_name.setdefault(limit.name, described)
        if seen != described:
            raise DefinitionError(
                f"{owner}: limit {limit.name!r} is declared twice with different settings ({_numbers(seen)} and "
                f"{_numbers(described)}); a limit is shared by name across workflows: declare it once and use "
                "the same object, or give the other one another name")


LIMITS = _Declared()


def check_limits(owner: str, option: str, value: object) -> tuple[Limit, ...]:
    """``limits=`` (or ``attempt_limits=``, ``check_limits=``) of a task: a list of RateLimit and
    Concurrency objects, each name once."""
    if value is None:
        return ()
    if isinstance(value, RateLimit | Concurrency):
        raise DefinitionError(f"{owner}: {option} must be a list of limits, e.g. {option}=[{value.name}]")
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise DefinitionError(f"{owner}: {option} must be a list of tl.RateLimit / tl.Concurrency, got {shown(value)}")
    found = tuple(value)
    for item in found:
        if not isinstance(item, RateLimit | Concurrency):
            raise DefinitionError(f"{owner}: {option} must list tl.RateLimit or tl.Concurrency objects, "
                                  f"got {shown(item)} in it")
        LIMITS.note(item, owner)
    seen = [limit.name for limit in found]
    if len(set(seen)) != len(seen):
        raise DefinitionError(f"{owner}: {option} names a limit twice ({seen}); list each limit once")
    return found


def merge(owner: str, every: tuple[Limit, ...], phase: tuple[Limit, ...]) -> tuple[Limit, ...]:
    """The limits of one phase: the task's own and the phase's, each once."""
    names_seen = {limit.name for limit in every}
    for limit in phase:
        if limit.name in names_seen:
            raise DefinitionError(f"{owner}: limit {limit.name!r} is in limits= and in a phase's limits; "
                                  "list it in one of them")
    return every + phase


def _check_name(value: object, what: str) -> None:
    if not names.is_name(value):
        raise DefinitionError(f"{what} name {shown(value)} is invalid: it must {names.NAME_RULE}")


def _numbers(described: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in described.items() if k != "name")

"""Before the first execution of an activation (attempt 0 of a task's record): the task's
condition, then its cache. Either may decide the phase's outcome before any callback runs: a
condition that says no skips the task, a condition or cache key that raises fails it, and a cache
hit succeeds it with the cached value. Otherwise the phase begins with the cache lookup's
fingerprint (written back with its outcome: cache.py)."""

from __future__ import annotations

from dataclasses import dataclass

from taskloop.base import clock
from taskloop.core import fields as fld
from taskloop.core.events import Event
from taskloop.core.outcomes import Outcome
from taskloop.core.phases import EventKind
from taskloop.define.context import TaskContext
from taskloop.define.tasks import Task
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution import cache as caching
from taskloop.worker.execution.callbacks import error_record, invoke


@dataclass(frozen=True)
class Decided:
    """The outcome the condition or the cache decided, with the cache's events."""

    outcome: Outcome
    events: list[Event] | None = None


def prepare(task: Task, ctx: TaskContext, workflow: str, store: RedisStore, cache_ttl_s: int, attempts: int,
            max_output: int | None) -> caching.Lookup | Decided:
    """The condition, then the cache (never on a resume: ``attempts`` > 0): what the phase begins
    with, or the outcome decided."""
    if task.condition is not None:
        try:
            keep = invoke(task.condition, ctx)
        except Exception as exc:
            return Decided(Outcome(EventKind.FAIL, error=error_record(exc)))
        if not keep:
            return Decided(Outcome(EventKind.SKIP, reason="condition"))
    if task.cache is None or attempts:  # no cache lookup on a resume
        return caching.Lookup()
    cache_store = caching.store_for(task.cache, store, cache_ttl_s)
    found = caching.lookup(task.cache, ctx, workflow, task.key, cache_store, clock.now(), max_output)
    if found.error is not None:
        return Decided(Outcome(EventKind.FAIL, error=found.error), found.events)
    if found.hit:
        assert found.value_raw is not None
        return Decided(Outcome(EventKind.SUCCEED, {fld.value_field(task.key): found.value_raw}, cache_hit=True),
                       found.events)
    return found

"""Task result cache: fingerprints, the Redis store, lookups before the first attempt, write-back.

Fingerprint = sha256 of the canonical JSON of ``{format, workflow, task, version, key}`` where
``key`` is what ``Cache.key(ctx)`` returned (lossless JSON). An entry is
``{"value": <lossless JSON>, "stored_at": <epoch seconds>}``. A store that fails (raises, or
returns something that is not such an entry) degrades to a miss and a ``cache.failed`` event; it
never changes the outcome of the task.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from taskloop.base import limits
from taskloop.base.errors import InvalidCacheKey
from taskloop.base.jsonvalue import canonical, dumps, lossless_problem
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.events import Event
from taskloop.core.records import ErrorRecord
from taskloop.core.snapshot import Snapshot
from taskloop.define.context import TaskContext
from taskloop.define.options import Cache
from taskloop.define.tasks import Task
from taskloop.store import keys as k
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution.callbacks import error_record, invoke

log = logging.getLogger("taskloop.cache")

FORMAT = "taskloop.cache/1"


class CacheStore(Protocol):
    def read(self, fingerprint: str) -> dict[str, Any] | None: ...

    def write(self, fingerprint: str, entry: dict[str, Any]) -> None: ...


class RedisCacheStore:
    """The default store: one string key per fingerprint, expiring after ``max_age_ms`` when set,
    else after ``ttl_s`` (TASKLOOP_CACHE_TTL_S, 30 days): no entry lives forever."""

    def __init__(self, store: RedisStore, max_age_ms: int | None = None,
                 ttl_s: int = limits.DEFAULT_CACHE_TTL_S) -> None:
        self.store = store
        self.max_age_ms = max_age_ms
        self.ttl_ms = max_age_ms if max_age_ms is not None else ttl_s * 1000

    def read(self, fingerprint: str) -> dict[str, Any] | None:
        raw = self.store.client.get(k.cache_key(fingerprint))
        return None if raw is None else dict(json.loads(raw))

    def write(self, fingerprint: str, entry: dict[str, Any]) -> None:
        self.store.client.set(k.cache_key(fingerprint), dumps(entry), px=self.ttl_ms)


def fingerprint(workflow: str, task: str, version: str, key: Any) -> str:
    payload = {"format": FORMAT, "workflow": workflow, "task": task, "version": version, "key": key}
    return hashlib.sha256(canonical(payload).encode()).hexdigest()


def _event(kind: str, task: str, now: float, **data: Any) -> Event:
    return Event(type=f"{ev.CACHE}.{kind}", key=task, at=now, data=data or None)


@dataclass
class Lookup:
    """The result of consulting the cache before a task's first attempt."""

    fingerprint: str | None = None
    value_raw: str | None = None  # set on a hit
    error: ErrorRecord | None = None  # the key function failed: the task fails
    events: list[Event] = field(default_factory=list)

    @property
    def hit(self) -> bool:
        return self.value_raw is not None


def store_for(cache: Cache, default: RedisStore, ttl_s: int = limits.DEFAULT_CACHE_TTL_S) -> CacheStore:
    return cache.store if cache.store is not None else RedisCacheStore(default, cache.max_age_ms, ttl_s)


def lookup(cache: Cache, ctx: TaskContext, workflow: str, task: str, store: CacheStore, now: float,
           max_bytes: int | None = None) -> Lookup:
    """Consult the cache. A cached value over ``max_bytes`` (TASKLOOP_MAX_OUTPUT_BYTES) is a failed
    read: a miss, never restored."""
    try:
        key = invoke(cache.key, ctx)
    except Exception as exc:
        return Lookup(error=error_record(exc, cause="cache key function failed"))
    problem = lossless_problem(key)
    if problem is not None:
        message = f"cache key of task {task} must be lossless JSON values: {problem}; return a str, int, list or dict"
        return Lookup(error=ErrorRecord(type=InvalidCacheKey.__name__, message=message))
    found = Lookup(fingerprint(workflow, task, cache.version, key))
    assert found.fingerprint is not None
    short = found.fingerprint[:16]
    if cache.mode == "refresh":
        found.events.append(_event("miss", task, now, fingerprint=short, reason="refresh"))
        return found
    try:
        entry = store.read(found.fingerprint)
        if entry is not None:
            value, stored_at = entry["value"], float(entry["stored_at"])
            stored = limits.store_form(value, max_bytes if max_bytes is not None else limits.UNLIMITED)
            if stored.problem is not None:
                raise ValueError(f"cached value is not lossless JSON: {stored.problem}")
            if stored.raw is None:
                raise ValueError(limits.too_large("cached value", stored.size or 0, max_bytes or 0, limits.OUTPUT_ENV))
            value_raw = stored.raw
    except Exception as exc:
        log.warning("cache read failed for %s/%s: %r (treated as a miss)", workflow, task, exc)
        found.events.append(_event("failed", task, now, fingerprint=short, operation="read",
                                   error=f"{type(exc).__name__}: {exc}"))
        found.events.append(_event("miss", task, now, fingerprint=short, reason="store failed"))
        return found
    if entry is None:
        found.events.append(_event("miss", task, now, fingerprint=short, reason="absent"))
    elif cache.max_age_ms is not None and (now - stored_at) * 1000 > cache.max_age_ms:
        found.events.append(_event("miss", task, now, fingerprint=short, reason="expired"))
    else:
        found.value_raw = value_raw
        found.events.append(_event("hit", task, now, fingerprint=short, stored_at=stored_at))
    return found


def write_back(store: CacheStore, task: str, fingerprint_: str, value_raw: str, now: float) -> Event:
    """Store an accepted value; returns the ``cache.stored`` or ``cache.failed`` event."""
    short = fingerprint_[:16]
    try:
        store.write(fingerprint_, {"value": json.loads(value_raw), "stored_at": now})
    except Exception as exc:
        log.warning("cache write failed for %s: %r", task, exc)
        return _event("failed", task, now, fingerprint=short, operation="write", error=f"{type(exc).__name__}: {exc}")
    return _event("stored", task, now, fingerprint=short)


def store_outcome(task: Task, default: RedisStore, ttl_s: int, snap: Snapshot, data: dict[str, str],
                  now: float) -> Event | None:
    """Store the value a phase of a cached task accepted, under the fingerprint its lookup noted
    (None: nothing was looked up for this activation)."""
    assert task.cache is not None
    fingerprint_ = snap.get(fld.fingerprint_field(task.key))
    if fingerprint_ is None:
        return None
    return write_back(store_for(task.cache, default, ttl_s), task.key, fingerprint_, data[fld.value_field(task.key)],
                      now)

"""The task result cache (taskloop/worker/execution/cache.py) with its default store on a real redis-server:
fingerprints, a miss then a write-back then a hit, expiry by ``max_age_ms`` (on an injected time),
the refresh mode, a failing store degrading to a miss, and cache keys that are not JSON."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

import taskloop as tl
from taskloop.define.context import Signal, TaskContext
from taskloop.store import keys as k
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution import cache as caching

NOW = 1_700_000_000.0
TASK = "essay"


class NoUsage:
    """A usage sink that must not be used by a cache key function."""

    def report(self, counts: dict[str, int]) -> None:
        raise AssertionError("a cache key reported usage")

    def report_once(self, receipt: str, counts: dict[str, int]) -> bool:
        raise AssertionError("a cache key reported usage")


def _ctx(input: Any, workflow: str) -> TaskContext:
    """The context a cache key function gets (attempt 0)."""
    return TaskContext(run_id="r1", workflow=workflow, key=TASK, load_input=lambda: input, attempt=0,
                       signal=Signal(), idempotency_key="r1:essay", after=(), load_value=lambda key: None,
                       usage=NoUsage())


@pytest.fixture()
def workflow() -> str:
    """A workflow name of its own, so that the global cache keys of two tests never meet."""
    return f"cache-{uuid.uuid4().hex[:12]}"


def _by_topic(ctx: TaskContext) -> Any:
    return {"topic": ctx.input["topic"]}


def _lookup(cache: tl.Cache, workflow: str, store: caching.CacheStore, now: float = NOW,
            input: Any = None, max_bytes: int | None = None) -> caching.Lookup:
    return caching.lookup(cache, _ctx(input or {"topic": "loops"}, workflow), workflow, TASK, store, now, max_bytes)


def _kinds(found: caching.Lookup) -> list[tuple[str, Any]]:
    return [(e.type, (e.data or {}).get("reason")) for e in found.events]


# --- fingerprints -----------------------------------------------------------------------------------


def test_the_fingerprint_is_stable_and_ignores_key_order() -> None:
    first = caching.fingerprint("wf", TASK, "1", {"a": 1, "b": [1, 2]})
    assert first == caching.fingerprint("wf", TASK, "1", {"b": [1, 2], "a": 1})
    assert len(first) == 64 and int(first, 16) >= 0  # sha256 in hex


@pytest.mark.parametrize(("workflow", "task", "version", "key"), [
    ("other", TASK, "1", "k"), ("wf", "other", "1", "k"), ("wf", TASK, "2", "k"), ("wf", TASK, "1", "k2"),
    ("wf", TASK, "1", ["k"]), ("wf", TASK, "1", 1),
])
def test_the_fingerprint_differs_by_workflow_task_version_and_key(workflow: str, task: str, version: str,
                                                                  key: Any) -> None:
    assert caching.fingerprint(workflow, task, version, key) != caching.fingerprint("wf", TASK, "1", "k")


def test_a_new_cache_version_misses_what_the_old_one_stored(store: RedisStore, workflow: str) -> None:
    redis_store = caching.RedisCacheStore(store)
    old = _lookup(tl.Cache(key=_by_topic, version="1"), workflow, redis_store)
    assert old.fingerprint is not None
    caching.write_back(redis_store, TASK, old.fingerprint, '"cached"', NOW)
    assert _lookup(tl.Cache(key=_by_topic, version="1"), workflow, redis_store).hit
    new = _lookup(tl.Cache(key=_by_topic, version="2"), workflow, redis_store)
    assert not new.hit and new.fingerprint != old.fingerprint


# --- lookups on the Redis store ---------------------------------------------------------------------


def test_a_miss_then_a_write_back_then_a_hit(store: RedisStore, workflow: str) -> None:
    # Given an empty cache
    cache = tl.Cache(key=_by_topic)
    redis_store = caching.store_for(cache, store)
    assert isinstance(redis_store, caching.RedisCacheStore)
    # When a task looks it up: a miss, with the fingerprint to store under
    miss = _lookup(cache, workflow, redis_store)
    expected = caching.fingerprint(workflow, TASK, "1", {"topic": "loops"})
    assert (miss.hit, miss.fingerprint, miss.error) == (False, expected, None)
    assert _kinds(miss) == [("cache.miss", "absent")]
    assert miss.events[0].key == TASK and miss.events[0].data == {"fingerprint": expected[:16], "reason": "absent"}
    # When its accepted value is written back
    stored = caching.write_back(redis_store, TASK, expected, '{"text":"an essay","n":[1,2]}', NOW)
    assert (stored.type, stored.data) == ("cache.stored", {"fingerprint": expected[:16]})
    entry = json.loads(store.client.get(k.cache_key(expected)))
    assert entry == {"value": {"text": "an essay", "n": [1, 2]}, "stored_at": NOW}
    # Then the next lookup is a hit that restores the value as stored JSON
    hit = _lookup(cache, workflow, redis_store, now=NOW + 5)
    assert hit.hit and hit.value_raw == '{"text":"an essay","n":[1,2]}'
    assert hit.events[0].type == "cache.hit" and hit.events[0].data == {"fingerprint": expected[:16],
                                                                        "stored_at": NOW}
    # and another input is another entry
    assert not _lookup(cache, workflow, redis_store, input={"topic": "graphs"}).hit


def test_entries_expire_in_redis_after_max_age_or_the_default_ttl(store: RedisStore, workflow: str) -> None:
    short, long = "a" * 40 + uuid.uuid4().hex[:24], "b" * 40 + uuid.uuid4().hex[:24]
    caching.write_back(caching.RedisCacheStore(store, max_age_ms=5_000), TASK, short, "1", NOW)
    caching.write_back(caching.RedisCacheStore(store, ttl_s=3_600), TASK, long, "1", NOW)
    assert 0 < store.client.pttl(k.cache_key(short)) <= 5_000
    assert 5_000 < store.client.pttl(k.cache_key(long)) <= 3_600_000  # no entry lives forever


def test_an_entry_older_than_max_age_is_a_miss(store: RedisStore, workflow: str) -> None:
    # Given an entry stored at NOW, with a maximum age of one minute
    cache = tl.Cache(key=_by_topic, max_age_ms=60_000)
    redis_store = caching.store_for(cache, store)
    found = _lookup(cache, workflow, redis_store)
    assert found.fingerprint is not None
    caching.write_back(redis_store, TASK, found.fingerprint, '"fresh"', NOW)
    # Then it is a hit up to its age, and a miss (expired) past it
    assert _lookup(cache, workflow, redis_store, now=NOW + 60.0).hit  # exactly max_age: still valid
    expired = _lookup(cache, workflow, redis_store, now=NOW + 60.5)
    assert not expired.hit and _kinds(expired) == [("cache.miss", "expired")]
    # without max_age_ms the same entry never expires by age
    assert _lookup(tl.Cache(key=_by_topic), workflow, redis_store, now=NOW + 10 * 365 * 86400).hit


def test_refresh_mode_always_misses_but_keeps_the_fingerprint(store: RedisStore, workflow: str) -> None:
    redis_store = caching.RedisCacheStore(store)
    reuse = _lookup(tl.Cache(key=_by_topic), workflow, redis_store)
    assert reuse.fingerprint is not None
    caching.write_back(redis_store, TASK, reuse.fingerprint, '"old"', NOW)
    refresh = _lookup(tl.Cache(key=_by_topic, mode="refresh"), workflow, redis_store)
    assert not refresh.hit and _kinds(refresh) == [("cache.miss", "refresh")]
    assert refresh.fingerprint == reuse.fingerprint  # the new value is written back over the old one


# --- failing stores and bad keys --------------------------------------------------------------------


class BrokenStore:
    """A custom cache store that fails as it is told: raise, or return something that is no entry."""

    def __init__(self, read: Any = None, read_error: Exception | None = None,
                 write_error: Exception | None = None) -> None:
        self.found = read
        self.read_error = read_error
        self.write_error = write_error

    def read(self, fingerprint: str) -> dict[str, Any] | None:
        if self.read_error is not None:
            raise self.read_error
        return self.found  # type: ignore[no-any-return]

    def write(self, fingerprint: str, entry: dict[str, Any]) -> None:
        if self.write_error is not None:
            raise self.write_error


@pytest.mark.parametrize(("broken", "error"), [
    (BrokenStore(read_error=ConnectionError("cache down")), "ConnectionError: cache down"),
    (BrokenStore(read={"stored_at": NOW}), "KeyError: 'value'"),
    (BrokenStore(read={"value": 1, "stored_at": "yesterday"}), "ValueError"),
    (BrokenStore(read={"value": float("nan"), "stored_at": NOW}), "cached value is not lossless JSON"),
], ids=["raises", "no value", "bad time", "not lossless"])
def test_a_failing_store_degrades_to_a_miss_and_a_failed_event(workflow: str, broken: BrokenStore,
                                                               error: str) -> None:
    cache = tl.Cache(key=_by_topic, store=broken)
    assert caching.store_for(cache, None) is broken  # type: ignore[arg-type]  # the custom store is used
    found = _lookup(cache, workflow, broken)
    assert not found.hit and found.error is None and found.fingerprint is not None
    assert _kinds(found) == [("cache.failed", None), ("cache.miss", "store failed")]
    failed = found.events[0].data or {}
    assert failed["operation"] == "read" and error in failed["error"]


def test_a_cached_value_over_the_output_cap_is_never_restored(workflow: str) -> None:
    big = BrokenStore(read={"value": "x" * 200, "stored_at": NOW})
    found = _lookup(tl.Cache(key=_by_topic), workflow, big, max_bytes=100)
    assert not found.hit and _kinds(found) == [("cache.failed", None), ("cache.miss", "store failed")]
    assert "TASKLOOP_MAX_OUTPUT_BYTES" in (found.events[0].data or {})["error"]
    assert _lookup(tl.Cache(key=_by_topic), workflow, big, max_bytes=1000).hit


def test_a_failing_write_back_is_a_failed_event_not_an_error() -> None:
    event = caching.write_back(BrokenStore(write_error=TimeoutError("slow")), TASK, "f" * 64, '"v"', NOW)
    assert event.type == "cache.failed"
    assert event.data == {"fingerprint": "f" * 16, "operation": "write", "error": "TimeoutError: slow"}


@pytest.mark.parametrize(("key", "problem"), [
    (lambda ctx: {"when": {1, 2}}, "$.when is a set"),
    (lambda ctx: float("inf"), "$ is inf"),
    (lambda ctx: object(), "$ is a object"),
])
def test_a_key_that_is_not_json_fails_the_task_with_invalid_cache_key(store: RedisStore, workflow: str, key: Any,
                                                                      problem: str) -> None:
    found = _lookup(tl.Cache(key=key), workflow, caching.RedisCacheStore(store))
    assert found.error is not None and found.error.type == "InvalidCacheKey"
    assert f"cache key of task {TASK} must be lossless JSON values" in found.error.message
    assert problem in found.error.message
    assert found.fingerprint is None and found.events == [] and not found.hit


def test_a_key_function_that_raises_fails_the_task_with_its_error(store: RedisStore, workflow: str) -> None:
    def broken(ctx: TaskContext) -> str:
        return str(ctx.input["missing"])

    found = _lookup(tl.Cache(key=broken), workflow, caching.RedisCacheStore(store))
    assert found.error is not None and found.error.type == "KeyError"
    assert (found.error.details or {})["cause"] == "cache key function failed"
    assert found.fingerprint is None and found.events == []


def test_an_async_key_function_is_awaited(store: RedisStore, workflow: str) -> None:
    async def key(ctx: TaskContext) -> str:
        return str(ctx.input["topic"])

    found = _lookup(tl.Cache(key=key), workflow, caching.RedisCacheStore(store))
    assert found.error is None and found.fingerprint == caching.fingerprint(workflow, TASK, "1", "loops")

"""The pure worker logic: outcome resolution (timeout, cancel, retry, accepts), the record
consistency checks, and cache lookups with a fake store and an injected time."""

from __future__ import annotations

import random
from typing import Any

import pytest

import taskloop as tl
from taskloop.base.errors import TaskLoopError
from taskloop.core import fields as fld
from taskloop.core import outcomes
from taskloop.core.outcomes import Outcome
from taskloop.core.phases import EventKind
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase, Slot, TaskStatus
from taskloop.worker.execution import cache as caching
from taskloop.worker.recovery import executions as recovery

NOW = 1000.0
BOOM = ErrorRecord(type="ValueError", message="boom")


def _task(**options: Any) -> tl.Task:
    return tl.define_task("fetch", run=lambda ctx: 1, **options)


def _running(round: int = 1, limit: int = 3, deadline: float | None = None) -> TaskRecord:
    return TaskRecord(key="fetch", kind="task", limit=limit, status=TaskStatus.ACTIVE, phase=Phase.RUN,
                      slot=Slot.RUNNING, round=round, token=3, execs=1, attempts=round, deadline=deadline)


RETRY = tl.Retry(attempts=3, delay_ms=200, backoff="exponential")
ONLY_VALUE_ERRORS = tl.Retry(attempts=3, delay_ms=100, accepts=lambda error, attempt: isinstance(error, ValueError))
FAILED = Outcome(EventKind.FAIL, error=BOOM, exception=ValueError("boom"))
FAILED_KEY = Outcome(EventKind.FAIL, error=BOOM, exception=KeyError("x"))
SUCCEEDED = Outcome(EventKind.SUCCEED, {"v:fetch": "1"})
CANCELLED_BY_CODE = Outcome(EventKind.CANCEL, cancelled=True)

# (label, task options, record, outcome, signal reason, run control) -> (event kind, reason, retry delay s)
CASES: list[tuple[str, dict[str, Any], TaskRecord, Outcome, str | None, str | None, tuple[Any, ...]]] = [
    ("success stays a success", {}, _running(), SUCCEEDED, None, None, (EventKind.SUCCEED, None, None)),
    ("failure without retry", {}, _running(), FAILED, None, None, (EventKind.FAIL, None, None)),
    ("failure retried with backoff", {"retry": RETRY}, _running(round=2), FAILED, None, None,
     (EventKind.RETRY, None, 0.4)),
    ("no tries left", {"retry": RETRY}, _running(round=3), FAILED, None, None, (EventKind.FAIL, None, None)),
    ("accepts lets it retry", {"retry": ONLY_VALUE_ERRORS}, _running(), FAILED, None, None,
     (EventKind.RETRY, None, 0.1)),
    ("accepts refuses", {"retry": ONLY_VALUE_ERRORS}, _running(), FAILED_KEY, None, None,
     (EventKind.FAIL, None, None)),
    ("timeout signal", {"timeout_ms": 500}, _running(deadline=NOW + 10), SUCCEEDED, "timeout", None,
     (EventKind.FAIL, None, None)),
    ("past the deadline", {"timeout_ms": 500}, _running(deadline=NOW - 1), SUCCEEDED, None, None,
     (EventKind.FAIL, None, None)),
    ("timeout retried", {"timeout_ms": 500, "retry": RETRY}, _running(deadline=NOW - 1), SUCCEEDED, None, None,
     (EventKind.RETRY, None, 0.2)),
    ("cancelled run", {}, _running(), SUCCEEDED, "user", "cancel:user", (EventKind.CANCEL, "cancelled", None)),
    ("stopped run", {}, _running(), SUCCEEDED, "stopped", "stop:failed", (EventKind.CANCEL, "stopped", None)),
    ("a failure in a stopped run stays a failure", {"retry": RETRY}, _running(), FAILED, "stopped", "stop:failed",
     (EventKind.FAIL, None, None)),
    ("Cancelled raised with no signal is a failure", {}, _running(), CANCELLED_BY_CODE, None, None,
     (EventKind.FAIL, None, None)),
]


@pytest.mark.parametrize(("label", "options", "record", "outcome", "signal", "control", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_resolve(label: str, options: dict[str, Any], record: TaskRecord, outcome: Outcome, signal: str | None,
                 control: str | None, expected: tuple[Any, ...]) -> None:
    resolved = outcomes.resolve(_task(**options), record, outcome, signal, control, NOW)
    kind, reason, delay = expected
    assert resolved.kind is kind
    assert resolved.reason == reason
    if delay is None:
        assert resolved.retry_at is None
    else:
        assert resolved.retry_at == pytest.approx(NOW + delay)
    if "timeout" in label or "deadline" in label:
        assert resolved.error is not None and resolved.error.type == "TaskTimeout"


def test_full_jitter_draws_below_the_delay() -> None:
    task = _task(retry=tl.Retry(attempts=5, delay_ms=1000, jitter="full"))
    rng = random.Random(3)
    delays = [outcomes.resolve(task, _running(), FAILED, None, None, NOW, rng).retry_at or 0 for _ in range(50)]
    assert all(NOW <= at <= NOW + 1.0 for at in delays) and len(set(delays)) > 10


def test_an_accepts_that_raises_means_no_retry() -> None:
    def broken(error: BaseException, attempt: int) -> bool:
        raise RuntimeError("bad filter")

    task = _task(retry=tl.Retry(attempts=3, accepts=broken))
    assert outcomes.resolve(task, _running(), FAILED, None, None, NOW).kind is EventKind.FAIL


# --- record consistency ----------------------------------------------------------------------------


def _loop(max_rounds: int = 3) -> tl.Task:
    return tl.define_loop_task("fix", max_rounds=max_rounds, attempt=lambda c, f: 1,
                               check=lambda c, v: tl.LoopCheck(done=True))


def _queued(phase: Phase, round: int, **fields: Any) -> TaskRecord:
    return TaskRecord(key="fix", kind="loop", limit=3, status=TaskStatus.ACTIVE, phase=phase, slot=Slot.QUEUED,
                      round=round, token=4, **fields)


INCONSISTENT = [
    ("kind", _loop(), TaskRecord(key="fix", kind="task", status=TaskStatus.ACTIVE, phase=Phase.RUN,
                                 slot=Slot.QUEUED, round=1), {},
     "the record is a task but the definition declares a loop"),
    ("round past the limit", _loop(), _queued(Phase.ATTEMPT, 4), {}, "round 4 is outside 1..3"),
    ("limit changed", _loop(max_rounds=5), _queued(Phase.ATTEMPT, 1), {},
     "the record allows 3 rounds, the definition 5"),
    ("check without candidate", _loop(), _queued(Phase.CHECK, 2), {},
     "round 2 is in check but has no recorded candidate"),
    ("candidate not JSON", _loop(), _queued(Phase.CHECK, 2), {fld.candidate_field("fix", 2): "{oops"},
     "the candidate of round 2 is not JSON"),
    ("attempt without rejection", _loop(), _queued(Phase.ATTEMPT, 2), {fld.check_field("fix", 1): '{"done": true}'},
     "round 2 started but round 1 has no recorded rejection"),
]


@pytest.mark.parametrize(("label", "task", "record", "data", "problem"), INCONSISTENT, ids=[c[0] for c in INCONSISTENT])
def test_inconsistencies_are_named(label: str, task: tl.Task, record: TaskRecord, data: dict[str, str],
                                   problem: str) -> None:
    assert recovery.inconsistency(task, record, Snapshot("r1", data)) == problem


def test_a_consistent_record_has_no_problem() -> None:
    data = {fld.check_field("fix", 1): '{"done": false, "feedback": "again"}', fld.candidate_field("fix", 2): "7"}
    snap = Snapshot("r1", data)
    assert recovery.inconsistency(_loop(), _queued(Phase.ATTEMPT, 2), snap) is None
    assert recovery.inconsistency(_loop(), _queued(Phase.CHECK, 2), snap) is None


def test_the_redelivery_cap_turns_a_lost_execution_into_phase_abandoned() -> None:
    record = TaskRecord(key="fix", kind="loop", limit=3, status=TaskStatus.ACTIVE, phase=Phase.ATTEMPT,
                        slot=Slot.RUNNING, round=1, token=9, execs=5, attempts=5, worker="w@h/1")
    error = recovery.abandoned_error(record, max_executions=5)
    assert error.type == "PhaseAbandoned" and "was started 5 times" in error.message
    assert recovery.is_redelivery_of_running(record, Phase.ATTEMPT, 1, 8)
    assert not recovery.is_redelivery_of_running(record, Phase.ATTEMPT, 1, 9)


# --- cache lookups -----------------------------------------------------------------------------------


class FakeStore:
    """A cache store in memory (the CacheStore protocol), with failures on demand."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}
        self.fail: Exception | None = None

    def read(self, fingerprint: str) -> dict[str, Any] | None:
        if self.fail is not None:
            raise self.fail
        return self.entries.get(fingerprint)

    def write(self, fingerprint: str, entry: dict[str, Any]) -> None:
        if self.fail is not None:
            raise self.fail
        self.entries[fingerprint] = entry


class Ctx:
    input = {"topic": "loops"}


def _lookup(cache: tl.Cache, store: FakeStore, now: float) -> caching.Lookup:
    return caching.lookup(cache, Ctx(), "wf", "essay", store, now)  # type: ignore[arg-type]


def test_cache_miss_then_hit_then_expired() -> None:
    cache = tl.Cache(key=lambda ctx: ctx.input["topic"], max_age_ms=1000)
    store = FakeStore()
    miss = _lookup(cache, store, NOW)
    assert not miss.hit and [e.type for e in miss.events] == ["cache.miss"]
    assert miss.fingerprint == caching.fingerprint("wf", "essay", "1", "loops")
    caching.write_back(store, "essay", miss.fingerprint, '"text"', NOW)
    hit = _lookup(cache, store, NOW + 0.5)
    assert hit.hit and hit.value_raw == '"text"'
    expired = _lookup(cache, store, NOW + 2.0)
    assert not expired.hit and expired.events[0].data == {"fingerprint": miss.fingerprint[:16], "reason": "expired"}


def test_cache_refresh_mode_always_misses() -> None:
    store = FakeStore()
    cache = tl.Cache(key=lambda ctx: "k", mode="refresh")
    store.entries[caching.fingerprint("wf", "essay", "1", "k")] = {"value": 1, "stored_at": NOW}
    assert not _lookup(cache, store, NOW).hit


def test_a_failing_store_is_a_miss_and_an_event() -> None:
    store = FakeStore()
    store.fail = ConnectionError("down")
    found = _lookup(tl.Cache(key=lambda ctx: "k"), store, NOW)
    assert not found.hit and found.error is None
    assert [e.type for e in found.events] == ["cache.failed", "cache.miss"]
    assert caching.write_back(store, "essay", "f" * 64, "1", NOW).type == "cache.failed"


def test_a_bad_key_fails_the_task_with_invalid_cache_key() -> None:
    found = _lookup(tl.Cache(key=lambda ctx: {"when": {1, 2}}), FakeStore(), NOW)
    assert found.error is not None and found.error.type == "InvalidCacheKey"
    assert "$.when is a set" in found.error.message


def test_a_key_function_that_raises_fails_the_task() -> None:
    def broken(ctx: Any) -> str:
        raise TaskLoopError("no key")

    found = _lookup(tl.Cache(key=broken), FakeStore(), NOW)
    assert found.error is not None and found.error.type == "TaskLoopError"

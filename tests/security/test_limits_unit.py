"""The payload caps as pure logic: sizes, settings, and what a callback's oversized value turns
into (an OutputTooLarge failure with no data to write), plus the cache TTL and the lease-first
check of a redelivered message. No Redis: fakes stand for the store."""

from __future__ import annotations

import time
from typing import Any, cast

import pytest

import taskloop as tl
from taskloop.base import limits, text
from taskloop.base.config import Settings
from taskloop.core import fields as fld
from taskloop.core import outcomes
from taskloop.core.phases import EventKind
from taskloop.core.records import TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase, Slot, TaskStatus
from taskloop.define.context import LoopContext, Signal, TaskContext
from taskloop.define.tasks import TaskKind
from taskloop.runtime import starting
from taskloop.store import keys as k
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution import cache as caching
from taskloop.worker.execution.callbacks import Usage, call_phase, error_record
from taskloop.worker.recovery import executions as recovery

MIB = 1_048_576
CAPS = limits.Caps()  # the defaults


class NoStore:
    """A store that must not be written to."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the store was used ({name}) for a value over its cap")


class Usages:
    def __init__(self) -> None:
        self.reports: list[tuple[str | None, dict[str, int]]] = []

    def report(self, counts: dict[str, int]) -> None:
        self.reports.append((None, counts))

    def report_once(self, receipt: str, counts: dict[str, int]) -> bool:
        self.reports.append((receipt, counts))
        return True


def _ctx(usage: Any = None, round: int | None = None, phase: str = "attempt", **input: Any) -> TaskContext:
    common: dict[str, Any] = dict(run_id="r1", workflow="wf", key="emit", load_input=lambda: input, attempt=1,
                                  signal=Signal(), idempotency_key="r1/emit/1/run", after=(),
                                  load_value=lambda key: None, usage=usage or Usages())
    if round is None:
        return TaskContext(**common)
    return LoopContext(round=round, phase=phase, **common)


def _plain(run: Any, **options: Any) -> tl.Task:
    return tl.define_task("emit", run=run, **options)


def _loop(attempt: Any = None, check: Any = None) -> tl.Task:
    return tl.define_loop_task("emit", max_rounds=3, attempt=attempt or (lambda ctx, feedback: 1),
                               check=check or (lambda ctx, candidate: tl.LoopCheck(done=True)))


# --- sizes and settings -----------------------------------------------------------------------------


def test_sizes_are_utf8_bytes_of_the_stored_json_and_the_cap_itself_is_allowed() -> None:
    assert limits.oversize("a" * 100, 100) is None
    assert limits.oversize("a" * 101, 100) == 101
    assert limits.oversize("é" * 50, 100) is None  # 2 bytes each: exactly the cap
    assert limits.oversize("é" * 51, 100) == 102  # 51 characters, 102 bytes
    assert limits.oversize("😀" * 26, 100) == 104


def test_the_default_caps_are_one_mebibyte_and_one_kibibyte_for_receipt_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (limits.INPUT_ENV, limits.OUTPUT_ENV, limits.FEEDBACK_ENV, limits.GATE_VALUE_ENV, limits.RECEIPT_ENV,
                 "TASKLOOP_CACHE_TTL_S"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings(redis_url="redis://127.0.0.1:1/0")
    assert settings.caps() == limits.Caps(input=MIB, output=MIB, feedback=MIB, gate_value=MIB, receipt=1024)
    assert settings.cache_ttl_s == 30 * 24 * 3600


def test_caps_come_from_the_environment_and_nonsense_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(limits.OUTPUT_ENV, "2048")
    monkeypatch.setenv(limits.RECEIPT_ENV, "64")
    monkeypatch.setenv("TASKLOOP_CACHE_TTL_S", "60")
    settings = Settings(redis_url="redis://127.0.0.1:1/0")
    assert (settings.caps().output, settings.caps().receipt, settings.cache_ttl_s) == (2048, 64, 60)
    for bad in ("0", "-5"):
        monkeypatch.setenv(limits.INPUT_ENV, bad)
        with pytest.raises(ValueError, match="TASKLOOP_MAX_INPUT_BYTES must be a positive number of bytes"):
            Settings(redis_url="redis://127.0.0.1:1/0")
    monkeypatch.setenv(limits.INPUT_ENV, "1MB")
    with pytest.raises(ValueError, match="TASKLOOP_MAX_INPUT_BYTES must be an integer"):
        Settings(redis_url="redis://127.0.0.1:1/0")


# --- the client side: InvalidInput ---------------------------------------------------------------------


def test_a_run_input_over_the_cap_raises_invalid_input_naming_size_limit_and_setting() -> None:
    raw, _ = starting.prepare_input({"text": "x" * (MIB - 11)}, MIB)  # 1 MiB of JSON exactly is fine
    assert len(raw) == MIB
    with pytest.raises(tl.InvalidInput) as info:
        starting.prepare_input({"text": "x" * (MIB - 10)}, MIB)
    message = str(info.value)
    assert "run input is 1,048,577 bytes of JSON, over the limit of 1,048,576 bytes" in message
    assert "TASKLOOP_MAX_INPUT_BYTES" in message


# --- the worker side: OutputTooLarge, nothing to write ------------------------------------------------------


def _assert_too_large(outcome: Any, *fragments: str) -> None:
    assert outcome.kind is EventKind.FAIL
    assert outcome.data == {}  # nothing of the value is recorded
    assert outcome.error.type == "OutputTooLarge"
    assert isinstance(outcome.exception, tl.OutputTooLarge)
    for fragment in fragments:
        assert fragment in outcome.error.message
    assert len(outcome.error.message) < 500


def test_a_plain_output_over_the_cap_fails_with_output_too_large() -> None:
    task = _plain(lambda ctx: "x" * (2 * MIB))
    outcome = call_phase(task, Phase.RUN, _ctx(), Snapshot("r1", {}), CAPS)
    _assert_too_large(outcome, "the output of task emit is 2,097,154 bytes of JSON", "1,048,576",
                      "TASKLOOP_MAX_OUTPUT_BYTES")
    assert outcome.error is not None and outcome.error.details is not None
    assert outcome.error.details["size"] == 2 * MIB + 2  # the quotes of the JSON string count


def test_an_output_at_the_cap_is_recorded() -> None:
    task = _plain(lambda ctx: "x" * (MIB - 2))
    outcome = call_phase(task, Phase.RUN, _ctx(), Snapshot("r1", {}), CAPS)
    assert outcome.kind is EventKind.SUCCEED and len(outcome.data[fld.value_field("emit")]) == MIB


def test_a_candidate_over_the_cap_fails_before_check_runs() -> None:
    task = _loop(attempt=lambda ctx, feedback: ["y" * MIB])
    outcome = call_phase(task, Phase.ATTEMPT, _ctx(round=1), Snapshot("r1", {}), CAPS)
    _assert_too_large(outcome, "the candidate of task emit round 1 is 1,048,580 bytes")


def test_a_check_feedback_over_the_cap_fails_with_output_too_large() -> None:
    task = _loop(check=lambda ctx, candidate: tl.LoopCheck(done=False, feedback="f" * (2 * MIB)))
    snap = Snapshot("r1", {fld.candidate_field("emit", 1): "1"})
    outcome = call_phase(task, Phase.CHECK, _ctx(round=1, phase="check"), snap, CAPS)
    _assert_too_large(outcome, "the check result (its feedback) of task emit round 1", "TASKLOOP_MAX_FEEDBACK_BYTES")


def test_a_receipt_id_over_its_cap_fails_the_phase_and_touches_no_store() -> None:
    usage = Usage(cast(RedisStore, NoStore()), "r1", "emit", max_receipt_bytes=1024)

    def bill(ctx: tl.TaskContext) -> int:
        ctx.report_usage_once("r" * 1025, input=1)
        return 1

    outcome = call_phase(_plain(bill), Phase.RUN, _ctx(usage=usage), Snapshot("r1", {}), CAPS)
    _assert_too_large(outcome, "the usage receipt id reported by task emit is 1,025 bytes",
                      "TASKLOOP_MAX_RECEIPT_BYTES")


def test_token_counts_must_be_safe_integers() -> None:
    ctx = _ctx()
    ctx.report_usage(input=2**53 - 1)
    with pytest.raises(tl.DefinitionError, match="up to 2\\*\\*53-1, got an int of 16610 bits"):
        ctx.report_usage(output=10**5000)


def test_notes_over_the_cap_are_replaced_by_a_note_and_never_fail_the_phase() -> None:
    def noted(ctx: tl.TaskContext) -> int:
        ctx.notes["llm"] = {"prompt": "p" * (2 * MIB)}
        return 1

    outcome = call_phase(_plain(noted), Phase.RUN, _ctx(), Snapshot("r1", {}), CAPS)
    assert outcome.kind is EventKind.SUCCEED
    note = outcome.data[fld.notes_field("emit", 1, "run")]
    assert len(note) < 200 and "over TASKLOOP_MAX_OUTPUT_BYTES=1048576" in note


def test_an_error_message_is_cut() -> None:
    error = error_record(ValueError("e" * (10 * MIB)))
    assert len(error.message) < text.MESSAGE_LIMIT + 100 and error.message.endswith("more characters cut)")


def _running(**fields: Any) -> TaskRecord:
    return TaskRecord(key="emit", kind=TaskKind.TASK, limit=3, status=TaskStatus.ACTIVE, phase=Phase.RUN,
                      slot=Slot.RUNNING, round=1, token=3, execs=1, attempts=1, **fields)


@pytest.mark.parametrize(("retry", "expected"), [
    (None, EventKind.FAIL),  # deterministic: no retry unless the task asks for one
    (tl.Retry(attempts=3), EventKind.RETRY),  # as for InvalidOutput, a Retry policy applies
    (tl.Retry(attempts=3, accepts=lambda error, n: not isinstance(error, tl.OutputTooLarge)), EventKind.FAIL),
])
def test_output_too_large_is_retried_only_as_the_retry_policy_says(retry: tl.Retry | None,
                                                                   expected: EventKind) -> None:
    task = _plain(lambda ctx: "x" * (2 * MIB), retry=retry)
    outcome = call_phase(task, Phase.RUN, _ctx(), Snapshot("r1", {}), CAPS)
    assert outcomes.resolve(task, _running(), outcome, None, None, 1000.0).kind is expected


# --- cache: values over the cap are misses; entries always expire -----------------------------------------


class FakeCache:
    def __init__(self, entries: dict[str, Any]) -> None:
        self.entries = entries

    def read(self, fingerprint: str) -> dict[str, Any] | None:
        return self.entries.get(fingerprint)

    def write(self, fingerprint: str, entry: dict[str, Any]) -> None:
        self.entries[fingerprint] = entry


def test_a_cached_value_over_the_cap_is_a_failed_read_and_a_miss() -> None:
    cache = tl.Cache(key=lambda ctx: "k")
    fingerprint = caching.fingerprint("wf", "emit", "1", "k")
    store = FakeCache({fingerprint: {"value": "x" * (2 * MIB), "stored_at": 1.0}})
    found = caching.lookup(cache, _ctx(), "wf", "emit", store, 2.0, MIB)
    assert not found.hit and found.error is None
    assert [e.type for e in found.events] == ["cache.failed", "cache.miss"]
    assert "TASKLOOP_MAX_OUTPUT_BYTES" in str((found.events[0].data or {})["error"])


class SetRecorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def set(self, name: str, value: str, px: int | None = None) -> None:
        self.calls.append({"name": name, "px": px})


@pytest.mark.parametrize(("max_age_ms", "ttl_s", "px"), [
    (None, 30 * 24 * 3600, 30 * 24 * 3600 * 1000),  # no max_age: TASKLOOP_CACHE_TTL_S (never forever)
    (None, 60, 60_000),
    (5_000, 60, 5_000),  # the Cache's own max_age_ms wins
])
def test_a_redis_cache_entry_always_has_a_ttl(max_age_ms: int | None, ttl_s: int, px: int) -> None:
    client = SetRecorder()
    store = cast(RedisStore, type("S", (), {"client": client})())
    found = caching.store_for(tl.Cache(key=lambda ctx: 1, max_age_ms=max_age_ms), store, ttl_s)
    found.write("f" * 64, {"value": 1, "stored_at": 1.0})
    assert client.calls == [{"name": k.cache_key("f" * 64), "px": px}]


# --- a redelivered message at a running phase: the lease first, never a wait ---------------------------


class Leases:
    def __init__(self, expiry: float | None) -> None:
        self.expiry = expiry

    def lease_of(self, run_id: str, key: str) -> float | None:
        return self.expiry

    def workers_seen(self) -> dict[str, str]:
        return {}


def _lost(expiry: float | None, record: TaskRecord) -> bool:
    return recovery.execution_lost(cast(RedisStore, Leases(expiry)), "r1", record, 300.0)


def test_an_expired_lease_means_lost_without_looking_at_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(worker: str | None, wait: float = 0.0) -> bool:
        raise AssertionError("worker_is_dead called although the lease had expired")

    monkeypatch.setattr(recovery, "worker_is_dead", never)
    record = _running(worker="w@host/1")
    assert _lost(time.time() - 1, record) is True


def test_a_live_lease_looks_at_the_process_once_and_never_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []

    def looked(worker: str | None, wait: float = 0.0) -> bool:
        waits.append(wait)
        return False

    monkeypatch.setattr(recovery, "worker_is_dead", looked)
    record = _running(worker="w@host/1")
    assert _lost(time.time() + 30, record) is False
    assert waits == [0.0]


def test_a_queued_phase_run_before_its_begin_is_judged_by_its_own_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop's next phase may keep the stored lease of its earlier queueing (core/draft.py
    _kept_leases, the record's lease_kept): expired there, it is not lost while its own queued lease
    is ahead. A lease written for its own queueing is taken at its word."""
    monkeypatch.setattr(recovery, "worker_is_dead", lambda worker, wait=0.0: False)
    now = time.time()
    ran = TaskRecord(key="t", kind=TaskKind.LOOP, limit=3, status=TaskStatus.ACTIVE, phase=Phase.ATTEMPT,
                     slot=Slot.QUEUED, round=2, token=5, queued_at=now - 10, worker="w@host/1", began_at=now - 1,
                     lease_kept=now - 60)
    assert _lost(now - 60, ran) is False  # the kept lease passed; its own ends at queued_at + 300 s
    assert _lost(now + 60, ran.model_copy(update={"queued_at": now - 301})) is True
    assert _lost(now - 1, ran.model_copy(update={"lease_kept": None})) is True  # its own lease, expired

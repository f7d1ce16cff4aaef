"""The one commit path (taskloop/runtime/commit.py) against a real redis-server: a guarded write
is applied whole or refused naming its guard; ``commit`` plans again after a conflict and gives up
after ``attempts``; a plan that raises writes nothing; ``through_outage`` rides out an unreachable
store for a bounded time."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import taskloop as tl
from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import CommitConflict, StoreUnavailable
from taskloop.core import fields as fld
from taskloop.core.batch import Batch, Index
from taskloop.core.begin import Dispatch
from taskloop.core.events import Event
from taskloop.core.phases import EventKind, PhaseEvent
from taskloop.core.planner import Planner
from taskloop.core.records import TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import State
from taskloop.define.workflow import REGISTRY, Workflow
from taskloop.ops.embedded import RedisServer
from taskloop.runtime import commit as cm
from taskloop.runtime import writes as wr
from taskloop.store import keys as k
from taskloop.store.redis_store import Applied, Conflict, RedisStore
from tests.harness import Sent

WORKER = "node@host/1"


@pytest.fixture()
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain client on the test server: the "other writer" of the conflict tests."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture()
def settings(redis_server: RedisServer) -> Settings:
    return Settings(redis_url=redis_server.url)


def _define(observers: tuple[Callable[..., Any], ...] = ()) -> Workflow:
    a = tl.define_task("a", run=lambda ctx: 1)
    b = tl.define_task("b", run=lambda ctx: 2, after=[a])
    return tl.define_workflow(f"commit-{uuid.uuid4().hex[:12]}", version="1", tasks=[a, b], observers=observers)


@pytest.fixture()
def workflow() -> Iterator[Workflow]:
    """a -> b, registered under a name of its own."""
    wf = _define()
    yield wf
    REGISTRY.unregister(wf.name, wf.version)


def _run_id() -> str:
    return f"commit-{uuid.uuid4().hex}"


def _start(store: RedisStore, wf: Workflow, settings: Settings) -> str:
    """A new run of ``wf`` (a queued), through commit itself."""
    run_id = _run_id()

    def plan(snap: Snapshot) -> Planner:
        return Planner.start_run(wf, run_id, "{}", "digest", clock.now(), settings)

    cm.commit(store, plan, Snapshot(run_id), Sent(), retry=cm.never)
    return run_id


def _record(store: RedisStore, run_id: str, key: str) -> TaskRecord:
    found = store.snapshot(run_id, fld.record_fields(key)).record(key)
    assert found is not None
    return found


def _running_a(store: RedisStore, wf: Workflow, settings: Settings) -> str:
    """A run whose task a is running (begun by a worker)."""
    run_id = _start(store, wf, settings)

    def plan(view: Snapshot) -> Planner:
        planner = Planner(wf, view, clock.now(), settings)
        planner.admit("a", WORKER, None)
        return planner

    cm.commit(store, plan, store.snapshot(run_id, [*fld.record_fields("a"), fld.F_CONTROL]), Sent())
    assert _record(store, run_id, "a").state is State.RUNNING_RUN
    return run_id


def _a_succeeds(wf: Workflow, settings: Settings, calls: list[Snapshot],
                before: Callable[[int], None] | None = None) -> cm.Plan:
    """A plan: a succeeded (b follows). ``before(n)`` runs before the n-th planning (1-based)."""
    def plan(view: Snapshot) -> Planner:
        calls.append(view)
        if before is not None:
            before(len(calls))
        planner = Planner(wf, view, clock.now(), settings)
        planner.outcome("a", PhaseEvent(EventKind.SUCCEED, planner.now), {fld.value_field("a"): "1"})
        return planner
    return plan


def _outcome_snapshot(store: RedisStore, run_id: str) -> Snapshot:
    return store.snapshot(run_id, [*fld.record_fields("a"), fld.F_CONTROL])


# --- write ------------------------------------------------------------------------------------------


def test_write_applies_a_guarded_batch_as_a_whole(store: RedisStore) -> None:
    # Given a batch that creates a run: fields, an event, a lease and an index entry
    run_id = _run_id()
    batch = Batch(run_id).expect(fld.F_WORKFLOW, None, "run exists")
    batch.set(fld.F_WORKFLOW, "wf").set(fld.F_STATUS, "running").incr(fld.F_OPEN, 2)
    batch.event(Event(type="run.started", at=1000.0)).event(Event(type="phase", key="a", at=1000.0))
    batch.lease("a", 1030.0).index(Index.LIVE, run_id, 1030.0).list_run("wf", "running", 1000.0, new=True)
    # When it is written
    result = wr.write(store, batch)
    # Then everything is there, and the two events share one stream entry
    assert result == Applied(finished=False)
    assert store.all_fields(run_id) == {fld.F_WORKFLOW: "wf", fld.F_STATUS: "running", fld.F_OPEN: "2"}
    events = store.events(run_id)
    assert [e.type for e in events] == ["run.started", "phase"]
    assert len({e.entry_id for e in events}) == 1
    assert store.lease_of(run_id, "a") == 1030.0
    assert store.client.zscore(k.LIVE_INDEX, run_id) == 1030.0  # an index, written outside the script
    for listed in ("tl:runs", "tl:runs:w:wf", "tl:runs:w:wf:s:running"):  # inside it
        assert store.client.zscore(listed, run_id) == 1000.0, listed
    assert "wf" in store.client.smembers(k.LISTED_WORKFLOWS)  # named, in the same round trip


def test_write_refuses_a_batch_whose_guard_failed_and_names_it(store: RedisStore, raw: redis.Redis) -> None:
    # Given a run whose status is running
    run_id = _run_id()
    assert isinstance(wr.write(store, Batch(run_id).set(fld.F_WORKFLOW, "wf").set(fld.F_STATUS, "running")), Applied)
    queue = f"queue-{uuid.uuid4().hex}"
    # When a batch that expects it pending is written (its first guard holds, the second does not)
    batch = Batch(run_id).exists(fld.F_WORKFLOW, "run exists").expect(fld.F_STATUS, "pending", "pending run")
    batch.set(fld.F_STATUS, "failed").delete(fld.F_WORKFLOW).incr(fld.F_OPEN, 1)
    batch.event(Event(type="run.finished", at=1000.0)).lease("a", 1030.0).push("lpush", queue, "message")
    batch.end_marker = "failed"
    result = wr.write(store, batch)
    # Then it is refused naming the guard, what it protects and what the store holds; nothing was written
    assert result == Conflict(index=2, label="pending run", field=fld.F_STATUS, current="running")
    assert store.all_fields(run_id) == {fld.F_WORKFLOW: "wf", fld.F_STATUS: "running"}
    assert store.events(run_id) == []
    assert store.lease_of(run_id, "a") is None
    assert raw.llen(queue) == 0  # a refused write sends no message
    assert raw.llen(k.RunKeys.of(run_id).end) == 0


GUARDS: list[tuple[str, Callable[[Batch], Batch], bool]] = [
    ("eq holds", lambda b: b.expect("f", "1"), True),
    ("eq fails", lambda b: b.expect("f", "2"), False),
    ("nx holds on an absent field", lambda b: b.expect("missing", None), True),
    ("nx fails on a present field", lambda b: b.expect("f", None), False),
    ("ex holds", lambda b: b.exists("f"), True),
    ("ex fails", lambda b: b.exists("missing"), False),
    ("in holds", lambda b: b.one_of("f", ["0", "1"]), True),
    ("in fails", lambda b: b.one_of("f", ["0", "2"]), False),
    ("cap holds at the limit", lambda b: b.cap("n", 5, 2, "cap"), True),
    ("cap fails past the limit", lambda b: b.cap("n", 5, 3, "cap"), False),
    ("cap counts an absent field as 0", lambda b: b.cap("missing", 1, 1, "cap"), True),
]


@pytest.mark.parametrize(("label", "guard", "holds"), GUARDS, ids=[g[0] for g in GUARDS])
def test_each_guard_kind_is_checked_by_the_script(store: RedisStore, label: str, guard: Callable[[Batch], Batch],
                                                  holds: bool) -> None:
    run_id = _run_id()
    wr.write(store, Batch(run_id).set("f", "1").set("n", "3"))
    result = wr.write(store, guard(Batch(run_id)).set("written", "yes"))
    assert isinstance(result, Applied) is holds
    assert (store.hmget(run_id, ["written"]) == ["yes"]) is holds


def test_a_conflict_on_an_absent_field_reports_none(store: RedisStore) -> None:
    run_id = _run_id()
    result = wr.write(store, Batch(run_id).expect(fld.F_STATUS, "running", "status"))
    assert result == Conflict(index=1, label="status", field=fld.F_STATUS, current=None)


def test_the_final_part_is_applied_by_the_write_that_ends_the_last_open_task(store: RedisStore) -> None:
    # Given a run with two open tasks
    run_id = _run_id()
    wr.write(store, Batch(run_id).set(fld.F_WORKFLOW, "wf").set(fld.F_OPEN, "2"))

    def ending(key: str) -> Batch:
        batch = Batch(run_id).set(fld.task_field(key), "done")
        batch.event(Event(type="task", key=key, at=1000.0))
        batch.open_delta = -1
        batch.final.hset[fld.F_STATUS] = "done"
        batch.final.events.append(Event(type="run.finished", at=1000.0))
        batch.final.end_marker = "done"
        batch.final.ttl = 600
        return batch

    # When the first ends: the run goes on, its final writes are not applied
    assert wr.write(store, ending("a")) == Applied(finished=False)
    assert store.hmget(run_id, [fld.F_OPEN, fld.F_STATUS]) == ["1", None]
    # When the second ends: the run ends, in the same write, with its events in the same entry
    assert wr.write(store, ending("b")) == Applied(finished=True)
    assert store.hmget(run_id, [fld.F_OPEN, fld.F_STATUS]) == ["0", "done"]
    events = store.events(run_id)
    assert [e.type for e in events] == ["task", "task", "run.finished"]
    assert events[1].entry_id == events[2].entry_id
    assert store.client.lrange(k.RunKeys.of(run_id).end, 0, -1) == ["done"]
    assert 0 < store.client.ttl(k.RunKeys.of(run_id).run) <= 600


def test_pushes_are_sent_with_the_write(store: RedisStore, raw: redis.Redis) -> None:
    run_id, first, second = _run_id(), f"q-{uuid.uuid4().hex}", f"q-{uuid.uuid4().hex}"
    batch = Batch(run_id).set(fld.F_WORKFLOW, "wf")
    batch.push("lpush", first, "m1").push("lpush", second, "m2").push("lpush", first, "m3")
    assert isinstance(wr.write(store, batch), Applied)
    assert raw.lrange(first, 0, -1) == ["m3", "m1"] and raw.lrange(second, 0, -1) == ["m2"]


def test_a_lease_set_after_it_was_dropped_in_the_same_batch_is_kept(store: RedisStore) -> None:
    run_id = _run_id()
    assert isinstance(wr.write(store, Batch(run_id).lease("a", None).lease("a", 1030.0)), Applied)
    assert store.lease_of(run_id, "a") == 1030.0


# --- commit -----------------------------------------------------------------------------------------


def test_commit_writes_the_plan_then_sends_its_dispatches(store: RedisStore, workflow: Workflow,
                                                          settings: Settings) -> None:
    run_id = _running_a(store, workflow, settings)
    sent, calls = Sent(), list[Snapshot]()
    committed = cm.commit(store, _a_succeeds(workflow, settings, calls), _outcome_snapshot(store, run_id), sent)
    assert len(calls) == 1 and not committed.finished
    b = _record(store, run_id, "b")
    assert _record(store, run_id, "a").state is State.DONE and b.state is State.QUEUED_RUN
    assert sent.calls == [(workflow.name, run_id, [("b", "run", 1, b.token)])]
    assert [e.type for e in committed.events] == ["task", "phase"]  # a done, b entered its run


def test_commit_plans_again_over_what_a_concurrent_writer_changed(store: RedisStore, raw: redis.Redis,
                                                                  workflow: Workflow, settings: Settings) -> None:
    # Given a running a, and another writer that stops the run just after the first planning read it
    run_id = _running_a(store, workflow, settings)

    def concurrent(n: int) -> None:
        if n == 1:
            raw.hset(k.RunKeys.of(run_id).run, fld.F_CONTROL, "stop:elsewhere")

    sent, calls = Sent(), list[Snapshot]()
    # When a's success is committed
    committed = cm.commit(store, _a_succeeds(workflow, settings, calls, concurrent), _outcome_snapshot(store, run_id),
                          sent)
    # Then the first write conflicted on the control flag, and the second plan saw the stop:
    # b is skipped instead of dispatched, and the first plan's dispatch of b was never sent
    assert len(calls) == 2
    assert calls[0] is calls[1] and calls[1].control == "stop:elsewhere"  # the snapshot was read again
    assert committed.planner.tasks["b"].state is State.SKIPPED
    assert _record(store, run_id, "b").state is State.SKIPPED
    assert sent.calls == []
    assert committed.finished  # both tasks are terminal: the run ended in that write
    assert store.hmget(run_id, [fld.F_STATUS, fld.F_CONTROL]) == ["failed", "stop:elsewhere"]


def test_commit_gives_up_after_its_attempts(store: RedisStore, raw: redis.Redis, workflow: Workflow,
                                            settings: Settings) -> None:
    # Given another writer that changes the control flag before every planning
    run_id = _running_a(store, workflow, settings)
    before = store.all_fields(run_id)

    def concurrent(n: int) -> None:
        raw.hset(k.RunKeys.of(run_id).run, fld.F_CONTROL, f"stop:writer-{n}")

    sent, calls = Sent(), list[Snapshot]()
    # When a's success is committed with 3 attempts
    with pytest.raises(CommitConflict, match="gave up writing after repeated conflicts") as caught:
        cm.commit(store, _a_succeeds(workflow, settings, calls, concurrent), _outcome_snapshot(store, run_id), sent,
                  attempts=3)
    # Then it planned 3 times, names the last conflict, wrote and sent nothing
    assert len(calls) == 3
    conflict = caught.value.conflict
    assert isinstance(conflict, Conflict) and conflict.label == "control"
    assert conflict.current == "stop:writer-3"
    assert {**before, fld.F_CONTROL: "stop:writer-3"} == store.all_fields(run_id)
    assert sent.calls == []


def test_a_final_conflict_is_not_planned_again(store: RedisStore, raw: redis.Redis, workflow: Workflow,
                                               settings: Settings) -> None:
    run_id = _running_a(store, workflow, settings)
    seen: list[Conflict] = []

    def concurrent(n: int) -> None:
        raw.hset(k.RunKeys.of(run_id).run, fld.F_CONTROL, "cancel:user")

    def retry(conflict: Conflict) -> bool:
        seen.append(conflict)
        return False

    calls: list[Snapshot] = []
    with pytest.raises(CommitConflict):
        cm.commit(store, _a_succeeds(workflow, settings, calls, concurrent), _outcome_snapshot(store, run_id), Sent(),
                  retry=retry)
    assert len(calls) == 1 and [c.label for c in seen] == ["control"]


def test_a_plan_that_raises_writes_nothing(store: RedisStore, workflow: Workflow, settings: Settings) -> None:
    run_id = _running_a(store, workflow, settings)
    fields, events = store.all_fields(run_id), store.events(run_id)
    sent = Sent()

    def plan(view: Snapshot) -> Planner:
        planner = Planner(workflow, view, clock.now(), settings)
        planner.outcome("a", PhaseEvent(EventKind.SUCCEED, planner.now))
        raise ValueError("changed my mind")

    with pytest.raises(ValueError, match="changed my mind"):
        cm.commit(store, plan, _outcome_snapshot(store, run_id), sent)
    assert store.all_fields(run_id) == fields and store.events(run_id) == events
    assert sent.calls == []


def test_a_plan_may_give_up_when_it_sees_the_concurrent_change(store: RedisStore, raw: redis.Redis,
                                                               workflow: Workflow, settings: Settings) -> None:
    # Given a plan that refuses to go on once the run was stopped (as the outage sweep does)
    run_id = _running_a(store, workflow, settings)
    calls: list[Snapshot] = []

    def concurrent(n: int) -> None:
        if n == 1:
            raw.hset(k.RunKeys.of(run_id).run, fld.F_CONTROL, "stop:elsewhere")
        elif calls[-1].control is not None:
            raise CommitConflict(f"{run_id}/a moved on")

    # When the first write conflicts, the second planning gives up: nothing of the plan is written
    with pytest.raises(CommitConflict, match="moved on"):
        cm.commit(store, _a_succeeds(workflow, settings, calls, concurrent), _outcome_snapshot(store, run_id), Sent())
    assert len(calls) == 2
    assert _record(store, run_id, "a").state is State.RUNNING_RUN


class Folding(Sent):
    """A sender that hands its messages over to be pushed inside the write (an outbox)."""

    def __init__(self, queue: str) -> None:
        super().__init__()
        self.queue = queue

    def fold(self, workflow: Workflow, run_id: str, dispatches: list[Dispatch]) -> list[tuple[str, tuple[Any, ...]]]:
        return [("lpush", (self.queue, f"{run_id}/{d.key}/{d.token}")) for d in dispatches]


def test_a_folding_sender_pushes_in_the_write_instead_of_sending_after(store: RedisStore, raw: redis.Redis,
                                                                       workflow: Workflow,
                                                                       settings: Settings) -> None:
    run_id = _running_a(store, workflow, settings)
    sender = Folding(f"q-{uuid.uuid4().hex}")
    cm.commit(store, _a_succeeds(workflow, settings, []), _outcome_snapshot(store, run_id), sender)
    token = _record(store, run_id, "b").token
    assert raw.lrange(sender.queue, 0, -1) == [f"{run_id}/b/{token}"]
    assert sender.calls == []  # already sent by the write


def test_a_failing_observer_is_recorded_in_the_run(store: RedisStore, settings: Settings) -> None:
    seen: list[str] = []

    def observer(event: Event) -> None:
        seen.append(event.type)
        if event.type == "phase":
            raise RuntimeError("observer broke")

    wf = _define((observer,))
    try:
        run_id = _start(store, wf, settings)
    finally:
        REGISTRY.unregister(wf.name, wf.version)
    assert seen == ["run.started", "phase"]
    errors = [e for e in store.events(run_id) if e.type == "observer.error"]
    assert len(errors) == 1 and errors[0].data is not None
    assert errors[0].data["event"] == "phase" and "observer broke" in errors[0].data["error"]
    assert store.hmget(run_id, [fld.stat_field("observer_errors")]) == ["1"]


def test_refresh_reads_again_every_field_the_snapshot_read(store: RedisStore, raw: redis.Redis) -> None:
    run_id = _run_id()
    wr.write(store, Batch(run_id).set(fld.F_WORKFLOW, "wf").set(fld.F_CONTROL, "a"))
    snap = store.snapshot(run_id, [fld.F_CONTROL, fld.F_STATUS])
    raw.hset(k.RunKeys.of(run_id).run, mapping={fld.F_CONTROL: "b", fld.F_STATUS: "running"})
    assert (snap.control, snap.get(fld.F_STATUS)) == ("a", None)
    cm.refresh(store, snap)
    assert (snap.control, snap.get(fld.F_STATUS)) == ("b", "running")


# --- through_outage ---------------------------------------------------------------------------------


class FakeTime:
    """Stands in for the ``time`` module of commit.py: sleeping advances a fake clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Flaky:
    """A store whose writes fail with StoreUnavailable ``failures`` times, then reach the real one."""

    def __init__(self, store: RedisStore, failures: int) -> None:
        self.store = store
        self.failures = failures
        self.applies = 0

    def apply(self, batch: Batch) -> Applied | Conflict:
        self.applies += 1
        if self.applies <= self.failures:
            raise StoreUnavailable("Redis at redis://127.0.0.1:1/0 is unreachable (simulated)")
        return self.store.apply(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@pytest.fixture()
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(cm, "time", fake)
    return fake


def test_through_outage_records_the_outcome_once_the_store_is_back(store: RedisStore, workflow: Workflow,
                                                                   settings: Settings, fake_time: FakeTime) -> None:
    # Given a store that is unreachable for two writes
    run_id = _running_a(store, workflow, settings)
    flaky, sent, calls = Flaky(store, failures=2), Sent(), list[Snapshot]()
    # When a's success is committed through the outage
    committed = cm.through_outage(flaky, _a_succeeds(workflow, settings, calls),  # type: ignore[arg-type]
                                  _outcome_snapshot(store, run_id), sent, limit_s=10.0)
    # Then it tried again with a growing delay, planning each time, and the third write went through
    assert fake_time.sleeps == [0.1, 0.2]
    assert flaky.applies == 3 and len(calls) == 3
    assert _record(store, run_id, "a").state is State.DONE
    assert committed.planner.tasks["b"].state is State.QUEUED_RUN
    assert len(sent.calls) == 1  # the dispatch of b is sent once, by the write that was applied


def test_through_outage_gives_up_after_its_limit(store: RedisStore, workflow: Workflow, settings: Settings,
                                                 fake_time: FakeTime) -> None:
    # Given a store that never comes back
    run_id = _running_a(store, workflow, settings)
    flaky, sent = Flaky(store, failures=1_000), Sent()
    # When the outcome is committed with a limit of one second
    with pytest.raises(StoreUnavailable, match="simulated"):
        cm.through_outage(flaky, _a_succeeds(workflow, settings, []),  # type: ignore[arg-type]
                          _outcome_snapshot(store, run_id), sent, limit_s=1.0)
    # Then it slept 0.1 + 0.2 + 0.4 s and gave up rather than sleep 0.8 s past its limit
    assert fake_time.sleeps == [0.1, 0.2, 0.4]
    assert flaky.applies == 4
    assert _record(store, run_id, "a").state is State.RUNNING_RUN and sent.calls == []


def test_through_outage_delays_are_capped_at_two_seconds(store: RedisStore, workflow: Workflow,
                                                         settings: Settings, fake_time: FakeTime) -> None:
    run_id = _running_a(store, workflow, settings)
    flaky = Flaky(store, failures=7)
    cm.through_outage(flaky, _a_succeeds(workflow, settings, []),  # type: ignore[arg-type]
                      _outcome_snapshot(store, run_id), Sent(), limit_s=60.0)
    assert fake_time.sleeps == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert _record(store, run_id, "a").state is State.DONE


def test_through_outage_does_not_retry_a_conflict(store: RedisStore, raw: redis.Redis, workflow: Workflow,
                                                  settings: Settings, fake_time: FakeTime) -> None:
    run_id = _running_a(store, workflow, settings)

    def concurrent(n: int) -> None:
        raw.hset(k.RunKeys.of(run_id).run, fld.F_CONTROL, f"stop:{n}")

    calls: list[Snapshot] = []
    with pytest.raises(CommitConflict):
        cm.through_outage(store, _a_succeeds(workflow, settings, calls, concurrent), _outcome_snapshot(store, run_id),
                          Sent(), limit_s=60.0)
    assert len(calls) == cm.MAX_ATTEMPTS and fake_time.sleeps == []


def test_scan_fields_reads_every_matching_field_past_its_first_scan_step(store: RedisStore, raw: redis.Redis) -> None:
    # Given a run with more task records than one HSCAN step returns, and other fields
    run_id = _run_id()
    records = {f"{fld.TASK_PREFIX}task-{n}": str(n) for n in range(2_500)}
    raw.hset(k.RunKeys.of(run_id).run, mapping={**records, fld.F_WORKFLOW: "wf", fld.value_field("a"): "1"})
    # Then the scan (its first step pipelined with the compaction marker's read) finds all of them
    assert store.scan_fields(run_id, fld.TASK_PREFIX) == records

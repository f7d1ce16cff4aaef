"""The scheduler's planning, on snapshots built in memory (pure logic, no Redis)."""

from __future__ import annotations

import taskloop as tl
from taskloop.config import Settings
from taskloop.phases import ErrorRecord, EventKind, Phase, PhaseEvent, State, TaskRecord, advance
from taskloop.scheduler import Planner, initial_records
from taskloop.store import Snapshot
from taskloop.store import keys as k

SETTINGS = Settings(redis_url="redis://unused:1/0")
NOW = 1000.0


def _flow(stop_on_error: bool = True) -> tl.Workflow:
    a = tl.define_task("a", run=lambda ctx: 1)
    b = tl.define_loop_task("b", max_rounds=2, attempt=lambda c, f: 1, check=lambda c, x: tl.LoopCheck(done=True),
                            after=[a])
    c = tl.define_task("c", run=lambda ctx: 3, after=[b])
    d = tl.define_task("d", run=lambda ctx: 4)
    return tl.define_workflow("plan-test", version="1", tasks=[a, b, c, d], stop_on_error=stop_on_error)


def _snapshot(records: dict[str, TaskRecord], run: dict[str, str] | None = None) -> Snapshot:
    return Snapshot("r1", run or {"wf": "plan-test", "ver": "1", "status": "running"},
                    {key: rec.dump() for key, rec in records.items()})


def _run(records: dict[str, TaskRecord], key: str, kinds: list[EventKind]) -> dict[str, TaskRecord]:
    for kind in kinds:
        records[key] = advance(records[key], PhaseEvent(kind, NOW))
    return records


def test_new_run_activates_only_roots() -> None:
    wf = _flow()
    planner = Planner.for_new_run(wf, "r1", NOW, SETTINGS)
    planner.settle()
    states = {key: rec.state for key, rec in planner.tasks.items()}
    assert states == {"a": State.QUEUED_RUN, "b": State.WAITING, "c": State.WAITING, "d": State.QUEUED_RUN}
    assert sorted((d.key, d.phase) for d in planner.dispatches) == [("a", Phase.RUN), ("d", Phase.RUN)]
    assert planner.run_updates["status"] == "running"
    batch = planner.batch()
    # every record is written, none may exist yet
    assert [g[0] for g in batch.guards].count("nx") == 5  # four tasks + the control flag
    assert set(planner.leases) == {"a", "d"}


def test_finishing_a_task_activates_its_dependents_and_guards_the_whole_graph() -> None:
    wf = _flow()
    records = _run(initial_records(wf), "a", [EventKind.ACTIVATE, EventKind.BEGIN])
    records = _run(records, "d", [EventKind.ACTIVATE])
    planner = Planner(wf, _snapshot(records), NOW, SETTINGS)
    planner.move("a", PhaseEvent(EventKind.SUCCEED, NOW))
    planner.settle()
    assert planner.tasks["b"].state is State.QUEUED_ATTEMPT and planner.tasks["b"].round == 1
    assert [(d.key, d.phase, d.round) for d in planner.dispatches] == [("b", Phase.ATTEMPT, 1)]
    guarded = [g[2] for g in planner.batch().guards if g[1] == k.K_TASKS]
    assert sorted(guarded) == ["a", "b", "c", "d"]
    phase_events = [(e.key, e.round, e.phase) for e in planner.events if e.type == "phase"]
    assert phase_events == [("b", 1, "attempt")]


def test_a_loop_round_only_guards_its_own_record() -> None:
    wf = _flow()
    records = _run(initial_records(wf), "a", [EventKind.ACTIVATE, EventKind.BEGIN, EventKind.SUCCEED])
    records = _run(records, "d", [EventKind.ACTIVATE, EventKind.BEGIN])
    records = _run(records, "b", [EventKind.ACTIVATE, EventKind.BEGIN])
    planner = Planner(wf, _snapshot(records), NOW, SETTINGS)
    planner.move("b", PhaseEvent(EventKind.CANDIDATE, NOW))
    planner.settle()
    guards = planner.batch().guards
    assert [g[2] for g in guards if g[1] == k.K_TASKS] == ["b"]
    assert [(d.key, d.phase) for d in planner.dispatches] == [("b", Phase.CHECK)]


def test_failure_with_stop_on_error_skips_waiting_and_cancels_queued() -> None:
    wf = _flow(stop_on_error=True)
    records = _run(initial_records(wf), "a", [EventKind.ACTIVATE, EventKind.BEGIN])
    records = _run(records, "d", [EventKind.ACTIVATE])
    planner = Planner(wf, _snapshot(records), NOW, SETTINGS)
    planner.move("a", PhaseEvent(EventKind.FAIL, NOW, error=None))
    planner.settle()
    assert {key: rec.state for key, rec in planner.tasks.items()} == {
        "a": State.FAILED, "b": State.SKIPPED, "c": State.SKIPPED, "d": State.CANCELLED}
    assert planner.run_updates["ctl"] == "stop:failed"
    assert planner.run_updates["status"] == "failed" and planner.run_updates["term"] == "failed"
    assert planner.finished and planner.dispatches == []
    assert planner.events[-1].type == "run.finished"


def test_failure_without_stop_on_error_lets_other_branches_run() -> None:
    wf = _flow(stop_on_error=False)
    records = _run(initial_records(wf), "a", [EventKind.ACTIVATE, EventKind.BEGIN])
    records = _run(records, "d", [EventKind.ACTIVATE, EventKind.BEGIN])
    planner = Planner(wf, _snapshot(records), NOW, SETTINGS)
    planner.move("a", PhaseEvent(EventKind.FAIL, NOW))
    planner.settle()
    assert planner.tasks["b"].state is State.SKIPPED and planner.tasks["c"].state is State.SKIPPED
    assert planner.tasks["d"].state is State.RUNNING_RUN
    assert "ctl" not in planner.run_updates and not planner.finished
    assert planner.run_updates["term"] == "failed"


def test_running_phase_survives_a_stop_until_it_reports() -> None:
    wf = _flow(stop_on_error=True)
    records = _run(initial_records(wf), "a", [EventKind.ACTIVATE, EventKind.BEGIN])
    records = _run(records, "d", [EventKind.ACTIVATE, EventKind.BEGIN])
    planner = Planner(wf, _snapshot(records), NOW, SETTINGS)
    planner.move("a", PhaseEvent(EventKind.FAIL, NOW))
    planner.settle()
    assert planner.tasks["d"].state is State.RUNNING_RUN  # it sees ctx.signal, records its own end
    assert not planner.finished and planner.status == "running"


def test_budget_failure_stops_even_without_stop_on_error() -> None:
    wf = _flow(stop_on_error=False)
    records = _run(initial_records(wf), "a", [EventKind.ACTIVATE])
    records = _run(records, "d", [EventKind.ACTIVATE])
    planner = Planner(wf, _snapshot(records), NOW, SETTINGS)
    error = ErrorRecord(type="WorkflowBudgetExceeded", message="spent")
    planner.move("a", PhaseEvent(EventKind.FAIL, NOW, error=error))
    planner.settle()
    assert planner.run_updates["ctl"] == "stop:limit"
    assert planner.tasks["d"].state is State.CANCELLED
    assert planner.run_updates["term"] == "limit" and planner.run_updates["status"] == "failed"


def test_cancel_finishes_at_once_when_nothing_runs() -> None:
    wf = _flow()
    records = _run(initial_records(wf), "a", [EventKind.ACTIVATE])
    planner = Planner(wf, _snapshot(records), NOW, SETTINGS)
    planner.control = "cancel:user"
    planner.guard_all = True
    planner.settle()
    assert {rec.state for rec in planner.tasks.values()} == {State.CANCELLED}
    assert planner.run_updates["status"] == "cancelled" and planner.run_updates["term"] == "aborted"


def test_last_terminal_task_finishes_the_run_with_its_retention_ttl() -> None:
    wf = _flow()
    records = initial_records(wf)
    for key in ("a", "d"):
        records = _run(records, key, [EventKind.ACTIVATE, EventKind.BEGIN, EventKind.SUCCEED])
    records = _run(records, "b", [EventKind.ACTIVATE, EventKind.BEGIN, EventKind.CANDIDATE, EventKind.BEGIN])
    # accepting b activates c: the run goes on
    planner = Planner(wf, _snapshot(records), NOW, SETTINGS)
    planner.move("b", PhaseEvent(EventKind.ACCEPT, NOW))
    planner.settle()
    assert planner.tasks["c"].state is State.QUEUED_RUN and not planner.finished
    assert "expire" not in [w[0] for w in planner.batch().writes]
    # c finishing is the last terminal transition: status done, the run's keys get the retention TTL
    records = _run(dict(planner.tasks), "c", [EventKind.BEGIN])
    planner = Planner(wf, _snapshot(records), NOW, SETTINGS)
    planner.move("c", PhaseEvent(EventKind.SUCCEED, NOW))
    planner.settle()
    assert planner.finished and planner.status == "done"
    expired = [(w[1], w[2]) for w in planner.batch().writes if w[0] == "expire"]
    assert expired == [(index, SETTINGS.retention_s) for index in k.RUN_SCOPED]

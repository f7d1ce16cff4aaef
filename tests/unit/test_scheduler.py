"""The scheduler's planning over an in-memory run (pure logic, no Redis): what a decision reads,
what it guards, how it settles the graph along its edges, and how the run ends."""

from __future__ import annotations

import json

import pytest

import taskloop as tl
from taskloop.base.config import Settings
from taskloop.core import fields as fld
from taskloop.core.begin import initial_record, prepared_begin
from taskloop.core.phases import EventKind, PhaseEvent, advance
from taskloop.core.planner import Planner
from taskloop.core.records import ErrorRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase, State

SETTINGS = Settings(redis_url="redis://unused:1/0")
NOW = 1000.0


def _flow(stop_on_error: bool = True) -> tl.Workflow:
    a = tl.define_task("a", run=lambda ctx: 1)
    b = tl.define_loop_task("b", max_rounds=2, attempt=lambda c, f: 1, check=lambda c, x: tl.LoopCheck(done=True),
                            after=[a])
    c = tl.define_task("c", run=lambda ctx: 3, after=[b])
    d = tl.define_task("d", run=lambda ctx: 4)
    name = "plan-test" if stop_on_error else "plan-test-continue"
    return tl.define_workflow(name, version="1", tasks=[a, b, c, d], stop_on_error=stop_on_error)


class Run:
    """A run hash in memory, with a loader that logs which fields each decision read."""

    def __init__(self, wf: tl.Workflow, **meta: str) -> None:
        self.fields: dict[str, str] = {fld.F_WORKFLOW: wf.name, fld.F_VERSION: wf.version, fld.F_STATUS: "running",
                                       **meta}
        self.records = {task.key: initial_record(task) for task in wf.tasks}
        self.reads: list[str] = []

    def step(self, key: str, *kinds: EventKind) -> Run:
        for kind in kinds:
            self.records[key] = advance(self.records[key], PhaseEvent(kind, NOW))
        return self

    def snapshot(self, *fields: str) -> Snapshot:
        def load(names: list[str]) -> list[str | None]:
            self.reads += names
            return [self._get(name) for name in names]
        snap = Snapshot("r1", loader=load)
        snap.ensure(fields)
        self.reads.clear()
        return snap

    def _get(self, name: str) -> str | None:
        for key, record in self.records.items():  # a record is its JSON and its execution fields
            stored = dict(zip(fld.record_fields(key), (record.dump(), *record.execution()), strict=True))
            if name in stored:
                return stored[name]
        return self.fields.get(name)


def guarded(planner: Planner) -> set[str]:
    return {g[1] for g in planner.batch().guards}


def test_new_run_activates_only_roots_and_counts_its_tasks() -> None:
    wf = _flow()
    planner = Planner.start_run(wf, "r1", "{}", "digest", NOW, SETTINGS)
    states = {key: rec.state for key, rec in planner.tasks.items()}
    assert states == {"a": State.QUEUED_RUN, "b": State.WAITING, "c": State.WAITING, "d": State.QUEUED_RUN}
    assert planner.tasks["b"].waiting_on == 1
    assert sorted((d.key, d.phase) for d in planner.dispatches) == [("a", Phase.RUN), ("d", Phase.RUN)]
    batch = planner.batch()
    assert [(g[0], g[1]) for g in batch.guards] == [("nx", fld.F_WORKFLOW), ("nx", fld.F_CONTROL)]
    assert batch.hset[fld.F_OPEN] == "4" and batch.hset[fld.F_ACTIVE] == "2" and batch.hset[fld.F_PAUSED] == "0"
    assert set(batch.leases) == {"a", "d"}
    assert fld.begin_field("a") in batch.hset  # the first phases are prepared for begin.lua


def test_finishing_a_task_reads_and_guards_only_its_dependents() -> None:
    wf = _flow()
    run = Run(wf).step("a", EventKind.ACTIVATE, EventKind.BEGIN).step("d", EventKind.ACTIVATE)
    planner = Planner(wf, run.snapshot(*fld.record_fields("a"), fld.F_CONTROL), NOW, SETTINGS)
    planner.outcome("a", PhaseEvent(EventKind.SUCCEED, NOW))
    assert planner.tasks["b"].state is State.QUEUED_ATTEMPT and planner.tasks["b"].round == 1
    assert [(d.key, d.phase, d.round) for d in planner.dispatches] == [("b", Phase.ATTEMPT, 1)]
    # it read its dependent and the run's outcome fields; never d or c
    assert fld.task_field("d") not in run.reads and fld.task_field("c") not in run.reads
    assert guarded(planner) == {fld.task_field("a"), fld.task_field("b"), fld.F_CONTROL,
                                fld.F_TERMINATION, fld.F_REJECTED, fld.F_STATUS}
    phase_events = [(e.key, e.round, e.phase) for e in planner.events if e.type == "phase"]
    assert phase_events == [("b", 1, "attempt")]


def test_a_loop_round_only_reads_and_guards_its_own_record() -> None:
    wf = _flow()
    run = Run(wf).step("a", EventKind.ACTIVATE, EventKind.BEGIN, EventKind.SUCCEED)
    run.step("b", EventKind.DEP_DONE, EventKind.ACTIVATE, EventKind.BEGIN)
    planner = Planner(wf, run.snapshot(*fld.record_fields("b"), fld.F_CONTROL), NOW, SETTINGS)
    planner.outcome("b", PhaseEvent(EventKind.CANDIDATE, NOW))
    assert run.reads == []
    assert guarded(planner) == {fld.task_field("b"), fld.F_CONTROL}
    assert [(d.key, d.phase) for d in planner.dispatches] == [("b", Phase.CHECK)]


def test_an_ended_execution_is_cleared_in_the_hset_it_sends_anyway() -> None:
    wf = _flow()
    run = Run(wf).step("a", EventKind.ACTIVATE, EventKind.BEGIN, EventKind.SUCCEED)
    run.step("b", EventKind.DEP_DONE, EventKind.ACTIVATE)
    run.records["b"] = advance(run.records["b"], PhaseEvent(EventKind.BEGIN, NOW, worker="w1", timeout_ms=1000))
    planner = Planner(wf, run.snapshot(*fld.record_fields("b"), fld.F_CONTROL), NOW, SETTINGS)
    planner.outcome("b", PhaseEvent(EventKind.CANDIDATE, NOW))
    batch = planner.batch()
    # the check waits in the queue: nobody runs it (worker, began cleared), its round keeps its deadline
    assert batch.hset[fld.worker_field("b")] == "" and batch.hset[fld.began_field("b")] == ""
    assert fld.deadline_field("b") not in batch.hset and batch.hdel == []  # unchanged deadline; no HDEL
    cleared = run.records["b"] = planner.tasks["b"]
    assert cleared.worker is None and cleared.began_at is None  # as the next reader loads it
    loaded = type(cleared).load(cleared.dump(), "", "", repr(NOW + 1.0))
    assert loaded.worker is None and loaded.began_at is None and loaded.deadline == NOW + 1.0
    run.records["b"] = advance(cleared, PhaseEvent(EventKind.BEGIN, NOW, worker="w2"))
    planner = Planner(wf, run.snapshot(*fld.record_fields("b"), fld.F_CONTROL), NOW, SETTINGS)
    planner.outcome("b", PhaseEvent(EventKind.ACCEPT, NOW))
    batch = planner.batch()
    assert planner.tasks["b"].terminal and planner.tasks["b"].worker == "w2"  # who ran it last stays
    assert not set(fld.record_fields("b")[1:]) & set(batch.hset)  # unchanged: not written again
    assert batch.hdel == [fld.begin_field("b"), fld.started_field("b")]  # one HDEL: the prepared begin, the start note


def test_the_cost_of_a_phase_does_not_grow_with_its_run() -> None:
    # a run of 5,000 independent tasks: finishing one reads and writes only its own record
    tasks = [tl.define_task(f"t{i}", run=lambda ctx: 1) for i in range(5000)]
    wf = tl.define_workflow("wide-plan", version="1", tasks=tasks)
    run = Run(wf).step("t7", EventKind.ACTIVATE, EventKind.BEGIN)
    planner = Planner(wf, run.snapshot(*fld.record_fields("t7"), fld.F_CONTROL), NOW, SETTINGS)
    planner.outcome("t7", PhaseEvent(EventKind.SUCCEED, NOW))
    batch = planner.batch()
    assert set(run.reads) <= {fld.F_TERMINATION, fld.F_REJECTED, fld.F_STATUS, fld.F_CREATED}
    assert [name for name in batch.hset if name.startswith(fld.TASK_PREFIX)] == [fld.task_field("t7")]
    assert batch.open_delta == -1  # the run ends if this was the last open task (cas.lua decides)


def test_failure_with_stop_on_error_stops_the_run_and_skips_its_dependents() -> None:
    wf = _flow(stop_on_error=True)
    run = Run(wf).step("a", EventKind.ACTIVATE, EventKind.BEGIN).step("d", EventKind.ACTIVATE)
    planner = Planner(wf, run.snapshot(*fld.record_fields("a"), fld.F_CONTROL), NOW, SETTINGS)
    planner.outcome("a", PhaseEvent(EventKind.FAIL, NOW, error=ErrorRecord(type="KeyError", message="x")))
    assert {key: rec.state for key, rec in planner.tasks.items()} == {
        "a": State.FAILED, "b": State.SKIPPED, "c": State.SKIPPED}
    assert planner.tasks["b"].reason == "stopped"
    assert planner.run_updates[fld.F_CONTROL] == "stop:failed" and planner.run_updates[fld.F_TERMINATION] == "failed"
    assert planner.dispatches == []
    # d is not touched here: its worker sees the control flag and records it cancelled
    batch = planner.batch()
    assert batch.open_delta == -3 and batch.final.hset[fld.F_STATUS] == "failed"


def test_failure_without_stop_on_error_lets_other_branches_run() -> None:
    wf = _flow(stop_on_error=False)
    run = Run(wf).step("a", EventKind.ACTIVATE, EventKind.BEGIN).step("d", EventKind.ACTIVATE, EventKind.BEGIN)
    planner = Planner(wf, run.snapshot(*fld.record_fields("a"), fld.F_CONTROL), NOW, SETTINGS)
    planner.outcome("a", PhaseEvent(EventKind.FAIL, NOW))
    assert planner.tasks["b"].state is State.SKIPPED and planner.tasks["b"].reason == "dependency"
    assert planner.tasks["c"].state is State.SKIPPED
    assert fld.F_CONTROL not in planner.run_updates
    assert planner.run_updates[fld.F_TERMINATION] == "failed"


def test_budget_failure_stops_even_without_stop_on_error() -> None:
    wf = _flow(stop_on_error=False)
    run = Run(wf).step("a", EventKind.ACTIVATE).step("d", EventKind.ACTIVATE)
    planner = Planner(wf, run.snapshot(*fld.record_fields("a"), fld.F_CONTROL), NOW, SETTINGS)
    error = ErrorRecord(type="WorkflowBudgetExceeded", message="spent")
    planner.outcome("a", PhaseEvent(EventKind.FAIL, NOW, error=error))
    assert planner.run_updates[fld.F_CONTROL] == "stop:limit"
    assert planner.run_updates[fld.F_TERMINATION] == "limit"
    assert planner.batch().final.hset[fld.F_TERMINATION] == "limit"


def test_a_cancelled_run_cancels_what_would_have_started() -> None:
    wf = _flow()
    run = Run(wf, **{fld.F_CONTROL: "cancel:user"}).step("a", EventKind.ACTIVATE, EventKind.BEGIN)
    planner = Planner(wf, run.snapshot(*fld.record_fields("a"), fld.F_CONTROL), NOW, SETTINGS)
    planner.outcome("a", PhaseEvent(EventKind.CANCEL, NOW, reason="cancelled"))
    assert planner.tasks["b"].state is State.CANCELLED and planner.tasks["c"].state is State.CANCELLED
    final = planner.batch().final
    assert (final.hset[fld.F_STATUS], final.hset[fld.F_TERMINATION]) == ("cancelled", "aborted")


def test_the_last_terminal_task_carries_the_writes_that_end_the_run() -> None:
    wf = _flow()
    run = Run(wf)
    for key in ("a", "d"):
        run.step(key, EventKind.ACTIVATE, EventKind.BEGIN, EventKind.SUCCEED)
    run.step("b", EventKind.DEP_DONE, EventKind.ACTIVATE, EventKind.BEGIN, EventKind.CANDIDATE, EventKind.BEGIN)
    planner = Planner(wf, run.snapshot(*fld.record_fields("b"), fld.F_CONTROL), NOW, SETTINGS)
    planner.outcome("b", PhaseEvent(EventKind.ACCEPT, NOW))
    assert planner.tasks["c"].state is State.QUEUED_RUN
    batch = planner.batch()
    final = batch.final
    assert batch.open_delta == -1
    assert final.hset[fld.F_STATUS] == "done" and final.ttl == SETTINGS.retention_s
    assert final.end_marker == "done" and [e.type for e in final.events] == ["run.finished"]


def test_a_run_that_already_ended_is_never_finished_twice() -> None:
    wf = _flow()
    run = Run(wf, **{fld.F_STATUS: "failed", fld.F_CONTROL: "stop:failed"})
    run = run.step("d", EventKind.ACTIVATE, EventKind.BEGIN)
    planner = Planner(wf, run.snapshot(*fld.record_fields("d"), fld.F_CONTROL), NOW, SETTINGS)
    planner.outcome("d", PhaseEvent(EventKind.CANCEL, NOW, reason="stopped"))
    batch = planner.batch()
    assert batch.open_delta == -1 and batch.final.program() == {}


def test_prepared_begin_leaves_worker_time_and_deadline_to_begin_lua() -> None:
    wf = tl.define_workflow("prep-test", version="1", tasks=[
        tl.define_loop_task("x", max_rounds=3, attempt=lambda c, f: 1, check=lambda c, v: tl.LoopCheck(done=True),
                            timeout_ms=1500),
        tl.define_task("y", run=lambda ctx: 1, after=["x"]),
    ])
    queued = advance(initial_record(wf.by_key["x"]), PhaseEvent(EventKind.ACTIVATE, NOW))
    prepared = json.loads(prepared_begin(wf, queued, SETTINGS) or "{}")
    assert prepared["tok"] == queued.token and prepared["ph"] == "attempt"
    assert prepared["cons"] == 0  # no attempts budget: the run needs no attempt counter
    assert prepared["tmo"] == 1.5 and prepared["dl"] is None  # a new round: begin.lua sets the deadline
    assert prepared["rd"] == []  # an attempt cannot end the task: nothing to read for its outcome
    running_json = json.loads(prepared["rec"])  # whole JSON, written as it is: begin.lua assembles none
    assert running_json["slot"] == "running" and not {"worker", "began_at", "deadline"} & set(running_json)
    running = advance(queued, PhaseEvent(EventKind.BEGIN, NOW, timeout_ms=1500))
    check = advance(running, PhaseEvent(EventKind.CANDIDATE, NOW))
    prepared = json.loads(prepared_begin(wf, check, SETTINGS) or "{}")
    assert prepared["dl"] == NOW + 1.5 and prepared["tmo"] is None  # the check keeps its round's deadline
    # the dependents' records with their execution fields (the run's status fields come with the record)
    assert prepared["rd"] == list(fld.record_fields("y"))


def test_resume_recounts_what_a_reopened_task_waits_for() -> None:
    wf = _flow(stop_on_error=True)
    run = Run(wf, **{fld.F_STATUS: "failed", fld.F_TERMINATION: "failed", fld.F_CONTROL: "stop:failed"})
    run.step("a", EventKind.ACTIVATE, EventKind.BEGIN, EventKind.FAIL)
    run.step("b", EventKind.SKIP).step("c", EventKind.SKIP)
    run.step("d", EventKind.ACTIVATE, EventKind.BEGIN, EventKind.SUCCEED)
    planner = Planner(wf, run.snapshot(fld.F_CONTROL), NOW, SETTINGS)
    planner.resume({"a"})
    assert planner.tasks["a"].state is State.QUEUED_RUN
    assert (planner.tasks["b"].state, planner.tasks["b"].waiting_on) == (State.WAITING, 1)
    assert planner.tasks["d"].state is State.DONE
    batch = planner.batch()
    assert batch.hincr[fld.F_OPEN] == 3 and fld.F_CONTROL in batch.hdel and batch.revive


def test_records_from_a_snapshot_that_does_not_parse_are_refused() -> None:
    snap = Snapshot("r1", {fld.task_field("a"): '{"key": "a", "kind": "task", "status": "exploded"}'})
    with pytest.raises(tl.TaskLoopError, match="corrupt or inconsistent"):
        snap.record("a")


def _queued_loop() -> tuple[tl.Workflow, Run]:
    wf = _flow()
    run = Run(wf).step("a", EventKind.ACTIVATE, EventKind.BEGIN, EventKind.SUCCEED)
    run.step("b", EventKind.DEP_DONE, EventKind.ACTIVATE)  # its attempt queued at NOW, leased to NOW + 300
    return wf, run


def test_a_loops_next_phase_keeps_the_lease_of_its_first_queueing() -> None:
    """The one-call step (worker/execution/deferred.py): the stored record is the queued attempt, whose lease
    (NOW + queued lease) is still ahead; the check it queues needs no lease write of its own."""
    wf, run = _queued_loop()
    planner = Planner(wf, run.snapshot(*fld.record_fields("b"), fld.F_CONTROL), NOW + 5, SETTINGS)
    planner.move("b", PhaseEvent(EventKind.BEGIN, NOW + 4, worker="w1"))
    planner.outcome("b", PhaseEvent(EventKind.CANDIDATE, NOW + 5))
    assert [(d.key, d.phase) for d in planner.dispatches] == [("b", Phase.CHECK)]
    batch = planner.batch()
    assert "b" not in batch.leases and "b" not in batch.unlease
    # its record says which lease it keeps: the next phase, and the reconciler, go by it
    kept = type(planner.tasks["b"]).load(batch.hset[fld.task_field("b")])
    assert kept.lease_kept == NOW + SETTINGS.queued_lease_s
    run.records["b"] = kept
    planner = Planner(wf, run.snapshot(*fld.record_fields("b"), fld.F_CONTROL), NOW + 7, SETTINGS)
    planner.move("b", PhaseEvent(EventKind.BEGIN, NOW + 6, worker="w2"))
    planner.outcome("b", PhaseEvent(EventKind.REJECT, NOW + 7, feedback="again"))
    batch = planner.batch()
    assert "b" not in batch.leases
    assert type(kept).load(batch.hset[fld.task_field("b")]).lease_kept == NOW + SETTINGS.queued_lease_s


@pytest.mark.parametrize("case", ["stored lease passed", "stored record running"])
def test_a_phase_queued_again_writes_its_lease_when_the_stored_one_would_not_do(case: str) -> None:
    wf, run = _queued_loop()
    now = NOW + 5
    if case == "stored lease passed":  # the reconciler would have to move it at once
        now = NOW + SETTINGS.queued_lease_s + 1
    else:  # begun by begin.lua: its lease is a running lease, renewed by the watcher
        run.records["b"] = advance(run.records["b"], PhaseEvent(EventKind.BEGIN, NOW + 4, worker="w1"))
    planner = Planner(wf, run.snapshot(*fld.record_fields("b"), fld.F_CONTROL), now, SETTINGS)
    if case == "stored lease passed":
        planner.move("b", PhaseEvent(EventKind.BEGIN, now, worker="w1"))
    planner.outcome("b", PhaseEvent(EventKind.CANDIDATE, now))
    batch = planner.batch()
    assert batch.leases == {"b": now + SETTINGS.queued_lease_s}
    assert type(planner.tasks["b"]).load(batch.hset[fld.task_field("b")]).lease_kept is None


def test_the_queued_lease_rule() -> None:
    from taskloop.core.leases import queued_lease_until

    _, run = _queued_loop()
    queued = run.records["b"]
    assert queued_lease_until(queued, 300.0) == NOW + 300.0
    assert queued_lease_until(queued.model_copy(update={"not_before": NOW + 60}), 300.0) == NOW + 360.0
    assert queued_lease_until(advance(queued, PhaseEvent(EventKind.BEGIN, NOW, worker="w1")), 300.0) is None

"""The one-call step's decision (taskloop/worker/execution/deferred.py): which reads let a phase run before its
begin is written, and the start note. Pure: snapshots built in memory."""

from __future__ import annotations

import json

import pytest

import taskloop as tl
from taskloop.base.config import Settings
from taskloop.core import fields as fld
from taskloop.core.begin import initial_record, prepared_begin
from taskloop.core.phases import EventKind, PhaseEvent, advance
from taskloop.core.records import TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase
from taskloop.worker.execution import deferred
from taskloop.worker.execution.deferred import Ready

SETTINGS = Settings(redis_url="redis://127.0.0.1:1/0", broker_url="redis://127.0.0.1:1/0")
LOOP = tl.define_workflow("deferred-unit", version="1", tasks=[
    tl.define_loop_task("l", max_rounds=3, attempt=lambda c, f: 1, check=lambda c, x: tl.LoopCheck(done=True)),
])
BUDGETED = tl.define_workflow("deferred-unit-budget", version="1", budget=tl.Budget(attempts=10), tasks=[
    tl.define_loop_task("l", max_rounds=3, attempt=lambda c, f: 1, check=lambda c, x: tl.LoopCheck(done=True)),
])
LIMITED = tl.define_workflow("deferred-unit-limit", version="1", tasks=[
    tl.define_loop_task("l", max_rounds=3, attempt=lambda c, f: 1, check=lambda c, x: tl.LoopCheck(done=True),
                        limits=[tl.RateLimit("deferred-unit", rate=5, per_s=1)]),
])


def _queued(workflow: tl.Workflow) -> TaskRecord:
    return advance(initial_record(workflow.task("l")), PhaseEvent(EventKind.ACTIVATE, 1.0))


def _snap(workflow: tl.Workflow, record: TaskRecord, **extra: str | None) -> Snapshot:
    fields: dict[str, str | None] = {fld.F_WORKFLOW: workflow.name, fld.F_CONTROL: None,
                                     fld.task_field("l"): record.dump(), fld.throttle_field("l"): None,
                                     fld.begin_field("l"): prepared_begin(workflow, record, SETTINGS),
                                     fld.started_field("l"): None}
    fields.update(extra)
    return Snapshot("r1", fields)


def test_a_queued_prepared_phase_matching_its_message_runs_now() -> None:
    record = _queued(LOOP)
    assert deferred.ready(_snap(LOOP, record), "l", Phase.ATTEMPT, 1, record.token, record) == (Ready.NOW, ())


@pytest.mark.parametrize(("change", "why"), [
    ({"token": 99}, "another token"),
    ({"round": 2}, "another round"),
    ({"phase": Phase.CHECK}, "another phase"),
])
def test_a_message_that_does_not_match_its_record_goes_to_the_full_path(change: dict, why: str) -> None:
    record = _queued(LOOP)
    token, round_, phase = change.get("token", record.token), change.get("round", 1), change.get("phase", Phase.ATTEMPT)
    assert deferred.ready(_snap(LOOP, record), "l", phase, round_, token, record)[0] is Ready.DECIDE, why


@pytest.mark.parametrize("extra", [
    {fld.F_CONTROL: "cancel:by a test"},  # cancelled: the full path ends it cancelled
    {fld.throttle_field("l"): "{}"},  # waiting for a fleet limit
    {fld.begin_field("l"): None},  # nothing prepared (a condition or a cache to consult first)
    {fld.begin_field("l"): "not json"},
    {fld.started_field("l"): "1 w1@host/12 1.5"},  # this very message already began on a worker
], ids=["cancelled", "throttled", "not prepared", "unreadable prepared begin", "began already"])
def test_what_the_full_path_decides(extra: dict[str, str | None]) -> None:
    record = _queued(LOOP)
    assert deferred.ready(_snap(LOOP, record, **extra), "l", Phase.ATTEMPT, 1, record.token, record)[0] \
        is Ready.DECIDE


def test_a_note_of_an_earlier_token_does_not_hold_the_phase_back() -> None:
    record = _queued(LOOP)
    snap = _snap(LOOP, record, **{fld.started_field("l"): f"{record.token - 1} w1@host/12 1.5"})
    assert deferred.ready(snap, "l", Phase.ATTEMPT, 1, record.token, record)[0] is Ready.NOW


@pytest.mark.parametrize("workflow", [BUDGETED, LIMITED], ids=["a budget on attempts", "a rate limit"])
def test_a_phase_admitted_before_it_starts_is_begun_first(workflow: tl.Workflow) -> None:
    record = _queued(workflow)
    prepared = json.loads(prepared_begin(workflow, record, SETTINGS) or "{}")
    assert prepared.get("cons") or prepared.get("caps") or prepared.get("lim")
    assert deferred.ready(_snap(workflow, record), "l", Phase.ATTEMPT, 1, record.token, record)[0] \
        is Ready.BEGIN_FIRST


def test_the_start_note_reads_back_and_refuses_what_is_not_one() -> None:
    note = deferred.note(7, "w1@host/12", 1796000000.25)
    assert deferred.started(note) == deferred.Started(7, "w1@host/12", 1796000000.25)
    for bad in (None, "", "7", "x w 1.0", "7 w notanumber", "7 w 1.0 extra"):
        assert deferred.started(bad) is None, bad


def test_the_record_a_deferred_phase_runs_as_is_what_begin_lua_would_write() -> None:
    record = _queued(LOOP)
    begun = deferred.begun(record, LOOP.task("l"), "w1@host/12", 5.0)
    prepared = json.loads(prepared_begin(LOOP, record, SETTINGS) or "{}")
    assert begun.dump() == prepared["rec"]  # the same JSON: the watcher's mark and the commit agree
    assert (begun.worker, begun.began_at, begun.attempts, begun.execs) == ("w1@host/12", 5.0, 1, 1)


def test_a_round_that_ran_out_while_queued_goes_to_the_full_path() -> None:
    record = _queued(LOOP).model_copy(update={"deadline": 1.0})  # long past
    assert deferred.ready(_snap(LOOP, record), "l", Phase.ATTEMPT, 1, record.token, record)[0] is Ready.DECIDE

"""Recovery (taskloop/worker/recovery/executions.py): whether a worker process is gone (live, reaped, zombie),
the "node@host/pid" worker names, redeliveries, the record consistency checks, and the replay or
abandonment of a lost execution. No Redis: snapshots are held in memory."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

import taskloop as tl
from taskloop.base.config import Settings
from taskloop.core import fields as fld
from taskloop.core.begin import initial_record
from taskloop.core.phases import EventKind, PhaseEvent, advance
from taskloop.core.planner import Planner
from taskloop.core.records import TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase, Slot, State, TaskStatus
from taskloop.define.tasks import TaskKind
from taskloop.define.workflow import REGISTRY, Workflow
from taskloop.worker.recovery import executions as recovery

SETTINGS = Settings(redis_url="redis://unused:1/0")
NOW = 1000.0
HOST = socket.gethostname()


def _fork_exiting_child() -> int:
    """A child process that exits at once (not reaped: the caller does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a process with threads (3.12+)
        pid = os.fork()
    if pid == 0:
        os._exit(0)
    return pid


def _state_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except OSError:
        return None


@contextlib.contextmanager
def _zombie() -> Iterator[int]:
    """A child that has exited and that nobody has reaped yet; reaped on the way out."""
    pid = _fork_exiting_child()
    try:
        deadline = time.monotonic() + 10.0
        while _state_of(pid) != "Z":  # it exits in a moment: wait for that, not for a fixed time
            assert time.monotonic() < deadline, f"child {pid} did not exit"
            time.sleep(0.005)
        yield pid
    finally:
        os.waitpid(pid, 0)


# --- process_gone, worker_is_dead -------------------------------------------------------------------


def test_a_live_process_is_not_gone() -> None:
    assert not recovery.process_gone(os.getpid())
    assert not recovery.process_gone(os.getppid())


def test_a_reaped_child_is_gone() -> None:
    pid = _fork_exiting_child()
    os.waitpid(pid, 0)
    assert recovery.process_gone(pid)


def test_a_zombie_is_gone() -> None:
    with _zombie() as pid:
        os.kill(pid, 0)  # the kernel still knows the pid...
        assert recovery.process_gone(pid)  # ...but nothing runs there any more


def test_a_dead_worker_on_this_host_is_dead() -> None:
    with _zombie() as pid:
        assert recovery.worker_is_dead(f"celery@{HOST}/{pid}")
    pid = _fork_exiting_child()
    os.waitpid(pid, 0)
    assert recovery.worker_is_dead(f"w1@{HOST}/{pid}")


@pytest.mark.parametrize("worker", [
    None, "", f"celery@{HOST}", f"celery@{HOST}/", f"celery@{HOST}/12ab", f"celery@{HOST}/-1",
])
def test_a_worker_name_that_says_no_pid_is_never_dead(worker: str | None) -> None:
    assert not recovery.worker_is_dead(worker)


def test_a_worker_on_another_host_is_never_dead_here() -> None:
    with _zombie() as pid:
        assert not recovery.worker_is_dead(f"celery@{HOST}.elsewhere/{pid}")  # its pid may be anything there
        assert not recovery.worker_is_dead(f"celery@not-{HOST}/{pid}")


def test_a_live_worker_is_not_dead_even_when_it_is_watched_for_a_while() -> None:
    assert not recovery.worker_is_dead(f"celery@{HOST}/{os.getpid()}")
    started = time.monotonic()
    assert not recovery.worker_is_dead(f"celery@{HOST}/{os.getpid()}", wait=0.1)
    assert time.monotonic() - started >= 0.1  # it kept looking for the time it was given


def test_the_host_is_what_follows_the_first_at_sign() -> None:
    with _zombie() as pid:
        assert not recovery.worker_is_dead(f"{HOST}/{pid}")  # no node@: no host to compare
        assert recovery.worker_is_dead(f"gen1@{HOST}/{pid}")


# --- is_redelivery_of_running -----------------------------------------------------------------------


def _running(phase: Phase = Phase.ATTEMPT, round: int = 2, token: int = 5) -> TaskRecord:
    kind = TaskKind.TASK if phase is Phase.RUN else TaskKind.LOOP
    return TaskRecord(key="fix", kind=kind, limit=3, status=TaskStatus.ACTIVE, phase=phase, slot=Slot.RUNNING,
                      round=round, token=token, execs=1, attempts=round, worker=f"w@{HOST}/1", began_at=NOW)


def test_the_message_of_the_running_execution_is_a_redelivery() -> None:
    record = _running()
    assert recovery.is_redelivery_of_running(record, Phase.ATTEMPT, 2, 4)  # BEGIN added one to its token


@pytest.mark.parametrize(("phase", "round", "token"), [
    (Phase.CHECK, 2, 4), (Phase.ATTEMPT, 1, 4), (Phase.ATTEMPT, 2, 5), (Phase.ATTEMPT, 2, 3),
])
def test_another_message_is_not_a_redelivery(phase: Phase, round: int, token: int) -> None:
    assert not recovery.is_redelivery_of_running(_running(), phase, round, token)


def test_a_queued_record_has_no_running_execution_to_redeliver() -> None:
    queued = _running().model_copy(update={"slot": Slot.QUEUED})
    assert not recovery.is_redelivery_of_running(queued, Phase.ATTEMPT, 2, 4)


# --- inconsistency ----------------------------------------------------------------------------------


def _loop(max_rounds: int = 3) -> tl.Task:
    return tl.define_loop_task("fix", max_rounds=max_rounds, attempt=lambda c, f: 1,
                               check=lambda c, v: tl.LoopCheck(done=True))


def _queued(phase: Phase, round: int, kind: TaskKind = TaskKind.LOOP, limit: int = 3) -> TaskRecord:
    return TaskRecord(key="fix", kind=kind, limit=limit, status=TaskStatus.ACTIVE, phase=phase, slot=Slot.QUEUED,
                      round=round, token=4)


REJECTED = '{"done": false, "feedback": "again"}'
INCONSISTENT: list[tuple[str, tl.Task, TaskRecord, dict[str, str], str]] = [
    ("a plain record for a loop", _loop(), _queued(Phase.RUN, 1, kind=TaskKind.TASK, limit=1), {},
     "the record is a task but the definition declares a loop"),
    ("a loop record for a plain task", tl.define_task("fix", run=lambda ctx: 1), _queued(Phase.ATTEMPT, 1), {},
     "the record is a loop but the definition declares a task"),
    ("round 0", _loop(), _queued(Phase.ATTEMPT, 0), {}, "round 0 is outside 1..3"),
    ("round past the limit", _loop(), _queued(Phase.ATTEMPT, 4), {}, "round 4 is outside 1..3"),
    ("rounds changed", _loop(max_rounds=5), _queued(Phase.ATTEMPT, 1), {},
     "the record allows 3 rounds, the definition 5"),
    ("check without a candidate", _loop(), _queued(Phase.CHECK, 2), {},
     "round 2 is in check but has no recorded candidate"),
    ("candidate not JSON", _loop(), _queued(Phase.CHECK, 2), {fld.candidate_field("fix", 2): "{oops"},
     "the candidate of round 2 is not JSON"),
    ("attempt without a check", _loop(), _queued(Phase.ATTEMPT, 2), {},
     "round 2 started but round 1 has no recorded rejection"),
    ("attempt after an acceptance", _loop(), _queued(Phase.ATTEMPT, 2), {fld.check_field("fix", 1): '{"done": true}'},
     "round 2 started but round 1 has no recorded rejection"),
    ("check not JSON", _loop(), _queued(Phase.ATTEMPT, 3), {fld.check_field("fix", 2): "not json"},
     "round 3 started but round 2 has no recorded rejection"),
    ("rejection without feedback", _loop(), _queued(Phase.ATTEMPT, 2), {fld.check_field("fix", 1): '{"done": false}'},
     "round 2 started but round 1 has no recorded rejection"),
    ("rejection of another round", _loop(), _queued(Phase.ATTEMPT, 3), {fld.check_field("fix", 1): REJECTED},
     "round 3 started but round 2 has no recorded rejection"),
]


@pytest.mark.parametrize(("label", "task", "record", "data", "problem"), INCONSISTENT,
                         ids=[case[0] for case in INCONSISTENT])
def test_each_inconsistency_is_named(label: str, task: tl.Task, record: TaskRecord, data: dict[str, str],
                                     problem: str) -> None:
    assert recovery.inconsistency(task, record, Snapshot("r1", data)) == problem


CONSISTENT: list[tuple[str, tl.Task, TaskRecord, dict[str, str]]] = [
    ("first attempt", _loop(), _queued(Phase.ATTEMPT, 1), {}),
    ("a later attempt after a rejection", _loop(), _queued(Phase.ATTEMPT, 2), {fld.check_field("fix", 1): REJECTED}),
    ("a check with its candidate", _loop(), _queued(Phase.CHECK, 3), {fld.candidate_field("fix", 3): '"text"'}),
    ("a check whose candidate is null", _loop(), _queued(Phase.CHECK, 1), {fld.candidate_field("fix", 1): "null"}),
    ("a plain task's later try", tl.define_task("fix", run=lambda ctx: 1, retry=tl.Retry(attempts=3)),
     _queued(Phase.RUN, 3, kind=TaskKind.TASK), {}),
]


@pytest.mark.parametrize(("label", "task", "record", "data"), CONSISTENT, ids=[case[0] for case in CONSISTENT])
def test_a_consistent_record_has_no_problem(label: str, task: tl.Task, record: TaskRecord,
                                            data: dict[str, str]) -> None:
    assert recovery.inconsistency(task, record, Snapshot("r1", data)) is None


# --- plan_recovery ----------------------------------------------------------------------------------


@pytest.fixture()
def workflow() -> Iterator[Workflow]:
    """A loop task ``fix`` and a task ``publish`` after it, under a name of its own."""
    publish = tl.define_task("publish", run=lambda ctx: 1, after=["fix"])
    wf = tl.define_workflow(f"recovery-{uuid.uuid4().hex[:12]}", version="1", tasks=[_loop(), publish])
    yield wf
    REGISTRY.unregister(wf.name, wf.version)


def _executed(workflow: Workflow, executions: int) -> TaskRecord:
    """``fix`` running its first attempt, begun ``executions`` times (each earlier one lost)."""
    record = advance(initial_record(workflow.task("fix")), PhaseEvent(EventKind.ACTIVATE, NOW - 100))
    for n in range(executions):
        if n:
            record = advance(record, PhaseEvent(EventKind.EXPIRE, NOW - 50 + n))
        record = advance(record, PhaseEvent(EventKind.BEGIN, NOW - 40 + n, worker=f"w@{HOST}/{100 + n}"))
    return record


def _planner(workflow: Workflow, record: TaskRecord) -> Planner:
    fields: dict[str, Any] = {fld.F_WORKFLOW: workflow.name, fld.F_VERSION: "1", fld.F_STATUS: "running"}
    for key, found in ((record.key, record), ("publish", initial_record(workflow.task("publish")))):
        fields.update(zip(fld.record_fields(key), (found.dump(), *found.execution()), strict=True))
    return Planner(workflow, Snapshot("r1", fields), NOW, SETTINGS)


def test_a_lost_execution_under_the_cap_is_replayed(workflow: Workflow) -> None:
    # Given fix running its second execution (the first was lost), with a cap of 3
    record = _executed(workflow, 2)
    assert (record.state, record.execs, record.lost) == (State.RUNNING_ATTEMPT, 2, 1)
    planner = _planner(workflow, record)
    # When its execution is found lost
    replay = recovery.plan_recovery(planner, record, max_executions=3)
    # Then it is queued again in the same round and phase, under a new token, and the loss is told
    assert replay.state is State.QUEUED_ATTEMPT and replay.round == 1
    assert (replay.execs, replay.lost, replay.worker) == (2, 2, None)
    assert replay.token == record.token + 1
    assert [(d.key, d.phase, d.round, d.token) for d in planner.dispatches] == [("fix", Phase.ATTEMPT, 1,
                                                                               replay.token)]
    assert planner.leases["fix"] == NOW + SETTINGS.queued_lease_s
    lost = planner.events[0]
    assert (lost.type, lost.key, lost.round, lost.phase) == ("lost", "fix", 1, "attempt")
    assert lost.data == {"exec": {"lost": True, "worker": f"w@{HOST}/101", "began": NOW - 39, "execs": 2,
                                  "attempt": 2}}
    assert planner.exec_info == {}  # used up by the first event
    assert planner.batch().guards[0] == ["eq", fld.task_field("fix"), record.dump()]


def test_a_lost_execution_at_the_cap_fails_with_phase_abandoned(workflow: Workflow) -> None:
    # Given fix begun for the third time, with a cap of 3
    record = _executed(workflow, 3)
    planner = _planner(workflow, record)
    # When that execution is lost too
    failed = recovery.plan_recovery(planner, record, max_executions=3)
    # Then the task fails with PhaseAbandoned, and the run stops (stop_on_error) and skips what follows
    assert failed.state is State.FAILED and failed.error is not None
    assert failed.error.type == "PhaseAbandoned"
    assert "attempt of task fix round 1 was started 3 times" in failed.error.message
    assert "TASKLOOP_MAX_EXECUTIONS=3" in failed.error.message
    assert failed.error.details == {"executions": 3, "lost": 3}
    assert planner.dispatches == [] and planner.leases == {"fix": None}
    assert planner.tasks["publish"].state is State.SKIPPED
    assert planner.run_updates[fld.F_TERMINATION] == "failed" and planner.run_updates[fld.F_CONTROL] == "stop:failed"
    task_event = next(e for e in planner.events if e.key == "fix")
    assert task_event.type == "task" and task_event.data is not None
    assert task_event.data["status"] == "failed" and task_event.data["error"] == "PhaseAbandoned"
    assert task_event.data["exec"]["lost"] is True and task_event.data["exec"]["execs"] == 3
    final = planner.batch()
    assert final.open_delta == -2 and final.final.hset[fld.F_STATUS] == "failed"


def test_a_cap_above_the_executions_still_replays(workflow: Workflow) -> None:
    record = _executed(workflow, 3)
    assert recovery.plan_recovery(_planner(workflow, record), record, max_executions=4).state is State.QUEUED_ATTEMPT


def test_a_stand_in_record_can_be_failed() -> None:
    for kind, phase in ((TaskKind.LOOP, Phase.ATTEMPT), (TaskKind.TASK, Phase.RUN)):
        record = recovery.stand_in("fix", kind)
        assert record.state is (State.QUEUED_ATTEMPT if phase is Phase.ATTEMPT else State.QUEUED_RUN)
        error = recovery.corrupt_error("r1", "fix", "does not parse")
        failed = advance(record, PhaseEvent(EventKind.FAIL, NOW, error=error))
        assert failed.state is State.FAILED and failed.error is not None and failed.error.type == "CorruptRecord"
        assert "does not parse" in failed.error.message

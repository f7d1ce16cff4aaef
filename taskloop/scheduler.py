"""The scheduler: from a snapshot and an outcome, decide every record write, event and dispatch.

Pure: `Planner` reads a `Snapshot`, moves task records through `phases.advance`, and settles
the run (activate what is ready, skip what can no longer run, stop on error, finish the run).
`Planner.batch()` turns the plan into one guarded write: it guards every record the decision
read, so a concurrent change anywhere it looked makes the write fail and the caller re-plans.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from taskloop import events as ev
from taskloop.config import Settings
from taskloop.definitions import Workflow
from taskloop.events import Event
from taskloop.phases import (
    QUEUED_STATES,
    RUNNING_STATES,
    TERMINAL_RUN,
    ErrorRecord,
    EventKind,
    Phase,
    PhaseEvent,
    RunStatus,
    State,
    TaskRecord,
    TaskStatus,
    Termination,
    advance,
)
from taskloop.store import keys as k
from taskloop.store.batch import Batch
from taskloop.store.redis_store import Snapshot

CANCEL_PREFIX = "cancel:"
STOP_PREFIX = "stop:"

_TERMINATION_OF_ERROR = {
    "TaskTimeout": Termination.TIMEOUT,
    "WorkflowBudgetExceeded": Termination.LIMIT,
}


def termination_for(error: ErrorRecord | None) -> Termination:
    return _TERMINATION_OF_ERROR.get(error.type if error else "", Termination.FAILED)


def ending_reason(control: str) -> str:
    """What a task ended by a run control records as its reason: ``cancelled`` or ``stopped``."""
    return "stopped" if control.startswith(STOP_PREFIX) else "cancelled"


def control_reason(control: str | None) -> str | None:
    """The signal reason that running phases see for a run control value."""
    if control is None:
        return None
    if control.startswith(STOP_PREFIX):
        return "stopped"
    return control.removeprefix(CANCEL_PREFIX) or "cancelled"


@dataclass(frozen=True)
class Dispatch:
    """A Celery message to send once the plan is committed."""

    key: str
    phase: Phase
    round: int
    token: int
    countdown: float | None = None


WORKER_SLOT = "@@worker@@"  # filled in by begin.lua with the executing worker's name
NOW_SLOT = "@@now@@"  # filled in by begin.lua with the begin time


def exec_event(record: TaskRecord, at: float, worker: str) -> Event:
    """The event of a worker beginning to execute a phase (``record`` is the running record)."""
    return Event(type=ev.EXEC, key=record.key, round=record.round, phase=_value(record.phase),
                 attempt=record.attempts, at=at, data={"worker": worker, "replay": record.execs > 1})


def budget_caps(workflow: Workflow, consumed: int) -> list[tuple[str, int, int, str]]:
    """The admission checks of a begin: (run field, limit, amount added, label)."""
    budget = workflow.budget
    caps: list[tuple[str, int, int, str]] = []
    if budget is None:
        return caps
    if budget.attempts is not None and consumed:
        caps.append(("u:attempts", budget.attempts, consumed, "budget:attempts"))
    if budget.input_tokens is not None:
        caps.append(("u:input", budget.input_tokens, 1, "budget:input_tokens"))
    if budget.output_tokens is not None:
        caps.append(("u:output", budget.output_tokens, 1, "budget:output_tokens"))
    return caps


def prepared_begin(workflow: Workflow, record: TaskRecord, raw: str, run_id: str, settings: Settings) -> str | None:
    """What beginning this queued phase will write, for begin.lua (None: the worker decides).

    The running record comes from the state machine; begin.lua only fills in the worker's name
    and the time. A phase that must first evaluate its condition or cache gets none."""
    task = workflow.by_key.get(record.key)
    if task is None or (not record.prepared and (task.condition is not None or task.cache is not None)):
        return None
    begun = advance(record, PhaseEvent(EventKind.BEGIN, 0.0, worker=WORKER_SLOT))
    consumed = begun.attempts - record.attempts
    fields = exec_event(begun, 0.0, WORKER_SLOT).to_fields()
    fields[fields.index("at") + 1] = NOW_SLOT
    return json.dumps({
        "token": record.token, "round": record.round, "phase": _value(record.phase),
        "expect": raw, "record": begun.dump(), "consume": consumed,
        "caps": [[field, limit, add] for field, limit, add, _ in budget_caps(workflow, consumed)],
        "event": fields, "member": k.lease_member(run_id, record.key),
        "timeout_ms": task.timeout_ms, "deadline": record.deadline, "grace": settings.timeout_grace_s,
    }, separators=(",", ":"), ensure_ascii=False)


def initial_records(workflow: Workflow) -> dict[str, TaskRecord]:
    """The records of a new run: every task waiting."""
    records = {}
    for key in workflow.order:
        task = workflow.by_key[key]
        if task.is_loop:
            limit = task.max_rounds or 1
        elif task.retry is not None:
            limit = task.retry.attempts
        else:
            limit = 1
        records[key] = TaskRecord(key=key, kind=task.kind.value, limit=limit)
    return records


class Planner:
    """Accumulates the transitions of one decision over a snapshot of a run."""

    def __init__(self, workflow: Workflow, snapshot: Snapshot, now: float, settings: Settings) -> None:
        self.workflow = workflow
        self.snapshot = snapshot
        self.run_id = snapshot.run_id
        self.now = now
        self.settings = settings
        self.tasks: dict[str, TaskRecord] = snapshot.tasks()
        self.changed: dict[str, TaskRecord] = {}
        self.events: list[Event] = []
        self.dispatches: list[Dispatch] = []
        self.leases: dict[str, float | None] = {}
        self.run_updates: dict[str, str] = {}
        self.run_deletes: list[str] = []
        self.revive = False  # a resumed run: its keys lose their retention TTL
        self.data: dict[str, str] = {}
        self.usage: dict[str, int] = {}
        self.control: str | None = snapshot.control
        self.term: str | None = snapshot.run.get("term")
        self.status: str | None = snapshot.run.get("status")
        self.guard_all = False
        self.caps: list[tuple[str, int, int, str]] = []

    @classmethod
    def for_new_run(
        cls, workflow: Workflow, run_id: str, now: float, settings: Settings
    ) -> Planner:
        """A planner over a run that does not exist yet: every task is written, none may exist."""
        planner = cls(workflow, Snapshot(run_id, run={}, raw_tasks={}), now, settings)
        planner.tasks = initial_records(workflow)
        planner.changed = dict(planner.tasks)
        return planner

    # transitions ----------------------------------------------------------------------------
    def move(self, key: str, event: PhaseEvent) -> TaskRecord:
        old = self.tasks[key]
        new = advance(old, event)
        self.tasks[key] = new
        self.changed[key] = new
        self._derive(old, new, event)
        if new.terminal:
            self.guard_all = True
        return new

    def _derive(self, old: TaskRecord, new: TaskRecord, event: PhaseEvent) -> None:
        key = new.key
        if old.state is State.RUNNING_CHECK and event.kind in (EventKind.ACCEPT, EventKind.REJECT):
            self.events.append(Event(type=ev.PHASE, key=key, round=old.round,
                                     phase=Phase.COMPLETE.value, at=self.now))
        if new.status is TaskStatus.ACTIVE and (new.phase, new.round) != (old.phase, old.round):
            assert new.phase is not None
            self.events.append(Event(type=ev.PHASE, key=key, round=new.round,
                                     phase=new.phase.value, at=self.now))
        if new.status is not old.status:
            data: dict[str, Any] = {"status": new.status.value}
            if new.error is not None and new.error is not old.error:
                data.update(error=new.error.type, message=new.error.message)
            if new.cache_hit:
                data["cache_hit"] = True
            self.events.append(Event(type=ev.TASK, key=key, round=new.round or None,
                                     phase=_value(new.phase), at=self.now, data=data))
        state = new.state
        if state in QUEUED_STATES:  # entering a queue (or re-entering it): send a message
            assert new.phase is not None
            countdown = None
            if new.not_before is not None and new.not_before > self.now:
                countdown = new.not_before - self.now
            self.dispatches.append(Dispatch(key, new.phase, new.round, new.token, countdown))
            self.leases[key] = self.now + (countdown or 0.0) + self.settings.queued_lease_s
        elif state in RUNNING_STATES:
            self.leases[key] = self.now + self.running_lease(new)
        elif state not in QUEUED_STATES:
            self.leases[key] = None

    def running_lease(self, record: TaskRecord) -> float:
        lease = self.settings.running_lease_s
        if record.deadline is not None:
            # A phase with a deadline is reclaimed soon after its hard limit, never before.
            lease = max(lease, record.deadline - self.now + self.settings.timeout_grace_s + 1.0)
        return lease

    # settling -------------------------------------------------------------------------------
    def stop(self, reason: str) -> None:
        """Stop the run: nothing new starts, queued phases are cancelled, running ones signalled."""
        if self.control is None:
            self.control = STOP_PREFIX + reason
            self.run_updates["ctl"] = self.control

    def settle(self) -> None:
        """Propagate the changes made so far through the graph and finish the run if it is over."""
        if not self.guard_all and self.control == self.snapshot.control and self.snapshot.raw_tasks:
            return  # no task ended and no control changed: the graph and the run status stay as they are
        for key, record in list(self.changed.items()):
            if record.status is TaskStatus.FAILED and not self._was_failed(key):
                self._on_failure(record)
        for key in self.workflow.order:
            record = self.tasks[key]
            state = record.state
            if self.control is not None:
                reason = ending_reason(self.control)
                if state is State.WAITING:
                    kind = EventKind.CANCEL if reason == "cancelled" else EventKind.SKIP
                    self.move(key, PhaseEvent(kind, self.now, reason=reason))
                elif state in QUEUED_STATES or state is State.PAUSED:
                    self.move(key, PhaseEvent(EventKind.CANCEL, self.now, reason=reason))
                continue
            if state is not State.WAITING:
                continue
            deps = [self.tasks[d] for d in self.workflow.by_key[key].after]
            if all(d.status is TaskStatus.DONE for d in deps):
                self.move(key, PhaseEvent(EventKind.ACTIVATE, self.now))
            elif any(d.terminal and d.status is not TaskStatus.DONE for d in deps):
                self.move(key, PhaseEvent(EventKind.SKIP, self.now, reason="dependency"))
        self._update_run_status()

    def _was_failed(self, key: str) -> bool:
        return key in self.snapshot.raw_tasks and self.snapshot.task(key).status is TaskStatus.FAILED

    def _on_failure(self, record: TaskRecord) -> None:
        if self.term is None:
            self.term = termination_for(record.error).value
            self.run_updates["term"] = self.term
        budget = record.error is not None and record.error.type == "WorkflowBudgetExceeded"
        if self.workflow.stop_on_error or budget:
            self.stop("limit" if budget else "failed")

    def _update_run_status(self) -> None:
        records = self.tasks.values()
        if all(r.terminal for r in records):
            status = self._final_status()
            if self.control is not None and self.control.startswith(CANCEL_PREFIX):
                term: str | None = Termination.ABORTED.value
            elif status is RunStatus.REJECTED:
                term = Termination.REJECTED.value
            elif status is RunStatus.FAILED:
                term = self.term or Termination.FAILED.value
            else:
                term = None
            self.run_updates.update(status=status.value, finished=repr(self.now))
            if term:
                self.run_updates["term"] = term
            self.events.append(Event(type=ev.RUN_FINISHED, at=self.now,
                                     data={"status": status.value, "termination": term}))
            self.status = status.value
            return
        active = any(r.status is TaskStatus.ACTIVE for r in records)
        paused = any(r.status is TaskStatus.PAUSED for r in records)
        status = RunStatus.WAITING if paused and not active else RunStatus.RUNNING
        if self.status != status.value:
            self.run_updates["status"] = status.value
            self.status = status.value

    def _final_status(self) -> RunStatus:
        statuses = {r.status for r in self.tasks.values()}
        if self.control is not None and self.control.startswith(CANCEL_PREFIX):
            return RunStatus.CANCELLED
        if TaskStatus.REJECTED in statuses:
            return RunStatus.REJECTED
        if TaskStatus.FAILED in statuses:
            return RunStatus.FAILED
        if self.control is not None:  # stopped without a failed task (cannot normally happen)
            return RunStatus.FAILED
        return RunStatus.DONE

    @property
    def finished(self) -> bool:
        return self.status is not None and RunStatus(self.status) in TERMINAL_RUN

    # the write ------------------------------------------------------------------------------
    def batch(self) -> Batch:
        """One guarded write for the whole plan."""
        b = Batch(self.run_id)
        guarded = self.snapshot.raw_tasks.keys() if self.guard_all else self.changed.keys()
        for key in guarded:
            b.expect_task(key, self.snapshot.raw_tasks.get(key))
        b.expect(k.K_RUN, "ctl", self.snapshot.control, "control")
        if "term" in self.run_updates and self.snapshot.run.get("term") is None:
            b.expect(k.K_RUN, "term", None, "termination")
        for field, limit, add, label in self.caps:
            b.cap(k.K_RUN, field, limit, add, label)
        for key, record in self.changed.items():
            raw = record.dump()
            b.hset(k.K_TASKS, key, raw)
            if record.state in QUEUED_STATES:
                prepared = prepared_begin(self.workflow, record, raw, self.run_id, self.settings)
                if prepared is not None:
                    b.hset(k.K_DATA, k.begin_field(key), prepared)
            elif key in self.snapshot.raw_tasks and self.snapshot.task(key).state in QUEUED_STATES:
                b.hdel(k.K_DATA, k.begin_field(key))  # it left the queue some other way
        for field, value in self.data.items():
            b.hset(k.K_DATA, field, value)
        for name, amount in self.usage.items():
            b.hincr(k.K_RUN, f"u:{name}", amount)
        for field, value in self.run_updates.items():
            b.hset(k.K_RUN, field, value)
        for field in self.run_deletes:
            b.hdel(k.K_RUN, field)
        if self.revive:
            b.persist_run()
        for event in self.events:
            b.event(event)
        for key, until in self.leases.items():
            b.lease(key, until)
        if self.finished:
            assert self.status is not None
            b.end(self.status)
            grace = self.settings.success_grace_s
            done = self.status == RunStatus.DONE.value
            b.expire_run(grace if done and self.workflow.delete_on_success else self.settings.retention_s)
        return b


def _value(phase: Phase | None) -> str | None:
    return phase.value if phase is not None else None

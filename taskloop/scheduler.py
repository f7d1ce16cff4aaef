"""The scheduler: from what a decision read of a run and an outcome, every record write, event,
lease and dispatch — as one guarded write.

`Planner` reads records through a `Snapshot` (only the fields it needs), moves them through
`phases.advance`, and settles the graph by following the workflow's edges from the tasks that
changed: a finished task lowers its dependents' ``waiting_on`` and activates those that reach
zero; a task that ended otherwise skips its dependents, and so on down. Counters in the run hash
(tasks not terminal, active, paused) make the run's end an O(1) check: the write carries the
finishing writes, which ``cas.lua`` applies when the open-task counter reaches zero.

`Planner.batch()` guards exactly what the decision read — the records it looked at, the run's
control flag, and (when it may end the run) the fields that decide the final status — so a
concurrent change anywhere it looked makes the write fail and the caller plans again.

Intent methods: `start_run`, `outcome`, `admit`, `resume`, `decide`, `stop`, `cancel_gates`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from taskloop import events as ev
from taskloop import graph_plan
from taskloop.config import Settings, min_lease_s
from taskloop.definitions import Task, Workflow
from taskloop.errors import CorruptRecord, LoopTaskExhausted, TaskTimeout, WorkflowBudgetExceeded
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
    TaskKind,
    TaskRecord,
    TaskStatus,
    Termination,
    advance,
    lease_until,
)
from taskloop.store import keys as k
from taskloop.store.batch import Batch, Writes
from taskloop.store.meta import Snapshot

# What decides the final status of a run besides its control flag (read and guarded together).
OUTCOME_FIELDS = (k.F_TERMINATION, k.F_REJECTED, k.F_STATUS)
TERMINAL_STATUSES = frozenset(s.value for s in TERMINAL_RUN)

CANCEL_PREFIX = "cancel:"
STOP_PREFIX = "stop:"

_TERMINATION_OF_ERROR = {
    TaskTimeout.__name__: Termination.TIMEOUT,
    WorkflowBudgetExceeded.__name__: Termination.LIMIT,
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


def final_status(control: str | None, termination: Termination | None,
                 rejected: bool) -> tuple[RunStatus, Termination | None]:
    """How a run whose tasks are all terminal ends: the one rule for its status and termination."""
    if control is not None and control.startswith(CANCEL_PREFIX):
        return RunStatus.CANCELLED, Termination.ABORTED
    if rejected:
        return RunStatus.REJECTED, Termination.REJECTED
    if termination is not None:
        return RunStatus.FAILED, termination
    if control is not None:  # stopped without a failed task (cannot normally happen)
        return RunStatus.FAILED, Termination.FAILED
    return RunStatus.DONE, None


@dataclass(frozen=True)
class Dispatch:
    """A Celery message to send once the plan is committed."""

    key: str
    phase: Phase
    round: int
    token: int
    countdown: float | None = None


@dataclass(frozen=True)
class Cap:
    """A budget admission check of a begin: run field + ``add`` must stay within ``limit``."""

    field: str
    limit: int
    add: int
    label: str


def counts_attempts(workflow: Workflow) -> bool:
    """Only a budget on attempts needs a run-wide attempt counter (to admit against); the usage
    reported to callers sums the records' own counts."""
    return workflow.budget is not None and workflow.budget.attempts is not None


def budget_caps(workflow: Workflow, consumed: int) -> list[Cap]:
    budget = workflow.budget
    caps: list[Cap] = []
    if budget is None:
        return caps
    if budget.attempts is not None and consumed:
        caps.append(Cap(k.usage_field("attempts"), budget.attempts, consumed, "budget:attempts"))
    if budget.input_tokens is not None:
        caps.append(Cap(k.usage_field("input"), budget.input_tokens, 1, "budget:input_tokens"))
    if budget.output_tokens is not None:
        caps.append(Cap(k.usage_field("output"), budget.output_tokens, 1, "budget:output_tokens"))
    return caps


_FILLED_BY_BEGIN = frozenset({"worker", "began_at", "deadline"})


def needs_preparation(task: Task, record: TaskRecord) -> bool:
    """Before the first execution of an activation, the worker evaluates the condition and the cache."""
    return not record.prepared and (task.condition is not None or task.cache is not None)


def prepared_begin(workflow: Workflow, record: TaskRecord, settings: Settings) -> str | None:
    """What beginning this queued phase will write, for begin.lua (None: the worker decides).

    The running record comes from the state machine; begin.lua fills in only the worker's name,
    the begin time and (for a new round with a timeout) the deadline, then takes the lease."""
    task = workflow.lookup(record.key)
    if task is None or needs_preparation(task, record):
        return None
    begun = advance(record, PhaseEvent(EventKind.BEGIN, 0.0, worker="-"))
    consumed = begun.attempts - record.attempts
    template = begun.model_dump_json(exclude_defaults=True, exclude=set(_FILLED_BY_BEGIN))
    return json.dumps({
        "tok": record.token, "rnd": record.round, "ph": _value(record.phase),
        "rec": template[:-1], "cons": consumed if counts_attempts(workflow) else 0,
        "caps": [[cap.field, cap.limit, cap.add] for cap in budget_caps(workflow, consumed)],
        "dl": record.deadline, "tmo": task.timeout_ms / 1000.0 if task.timeout_ms and record.deadline is None else None,
        "lease": settings.running_lease_s, "grace": settings.timeout_grace_s,
        "rd": outcome_fields(workflow, record),
    }, separators=(",", ":"), ensure_ascii=False)


PREFETCH_DEPENDENTS = 64  # beyond this many, an outcome reads its dependents when it needs them


def outcome_fields(workflow: Workflow, record: TaskRecord) -> list[str]:
    """What the outcome of a phase that may end its task will read besides OUTCOME_FIELDS (which
    the executor asks begin.lua for with the record): the dependents' records, returned with the
    begin."""
    if record.phase is Phase.ATTEMPT:
        return []
    dependents = workflow.dependents.get(record.key, ())
    return [k.task_field(d) for d in dependents] if len(dependents) <= PREFETCH_DEPENDENTS else []


def initial_record(task: Task) -> TaskRecord:
    """The record of a task in a new run: waiting for its dependencies."""
    if task.kind is TaskKind.LOOP:
        limit = task.max_rounds or 1
    elif task.retry is not None:
        limit = task.retry.attempts
    else:
        limit = 1
    return TaskRecord(key=task.key, kind=task.kind, limit=limit, waiting_on=len(task.after))


class Planner:
    """Accumulates the transitions of one decision over what it read of a run."""

    def __init__(self, workflow: Workflow, snapshot: Snapshot, now: float, settings: Settings) -> None:
        self.workflow = workflow
        self.snapshot = snapshot
        self.run_id = snapshot.run_id
        self.now = now
        self.settings = settings
        self.new_run = False
        self.tasks: dict[str, TaskRecord] = {}  # every record read or changed
        self.changed: dict[str, TaskRecord] = {}
        self.events: list[Event] = []
        self.final_events: list[Event] = []  # written only if this plan ends the run
        self.dispatches: list[Dispatch] = []
        self.leases: dict[str, float | None] = {}
        self.data: dict[str, str] = {}
        self.run_updates: dict[str, str] = {}
        self.run_deletes: list[str] = []
        self.usage: dict[str, int] = {}
        self.counters: Counter[str] = Counter()
        self.caps: list[Cap] = []
        self.revive = False
        self.indexes: list[tuple[str, str, float]] = []  # global index entries written with the plan
        self.stats: dict[str, int] = {}  # fleet counters added with the plan (in the same round trip)
        self.exec_info: dict[str, dict[str, Any]] = {}  # key -> what ran, added to its first event
        self.control: str | None = snapshot.control
        self._ended: list[str] = []  # keys that became terminal in this plan, in order
        self.guarded: set[str] = set()  # run fields read to be rewritten (guarded by the write)
        self._settled = 0
        self._term_read = False
        self.term: Termination | None = None
        self.rejected = False
        self.over = False  # the run had ended before this plan (an aborted run's late phases)
        self.aborting = False

    # reading --------------------------------------------------------------------------------
    def record(self, key: str) -> TaskRecord:
        """The task's record as this plan sees it; reading it makes the write guard it."""
        found = self.tasks.get(key)
        if found is None:
            found = self.snapshot.record(key)
            if found is None:
                raise CorruptRecord(self.run_id, key, "the run has no record of this task")
            self.tasks[key] = found
        return found

    def _read_outcome_fields(self) -> None:
        """The fields that decide the run's final status (guarded once read)."""
        if not self._term_read:
            self.snapshot.ensure(OUTCOME_FIELDS)
            term = self.snapshot.fields.get(k.F_TERMINATION)
            self.term = self.term or (Termination(term) if term else None)
            self.rejected = self.rejected or bool(self.snapshot.fields.get(k.F_REJECTED))
            self.over = self.snapshot.fields.get(k.F_STATUS) in TERMINAL_STATUSES
            self._term_read = True

    # transitions ----------------------------------------------------------------------------
    def move(self, key: str, event: PhaseEvent) -> TaskRecord:
        old = self.record(key)
        new = advance(old, event)
        self.tasks[key] = new
        self.changed[key] = new
        self._count(old, new)
        self._derive(old, new, event)
        if new.terminal and not old.terminal:
            self._ended.append(key)
        return new

    def _count(self, old: TaskRecord, new: TaskRecord) -> None:
        self.counters[k.F_OPEN] += int(old.terminal) - int(new.terminal)
        for status, field in ((TaskStatus.ACTIVE, k.F_ACTIVE), (TaskStatus.PAUSED, k.F_PAUSED)):
            self.counters[field] += int(new.status is status) - int(old.status is status)

    def _derive(self, old: TaskRecord, new: TaskRecord, event: PhaseEvent) -> None:
        key = new.key
        emitted: list[Event] = []
        if old.state is State.RUNNING_CHECK and event.kind in (EventKind.ACCEPT, EventKind.REJECT):
            verdict = {"done": event.kind is EventKind.ACCEPT, "feedback": _shorten(event.feedback)}
            emitted.append(Event(type=ev.PHASE, key=key, round=old.round, phase=Phase.COMPLETE.value, at=self.now,
                                 data=verdict))
        if event.kind in (EventKind.EXPIRE, EventKind.HAND_BACK):
            kind = ev.LOST if event.kind is EventKind.EXPIRE else ev.HANDED_BACK
            emitted.append(Event(type=kind, key=key, round=new.round, phase=_value(new.phase), at=self.now))
        if event.kind is EventKind.RETRY and new.phase is Phase.CHECK:  # same round and phase: say so
            emitted.append(Event(type=ev.RETRY, key=key, round=new.round, phase=_value(new.phase), at=self.now,
                                 data={"try": new.tries + 1, "due": new.not_before,
                                       "error": event.error.message if event.error else None}))
        if new.status is TaskStatus.ACTIVE and (new.phase, new.round) != (old.phase, old.round):
            emitted.append(Event(type=ev.PHASE, key=key, round=new.round, phase=_value(new.phase), at=self.now))
        entered_phase = bool(emitted) and emitted[-1].type == ev.PHASE
        if new.status is not old.status and not (new.status is TaskStatus.ACTIVE and entered_phase):
            data: dict[str, Any] = {"status": new.status.value}
            if new.error is not None and new.error is not old.error:
                data.update(error=new.error.type, message=new.error.message)
            if new.reason is not None and new.reason is not old.reason:
                data["reason"] = new.reason
            if new.cache_hit:
                data["cache_hit"] = True
            emitted.append(Event(type=ev.TASK, key=key, round=new.round or None,
                                 phase=_value(new.phase), at=self.now, data=data))
        if emitted and key in self.exec_info:
            first = emitted[0]
            emitted[0] = first.model_copy(update={"data": {**(first.data or {}), "exec": self.exec_info.pop(key)}})
        self.events += emitted
        state = new.state
        if state in QUEUED_STATES:  # entering a queue (or re-entering it): send a message
            assert new.phase is not None
            countdown = None
            if new.not_before is not None and new.not_before > self.now:
                countdown = new.not_before - self.now
            self.dispatches.append(Dispatch(key, new.phase, new.round, new.token, countdown))
            self.leases[key] = self.now + (countdown or 0.0) + self.settings.queued_lease_s
        elif state in RUNNING_STATES:
            self.leases[key] = self.running_lease(new)
        elif old.state in QUEUED_STATES or old.state in RUNNING_STATES:
            self.leases[key] = None

    def running_lease(self, record: TaskRecord) -> float:
        return lease_until(self.now, record.deadline, self.settings.running_lease_s, self.settings.timeout_grace_s)

    # intents --------------------------------------------------------------------------------
    @classmethod
    def start_run(cls, workflow: Workflow, run_id: str, input_raw: str, digest: str, now: float,
                  settings: Settings, pending: Snapshot | None = None) -> Planner:
        """Plan a new run: every record written, the roots activated. With ``pending``, the run
        was recorded by name and is planned now by a worker (its input and creation time stay)."""
        snap = pending or Snapshot(run_id)
        planner = cls(workflow, snap, now, settings)
        planner.new_run = True
        planner._term_read = True
        planner.run_updates.update({
            k.F_FORMAT: k.FORMAT, k.F_WORKFLOW: workflow.name, k.F_VERSION: workflow.version,
            k.F_FINGERPRINT: workflow.fingerprint, k.F_STATUS: RunStatus.RUNNING.value,
        })
        if pending is None:
            planner.run_updates.update({k.F_INPUT: input_raw, k.F_INPUT_DIGEST: digest, k.F_CREATED: repr(now)})
            planner.indexes.append((k.RUNS_INDEX, run_id, now))
        planner.indexes.append((k.LIVE_INDEX, run_id, now + min_lease_s(settings)))
        planner.events.append(Event(type=ev.RUN_STARTED, at=now,
                                    data={"workflow": workflow.name, "version": workflow.version}))
        planner.stats[k.started_stat(workflow.name)] = 1
        if workflow.graph is not None:  # a graph run starts with its entry's first activation
            graph_plan.start(planner, workflow.graph)
            planner.settle()
            return planner
        for task in workflow.tasks:
            planner.tasks[task.key] = planner.changed[task.key] = initial_record(task)
        planner.counters[k.F_OPEN] = len(workflow.tasks)
        if workflow.gates:
            planner.run_updates[k.F_GATES] = json.dumps(list(workflow.gates))
        for key in workflow.roots:
            planner._activate(key)
        planner.settle()
        return planner

    def outcome(self, key: str, event: PhaseEvent, data: dict[str, str] | None = None,
                extra_events: list[Event] | None = None) -> TaskRecord:
        """Record what a phase produced, and everything that follows from it."""
        self.data.update(data or {})
        self.events += extra_events or ()
        new = self.move(key, event)
        self.settle()
        return new

    def admit(self, key: str, worker: str, timeout_ms: int | None) -> TaskRecord:
        """Begin a queued phase on the worker's own write (the path without a prepared begin):
        one attempt consumed and admitted against the budget."""
        old = self.record(key)
        begun = self.move(key, PhaseEvent(EventKind.BEGIN, self.now, worker=worker, timeout_ms=timeout_ms))
        consumed = begun.attempts - old.attempts
        if counts_attempts(self.workflow):
            self.usage["attempts"] = self.usage.get("attempts", 0) + consumed
        self.caps += budget_caps(self.workflow, consumed)
        return begun

    def stop(self, reason: str) -> None:
        """Stop the run: nothing new starts; queued phases end cancelled when their messages come,
        running ones see their signal, paused gates are cancelled here."""
        if self.control is None:
            self.control = STOP_PREFIX + reason
            self.run_updates[k.F_CONTROL] = self.control
            self.cancel_gates()

    def abort(self, error: ErrorRecord) -> None:
        """End the run failed now, whatever its tasks: its definition is not available here, or it
        cannot be planned. Phases still in flight end cancelled as their messages come."""
        self._read_outcome_fields()
        if self.over:
            return
        if self.control is None:
            self.control = STOP_PREFIX + "failed"
            self.run_updates[k.F_CONTROL] = self.control
        if self.term is None:
            self.term = Termination.FAILED
            self.run_updates[k.F_TERMINATION] = self.term.value
        self.run_updates[k.F_ERROR] = error.model_dump_json()
        self.aborting = True

    def cancel_gates(self) -> None:
        """End the paused gates of a stopped or cancelled run (nothing else would). The run lists
        its gates (a graph run, those it activated so far)."""
        assert self.control is not None
        reason = ending_reason(self.control)
        gates = self.run_updates.get(k.F_GATES) or self.guard(k.F_GATES)
        for key in json.loads(gates or "[]"):
            if self.record(key).state is State.PAUSED:
                self.move(key, PhaseEvent(EventKind.CANCEL, self.now, reason=reason))

    def fail_run(self, error: ErrorRecord, termination: Termination = Termination.FAILED) -> None:
        """End the run by its own rules (a graph's handler, state or transition was invalid): the
        error is the run's, nothing new starts, and what still runs ends cancelled."""
        self._read_outcome_fields()
        if self.term is None:
            self.term = termination
            self.run_updates[k.F_TERMINATION] = termination.value
        self.run_updates[k.F_ERROR] = error.model_dump_json()
        self.stop("limit" if termination is Termination.LIMIT else "failed")

    def guard(self, field: str) -> str | None:
        """Read a run field that this plan will rewrite from what it read: the write guards it."""
        self.guarded.add(field)
        return self.snapshot.get(field)

    def decide(self, key: str, approve: bool, value_raw: str | None, gate_event: Event) -> None:
        kind = EventKind.APPROVE if approve else EventKind.DENY
        if approve:
            self.data[k.value_field(key)] = value_raw or "null"
        self.events.append(gate_event)
        self.move(key, PhaseEvent(kind, self.now))
        self.settle()

    def resume(self, replay: set[str]) -> None:
        """Reopen a failed run: replay the interrupted phases in ``replay``, and let the tasks that
        were cancelled or skipped because of them run again. Reads every record (O(tasks))."""
        keys = self.record_keys()
        self.snapshot.ensure([k.task_field(key) for key in keys])
        self._read_outcome_fields()
        self.control = None
        self.run_deletes += [k.F_CONTROL, k.F_TERMINATION, k.F_FINISHED, k.F_ERROR]
        self.run_updates[k.F_STATUS] = RunStatus.RUNNING.value
        self.revive = True
        self.indexes.append((k.LIVE_INDEX, self.run_id, self.now + min_lease_s(self.settings)))
        self.term = None
        self.events.append(Event(type=ev.RUN_RESUMED, at=self.now, data={"tasks": sorted(replay)}))
        for key in keys:  # dependencies before dependents
            record = self.record(key)
            reopen = key in replay or record.status is TaskStatus.CANCELLED or (
                record.status is TaskStatus.SKIPPED and record.reason != "condition")
            if not reopen:
                continue
            waiting_on = sum(1 for dep in self.workflow.task(key).after
                             if self.record(dep).status is not TaskStatus.DONE)
            reopened = self.move(key, PhaseEvent(EventKind.RESUME, self.now, waiting_on=waiting_on))
            if reopened.state is State.WAITING and reopened.waiting_on == 0:
                self._activate(key)
        self.settle()

    def record_keys(self) -> list[str]:
        """Every task record of the run, dependencies first: a DAG's tasks, or a graph run's actions
        so far (reads the activation counters)."""
        if self.workflow.graph is None:
            return list(self.workflow.order)
        return graph_plan.action_keys(self)

    # settling -------------------------------------------------------------------------------
    def settle(self) -> None:
        """Follow the edges from every task that ended in this plan (and from those that end
        because of them): activate, skip or cancel dependents; note failures and rejections."""
        while self._settled < len(self._ended):
            key = self._ended[self._settled]
            self._settled += 1
            record = self.tasks[key]
            budget = record.error is not None and record.error.type == WorkflowBudgetExceeded.__name__
            if record.status is TaskStatus.FAILED and (self.workflow.graph is None or budget):
                self.note_failure(record)
            elif record.status is TaskStatus.REJECTED and not self.rejected:
                self._read_outcome_fields()
                self.rejected = True
                self.run_updates[k.F_REJECTED] = "1"
            if self.workflow.graph is not None:
                if not budget:
                    graph_plan.after_action(self, record)
                continue
            for dependent in self.workflow.dependents.get(key, ()):
                waiting = self.record(dependent)
                if waiting.state is not State.WAITING:
                    continue
                if record.status is TaskStatus.DONE:
                    if self.move(dependent, PhaseEvent(EventKind.DEP_DONE, self.now)).waiting_on == 0:
                        self._activate(dependent)
                elif self.control is not None:
                    self._end_by_control(dependent)
                else:
                    self.move(dependent, PhaseEvent(EventKind.SKIP, self.now, reason="dependency"))

    def _activate(self, key: str) -> None:
        if self.control is None:
            self.move(key, PhaseEvent(EventKind.ACTIVATE, self.now))
        else:
            self._end_by_control(key)

    def _end_by_control(self, key: str) -> None:
        """A waiting task of a cancelled run is cancelled; of a stopped run, skipped."""
        assert self.control is not None
        reason = ending_reason(self.control)
        kind = EventKind.CANCEL if reason == "cancelled" else EventKind.SKIP
        self.move(key, PhaseEvent(kind, self.now, reason=reason))

    def note_failure(self, record: TaskRecord) -> None:
        """A task failed for good: the run's termination (the first failure's), and a stop when the
        workflow stops on errors or the budget is spent."""
        self._read_outcome_fields()
        if self.term is None:
            self.term = termination_for(record.error)
            self.run_updates[k.F_TERMINATION] = self.term.value
        budget = record.error is not None and record.error.type == WorkflowBudgetExceeded.__name__
        if self.workflow.stop_on_error or budget:
            self.stop("limit" if budget else "failed")

    # the write ------------------------------------------------------------------------------
    def batch(self) -> Batch:
        """One guarded write for the whole plan."""
        b = Batch(self.run_id)
        snap = self.snapshot
        if self.new_run:
            if snap.fields.get(k.F_STATUS) == RunStatus.PENDING.value:
                b.expect(k.F_STATUS, RunStatus.PENDING.value, "pending run")
            else:
                b.expect(k.F_WORKFLOW, None, "run exists")
        else:
            for key in self.tasks:
                b.expect(k.task_field(key), snap.fields.get(k.task_field(key)), f"task:{key}")
        b.expect(k.F_CONTROL, snap.fields.get(k.F_CONTROL), "control")
        for field in sorted(self.guarded):
            b.expect(field, snap.fields.get(field), field)
        for cap in self.caps:
            b.cap(cap.field, cap.limit, cap.add, cap.label)
        for key, record in self.changed.items():
            raw = record.dump()
            b.set(k.task_field(key), raw)
            if record.state in QUEUED_STATES:
                prepared = prepared_begin(self.workflow, record, self.settings)
                if prepared is not None:
                    b.set(k.begin_field(key), prepared)
            elif record.terminal and not self.new_run:
                b.delete(k.begin_field(key))
        for field, value in self.data.items():
            b.set(field, value)
        for name, amount in self.usage.items():
            b.incr(k.usage_field(name), amount)
        b.hset.update(self.run_updates)
        for field in self.run_deletes:
            b.delete(field)
        b.revive = self.revive
        for index in self.indexes:
            b.index(*index)
        b.stats.update(self.stats)
        for event in self.events:
            b.event(event)
        for key, until in self.leases.items():
            b.lease(key, until)
        open_delta = self.counters[k.F_OPEN]
        if self.new_run:
            for field in (k.F_OPEN, k.F_ACTIVE, k.F_PAUSED):
                b.set(field, str(self.counters[field]))
            return b
        for field in (k.F_ACTIVE, k.F_PAUSED):
            b.incr(field, self.counters[field])
        if self.aborting:
            b.incr(k.F_OPEN, open_delta)
            self._finish(b)
            b.finishes = b.ttl_leases = True
        elif open_delta < 0:
            self._read_outcome_fields()
            b.open_delta = open_delta
            if not self.over:
                self._finish(b.final)
        elif open_delta > 0:
            b.incr(k.F_OPEN, open_delta)
        if self._term_read:  # the final status depends on them: guard them as read
            for field in OUTCOME_FIELDS:
                b.expect(field, snap.fields.get(field), field)
        return b

    def _finish(self, final: Writes) -> None:
        """The writes that end the run: in ``b.final`` they apply only if this write ends the run's
        last open task; an abort writes them at once."""
        status, term = final_status(self.control, self.term, self.rejected)
        final.hset[k.F_STATUS] = status.value
        final.hset[k.F_FINISHED] = repr(self.now)
        if term is not None:
            final.hset[k.F_TERMINATION] = term.value
        event = Event(type=ev.RUN_FINISHED, at=self.now,
                      data={"status": status.value, "termination": term.value if term else None})
        final.events.append(event)
        self.final_events = [event]
        final.end_marker = status.value
        done = status is RunStatus.DONE
        final.ttl = self.settings.success_grace_s if done and self.workflow.delete_on_success \
            else self.settings.retention_s


EVENT_TEXT_LIMIT = 300  # characters of a feedback quoted in an event (the whole one is in the round data)


def _shorten(text: str | None) -> str | None:
    if text is None or len(text) <= EVENT_TEXT_LIMIT:
        return text
    return text[:EVENT_TEXT_LIMIT - 3] + "..."


def _value(phase: Phase | None) -> str | None:
    return phase.value if phase is not None else None


def exhausted(record: TaskRecord) -> bool:
    return record.error is not None and record.error.type == LoopTaskExhausted.__name__

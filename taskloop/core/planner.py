"""The planner: from what a decision read of a run and an outcome, every record write, event,
lease and dispatch, as one guarded write.

`Planner` reads records through a `Snapshot` (only the fields it needs), moves them through
`phases.advance`, and settles the run from the tasks that ended, as its topology says
(topology.py: a DAG's edges in dag.py, a graph workflow's handler in graph_plan.py), by the run's
rules (rules.py: its control flag, terminations). What it reads and what it will write is its
`Draft` (draft.py), which ``batch()`` makes the one guarded write, with the writes that end the
run when its last open task ends.

Intent methods: `start_run`, `outcome`, `admit`, `resume`, `decide`, `stop`, `cancel_gates`.
"""

from __future__ import annotations

import json
from typing import Any

from taskloop.base.config import Settings, min_lease_s
from taskloop.base.errors import WorkflowBudgetExceeded
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.batch import Index
from taskloop.core.begin import Dispatch, budget_caps, counts_attempts
from taskloop.core.draft import Draft
from taskloop.core.events import Event
from taskloop.core.leases import lease_until
from taskloop.core.phases import EventKind, PhaseEvent, advance
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.rules import STOP_PREFIX, ending_reason, termination_for
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import QUEUED_STATES, RUNNING_STATES, RunStatus, State, TaskStatus, Termination
from taskloop.core.topology import topology_of
from taskloop.core.transition_events import transition_events
from taskloop.define.workflow import Workflow


class Planner(Draft):
    """Accumulates the transitions of one decision over what it read of a run."""

    def __init__(self, workflow: Workflow, snapshot: Snapshot, now: float, settings: Settings) -> None:
        super().__init__(workflow, snapshot, now, settings)
        self.topology = topology_of(workflow)
        self.exec_info: dict[str, dict[str, Any]] = {}  # key -> what ran, added to its first event
        self._ended: list[str] = []  # keys that became terminal in this plan, in order
        self._settled = 0

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
        self.counters[fld.F_OPEN] += int(old.terminal) - int(new.terminal)
        for status, field in ((TaskStatus.ACTIVE, fld.F_ACTIVE), (TaskStatus.PAUSED, fld.F_PAUSED)):
            self.counters[field] += int(new.status is status) - int(old.status is status)

    def _derive(self, old: TaskRecord, new: TaskRecord, event: PhaseEvent) -> None:
        """What follows from one transition: its events (transition_events.py; the first carries
        what ran), and the message and lease of a phase that enters a queue or begins."""
        key = new.key
        emitted = transition_events(old, new, event, self.now)
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
        planner.mark_outcome_read()
        planner.run_updates.update({
            fld.F_FORMAT: fld.FORMAT, fld.F_WORKFLOW: workflow.name, fld.F_VERSION: workflow.version,
            fld.F_FINGERPRINT: workflow.fingerprint, fld.F_STATUS: RunStatus.RUNNING.value,
        })
        if pending is None:
            planner.run_updates.update({fld.F_INPUT: input_raw, fld.F_INPUT_DIGEST: digest, fld.F_CREATED: repr(now)})
            planner.listing = (RunStatus.RUNNING.value, None, now, True)
        else:  # listed by record_pending (runtime/starting.py) under the same name
            planner.listing = (RunStatus.RUNNING.value, RunStatus.PENDING.value, planner.created(), False)
        planner.indexes.append((Index.LIVE, run_id, now + min_lease_s(settings)))
        planner.events.append(Event(type=ev.RUN_STARTED, at=now,
                                    data={"workflow": workflow.name, "version": workflow.version}))
        planner.stats[fld.started_stat(workflow.name)] = 1
        planner.topology.start(planner)
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

    def admit(self, key: str, worker: str, timeout_ms: int | None, at: float | None = None) -> TaskRecord:
        """Begin a queued phase on the worker's own write (the path without a prepared begin, and a
        deferred phase's outcome, which begins it ``at`` the time its callback started): one
        attempt consumed and admitted against the budget."""
        old = self.record(key)
        begun = self.move(key, PhaseEvent(EventKind.BEGIN, self.now if at is None else at, worker=worker,
                                          timeout_ms=timeout_ms))
        consumed = begun.attempts - old.attempts
        if counts_attempts(self.workflow) and consumed:
            self.usage["attempts"] = self.usage.get("attempts", 0) + consumed
        self.caps += budget_caps(self.workflow, consumed)
        return begun

    def stop(self, reason: str) -> None:
        """Stop the run: nothing new starts; queued phases end cancelled when their messages come,
        running ones see their signal, paused gates are cancelled here."""
        if self.control is None:
            self.control = STOP_PREFIX + reason
            self.run_updates[fld.F_CONTROL] = self.control
            self.cancel_gates()

    def abort(self, error: ErrorRecord) -> None:
        """End the run failed now, whatever its tasks: its definition is not available here, or it
        cannot be planned. Phases still in flight end cancelled as their messages come."""
        self._read_outcome_fields()
        if self.over:
            return
        if self.control is None:
            self.control = STOP_PREFIX + "failed"
            self.run_updates[fld.F_CONTROL] = self.control
        if self.term is None:
            self.term = Termination.FAILED
            self.run_updates[fld.F_TERMINATION] = self.term.value
        self.run_updates[fld.F_ERROR] = error.model_dump_json()
        self.aborting = True

    def cancel_gates(self) -> None:
        """End the paused gates of a stopped or cancelled run (nothing else would). The run lists
        its gates (a graph run, those it activated so far)."""
        assert self.control is not None
        reason = ending_reason(self.control)
        gates = self.run_updates.get(fld.F_GATES) or self.guard(fld.F_GATES)
        for key in json.loads(gates or "[]"):
            if self.record(key).state is State.PAUSED:
                self.move(key, PhaseEvent(EventKind.CANCEL, self.now, reason=reason))

    def fail_run(self, error: ErrorRecord, termination: Termination = Termination.FAILED) -> None:
        """End the run by its own rules (a graph's handler, state or transition was invalid): the
        error is the run's, nothing new starts, and what still runs ends cancelled."""
        self._read_outcome_fields()
        if self.term is None:
            self.term = termination
            self.run_updates[fld.F_TERMINATION] = termination.value
        self.run_updates[fld.F_ERROR] = error.model_dump_json()
        self.stop("limit" if termination is Termination.LIMIT else "failed")

    def decide(self, key: str, approve: bool, value_raw: str | None, gate_event: Event) -> None:
        kind = EventKind.APPROVE if approve else EventKind.DENY
        if approve:
            self.data[fld.value_field(key)] = value_raw or "null"
        self.events.append(gate_event)
        self.move(key, PhaseEvent(kind, self.now))
        self.settle()

    def resume(self, replay: set[str], actor: str | None = None) -> None:
        """Reopen a failed run: replay the interrupted phases in ``replay``, and let the tasks that
        were cancelled or skipped because of them run again. Reads every record (O(tasks))."""
        keys = self.record_keys()
        self.snapshot.ensure([fld.task_field(key) for key in keys])
        self._read_outcome_fields()
        self.control = None
        self.run_deletes += [fld.F_CONTROL, fld.F_TERMINATION, fld.F_FINISHED, fld.F_ERROR]
        self.run_updates[fld.F_STATUS] = RunStatus.RUNNING.value
        self.listing = (RunStatus.RUNNING.value, RunStatus.FAILED.value, self.created(), False)
        self.revive = True
        self.indexes.append((Index.LIVE, self.run_id, self.now + min_lease_s(self.settings)))
        self.term = None
        self.events.append(Event(type=ev.RUN_RESUMED, at=self.now,
                                 data={"tasks": sorted(replay), **({"actor": actor} if actor else {})}))
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
                self.activate(key)
        self.settle()

    def record_keys(self) -> list[str]:
        """Every task record of the run, dependencies first: a DAG's tasks, or a graph run's actions
        so far (reads the activation counters)."""
        return self.topology.record_keys(self)

    # settling -------------------------------------------------------------------------------
    def settle(self) -> None:
        """Follow the edges from every task that ended in this plan (and from those that end
        because of them): activate, skip or cancel dependents; note failures and rejections."""
        while self._settled < len(self._ended):
            key = self._ended[self._settled]
            self._settled += 1
            record = self.tasks[key]
            if record.status is TaskStatus.REJECTED and not self.rejected:
                self._read_outcome_fields()
                self.rejected = True
                self.run_updates[fld.F_REJECTED] = "1"
            self.topology.settle(self, record)

    def activate(self, key: str) -> None:
        if self.control is None:
            self.move(key, PhaseEvent(EventKind.ACTIVATE, self.now))
        else:
            self.end_by_control(key)

    def end_by_control(self, key: str) -> None:
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
            self.run_updates[fld.F_TERMINATION] = self.term.value
        budget = record.error is not None and record.error.of(WorkflowBudgetExceeded)
        if self.workflow.stop_on_error or budget:
            self.stop("limit" if budget else "failed")

"""The planner: from what a decision read of a run and an outcome, every record write, event,
lease and dispatch, as one guarded write.

`Planner` reads records through a `Snapshot` (only the fields it needs), moves them through
`phases.advance`, and settles the run from the tasks that ended, as its topology says
(topology.py: a DAG's edges in dag.py, a graph workflow's handler in graph_plan.py). Counters in the run hash
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
from typing import Any

from taskloop.base.config import Settings, min_lease_s
from taskloop.base.errors import CorruptRecord, WorkflowBudgetExceeded
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.batch import Batch, Index, Writes, ended_score
from taskloop.core.begin import Cap, Dispatch, budget_caps, counts_attempts, prepared_begin
from taskloop.core.events import Event
from taskloop.core.leases import kept_lease, lease_until
from taskloop.core.phases import (
    QUEUED_STATES,
    RUNNING_STATES,
    EventKind,
    PhaseEvent,
    RunStatus,
    State,
    TaskStatus,
    Termination,
    advance,
)
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.rules import (
    ENDING_FIELDS,
    OUTCOME_FIELDS,
    STOP_PREFIX,
    TERMINAL_STATUSES,
    ending_reason,
    final_status,
    termination_for,
)
from taskloop.core.snapshot import Snapshot
from taskloop.core.topology import topology_of
from taskloop.core.transition_events import transition_events
from taskloop.define.workflow import Workflow


class Planner:
    """Accumulates the transitions of one decision over what it read of a run."""

    def __init__(self, workflow: Workflow, snapshot: Snapshot, now: float, settings: Settings) -> None:
        self.workflow = workflow
        self.topology = topology_of(workflow)
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
        self.indexes: list[tuple[Index, str, float]] = []  # global index entries written with the plan
        self.listing: tuple[str, str | None, float, bool] | None = None  # run lists: (status, was, created, new)
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
            self.snapshot.ensure(ENDING_FIELDS)
            term = self.snapshot.fields.get(fld.F_TERMINATION)
            self.term = self.term or (Termination(term) if term else None)
            self.rejected = self.rejected or bool(self.snapshot.fields.get(fld.F_REJECTED))
            self.over = self.snapshot.fields.get(fld.F_STATUS) in TERMINAL_STATUSES
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

    def _kept_leases(self) -> dict[str, float]:
        """The phases queued again that keep the lease of their earlier queueing (leases.py
        ``kept_lease``), by that lease's time: the write has one ZADD fewer for each."""
        kept: dict[str, float] = {}
        for key, until in ({} if self.new_run else self.leases).items():
            held = kept_lease(self.snapshot.record(key), self.changed.get(key), until, self.now,
                              self.settings.queued_lease_s)
            if held is not None:
                kept[key] = held
        return kept

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

    def mark_outcome_read(self) -> None:
        """A new run has no outcome fields to read (nothing has failed or been rejected yet)."""
        self._term_read = True

    def created(self) -> float:
        """When the run was created: its score in the run lists."""
        written = self.run_updates.get(fld.F_CREATED)
        return float(written or self.snapshot.get(fld.F_CREATED) or self.now)

    def guard(self, field: str) -> str | None:
        """Read a run field that this plan will rewrite from what it read: the write guards it."""
        self.guarded.add(field)
        return self.snapshot.get(field)

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

    # the write ------------------------------------------------------------------------------
    def batch(self) -> Batch:
        """One guarded write for the whole plan."""
        b = Batch(self.run_id)
        snap = self.snapshot
        if self.new_run:
            if snap.fields.get(fld.F_STATUS) == RunStatus.PENDING.value:
                b.expect(fld.F_STATUS, RunStatus.PENDING.value, "pending run")
            else:
                b.expect(fld.F_WORKFLOW, None, "run exists")
        else:
            for key in self.tasks:
                b.expect(fld.task_field(key), snap.fields.get(fld.task_field(key)), f"task:{key}")
        b.expect(fld.F_CONTROL, snap.fields.get(fld.F_CONTROL), "control")
        for field in sorted(self.guarded):
            b.expect(field, snap.fields.get(field), field)
        for cap in self.caps:
            b.cap(cap.field, cap.limit, cap.add, cap.label)
        kept = self._kept_leases()
        for key, record in self.changed.items():
            if kept.get(key) != record.lease_kept:
                record = self.changed[key] = self.tasks[key] = record.model_copy(update={"lease_kept": kept.get(key)})
            b.set(fld.task_field(key), record.dump())
            for field, value in zip(fld.record_fields(key)[1:], record.execution(), strict=True):
                if value is not None:
                    if value != snap.fields.get(field):
                        b.set(field, value)
                elif record.terminal:  # the task ended: its execution fields go (one HDEL with b:)
                    if snap.fields.get(field) is not None:
                        b.delete(field)
                elif snap.fields.get(field):  # cleared as "" in the HSET the transition sends anyway
                    b.set(field, "")
            if record.state in QUEUED_STATES:
                prepared = prepared_begin(self.workflow, record, self.settings)
                if prepared is not None:
                    b.set(fld.begin_field(key), prepared)
            elif record.terminal and not self.new_run:
                b.delete(fld.begin_field(key))
                b.delete(fld.started_field(key))
        for field, value in self.data.items():
            b.set(field, value)
        for name, amount in self.usage.items():
            b.incr(fld.usage_field(name), amount)
        b.hset.update(self.run_updates)
        for field in self.run_deletes:
            b.delete(field)
        b.revive = self.revive
        if self.listing is not None:
            status, was, created, new = self.listing
            b.list_run(self.workflow.name, status, created, new=new, was=was)
        for index in self.indexes:
            b.index(*index)
        b.stats.update(self.stats)
        for event in self.events:
            b.event(event)
        for key, until in self.leases.items():
            if key not in kept:
                b.lease(key, until)
        open_delta = self.counters[fld.F_OPEN]
        if self.new_run:
            for field in (fld.F_OPEN, fld.F_ACTIVE, fld.F_PAUSED):
                b.set(field, str(self.counters[field]))
            return b
        for field in (fld.F_ACTIVE, fld.F_PAUSED):
            b.incr(field, self.counters[field])
        if self.aborting:
            b.incr(fld.F_OPEN, open_delta)
            self._finish(b)
            b.finishes = b.ttl_leases = True
        elif open_delta < 0:
            self._read_outcome_fields()
            b.open_delta = open_delta
            if not self.over:
                self._finish(b.final)
        elif open_delta > 0:
            b.incr(fld.F_OPEN, open_delta)
        if self._term_read:  # the final status depends on them: guard them as read
            for field in OUTCOME_FIELDS:
                b.expect(field, snap.fields.get(field), field)
        return b

    def _finish(self, final: Writes) -> None:
        """The writes that end the run: in ``b.final`` they apply only if this write ends the run's
        last open task; an abort writes them at once."""
        status, term = final_status(self.control, self.term, self.rejected)
        final.hset[fld.F_STATUS] = status.value
        final.hset[fld.F_FINISHED] = repr(self.now)
        if term is not None:
            final.hset[fld.F_TERMINATION] = term.value
        event = Event(type=ev.RUN_FINISHED, at=self.now,
                      data={"status": status.value, "termination": term.value if term else None})
        final.events.append(event)
        self.final_events = [event]
        final.end_marker = status.value
        deleted = status is RunStatus.DONE and self.workflow.delete_on_success
        final.ttl = self.settings.success_grace_s if deleted else self.settings.retention_s
        was = self.run_updates.get(fld.F_STATUS) or self.snapshot.get(fld.F_STATUS) or RunStatus.RUNNING.value
        if deleted:
            final.unlist_run(self.workflow.name, was)
        else:
            final.list_run(self.workflow.name, status.value, self.created(), was=was)
        final.look_at(ended_score(self.now))  # the next pass forgets and compacts it (store/compacted.py)

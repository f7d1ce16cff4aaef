"""What a plan gathers, and the one guarded write it becomes.

A `Draft` holds what one decision read of a run (task records through a `Snapshot`, run fields it
rewrites, the fields that decide the run's end) and what it will write and send (records, data,
events, dispatches, leases, counters, run fields, lists, indexes, budget caps). The `Planner`
(planner.py) fills it: it moves the records and applies the run's rules.

`Draft.batch()` guards exactly what the decision read — the records it looked at, the run's
control flag, and (when it may end the run) the fields that decide the final status — so a
concurrent change anywhere it looked makes the write fail and the caller plans again. Counters in
the run hash (tasks not terminal, active, paused) make the run's end an O(1) check: the write
carries the finishing writes, which ``cas.lua`` applies when the open-task counter reaches zero.
"""

from __future__ import annotations

from collections import Counter

from taskloop.base.config import Settings
from taskloop.base.errors import CorruptRecord
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.batch import Batch, Index, Writes, ended_score
from taskloop.core.begin import Cap, Dispatch, prepared_begin
from taskloop.core.events import Event
from taskloop.core.leases import kept_lease
from taskloop.core.records import TaskRecord
from taskloop.core.rules import ENDING_FIELDS, OUTCOME_FIELDS, TERMINAL_STATUSES, final_status
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import QUEUED_STATES, RunStatus, Termination
from taskloop.define.workflow import Workflow


class Draft:
    """What one decision read of a run and what it will write: the state a `Planner` fills."""

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
        self.indexes: list[tuple[Index, str, float]] = []  # global index entries written with the plan
        self.listing: tuple[str, str | None, float, bool] | None = None  # run lists: (status, was, created, new)
        self.stats: dict[str, int] = {}  # fleet counters added with the plan (in the same round trip)
        self.control: str | None = snapshot.control
        self.guarded: set[str] = set()  # run fields read to be rewritten (guarded by the write)
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

    def guard(self, field: str) -> str | None:
        """Read a run field that this plan will rewrite from what it read: the write guards it."""
        self.guarded.add(field)
        return self.snapshot.get(field)

    def _read_outcome_fields(self) -> None:
        """The fields that decide the run's final status (guarded once read)."""
        if not self._term_read:
            self.snapshot.ensure(ENDING_FIELDS)
            term = self.snapshot.fields.get(fld.F_TERMINATION)
            self.term = self.term or (Termination(term) if term else None)
            self.rejected = self.rejected or bool(self.snapshot.fields.get(fld.F_REJECTED))
            self.over = self.snapshot.fields.get(fld.F_STATUS) in TERMINAL_STATUSES
            self._term_read = True

    def mark_outcome_read(self) -> None:
        """A new run has no outcome fields to read (nothing has failed or been rejected yet)."""
        self._term_read = True

    def created(self) -> float:
        """When the run was created: its score in the run lists."""
        written = self.run_updates.get(fld.F_CREATED)
        return float(written or self.snapshot.get(fld.F_CREATED) or self.now)

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

"""The full path: a phase message that did not run on its message's fields or its one read, decided
on what was read. A stale or duplicated message is refused; a redelivery whose execution was lost
is replayed (recovery/executions.py); a run whose definition is not available here is aborted; on
the first execution of an activation the condition and the cache are consulted (preparing.py); a
cancelled run cancels the phase; then a guarded write admits the phase against the budget and
begins it, taking its room under its fleet limits in the same call (limits/limiter.py). What lets
the phase run is a ``Call`` (running.py); anything else is the ``Handled`` it came to."""

from __future__ import annotations

from taskloop.base import clock
from taskloop.base.errors import LimitRefused, Superseded, TaskLoopError
from taskloop.base.limits import Caps
from taskloop.core import fields as fld
from taskloop.core import outcomes
from taskloop.core.outcomes import Outcome
from taskloop.core.phases import EventKind
from taskloop.core.planner import Planner
from taskloop.core.records import TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase, Slot, active_state
from taskloop.define.context import Signal
from taskloop.define.tasks import Task
from taskloop.define.workflow import Workflow
from taskloop.runtime.commit import commit
from taskloop.store.limit_store import Admission
from taskloop.store.redis_store import Conflict
from taskloop.worker.execution import cache as caching
from taskloop.worker.execution import deferred as deferring
from taskloop.worker.execution import preparing
from taskloop.worker.execution.callbacks import build_context, error_record
from taskloop.worker.execution.handled import Handled, Result
from taskloop.worker.execution.recording import Recorder
from taskloop.worker.execution.running import Call, make_call
from taskloop.worker.limits import limiter
from taskloop.worker.recovery import executions as recovery

Step = Handled | Call


class FullPath:
    """Decides on a read for one worker process (its recorder, and the limits it learned per
    message name)."""

    def __init__(self, recorder: Recorder, caps: Caps, hints: limiter.Hints) -> None:
        self.recorder = recorder
        self.store = recorder.store
        self.settings = recorder.settings
        self.worker = recorder.worker
        self.caps = caps
        self.hints = hints

    def began(self, snap: Snapshot, record: TaskRecord, holding: limiter.Holding | None = None) -> Step:
        """The phase began in begin.lua: check what it runs on, then let it run."""
        ran = False
        try:
            found = self.recorder.definition(snap, record)
            if isinstance(found, Handled):
                return found
            workflow, task = found
            if record.overdue(record.began_at or clock.now()):  # the round ran out while this message was queued
                return self.recorder.record(workflow, task, snap, record, outcomes.timeout(task, record),
                                            holding=holding)
            ran = True
            return make_call(self.store, workflow, task, snap, record, self.caps, holding)
        finally:
            if not ran:
                self.recorder.release(holding)

    def decide(self, snap: Snapshot, record: TaskRecord, phase: Phase, round: int, token: int,
               name: str | None) -> Step:
        """The message was not begun by begin.lua (``name``: its Celery name, for the limits' hints)."""
        if record.state is not active_state(phase, Slot.QUEUED) or record.round != round or record.token != token:
            if recovery.is_redelivery_of_running(record, phase, round, token) and record.worker == self.worker:
                # this process began it and the reply of that begin was lost (a timeout, retried); no
                # copy of this message runs here (the executor's registry), so it is its own execution
                return self.began(snap, record)
            if recovery.is_redelivery_of_running(record, phase, round, token) and recovery.execution_lost(
                    self.store, snap.run_id, record, self.settings.queued_lease_s):
                return self.recorder.recover(snap, record)
            limiter.left_waiting(self.store, snap, record)
            return self.recorder.stale(snap, record, phase, round, token)
        earlier = deferring.started(snap.get(fld.started_field(record.key)))
        if earlier is not None and earlier.token == token and earlier.worker != self.worker:
            ran = record.model_copy(update={"worker": earlier.worker, "began_at": earlier.at})  # ran before its begin
            if recovery.execution_lost(self.store, snap.run_id, ran, self.settings.queued_lease_s):
                return self.recorder.recover(snap, ran)
            return self.recorder.stale(snap, record, phase, round, token)  # it runs there: this is a duplicate
        found = self.recorder.definition(snap, record)
        if isinstance(found, Handled):
            return found
        workflow, task = found
        if record.overdue(clock.now()):  # the round ran out while queued
            return self.recorder.commit_outcome(workflow, task, snap, record, outcomes.timeout(task, record))
        if snap.control is not None:
            return self.recorder.commit_outcome(workflow, task, snap, record, outcomes.cancel(snap.control))
        lookup: caching.Lookup | None = None
        if not record.prepared:
            prepared = self._prepare(workflow, task, snap, record)
            if isinstance(prepared, Handled):
                return prepared
            lookup = prepared
        room: limiter.Room | None = None
        if not task.limits_of(phase.value):
            self.hints.forget(name)
        else:
            taken = self._room_for(workflow, task, snap, record, name)
            if isinstance(taken, Handled):
                return taken
            room = taken
        return self._admit(workflow, task, snap, record, lookup, room)

    def _room_for(self, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord,
                  name: str | None) -> limiter.Room | Handled:
        """What the phase's begin takes under its fleet limits. A concurrency key that fails fails
        the task."""
        assert record.phase is not None
        ctx = build_context(self.store, workflow, task, snap, record, Signal(), record.phase, self.caps)
        room = limiter.room_for(self.settings, workflow, task, snap, record, ctx,
                                lambda specs: self.hints.learn(name, workflow, task, specs))
        if isinstance(room, limiter.KeyFailed):
            failed = Outcome(EventKind.FAIL, error=error_record(room.error))
            return self.recorder.commit_outcome(workflow, task, snap, record, failed)
        return room

    def _prepare(self, workflow: Workflow, task: Task, snap: Snapshot,
                 record: TaskRecord) -> caching.Lookup | Handled:
        """Condition and cache (preparing.py): the lookup to begin with, or their outcome, recorded."""
        ctx = build_context(self.store, workflow, task, snap, record, Signal(), None, self.caps)
        found = preparing.prepare(task, ctx, workflow.name, self.store, self.settings.cache_ttl_s, record.attempts,
                                  self.caps.output)
        if isinstance(found, preparing.Decided):
            return self.recorder.commit_outcome(workflow, task, snap, record, found.outcome, found.events)
        return found

    def _admit(self, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord,
               lookup: caching.Lookup | None, room: limiter.Room | None = None) -> Step:
        """Begin the phase with a guarded write of its own (admitted against the budget, and taking
        its room under its fleet limits in the same call: a refusal writes nothing and the phase
        waits, noted throttled, its message done)."""
        raw = snap.raw_record(task.key)
        note = snap.get(fld.throttle_field(task.key))

        def plan(view: Snapshot) -> Planner:
            if view.raw_record(task.key) != raw or view.control is not None:
                raise Superseded(f"task {task.key} moved on before it began")
            planner = Planner(workflow, view, clock.now(), self.settings)
            if lookup is not None:
                planner.events += lookup.events
                if lookup.fingerprint is not None:
                    planner.data[fld.fingerprint_field(task.key)] = lookup.fingerprint
            planner.admit(task.key, self.worker, task.timeout_ms)
            if note is not None:
                planner.run_deletes.append(fld.throttle_field(task.key))
            return planner

        try:
            committed = commit(self.store, plan, snap, self.recorder.send, retry=_not_budget,
                               limits=room.op if room is not None else None)
        except Superseded:
            return self.recorder.moved_on(snap, record)
        except LimitRefused as exc:
            assert room is not None and isinstance(exc.admission, Admission) and raw is not None
            limiter.record_throttled(self.store, snap.run_id, task.key, raw, note, exc.admission, room.waiter)
            return Handled(Result.THROTTLED, reason=f"waits for limit {exc.admission.limit}")
        except TaskLoopError as exc:
            conflict = getattr(exc, "conflict", None)
            if not isinstance(conflict, Conflict) or not conflict.label.startswith("budget:"):
                raise
            spent = outcomes.budget_spent(workflow, task, record, conflict.label.removeprefix("budget:"),
                                          int(conflict.current or 0))
            return self.recorder.commit_outcome(workflow, task, snap, record, spent)
        if room is not None:
            limiter.started(self.store, note, room.waiter)
        begun = committed.planner.tasks[task.key]
        fresh = Snapshot(snap.run_id, {**snap.fields, fld.task_field(task.key): begun.dump(),
                                       fld.throttle_field(task.key): None},
                         loader=lambda names: self.store.hmget(snap.run_id, names))
        return make_call(self.store, workflow, task, fresh, begun, self.caps,
                         limiter.Holding(room.held) if room is not None else None)


def _not_budget(conflict: Conflict) -> bool:
    return not conflict.label.startswith("budget:")

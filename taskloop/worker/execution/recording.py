"""Writing what a phase message came to: the outcome of a phase that ran (resolved against the run
as it is when written, with the release of its fleet-limit slots in the same call), an outcome
decided before any callback ran (a skip, a cache hit, a timeout while queued, a cancel), and the
refusals and recoveries (a stale delivery, a superseded execution, a lost one replayed, a corrupt
record, a run whose definition is not here). Every write goes through runtime/commit.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import CorruptRecord, StoreUnavailable, Superseded, TaskLoopError
from taskloop.core import fields as fld
from taskloop.core import outcomes
from taskloop.core.events import Event
from taskloop.core.limits import LimitOp
from taskloop.core.outcomes import Outcome
from taskloop.core.phases import EventKind
from taskloop.core.planner import Planner
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase
from taskloop.define.context import Signal
from taskloop.define.tasks import Task, TaskKind
from taskloop.define.workflow import Workflow
from taskloop.runtime.commit import Committed, Plan, Sender, commit, commit_once, through_outage
from taskloop.store.aio import AsyncScripts
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution import cache as caching
from taskloop.worker.execution import refusals
from taskloop.worker.execution.deferred import Deferred
from taskloop.worker.execution.handled import Handled, Result, handled_of
from taskloop.worker.limits import limiter
from taskloop.worker.recovery import executions as recovery

log = logging.getLogger("taskloop.executor")


@dataclass(frozen=True)
class Recording:
    """An outcome to write: its plan (made again on every try), and what it gives back."""

    key: str
    snap: Snapshot
    begun: TaskRecord
    plan: Plan
    holding: limiter.Holding | None
    wake: LimitOp | None


class Recorder:
    """Records for one worker process (its store, settings, sender and name)."""

    def __init__(self, store: RedisStore, settings: Settings, send: Sender, worker: str,
                 resend: limiter.Resend) -> None:
        self.store = store
        self.settings = settings
        self.send = send
        self.worker = worker
        self.resend = resend  # sends the messages of phases a released slot lets start (PhaseSender.resend)

    def workflow_of(self, snap: Snapshot) -> Workflow:
        return recovery.workflow_for(snap, self.worker)

    def definition(self, snap: Snapshot, record: TaskRecord) -> tuple[Workflow, Task] | Handled:
        """The workflow and task a record runs under; when the definition is not available here
        the run is aborted, and when the record contradicts it the task fails (both recorded)."""
        try:
            workflow = self.workflow_of(snap)
        except TaskLoopError as exc:
            return self.abort(snap, ErrorRecord(type=type(exc).__name__, message=str(exc)))
        task = workflow.task(record.key)
        problem = recovery.inconsistency(task, record, snap)
        if problem is not None:
            return self.record(workflow, task, snap, record, Outcome(
                EventKind.FAIL, error=recovery.corrupt_error(snap.run_id, record.key, problem)))
        return workflow, task

    def release(self, holding: limiter.Holding | None) -> None:
        """Give back the phase's slots, unless the write of its outcome did (once)."""
        if holding is not None and not holding.released:
            holding.released = True
            limiter.release(self.store, holding.held, self.resend)

    # outcomes -------------------------------------------------------------------------------
    def record(self, workflow: Workflow, task: Task, snap: Snapshot, begun: TaskRecord, outcome: Outcome,
               signal: Signal | None = None, holding: limiter.Holding | None = None,
               deferred: Deferred | None = None) -> Handled:
        """Record the outcome of a running phase (resolved against the run as it is now), releasing
        its limit slots in the same call. A deferred phase (deferred.py) is begun in the same write,
        unless the watcher began it on the way."""
        return self.write(self.recording(workflow, task, snap, begun, outcome, signal, holding, deferred))

    def recording(self, workflow: Workflow, task: Task, snap: Snapshot, begun: TaskRecord, outcome: Outcome,
                  signal: Signal | None = None, holding: limiter.Holding | None = None,
                  deferred: Deferred | None = None) -> Recording:
        """What ``record`` writes: the plan of the outcome's write (made again on every try), before
        any write (``write`` makes it, or ``awrite`` on an event loop)."""
        key = task.key
        if deferred is not None:
            mark = deferred.claim()
            if mark is not None:  # begun by the watcher: recorded as any running phase
                snap.forget(mark.fields)
                snap.fields.update(mark.fields)
                deferred = None
        begun_raw = deferred.queued_raw if deferred is not None else snap.raw_record(key)
        write_back: list[Event | None] = []
        exec_info: dict[str, object] = {"worker": begun.worker, "began": begun.began_at, "execs": begun.execs,
                                        "attempt": begun.attempts}
        if begun.began_at is not None and begun.queued_at is not None:
            exec_info["wait"] = round(begun.began_at - begun.queued_at, 6)

        ended = clock.now()  # the outcome's time, also when Redis is away and it is recorded later

        def plan(view: Snapshot) -> Planner:
            if view.raw_record(key) != begun_raw:
                raise Superseded(f"task {key} was taken over while its phase ran")
            now = clock.now()
            resolved = outcomes.resolve(task, begun, outcome, signal.reason if signal else None, view.control, ended)
            if not write_back and task.cache is not None and resolved.kind in (EventKind.ACCEPT, EventKind.SUCCEED):
                write_back.append(caching.store_outcome(task, self.store, self.settings.cache_ttl_s, view,
                                                        resolved.data, clock.now()))
            planner = Planner(workflow, view, now, self.settings)
            if deferred is not None:
                planner.admit(key, self.worker, task.timeout_ms, at=deferred.started)
            planner.exec_info[key] = {**exec_info, "took": round(ended - (begun.began_at or ended), 6)}
            planner.outcome(key, outcomes.phase_event(resolved, now, task), resolved.data,
                            [e for e in write_back if e is not None])
            return planner

        wake = limiter.wake_op(holding.held) if holding is not None and not holding.released else None
        return Recording(key, snap, begun, plan, holding, wake)

    def write(self, recording: Recording) -> Handled:
        """Write a recording, riding out an outage of the store (TASKLOOP_RECORD_OUTAGE_S)."""
        try:
            committed = through_outage(self.store, recording.plan, recording.snap, self.send,
                                       self.settings.record_outage_s, recording.wake)
        except Superseded:
            return self.superseded(recording.snap, recording.begun)
        return self._recorded(recording, committed)

    async def awrite(self, aio: AsyncScripts, recording: Recording) -> Handled | None:
        """Write a recording with its one script call awaited on an event loop (runtime/commit.py
        ``commit_once``); None when it takes the sync path (``write``: a conflict, an outage, a
        write of more than one call)."""
        try:
            committed = await commit_once(self.store, aio, recording.plan, recording.snap, self.send, recording.wake)
        except Superseded:
            return self.superseded(recording.snap, recording.begun)
        except StoreUnavailable:
            return None  # the sync path rides the outage out
        return None if committed is None else self._recorded(recording, committed)

    def _recorded(self, recording: Recording, committed: Committed) -> Handled:
        holding = recording.holding
        if recording.wake is not None and holding is not None:
            holding.released = True
            limiter.woken(committed.picked, self.resend)
        return handled_of(committed, recording.key)

    def commit_outcome(self, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord,
                       outcome: Outcome, extra_events: list[Event] | None = None) -> Handled:
        """Record an outcome decided before any callback ran (skip, cache hit, timeout, cancel, ...)."""
        raw = snap.raw_record(task.key)
        note = snap.get(fld.throttle_field(task.key))  # it waited for a fleet limit: it leaves the queue

        def plan(view: Snapshot) -> Planner:
            if view.raw_record(task.key) != raw:
                raise Superseded(f"task {task.key} moved on")
            planner = Planner(workflow, view, clock.now(), self.settings)
            planner.outcome(task.key, outcomes.phase_event(outcome, planner.now, task), outcome.data, extra_events)
            if note is not None:
                planner.run_deletes.append(fld.throttle_field(task.key))
            return planner

        try:
            committed = commit(self.store, plan, snap, self.send)
        except Superseded:
            return self.moved_on(snap, record)
        if note is not None:
            limiter.leave(self.store, note)
        return handled_of(committed, task.key)

    # refusals and recovery ------------------------------------------------------------------
    def moved_on(self, snap: Snapshot, record: TaskRecord) -> Handled:
        """The record moved while this message was being decided on: the message is stale now."""
        phase = record.phase or Phase.RUN
        return self.stale(snap, record, phase, record.round, record.token)

    def stale(self, snap: Snapshot, record: TaskRecord, phase: Phase, round: int, token: int) -> Handled:
        return refusals.stale(self.store, snap.run_id, record, phase, round, token)

    def superseded(self, snap: Snapshot, begun: TaskRecord) -> Handled:
        return refusals.superseded(self.store, snap.run_id, begun)

    def recover(self, snap: Snapshot, record: TaskRecord) -> Handled:
        """Do the reconciler's work at once: queue a replay of the lost execution (or give up)."""
        try:
            workflow = self.workflow_of(snap)
        except TaskLoopError:
            return Handled(Result.STALE, reason="lost execution left to a worker that has the definition")
        return recovery.recover(self.store, self.settings, self.send, workflow, snap, record)

    def fail_corrupt(self, snap: Snapshot, key: str, problem: str) -> Handled:
        """A record that does not parse fails its task before any callback runs on it."""
        log.error("%s", problem)
        try:
            workflow = self.workflow_of(snap)
        except TaskLoopError as exc:
            return self.abort(snap, ErrorRecord(type=type(exc).__name__, message=str(exc)))
        task = workflow.task(key)
        snap.put_record(key, recovery.stand_in(key, task.kind))
        error = ErrorRecord(type=CorruptRecord.__name__, message=problem)
        return self.commit_outcome(workflow, task, snap, snap.record(key) or recovery.stand_in(key, TaskKind.TASK),
                                   Outcome(EventKind.FAIL, error=error))

    def abort(self, snap: Snapshot, error: ErrorRecord) -> Handled:
        """The run cannot go on here: end it failed with ``error`` (see recovery/executions.py)."""
        recovery.abort_run(self.store, self.settings, self.send, snap, error)
        return Handled(Result.COMMITTED, outcome=EventKind.FAIL, error=error)

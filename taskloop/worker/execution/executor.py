"""Executes one phase message on a worker: begin, call, record. It sequences the other worker
modules; the rules live in them (deferred.py, core/outcomes.py, recovery/executions.py, cache.py, limits/limiter.py).

1. **Ready**: a prepared phase runs on the fields its message carries, or on one plain read
   (deferred.py), and its begin is written with its outcome; a phase under a budget or a fleet
   limit begins in one call first (begin.lua: the record moves to running, an attempt is counted,
   a lease and the room under its limits are taken).
2. Otherwise the **full path** decides on what was read: a stale or duplicated message is
   refused; a redelivery whose execution was lost is replayed (worker/recovery/executions.py); a run whose
   definition is not available here is aborted; on the first execution of an activation the
   condition and the cache are consulted; a cancelled run cancels the phase; then a guarded
   write admits the phase against the budget and begins it.
3. **Call** the callback while the watcher sets ``ctx.signal`` (cancel, stop, deadline) and,
   past the grace period, records the outcome itself and stops the process.
4. **Record** (one call, cas.lua): the outcome as resolved by outcomes.py, with everything the
   scheduler decides from it and the release of the phase's limit slots; the messages it
   dispatches go out in the same call when the broker is the store's Redis.
"""

from __future__ import annotations

import logging
import os
import signal as signals

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import (
    CorruptRecord,
    LimitRefused,
    Superseded,
    TaskLoopError,
)
from taskloop.connections import clients
from taskloop.core import fields as fld
from taskloop.core import outcomes, reads
from taskloop.core.events import Event
from taskloop.core.outcomes import Outcome
from taskloop.core.phases import (
    ErrorRecord,
    EventKind,
    Phase,
    Slot,
    TaskRecord,
    active_state,
)
from taskloop.core.planner import Planner
from taskloop.core.snapshot import Snapshot
from taskloop.define.context import Signal
from taskloop.define.tasks import Task, TaskKind
from taskloop.define.workflow import Workflow
from taskloop.ops import metrics
from taskloop.runtime.commit import Sender, begin, commit, through_outage
from taskloop.store.limit_store import Admission
from taskloop.store.redis_store import Conflict, RedisStore
from taskloop.worker.execution import cache as caching
from taskloop.worker.execution import deferred as deferring
from taskloop.worker.execution import preparing, refusals
from taskloop.worker.execution.callbacks import build_context, call_phase, error_record
from taskloop.worker.execution.deferred import Deferred
from taskloop.worker.execution.handled import Handled, Result, handled_of
from taskloop.worker.execution.messages import Carried
from taskloop.worker.limits import limiter
from taskloop.worker.liveness.watcher import Watcher
from taskloop.worker.recovery import executions as recovery

log = logging.getLogger("taskloop.executor")

# Set in Celery prefork pool processes (worker_process_init): only there may a worker stop a
# callback that overran its grace period by ending its own process (the pool replaces it).
hard_stop_allowed = False


class Executor:
    """Runs phase messages for one worker process."""

    def __init__(self, store: RedisStore, settings: Settings, send: Sender, worker: str,
                 resend: limiter.Resend | None = None) -> None:
        self.store = store
        self.settings = settings
        self.send = send
        self.worker = worker
        # sends the messages of phases that waited for a fleet limit (PhaseSender.resend)
        self.resend: limiter.Resend = resend or getattr(send, "resend", None) or _no_resend
        self.watcher = Watcher(store, settings)
        self.caps = settings.caps()
        self.cluster = clients.is_cluster(store.client)  # limits live in other slots: never taken in begin.lua
        self.hints = limiter.Hints()
        self.slow: set[str | None] = set()  # message names whose every phase needs its begin first (deferred.py)
        self.learned: dict[str | None, tuple[str, ...]] = {}  # per message name: what its outcome read besides
        self.name: str | None = None  # the current message's Celery name (<workflow>.<key>.<phase>)
        # set once the current message's callback was called: until then a store outage may hand
        # the message back to the queue (worker/tasks.py), since nothing ran yet
        self.calling = False

    # entry point ----------------------------------------------------------------------------
    def handle(self, phase: Phase, run_id: str, key: str, round: int, token: int,
               name: str | None = None, carried: Carried | None = None) -> Handled:
        """Process one message (``name``: its Celery name, for the limits hints; ``carried``: the
        fields its queuing write put into it, core/reads.py)."""
        self.calling = False
        self.name = name
        fields = reads.message_fields(phase, key, round)
        presented = None if self.cluster else self.hints.presented(name, run_id, key, phase.value, round, token)
        if presented is None and name not in self.slow:  # no read if the message carries it, else one plain read
            on_carried = self._on_carried(phase, run_id, key, round, token, carried) \
                if carried is not None and not self.cluster else None
            if isinstance(on_carried, Handled):
                return on_carried
            handled = self._one_read(phase, run_id, key, round, token, fields) \
                if on_carried is not deferring.Ready.BEGIN_FIRST else None
            if handled is not None:
                return handled
        reply = begin(self.store, run_id, key, round, phase.value, token, self.worker, clock.now(), fields,
                      presented.op if presented else None)
        snap = Snapshot(run_id, reply.fields, loader=lambda names: self.store.hmget(run_id, names))
        found = self._read(snap, key, phase, round)
        if not isinstance(found, TaskRecord):
            return found
        record = found
        if presented is not None and reply.refused is not None:
            limiter.record_throttled(self.store, run_id, key, snap.raw_record(key) or "",
                                     snap.get(fld.throttle_field(key)), reply.refused, presented.waiter)
            return Handled(Result.THROTTLED, reason=f"waits for limit {reply.refused.limit}")
        if reply.began:
            if presented is None:
                return self._began(snap, record)
            limiter.started(self.store, snap.get(fld.throttle_field(key)), presented.waiter)
            snap.fields[fld.throttle_field(key)] = None  # begin.lua deleted it
            return self._began(snap, record, limiter.Holding(presented.held))
        return self._decide(snap, record, phase, round, token)

    def _on_carried(self, phase: Phase, run_id: str, key: str, round: int, token: int,
                    carried: Carried) -> Handled | deferring.Ready:
        """The step on the fields the message carries (deferred.py): run now, BEGIN_FIRST or DECIDE."""
        started = clock.now()
        ready, snap, record, outcome_reads = deferring.on_carried(self.store, run_id, key, phase, round, token,
                                                                  carried, started)
        if ready is deferring.Ready.BEGIN_FIRST:
            self.slow.add(self.name)
        if ready is not deferring.Ready.NOW:
            return ready
        assert snap is not None and record is not None
        self.learned[self.name] = outcome_reads
        return self._run_deferred(snap, record, phase, token, started, carried=True)

    def _one_read(self, phase: Phase, run_id: str, key: str, round: int, token: int,
                  fields: list[str]) -> Handled | None:
        """The step on one read (deferred.py): the phase runs now, or the full path decides on the
        read, or None: begin.lua first (a budget or a fleet limit: learned for the message name)."""
        started = clock.now()
        note = fld.started_field(key)
        mine = deferring.note(token, self.worker, started)
        snap = self.store.read_noting(run_id, reads.read_fields(key, fields, self.learned.get(self.name, ())),
                                      note, mine)
        before = snap.fields.get(note)
        read = self._read(snap, key, phase, round)
        ready, outcome_reads = (deferring.Ready.DECIDE, ()) if not isinstance(read, TaskRecord) else \
            deferring.ready(snap, key, phase, round, token, read)
        if ready is not deferring.Ready.NOW:
            # not this message's execution: the note goes, or back to the live execution's note
            earlier = deferring.started(before)
            live = isinstance(read, TaskRecord) and earlier is not None and earlier.token == read.token
            self.store.unnote(run_id, note, mine, before if live else None)
            if ready is deferring.Ready.BEGIN_FIRST:
                self.slow.add(self.name)  # a budget or a fleet limit: begin.lua from now on
                return None
            return read if not isinstance(read, TaskRecord) else self._decide(snap, read, phase, round, token)
        assert isinstance(read, TaskRecord)
        self.learned[self.name] = outcome_reads  # read with the next message of this name
        return self._run_deferred(snap, read, phase, token, started)

    def _read(self, snap: Snapshot, key: str, phase: Phase, round: int) -> TaskRecord | Handled:
        """The task's record as read; a run or task not there is dropped, a corrupt record failed."""
        if snap.fields[fld.F_WORKFLOW] is None or snap.fields[fld.task_field(key)] is None:
            what = "run" if snap.fields[fld.F_WORKFLOW] is None else f"task {key!r} of run"
            log.warning("%s %r not found (never started, or expired); dropping %s round %s",
                        what, snap.run_id, phase.value, round)
            self.store.incr_stat("dropped_unknown_run")
            metrics.refused("unknown run")
            return Handled(Result.DROPPED, reason=f"{what} not found")
        try:
            record = snap.record(key)
        except CorruptRecord as exc:
            return self._fail_corrupt(snap, key, str(exc))
        assert record is not None
        return record

    # deciding -------------------------------------------------------------------------------
    def workflow_of(self, snap: Snapshot) -> Workflow:
        return recovery.workflow_for(snap, self.worker)

    def _definition(self, snap: Snapshot, record: TaskRecord) -> tuple[Workflow, Task] | Handled:
        """The workflow and task a record runs under; when the definition is not available here
        the run is aborted, and when the record contradicts it the task fails (both recorded)."""
        try:
            workflow = self.workflow_of(snap)
        except TaskLoopError as exc:
            return self._abort(snap, ErrorRecord(type=type(exc).__name__, message=str(exc)))
        task = workflow.task(record.key)
        problem = recovery.inconsistency(task, record, snap)
        if problem is not None:
            return self._record(workflow, task, snap, record, Outcome(
                EventKind.FAIL, error=recovery.corrupt_error(snap.run_id, record.key, problem)))
        return workflow, task

    def _began(self, snap: Snapshot, record: TaskRecord, holding: limiter.Holding | None = None) -> Handled:
        """The phase began in begin.lua: check what it runs on, then run it."""
        try:
            found = self._definition(snap, record)
            if isinstance(found, Handled):
                return found
            workflow, task = found
            if record.overdue(record.began_at or clock.now()):  # the round ran out while this message was queued
                return self._record(workflow, task, snap, record, outcomes.timeout(task, record), holding=holding)
            return self._run(workflow, task, snap, record, holding)
        finally:
            self._release(holding)

    def _run_deferred(self, snap: Snapshot, record: TaskRecord, phase: Phase, token: int, started: float,
                      carried: bool = False) -> Handled:
        """Run a prepared phase on the one read, or on its message's fields (its start note sent now,
        read before the outcome is written): its begin is written with its outcome (deferred.py)."""
        found = self._definition(snap, record)
        if isinstance(found, Handled):
            return found
        workflow, task = found
        queued_raw = snap.raw_record(task.key)
        assert queued_raw is not None
        note = self.store.note_later(snap.run_id, fld.started_field(task.key),
                                     deferring.note(token, self.worker, started)) if carried else None
        deferred = Deferred(self.store, snap.run_id, task.key, phase, record.round, token, self.worker, started,
                            queued_raw, note)
        return self._run(workflow, task, snap, deferring.begun(record, task, self.worker, started), deferred=deferred)

    def _decide(self, snap: Snapshot, record: TaskRecord, phase: Phase, round: int, token: int) -> Handled:
        """The full path: the message was not begun by begin.lua."""
        if record.state is not active_state(phase, Slot.QUEUED) or record.round != round or record.token != token:
            if recovery.is_redelivery_of_running(record, phase, round, token) and record.worker == self.worker:
                # this process began it, and the reply of that begin was lost (a timeout, retried):
                # one process runs one message at a time, so it is this message's own execution
                return self._began(snap, record)
            if recovery.is_redelivery_of_running(record, phase, round, token) and recovery.execution_lost(
                    self.store, snap.run_id, record, self.settings.queued_lease_s):
                return self._recover(snap, record)
            limiter.left_waiting(self.store, snap, record)
            return self._stale(snap, record, phase, round, token)
        earlier = deferring.started(snap.get(fld.started_field(record.key)))
        if earlier is not None and earlier.token == token and earlier.worker != self.worker:
            ran = record.model_copy(update={"worker": earlier.worker, "began_at": earlier.at})  # ran before its begin
            if recovery.execution_lost(self.store, snap.run_id, ran, self.settings.queued_lease_s):
                return self._recover(snap, ran)
            return self._stale(snap, record, phase, round, token)  # it runs there: this is a duplicate
        found = self._definition(snap, record)
        if isinstance(found, Handled):
            return found
        workflow, task = found
        if record.overdue(clock.now()):  # the round ran out while queued
            return self._commit_outcome(workflow, task, snap, record, outcomes.timeout(task, record))
        if snap.control is not None:
            return self._commit_outcome(workflow, task, snap, record, outcomes.cancel(snap.control))
        lookup: caching.Lookup | None = None
        if not record.prepared:
            prepared = self._prepare(workflow, task, snap, record)
            if isinstance(prepared, Handled):
                return prepared
            lookup = prepared
        room: limiter.Room | None = None
        if not task.limits_of(phase.value):
            self.hints.forget(self.name)
        else:
            taken = self._room_for(workflow, task, snap, record)
            if isinstance(taken, Handled):
                return taken
            room = taken
        return self._admit(workflow, task, snap, record, lookup, room)

    def _room_for(self, workflow: Workflow, task: Task, snap: Snapshot,
                  record: TaskRecord) -> limiter.Room | Handled:
        """What the phase's begin takes under its fleet limits. A concurrency key that fails fails
        the task."""
        assert record.phase is not None
        ctx = build_context(self.store, workflow, task, snap, record, Signal(), record.phase, self.caps)
        room = limiter.room_for(self.settings, workflow, task, snap, record, ctx,
                                lambda specs: self.hints.learn(self.name, workflow, task, specs))
        if isinstance(room, limiter.KeyFailed):
            failed = Outcome(EventKind.FAIL, error=error_record(room.error))
            return self._commit_outcome(workflow, task, snap, record, failed)
        return room

    def _prepare(self, workflow: Workflow, task: Task, snap: Snapshot,
                 record: TaskRecord) -> caching.Lookup | Handled:
        """Condition and cache (preparing.py): the lookup to begin with, or their outcome, recorded."""
        ctx = build_context(self.store, workflow, task, snap, record, Signal(), None, self.caps)
        found = preparing.prepare(task, ctx, workflow.name, self.store, self.settings.cache_ttl_s, record.attempts,
                                  self.caps.output)
        if isinstance(found, preparing.Decided):
            return self._commit_outcome(workflow, task, snap, record, found.outcome, found.events)
        return found

    def _admit(self, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord,
               lookup: caching.Lookup | None, room: limiter.Room | None = None) -> Handled:
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
            committed = commit(self.store, plan, snap, self.send, retry=_not_budget,
                               limits=room.op if room is not None else None)
        except Superseded:
            return self.handle_again(snap, record)
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
            return self._commit_outcome(workflow, task, snap, record, spent)
        if room is not None:
            limiter.started(self.store, note, room.waiter)
        begun = committed.planner.tasks[task.key]
        fresh = Snapshot(snap.run_id, {**snap.fields, fld.task_field(task.key): begun.dump(),
                                       fld.throttle_field(task.key): None},
                         loader=lambda names: self.store.hmget(snap.run_id, names))
        return self._run(workflow, task, fresh, begun, limiter.Holding(room.held) if room is not None else None)

    def handle_again(self, snap: Snapshot, record: TaskRecord) -> Handled:
        """The record moved while this message was being decided on: the message is stale now."""
        phase = record.phase or Phase.RUN
        return self._stale(snap, record, phase, record.round, record.token)

    # running --------------------------------------------------------------------------------
    def _run(self, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord,
             holding: limiter.Holding | None = None, deferred: Deferred | None = None) -> Handled:
        phase = record.phase
        assert phase is not None
        signal = Signal()
        held = holding.held if holding is not None else None
        tokens = limiter.token_counter(self.store, held) if held is not None else None
        ctx = build_context(self.store, workflow, task, snap, record, signal, phase, self.caps, tokens)
        raw = snap.raw_record(task.key)
        assert raw is not None
        renew = limiter.slot_renewer(self.store, held) if held is not None else None

        def overrun(reason: str) -> None:
            """The callback ignored its signal past the grace period: record for it, then stop it."""
            outcome = outcomes.timeout(task, record) if reason == "timeout" else Outcome(EventKind.CANCEL,
                                                                                          cancelled=True)
            copy = Snapshot(snap.run_id, dict(snap.fields), loader=lambda names: self.store.hmget(snap.run_id, names))
            handled = self._record(workflow, task, copy, record, outcome, signal, deferred=deferred)
            log.error("run %s task %s: %s %s ignored its %s signal past the grace period; recorded (%s)%s",
                      snap.run_id, task.key, phase.value, outcomes.step_name(task, record), reason,
                      handled.result.value, "; stopping this pool process" if hard_stop_allowed else "")
            if hard_stop_allowed:
                self._release(holding)  # the process ends here: the finally below never runs
                os.kill(os.getpid(), signals.SIGKILL)

        try:
            self.calling = True
            with self.watcher.watch(snap.run_id, task.key, raw, signal, record.deadline, overrun, renew, deferred):
                outcome = call_phase(task, phase, ctx, snap, self.caps)
            return self._record(workflow, task, snap, record, outcome, signal, holding, deferred)
        finally:
            self._release(holding)

    def _release(self, holding: limiter.Holding | None) -> None:
        """Give back the phase's slots, unless the write of its outcome did (once)."""
        if holding is not None and not holding.released:
            holding.released = True
            limiter.release(self.store, holding.held, self.resend)

    # recording ------------------------------------------------------------------------------
    def _record(self, workflow: Workflow, task: Task, snap: Snapshot, begun: TaskRecord, outcome: Outcome,
                signal: Signal | None = None, holding: limiter.Holding | None = None,
                deferred: Deferred | None = None) -> Handled:
        """Record the outcome of a running phase (resolved against the run as it is now), releasing
        its limit slots in the same call. A deferred phase (deferred.py) is begun in the same write,
        unless the watcher began it on the way."""
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
        try:
            committed = through_outage(self.store, plan, snap, self.send, self.settings.record_outage_s, wake)
        except Superseded:
            return self._superseded(snap, begun)
        if wake is not None and holding is not None:
            holding.released = True
            limiter.woken(committed.picked, self.resend)
        return handled_of(committed, key)

    def _commit_outcome(self, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord,
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
            return self.handle_again(snap, record)
        if note is not None:
            limiter.leave(self.store, note)
        return handled_of(committed, task.key)

    # refusals and recovery ------------------------------------------------------------------
    def _stale(self, snap: Snapshot, record: TaskRecord, phase: Phase, round: int, token: int) -> Handled:
        return refusals.stale(self.store, snap.run_id, record, phase, round, token)

    def _superseded(self, snap: Snapshot, begun: TaskRecord) -> Handled:
        return refusals.superseded(self.store, snap.run_id, begun)

    def _recover(self, snap: Snapshot, record: TaskRecord) -> Handled:
        """Do the reconciler's work at once: queue a replay of the lost execution (or give up)."""
        try:
            workflow = self.workflow_of(snap)
        except TaskLoopError:
            return Handled(Result.STALE, reason="lost execution left to a worker that has the definition")
        return recovery.recover(self.store, self.settings, self.send, workflow, snap, record)

    def _fail_corrupt(self, snap: Snapshot, key: str, problem: str) -> Handled:
        """A record that does not parse fails its task before any callback runs on it."""
        log.error("%s", problem)
        try:
            workflow = self.workflow_of(snap)
        except TaskLoopError as exc:
            return self._abort(snap, ErrorRecord(type=type(exc).__name__, message=str(exc)))
        task = workflow.task(key)
        snap.put_record(key, recovery.stand_in(key, task.kind))
        error = ErrorRecord(type=CorruptRecord.__name__, message=problem)
        return self._commit_outcome(workflow, task, snap, snap.record(key) or recovery.stand_in(key, TaskKind.TASK),
                                    Outcome(EventKind.FAIL, error=error))

    def _abort(self, snap: Snapshot, error: ErrorRecord) -> Handled:
        """The run cannot go on here: end it failed with ``error`` (see worker/recovery/executions.py)."""
        recovery.abort_run(self.store, self.settings, self.send, snap, error)
        return Handled(Result.COMMITTED, outcome=EventKind.FAIL, error=error)


def _no_resend(waiters: object) -> None:
    log.warning("no sender for the phases a fleet limit let start; the drainer sends them")


def _not_budget(conflict: Conflict) -> bool:
    return not conflict.label.startswith("budget:")

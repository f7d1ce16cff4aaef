"""Executes phase messages for one worker process: begin, call, record. It sequences the other
execution modules; the rules live in them (deferred.py, deciding.py, running.py, recording.py,
core/outcomes.py, recovery/executions.py, limits/limiter.py).

1. **Ready**: a prepared phase runs on the fields its message carries, or on one plain read
   (deferred.py), and its begin is written with its outcome; a phase under a budget or a fleet
   limit begins in one call first (begin.lua: the record moves to running, an attempt is counted,
   a lease and the room under its limits are taken).
2. Otherwise the **full path** decides on what was read (deciding.py).
3. **Call** the callback while the watcher sets ``ctx.signal`` (cancel, stop, deadline) and,
   past the grace period, records the outcome itself (running.py).
4. **Record** (one call, cas.lua): the outcome as resolved by core/outcomes.py, with everything
   the scheduler decides from it and the release of the phase's limit slots; the messages it
   dispatches go out in the same call when the broker is the store's Redis (recording.py).

``prepare`` does 1 and 2 and returns the ``Call`` of a phase that may run, or what the message came
to; ``run`` does 3 and 4. ``handle`` is both, for a pool that runs a message in one thread or
greenlet; the asyncio pool prepares and records on threads and awaits the callback on its loop.
One executor serves every thread or greenlet of its process: what belongs to one message lives in
the call, and a copy of a message that this process already runs is refused before any read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import CorruptRecord
from taskloop.connections import clients
from taskloop.core import fields as fld
from taskloop.core import reads
from taskloop.core.records import TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase
from taskloop.define.workflow import Workflow
from taskloop.ops.hooks import Refused
from taskloop.runtime.commit import Sender, begin
from taskloop.runtime.instruments import hooks
from taskloop.store.redis_store import RedisStore
from taskloop.store.running import Begin, BeginReply
from taskloop.worker.execution import deferred as deferring
from taskloop.worker.execution import running
from taskloop.worker.execution.deciding import FullPath, Step
from taskloop.worker.execution.deferred import Deferred
from taskloop.worker.execution.handled import Handled, Result
from taskloop.worker.execution.messages import Carried
from taskloop.worker.execution.recording import Recorder
from taskloop.worker.execution.running import Call
from taskloop.worker.limits import limiter
from taskloop.worker.liveness.watcher import Watcher

log = logging.getLogger("taskloop.executor")

Message = tuple[str, str, int]  # (run_id, key, token): what a copy of a message shares with it


class Executor:
    """Runs phase messages for one worker process, from any number of its threads or greenlets."""

    def __init__(self, store: RedisStore, settings: Settings, send: Sender, worker: str,
                 resend: limiter.Resend | None = None) -> None:
        self.store = store
        self.settings = settings
        self.send = send
        self.worker = worker
        # sends the messages of phases that waited for a fleet limit (PhaseSender.resend)
        self.resend: limiter.Resend = resend or getattr(send, "resend", None) or _no_resend
        self.recorder = Recorder(store, settings, send, worker, self.resend)
        self.watcher = Watcher(store, settings)
        self.caps = settings.caps()
        self.cluster = clients.is_cluster(store.client)  # limits live in other slots: never taken in begin.lua
        self.hints = limiter.Hints()
        self.full = FullPath(self.recorder, self.caps, self.hints)
        # message names whose every phase is begun first (begin.lua): a budget or a fleet limit admits it
        # (deferred.py), or its last phase ran past MARK_S, so that the watcher would have begun it
        # on the way anyway (one begin before it runs costs less than a read, a start note and a mark)
        self.slow: set[str | None] = set()
        # message names of async callbacks: what their context reads, read with the phase (the task's
        # ``after`` and whether it is a loop: reads.context_fields)
        self.contexts: dict[str | None, tuple[tuple[str, ...], bool]] = {}
        self.learned: dict[str | None, tuple[str, ...]] = {}  # per message name: what its outcome read besides
        self._running: set[Message] = set()  # the messages this process is executing now
        self._lock = threading.Lock()

    def workflow_of(self, snap: Snapshot) -> Workflow:
        return self.recorder.workflow_of(snap)

    @property
    def in_flight(self) -> int:
        """How many phase messages this process executes now."""
        return len(self._running)

    # entry points ---------------------------------------------------------------------------
    def handle(self, phase: Phase, run_id: str, key: str, round: int, token: int,
               name: str | None = None, carried: Carried | None = None) -> Handled:
        """Process one message here, the callback included (``name``: its Celery name, for the
        limits hints; ``carried``: the fields its queuing write put into it, core/reads.py)."""
        step = self.prepare(phase, run_id, key, round, token, name, carried)
        return step if isinstance(step, Handled) else self.run(step)

    def run(self, call: Call) -> Handled:
        """Call a prepared phase's callback here, watched, and record its outcome."""
        try:
            with self.watcher.watch(call, lambda reason: running.overrun(call, self.recorder, reason)):
                outcome = running.call_sync(call, self.caps)
        except BaseException:
            self.recorder.release(call.holding)
            call.end()
            raise
        return running.finish(call, self.recorder, outcome)

    def prepare(self, phase: Phase, run_id: str, key: str, round: int, token: int,
                name: str | None = None, carried: Carried | None = None) -> Step:
        """Everything before the callback: the ``Call`` of a phase that may run now (its ``end``
        frees this message's place in the process), or what the message came to."""
        refused = self.claim(phase, run_id, key, round, token)
        if refused is not None:
            return refused
        return self.settle((run_id, key, token), name,
                           lambda: self._prepare(phase, run_id, key, round, token, name, carried))

    def claim(self, phase: Phase, run_id: str, key: str, round: int, token: int) -> Handled | None:
        """Take this message's place among those the process executes: None, or the refusal of a copy
        of a message that runs here already (``settle`` gives the place back)."""
        message = (run_id, key, token)
        with self._lock:
            if message in self._running:
                return self._copy_runs_here(phase, run_id, key, round, token)
            self._running.add(message)
        return None

    def settle(self, message: Message, name: str | None, step_of: Callable[[], Step]) -> Step:
        """The step a claimed message came to: a call keeps its place until it ends; anything else
        (or an error) gives it back now."""
        try:
            step = step_of()
        except BaseException:
            self._done(message)
            raise
        if isinstance(step, Handled):
            self._done(message)
            return step
        if step.is_async and name not in self.contexts:
            self.contexts[name] = (tuple(step.task.after), step.task.is_loop)
        step.on_end.append(lambda: self._ended(message, name, step))
        return step

    def begin_first(self, phase: Phase, run_id: str, key: str, round: int, token: int,
                    name: str | None) -> Begin | None:
        """The begin a claimed message's step starts with when it is begun first (begin.lua) with no
        fleet limit to present: what an event loop may make itself (store/aio.py), then hand the reply
        to ``after_begin``. None: ``prepare`` does the whole step."""
        if self.cluster or name not in self.slow or self.hints.presented(name, run_id, key, phase.value, round,
                                                                          token) is not None:
            return None
        return Begin(run_id, key, round, phase.value, token, self.worker, clock.now(),
                     self._fields(phase, key, round, name))

    def after_begin(self, begin: Begin, reply: BeginReply, name: str | None) -> Step:
        """The step of a message whose begin was made (``begin_first``), from begin.lua's reply."""
        return self._begun(Phase(begin.phase), begin.run_id, begin.key, begin.round, begin.token, name, reply, None)

    def release(self, message: Message) -> None:
        """Give back a claimed message's place (its step came to nothing here: a store outage)."""
        self._done(message)

    def _done(self, message: Message) -> None:
        with self._lock:
            self._running.discard(message)

    def _ended(self, message: Message, name: str | None, call: Call) -> None:
        self._done(message)
        if call.deferred is not None and call.deferred.marked is not None:
            self.slow.add(name)  # it ran past MARK_S: the next phases of this name are begun first

    def _copy_runs_here(self, phase: Phase, run_id: str, key: str, round: int, token: int) -> Handled:
        """A copy of a message this process is executing (a redelivery that came back to it): refused
        without a read, as any duplicate (a counter, never an event)."""
        log.info("run %r task %r: refused a copy of %s round %s token %s, which this process runs now",
                 run_id, key, phase.value, round, token)
        self.store.incr_stat("stale_deliveries")
        hooks().delivery_refused(Refused("stale"))
        return Handled(Result.STALE, reason=f"a copy of {phase.value} round {round} token {token} runs here")

    def _fields(self, phase: Phase, key: str, round: int, name: str | None) -> list[str]:
        """What a message reads first (reads.message_fields), and an async callback's context."""
        fields = reads.message_fields(phase, key, round)
        context = self.contexts.get(name)
        if context is not None:  # an async callback's context, read now (reads.context_fields)
            fields += [f for f in reads.context_fields(key, context[0], context[1], round) if f not in fields]
        return fields

    def _prepare(self, phase: Phase, run_id: str, key: str, round: int, token: int, name: str | None,
                 carried: Carried | None) -> Step:
        fields = self._fields(phase, key, round, name)
        presented = None if self.cluster else self.hints.presented(name, run_id, key, phase.value, round, token)
        if presented is None and name not in self.slow:  # no read if the message carries it, else one plain read
            on_carried = self._on_carried(phase, run_id, key, round, token, carried, name) \
                if carried is not None and not self.cluster else None
            if isinstance(on_carried, (Handled, Call)):
                return on_carried
            step = self._one_read(phase, run_id, key, round, token, fields, name) \
                if on_carried is not deferring.Ready.BEGIN_FIRST else None
            if step is not None:
                return step
        reply = begin(self.store, run_id, key, round, phase.value, token, self.worker, clock.now(), fields,
                      presented.op if presented else None)
        return self._begun(phase, run_id, key, round, token, name, reply, presented)

    def _begun(self, phase: Phase, run_id: str, key: str, round: int, token: int, name: str | None,
               reply: BeginReply, presented: limiter.Room | None) -> Step:
        """The step after begin.lua: run the phase it began, or decide on what it read."""
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
                return self.full.began(snap, record)
            limiter.started(self.store, snap.get(fld.throttle_field(key)), presented.waiter)
            snap.fields[fld.throttle_field(key)] = None  # begin.lua deleted it
            return self.full.began(snap, record, limiter.Holding(presented.held))
        return self.full.decide(snap, record, phase, round, token, name)

    def _on_carried(self, phase: Phase, run_id: str, key: str, round: int, token: int,
                    carried: Carried, name: str | None) -> Step | deferring.Ready:
        """The step on the fields the message carries (deferred.py): a call, BEGIN_FIRST or DECIDE."""
        started = clock.now()
        ready, snap, record, outcome_reads = deferring.on_carried(self.store, run_id, key, phase, round, token,
                                                                  carried, started)
        if ready is deferring.Ready.BEGIN_FIRST:
            self.slow.add(name)
        if ready is not deferring.Ready.NOW:
            return ready
        assert snap is not None and record is not None
        self.learned[name] = outcome_reads
        return self._deferred(snap, record, phase, token, started, carried=True)

    def _one_read(self, phase: Phase, run_id: str, key: str, round: int, token: int,
                  fields: list[str], name: str | None) -> Step | None:
        """The step on one read (deferred.py): the phase runs now, or the full path decides on the
        read, or None: begin.lua first (a budget or a fleet limit: learned for the message name)."""
        started = clock.now()
        note = fld.started_field(key)
        mine = deferring.note(token, self.worker, started)
        snap = self.store.read_noting(run_id, reads.read_fields(key, fields, self.learned.get(name, ())),
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
                self.slow.add(name)  # a budget or a fleet limit: begin.lua from now on
                return None
            return read if not isinstance(read, TaskRecord) else self.full.decide(snap, read, phase, round, token,
                                                                                   name)
        assert isinstance(read, TaskRecord)
        self.learned[name] = outcome_reads  # read with the next message of this name
        return self._deferred(snap, read, phase, token, started)

    def _read(self, snap: Snapshot, key: str, phase: Phase, round: int) -> TaskRecord | Handled:
        """The task's record as read; a run or task not there is dropped, a corrupt record failed."""
        if snap.fields[fld.F_WORKFLOW] is None or snap.fields[fld.task_field(key)] is None:
            what = "run" if snap.fields[fld.F_WORKFLOW] is None else f"task {key!r} of run"
            log.warning("%s %r not found (never started, or expired); dropping %s round %s",
                        what, snap.run_id, phase.value, round)
            self.store.incr_stat("dropped_unknown_run")
            hooks().delivery_refused(Refused("unknown run"))
            return Handled(Result.DROPPED, reason=f"{what} not found")
        try:
            record = snap.record(key)
        except CorruptRecord as exc:
            return self.recorder.fail_corrupt(snap, key, str(exc))
        assert record is not None
        return record

    def _deferred(self, snap: Snapshot, record: TaskRecord, phase: Phase, token: int, started: float,
                  carried: bool = False) -> Step:
        """A prepared phase that runs on the one read, or on its message's fields (its start note sent
        now, read before the outcome is written): its begin is written with its outcome (deferred.py)."""
        found = self.recorder.definition(snap, record)
        if isinstance(found, Handled):
            return found
        workflow, task = found
        queued_raw = snap.raw_record(task.key)
        assert queued_raw is not None
        note = self.store.note_later(snap.run_id, fld.started_field(task.key),
                                     deferring.note(token, self.worker, started)) if carried else None
        deferred = Deferred(self.store, snap.run_id, task.key, phase, record.round, token, self.worker, started,
                            queued_raw, note)
        return running.make_call(self.store, workflow, task, snap, deferring.begun(record, task, self.worker, started),
                                 self.caps, deferred=deferred)


def _no_resend(waiters: object) -> None:
    log.warning("no sender for the phases a fleet limit let start; the drainer sends them")

"""The one-call step: a phase whose begin the scheduler prepared runs on the fields its message
carries, or on one plain read, and its begin is written with its outcome.

When the commit that queued a phase prepared its begin (core/begin.py ``prepared_begin``: the
running record, its lease terms), a worker that receives the phase's message finds the record,
the run's control flag and the callback's data in the message (a fresh one: core/reads.py, its
start note sent without waiting, ``on_carried``) or reads them in one ``HMGET`` with its start
note (no script), checks in Python
what begin.lua would check (the record is queued under the message's token, the run has no
control flag, the prepared begin names the same token, no fleet limit and no budget cap), and
runs the callback. The commit of the outcome then begins and ends the phase in one guarded write
(the planner applies BEGIN at the time the callback started, then the outcome): its guard on the
queued record is the proof of ownership. A step therefore costs one script call, not two.

A phase that runs longer than ``MARK_S`` is begun for real on the way, by the watcher thread
(begin.lua, with the time it started): from then on it holds a running lease that the watcher
renews, the run's readers see it running on its worker, a duplicate of its message is refused
before its callback, and a cancel that lands meanwhile sets its signal. Until then, a phase runs
under its queued lease; a pool process that dies while running it is replayed by the worker's
main process (replies.py), and a process that hangs before ``MARK_S`` is found from the worker's
heartbeat (liveness/presence.py, recovery/reconciler.py).

Which phases take this path: those whose begin is prepared (no condition or cache to consult
first), with no fleet limit on the phase (its room is taken in begin.lua) and no budget on the
workflow (a phase is admitted against it before it starts). Every other phase, and every message
that does not match its record (a duplicate, a stale or cancelled one), takes the full path
(executor.py), which decides on the same read.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from enum import Enum

from taskloop.base import clock
from taskloop.base.errors import CorruptRecord
from taskloop.core import fields as fld
from taskloop.core import reads
from taskloop.core.phases import EventKind, PhaseEvent, advance
from taskloop.core.records import TaskRecord
from taskloop.core.rules import control_reason
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase, Slot, active_state
from taskloop.define.tasks import Task
from taskloop.runtime.commit import begin_many
from taskloop.store.redis_store import RedisStore
from taskloop.store.running import Begin, BeginReply
from taskloop.store.side import Side
from taskloop.worker.execution.messages import Carried

log = logging.getLogger("taskloop.deferred")

MARK_S = 1.0  # a phase still running this long after it started is begun for real (the watcher)


def note(token: int, worker: str, started: float) -> str:
    """The start note a phase writes with its read (core/fields.py ``started_field``)."""
    return f"{token} {worker} {started!r}"


@dataclass(frozen=True)
class Started:
    """A start note, read: which message's execution began, on which worker, when."""

    token: int
    worker: str
    at: float


def started(raw: str | None) -> Started | None:
    """A start note as stored (None: absent or not one)."""
    parts = (raw or "").split(" ")
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    try:
        return Started(int(parts[0]), parts[1], float(parts[2]))
    except ValueError:
        return None


class Ready(Enum):
    NOW = "now"  # run it: the begin is written with the outcome
    BEGIN_FIRST = "begin first"  # its begin must be written first (a budget, a fleet limit): begin.lua
    DECIDE = "decide"  # the full path decides on this read (stale, cancelled, not prepared, ...)


def ready(snap: Snapshot, key: str, phase: Phase, round: int, token: int,
          record: TaskRecord) -> tuple[Ready, tuple[str, ...]]:
    """Whether the message, the record and the run let this phase run now without a begin of its
    own (what begin.lua checks, in Python, on the one read), and the fields its outcome will read
    besides (its dependents' records, which the prepared begin names)."""
    if record.state is not active_state(phase, Slot.QUEUED) or record.round != round or record.token != token \
            or record.overdue(clock.now()):  # the round ran out while it was queued: recorded as a timeout
        return Ready.DECIDE, ()
    if snap.fields.get(fld.F_CONTROL) is not None or snap.fields.get(fld.throttle_field(key)) is not None:
        return Ready.DECIDE, ()
    earlier = started(snap.fields.get(fld.started_field(key)))
    if earlier is not None and earlier.token == token:  # this message's execution began before: a duplicate,
        return Ready.DECIDE, ()  # or a redelivery of an execution that may be lost (executor.py decides)
    raw = snap.fields.get(fld.begin_field(key))
    try:
        prepared = json.loads(raw) if raw is not None else None
    except ValueError:
        prepared = None
    if not isinstance(prepared, dict) or prepared.get("tok") != token or prepared.get("rnd") != round \
            or prepared.get("ph") != phase.value:
        return Ready.DECIDE, ()
    if prepared.get("lim") or prepared.get("caps") or prepared.get("cons"):
        return Ready.BEGIN_FIRST, ()
    outcome = prepared.get("rd")
    return Ready.NOW, tuple(name for name in outcome if isinstance(name, str)) if isinstance(outcome, list) else ()


def on_carried(store: RedisStore, run_id: str, key: str, phase: Phase, round: int, token: int, carried: Carried,
               now: float) -> tuple[Ready, Snapshot | None, TaskRecord | None, tuple[str, ...]]:
    """Whether a message runs on the fields it carries (core/reads.py): ``ready`` on them, with the
    snapshot they make, the record and the outcome's reads; DECIDE when the message is not fresh,
    its values are not what a worker reads, or they show no run or a corrupt record (the one read
    decides, as for any message)."""
    fields = reads.carried(key, phase, round, carried.values) \
        if reads.fresh(carried.queued_at, carried.redelivered, now) else None
    if fields is None or fields.get(fld.F_WORKFLOW) is None or fields.get(fld.task_field(key)) is None:
        return Ready.DECIDE, None, None, ()
    snap = Snapshot(run_id, fields, loader=lambda names: store.hmget(run_id, names))
    try:
        record = snap.record(key)
    except CorruptRecord:
        return Ready.DECIDE, None, None, ()
    assert record is not None
    ready_, outcome_reads = ready(snap, key, phase, round, token, record)
    return ready_, snap, record, outcome_reads


def begun(record: TaskRecord, task: Task, worker: str, started: float) -> TaskRecord:
    """The running record this phase runs as (what begin.lua would write, and the commit writes)."""
    return advance(record, PhaseEvent(EventKind.BEGIN, started, worker=worker, timeout_ms=task.timeout_ms))


@dataclass(frozen=True)
class Mark:
    """A begin the watcher wrote: the record's fields as written."""

    fields: dict[str, str | None]

    def raw(self, key: str) -> str:
        value = self.fields[fld.task_field(key)]
        assert value is not None
        return value

    def token(self, key: str) -> int:
        """The fencing token of the running record the begin wrote."""
        return int(json.loads(self.raw(key)).get("token", 0))


class Deferred:
    """A phase running before its begin is written. The watcher may write the begin (``mark``);
    the executor ``claim``s the phase before it records the outcome, after which no mark is made,
    and learns whether one was."""

    def __init__(self, store: RedisStore, run_id: str, key: str, phase: Phase, round: int, token: int,
                 worker: str, started: float, queued_raw: str, note: Side | None = None) -> None:
        self.store = store
        self.run_id = run_id
        self.key = key
        self.phase = phase
        self.round = round
        self.token = token
        self.worker = worker
        self.started = started
        self.queued_raw = queued_raw
        self.note = note  # the start note sent without waiting (a message that carried its fields)
        self._lock = threading.Lock()
        self._closed = False
        self.marked: Mark | None = None
        self.refused: str | None = None  # why the begin was refused: the reason for the phase's signal

    @property
    def settled(self) -> bool:
        return self._closed or self.marked is not None or self.refused is not None

    def mark(self) -> Mark | None:
        """Write the begin now (begin.lua, begun at ``started``); the mark, or None when it was
        refused (``refused`` says why) or the phase is being recorded already. Raises
        StoreUnavailable when Redis is away (the watcher tries again)."""
        mark_all(self.store, [self])
        return self.marked

    def _begin(self) -> Begin:
        return Begin(self.run_id, self.key, self.round, self.phase.value, self.token, self.worker, self.started,
                     [*fld.record_fields(self.key), fld.F_CONTROL])

    def _apply(self, reply: BeginReply) -> None:
        if reply.began:
            self.marked = Mark({name: reply.fields.get(name) for name in fld.record_fields(self.key)})
        else:
            self.refused = control_reason(reply.fields.get(fld.F_CONTROL)) or "superseded"

    def claim(self) -> Mark | None:
        """No mark from now on: the outcome is being recorded. The mark made before, if any."""
        with self._lock:
            self._closed = True
            self.note_landed()
            return self.marked

    def note_landed(self) -> None:
        """The start note sent without waiting is in Redis before the phase's begin or outcome is
        written (its reply read; a connection that failed meanwhile is logged, and the write goes on:
        the begin or outcome written records the execution itself)."""
        if self.note is not None:
            note, self.note = self.note, None
            if not note.landed():
                log.warning("run %s task %s: the start note of %s round %s may not have landed (the connection "
                            "failed); its outcome records the execution", self.run_id, self.key, self.phase.value,
                            self.round)


def mark_all(store: RedisStore, deferreds: list[Deferred]) -> None:
    """Write the begins of deferred phases that have run MARK_S, in one round trip (the watcher's,
    once per interval for all of a process's phases): each is marked, or refused (its ``refused``
    says why), unless it is being recorded already. Raises StoreUnavailable when Redis is away
    (nothing is marked; the watcher tries again)."""
    taken: list[Deferred] = []
    for deferred in deferreds:
        deferred._lock.acquire()
        if deferred.settled:
            deferred._lock.release()
        else:
            taken.append(deferred)
    try:
        for deferred in taken:
            deferred.note_landed()
        for deferred, reply in zip(taken, begin_many(store, [d._begin() for d in taken]), strict=True):
            deferred._apply(reply)
    finally:
        for deferred in taken:
            deferred._lock.release()

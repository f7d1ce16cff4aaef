"""Phases whose message was lost inside the broker: found by a census and sent again within
seconds, not after their queued lease.

kombu's Redis transport takes a message with ``BRPOP``, and with taskloop's settings (ack
emulation off, connections/broker.py) keeps no copy of it: the worker holds it in memory, and its
heartbeat lists it (worker/liveness/presence.py). Redis removes the message when it answers the ``BRPOP``:
if that answer never reaches the worker (a network that drops packets while Redis still holds
the connection, a connection cut with an RST, a worker killed at that moment), the message is
gone. Its phase would stay queued until its queued lease (``TASKLOOP_QUEUED_LEASE_S``, 300 s):
the 1,000-fault soak at the shipped defaults saw it after black holes, RSTs and worker kills.

A queue is first in, first out (kombu pushes at its head and takes from its tail). So a message
sent before the one at the tail of its queue at some moment had been taken by then: a worker
holds it, or it is lost. Every reconcile pass dates each queue's tail (when the tail message's
phase was queued); a census takes the latest dating that every live worker's last heartbeat is
newer than, and then the queued phases of the live runs queued well before that tail (a margin
for clocks and for a message sent just after its write): each one that no live worker's
heartbeat lists, and that no pending ``taskloop.dispatch`` covers, is sent again (a guarded
REDISPATCH, with a new token, refused if the phase moved on meanwhile). A phase that waits for a
fleet limit has no message on purpose and is left alone, and so is a phase of a queue that no live
worker consumes (its message waits there), or of a queue whose tail cannot be dated (it is not a
phase message, or its phase moved on).

The reconciler runs a census every ``CENSUS_S`` seconds and at once after it sent again what a
silent worker held; a worker whose broker connection died takes one as soon as Redis answers again.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import CorruptRecord, TaskLoopError
from taskloop.core import fields as fld
from taskloop.core.states import QUEUED_STATES
from taskloop.runtime.commit import Sender
from taskloop.runtime.fleet import HEARTBEAT_S, WorkerInfo, heartbeats, holdings, read_holdings
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution.deferred import started
from taskloop.worker.execution.handled import Result
from taskloop.worker.recovery import executions as recovery
from taskloop.worker.recovery.outage import PHASE_TASKS, redispatch, workflow_of

log = logging.getLogger("taskloop.census")

CENSUS_S = 15.0  # at most this long between two censuses (the reconciler's passes)
MARGIN_S = 5.0  # a phase is counted only if queued this long before the tail message's phase
TAIL_LOOK = 5  # messages looked at from the tail of a queue to date it
KEEP_OBSERVED = 12  # datings of the queues' tails kept (one per reconcile pass)
PAGE = 500  # live runs read at a time
DISPATCH_TASK = "taskloop.dispatch"


class Wanted:
    """Set by a worker's consumer when its broker connection dies (worker/consumer.py): that worker's
    reconciler thread takes a census once Redis answers, without waiting for its turn."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.since = 0.0  # monotonic time of the first loss not yet looked into

    def set(self) -> None:
        if not self._event.is_set():
            self.since = time.monotonic()
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def clear(self) -> None:
        self._event.clear()


WANTED = Wanted()


@dataclass(frozen=True)
class Message:
    """What a census reads of a broker message: its task, and its phase or run."""

    task: str
    run_id: str
    key: str | None = None
    token: int | None = None
    keys: tuple[str, ...] = ()


def read_message(raw: bytes | str) -> Message | None:
    """A kombu message as its queue or its unacked entry holds it (None: not one of taskloop's)."""
    try:
        data = json.loads(raw)
        payload = data[0] if isinstance(data, list) else data
        task = payload["headers"]["task"]
        body = payload["body"]
        if payload.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    if task in PHASE_TASKS and isinstance(args, list) and len(args) == 4 and type(args[3]) is int:
        return Message(task, str(args[0]), str(args[1]), args[3])
    if task == DISPATCH_TASK and isinstance(args, list) and len(args) == 2 and isinstance(args[1], list):
        return Message(task, str(args[0]), keys=tuple(str(key) for key in args[1]))
    return None


class Census:
    """The census of one process's reconciler (``app``: the Celery app, for the broker)."""

    def __init__(self, app: Any, store: RedisStore, settings: Settings, send: Sender) -> None:
        self.app = app
        self.store = store
        self.settings = settings
        self.send = send
        self.last = 0.0
        self.observed: list[tuple[float, dict[str, float]]] = []  # (when, each queue's cutoff then)

    def due(self, now: float) -> bool:
        return now - self.last >= CENSUS_S

    def observe(self, now: float | None = None, beats: dict[str, WorkerInfo] | None = None) -> None:
        """Date the tail of every queue now (each reconcile pass): a census compares the heartbeats
        with cutoffs observed before them."""
        now = clock.now() if now is None else now
        beats = heartbeats(self.store.workers_seen()) if beats is None else beats
        queues = {self.app.conf.task_default_queue, *(queue for info in beats.values() for queue in info.queues)}
        with self.app.connection_for_write() as connection:
            channel = connection.default_channel
            with channel.conn_or_acquire() as broker:
                dated = {queue: self._tail(broker, queue, now) for queue in sorted(queues)}
        self.observed.append((now, {queue: tail - MARGIN_S for queue, tail in dated.items() if tail is not None}))
        del self.observed[:-KEEP_OBSERVED]

    def run(self, now: float | None = None, beats: dict[str, WorkerInfo] | None = None) -> int:
        """One census; how many phases it sent again (``beats``: the heartbeats with their holdings,
        as a reconcile pass read them)."""
        now = clock.now() if now is None else now
        self.last = now
        beats = read_holdings(self.store) if beats is None else beats
        if not self.observed or now - self.observed[-1][0] > HEARTBEAT_S:
            self.observe(now, beats)
        hold = holdings(beats, now)
        held_tasks = hold.tasks
        if hold.before is None:
            return 0
        # the tails dated before every live worker's last heartbeat: a message taken from its queue
        # before then is in the heartbeat of the worker that holds it, or lost
        usable = [cutoffs for at, cutoffs in self.observed if at <= hold.before]
        if not usable or not usable[-1]:
            return 0
        cutoffs = usable[-1]
        resent = 0
        start = 0
        while True:
            run_ids = self.store.live_page(start, PAGE)
            start += len(run_ids)
            rows = self.store.leases_of_runs(run_ids, max(cutoffs.values()) + self.settings.queued_lease_s)
            for run_id, keys in zip(run_ids, rows, strict=True):
                # a run whose leased tasks all have a message a live worker holds (running, or
                # prefetched) is not read: most of a busy fleet's runs. A task whose held message is
                # of an earlier token (its phase moved on since that heartbeat) is looked at by the
                # next census, once the heartbeats no longer list that message
                keys = [key for key in keys if (run_id, key) not in held_tasks]
                if keys and run_id not in hold.dispatching:
                    resent += self._resend(run_id, keys, cutoffs, hold.phases)
            if len(run_ids) < PAGE:
                break
        if resent:
            log.warning("census: sent again %d queued phase(s) whose message was lost (taken from its queue, held "
                        "by no worker)", resent)
        return resent

    def _tail(self, broker: Any, queue: str, now: float) -> float | None:
        """When the phase of the oldest message still in ``queue`` was queued (now: the queue is
        empty; None: it cannot be told)."""
        if broker.llen(queue) == 0:
            return now
        for index in range(1, TAIL_LOOK + 1):
            raw = broker.lindex(queue, -index)
            if raw is None:
                return now
            message = read_message(raw)
            if message is None or message.key is None:
                continue
            snap = self.store.snapshot(message.run_id, [fld.task_field(message.key)])
            try:
                record = snap.record(message.key)
            except CorruptRecord:
                continue
            if record is not None and record.state in QUEUED_STATES and record.token == message.token \
                    and record.queued_at is not None:
                return record.queued_at
        return None

    def _resend(self, run_id: str, keys: list[str], cutoffs: dict[str, float],
                held: frozenset[tuple[str, str, int]]) -> int:
        names = [fld.F_WORKFLOW, fld.F_VERSION, *map(fld.task_field, keys), *map(fld.throttle_field, keys),
                 *map(fld.started_field, keys)]
        snap = self.store.snapshot(run_id, names)  # later reads (a replay's write) load what they need
        workflow = workflow_of(snap)
        if workflow is None:
            return 0  # not imported here: its phases are left to their lease
        resent = 0
        for key in keys:
            try:
                record = snap.record(key)
            except CorruptRecord:
                continue
            task = workflow.lookup(key)
            cutoff = cutoffs.get((task.queue if task is not None else None) or self.app.conf.task_default_queue)
            if record is None or cutoff is None or record.state not in QUEUED_STATES or record.queued_at is None \
                    or record.queued_at >= cutoff or snap.get(fld.throttle_field(key)) is not None \
                    or (run_id, key, record.token) in held:
                continue
            try:
                note = started(snap.get(fld.started_field(key)))
                if note is None or note.token != record.token:
                    resent += redispatch(self.store, self.settings, self.send, run_id, key, token=record.token)
                    continue
                # its message was taken and its callback began (worker/execution/deferred.py): replayed, and
                # counted, if that execution is lost; left alone while its worker runs it
                ran = record.model_copy(update={"worker": note.worker, "began_at": note.at})
                if recovery.execution_lost(self.store, run_id, ran, self.settings.queued_lease_s):
                    resent += recovery.recover(self.store, self.settings, self.send, workflow, snap,
                                               ran).result is Result.RECOVERED
            except TaskLoopError as exc:
                log.warning("census: %s/%s not sent again: %s", run_id, key, exc)
        return resent

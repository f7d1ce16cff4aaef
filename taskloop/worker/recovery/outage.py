"""After an outage: phases whose messages died with a connection are sent again at once, not
after their queued lease (TASKLOOP_QUEUED_LEASE_S, 300 s).

Two things lose phase messages when Redis restarts or a worker's broker connection dies:

1. **What a worker had prefetched.** Celery drops the requests it had reserved (and those
   waiting for a retry countdown) when its broker connection dies (``Consumer.on_close``: their
   delivery tags belong to the dead channel). kombu keeps the messages in its ``unacked`` hash
   and restores them only after the visibility timeout (an hour). The worker's consumer
   (worker/consumer.py) notes those phases here when the connection dies (`LOST`); once Redis
   answers again, the worker's reconciler thread re-sends each one whose record is still queued
   under the token of the lost message.
2. **What was in flight when Redis restarted** (popped by a worker whose connection then died,
   or written but not yet synced to the AOF). A reconcile pass compares the identity of the
   Redis it talks to (INFO ``run_id``) with the one the fleet last saw (`restarted_at`); after a
   restart, `sweep` re-sends every queued phase whose message was sent before Redis started.

Re-sending is the reconciler's REDISPATCH: the phase gets a new fencing token and a new
message, in one guarded write that is refused if the phase began meanwhile. Should the old
message come back (kombu restores it an hour later), it is refused as stale. Running phases need
none of this: their executions ride out the outage and record their outcome once Redis is back
(the executor), and one whose process died is replayed by the usual lease, or at once when it
ran on this host.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import CommitConflict, CorruptRecord, TaskLoopError
from taskloop.core import fields as fld
from taskloop.core.phases import EventKind, PhaseEvent
from taskloop.core.planner import Planner
from taskloop.core.records import TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import QUEUED_STATES, RUNNING_STATES
from taskloop.define.workflow import REGISTRY, Workflow
from taskloop.runtime.commit import Sender, commit
from taskloop.store.redis_store import RedisStore
from taskloop.worker.recovery import executions as recovery

log = logging.getLogger("taskloop.outage")

PHASE_TASKS = frozenset({"taskloop.attempt", "taskloop.check", "taskloop.run"})
SWEEP_PAGE = 500  # live runs read at a time by a sweep


@dataclass(frozen=True)
class LostPhase:
    """A phase message a worker held when its connection died: (run, task, token of the message)."""

    run_id: str
    key: str
    token: int


def phases_of(requests: Iterable[Any]) -> list[LostPhase]:
    """The taskloop phases among Celery requests (``type``: the registered task name)."""
    found = []
    for request in requests:
        args = tuple(getattr(request, "args", None) or ())
        if getattr(request, "type", None) not in PHASE_TASKS or len(args) != 4:
            continue
        run_id, key, _, token = args
        if isinstance(run_id, str) and isinstance(key, str) and type(token) is int:
            found.append(LostPhase(run_id, key, token))
    return found


class Lost:
    """The phases this process's consumer held when its broker connection died, until they are
    re-sent (process-local; the consumer notes, the reconciler thread takes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phases: dict[LostPhase, None] = {}
        self.noted = threading.Event()  # set while phases wait to be re-sent

    def note(self, phases: Iterable[LostPhase]) -> None:
        with self._lock:
            self._phases.update(dict.fromkeys(phases))
            if self._phases:
                self.noted.set()

    def take(self) -> list[LostPhase]:
        with self._lock:
            found, self._phases = list(self._phases), {}
            self.noted.clear()
        return found


LOST = Lost()


def resend_lost(store: RedisStore, settings: Settings, send: Sender) -> int:
    """Re-send the phases in LOST whose records are still queued under their lost message's token.
    Phases that cannot be looked at now (Redis still away) go back to LOST for the next try."""
    phases = LOST.take()
    resent = 0
    for n, phase in enumerate(phases):
        try:
            resent += redispatch(store, settings, send, phase.run_id, phase.key, token=phase.token)
        except TaskLoopError as exc:
            LOST.note(phases[n:])
            log.info("%d lost phase message(s) wait for Redis to be re-sent (%s)", len(phases) - n, exc)
            break
    if resent:
        log.warning("re-sent %d phase message(s) that this worker held when its broker connection died", resent)
    return resent


def redispatch(store: RedisStore, settings: Settings, send: Sender, run_id: str, key: str, *,
               token: int | None = None, sent_before: float | None = None) -> bool:
    """Send a queued phase again with a new token: only while it is queued (under ``token``, or
    with a message sent before ``sent_before``). False when it began, moved on or is not known."""
    snap = store.snapshot(run_id, [fld.task_field(key), fld.F_CONTROL, fld.F_VERSION])
    if not snap.exists:
        return False
    try:
        record = snap.record(key)
    except CorruptRecord:
        return False
    if record is None or record.state not in QUEUED_STATES:
        return False
    if token is not None and record.token != token:
        return False
    if sent_before is not None and (record.queued_at or 0.0) >= sent_before:
        return False
    workflow = workflow_of(snap)
    return workflow is not None and _commit_redispatch(store, settings, send, workflow, snap, record)


def workflow_of(snap: Snapshot) -> Workflow | None:
    try:
        return REGISTRY.get(snap.get(fld.F_WORKFLOW) or "", snap.get(fld.F_VERSION) or None)
    except TaskLoopError:
        return None  # not imported here: the lease leaves it to a process that has it


def _commit_redispatch(store: RedisStore, settings: Settings, send: Sender, workflow: Workflow, snap: Snapshot,
                       record: TaskRecord) -> bool:
    raw = snap.raw_record(record.key)

    def plan(view: Snapshot) -> Planner:
        if view.raw_record(record.key) != raw:
            raise CommitConflict(f"{snap.run_id}/{record.key} moved on")
        planner = Planner(workflow, view, clock.now(), settings)
        planner.outcome(record.key, PhaseEvent(EventKind.REDISPATCH, planner.now))
        return planner

    try:
        commit(store, plan, snap, send, attempts=3)
    except CommitConflict:
        return False
    return True


def restarted_at(store: RedisStore) -> float | None:
    """When the Redis behind ``store`` started, if it is not the one the fleet's reconcilers last
    saw (None: the same one, or the first look ever). Needs INFO (the worker ACL role has it)."""
    identity, started = store.server_started()
    before = store.swap_server_seen(identity)
    return started if before is not None and before != identity else None


@dataclass
class Swept:
    runs: int = 0
    resent: int = 0
    replayed: int = 0


def sweep(store: RedisStore, settings: Settings, send: Sender, sent_before: float) -> Swept:
    """After a Redis restart: every queued phase of every live run whose message was sent before
    ``sent_before`` gets a new one; a running phase whose process died on this host is replayed."""
    swept = Swept()
    start = 0
    while True:
        run_ids = store.live_page(start, SWEEP_PAGE)
        start += len(run_ids)
        for run_id in run_ids:
            swept.runs += 1
            for key, _ in store.leases(run_id, float("inf"), limit=10_000):
                try:
                    _sweep_phase(store, settings, send, run_id, key, sent_before, swept)
                except TaskLoopError as exc:
                    log.warning("outage sweep of %s/%s: %s", run_id, key, exc)
        if len(run_ids) < SWEEP_PAGE:
            return swept


def _sweep_phase(store: RedisStore, settings: Settings, send: Sender, run_id: str, key: str, sent_before: float,
                 swept: Swept) -> None:
    snap = store.snapshot(run_id, [fld.task_field(key), fld.F_CONTROL, fld.F_VERSION])
    try:
        record = snap.record(key)
    except CorruptRecord:
        return
    if record is None:
        return
    if record.state in QUEUED_STATES:
        swept.resent += redispatch(store, settings, send, run_id, key, sent_before=sent_before)
    elif record.state in RUNNING_STATES and recovery.worker_is_dead(record.worker):
        workflow = workflow_of(snap)
        if workflow is None:
            return
        raw = snap.raw_record(key)

        def plan(view: Snapshot) -> Planner:
            if view.raw_record(key) != raw:
                raise CommitConflict(f"{run_id}/{key} moved on")
            planner = Planner(workflow, view, clock.now(), settings)
            recovery.plan_recovery(planner, record, settings.max_executions)
            return planner

        try:
            commit(store, plan, snap, send, attempts=3)
            swept.replayed += 1
        except CommitConflict:
            pass

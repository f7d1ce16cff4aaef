"""Phases that ran before their begin was written (worker/deferred.py) and whose execution is lost,
found from the workers' heartbeats (worker/presence.py lists what each pool runs, and since when).

Such a phase holds no running lease yet: its record is still queued under its message's token, so
neither the lease nor a redelivery tells that it ran. Two cases are looked at every reconcile pass:

- its worker **fell silent** (killed with its host, stopped): the phase is replayed, its lost
  execution counted, before the worker's messages go back to their queues (worker/orphans.py),
  which then come back stale;
- its worker is live, but its heartbeats have shown the phase running for longer than the running
  lease (``TASKLOOP_LEASE_S``) and its begin was never written (the watcher writes it after
  ``MARK_S``): the pool process is hung or stopped. It is replayed as a phase whose lease expired
  would be; if the process wakes, its outcome is refused (its phase was taken over).

A dead pool process on a live worker is handled at once by the worker's main process
(worker/pool_loss.py).
"""

from __future__ import annotations

import logging

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import CorruptRecord, TaskLoopError
from taskloop.core import fields as fld
from taskloop.core.phases import QUEUED_STATES
from taskloop.runtime.commit import Sender
from taskloop.runtime.fleet import RunningPhase, heartbeats, holdings
from taskloop.store.redis_store import RedisStore
from taskloop.worker import recovery
from taskloop.worker.handled import Result
from taskloop.worker.outage import workflow_of

log = logging.getLogger("taskloop.unbegun")


def recover(store: RedisStore, settings: Settings, send: Sender, now: float | None = None) -> int:
    """Replay the lost executions of phases that ran before their begin was written; how many."""
    beats = heartbeats(store.workers_seen())
    if not beats:
        return 0
    hold = holdings(beats, clock.now() if now is None else now)
    replayed = 0
    for node, info in beats.items():
        for phase in info.running:
            hung = info.at is not None and info.at - phase.since > settings.running_lease_s
            if node in hold.silent or hung:
                replayed += _replay(store, settings, send, node, phase, "fell silent" if node in hold.silent
                                    else f"has run it for {info.at - phase.since:.0f} s without its begin"
                                    if info.at is not None else "hung")
    return replayed


def _replay(store: RedisStore, settings: Settings, send: Sender, node: str, phase: RunningPhase, why: str) -> int:
    try:
        snap = store.snapshot(phase.run_id, [*fld.record_fields(phase.key), fld.F_CONTROL, fld.F_VERSION])
        record = snap.record(phase.key) if snap.exists else None
        if record is None or record.state not in QUEUED_STATES or record.token != phase.token:
            return 0  # begun since, or moved on: the lease or the message decides
        workflow = workflow_of(snap)
        if workflow is None:
            return 0
        worker = f"{node}/{phase.pid}" if phase.pid is not None else node
        log.warning("run %s task %s: %s ran %s round %s before its begin was written and %s; replaying it",
                    phase.run_id, phase.key, worker, record.phase.value if record.phase else "-", record.round, why)
        handled = recovery.recover(store, settings, send, workflow, snap, record.model_copy(update={"worker": worker}))
    except (TaskLoopError, CorruptRecord) as exc:
        log.warning("run %s task %s: not replayed now (%s); the next pass looks again", phase.run_id, phase.key, exc)
        return 0
    return int(handled.result is Result.RECOVERED)

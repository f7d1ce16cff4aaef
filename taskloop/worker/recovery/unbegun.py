"""Phases that ran before their begin was written (worker/execution/deferred.py) on a process that hung,
found from its worker's heartbeat (worker/liveness/presence.py lists what each pool runs, and since when).

Such a phase holds no running lease yet: its record is still queued under its message's token.
When a live worker's heartbeats have shown it running for longer than the running lease
(``TASKLOOP_LEASE_S``) and its begin was never written (the watcher writes it after
``MARK_S``), its pool process is hung or stopped: it is replayed as a phase whose lease expired
would be, and if the process wakes, its outcome is refused (its phase was taken over).

A dead pool process on a live worker is handled at once by the worker's main process
(worker/recovery/pool_loss.py); what a worker that fell silent held, by worker/recovery/orphans.py.
"""

from __future__ import annotations

import logging

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import CorruptRecord, TaskLoopError
from taskloop.core import fields as fld
from taskloop.core.states import QUEUED_STATES
from taskloop.runtime.commit import Sender
from taskloop.runtime.fleet import Held, WorkerInfo, holdings, read_holdings
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution.handled import Result
from taskloop.worker.recovery import executions as recovery
from taskloop.worker.recovery.outage import workflow_of

log = logging.getLogger("taskloop.unbegun")


def recover(store: RedisStore, settings: Settings, send: Sender, now: float | None = None,
            beats: dict[str, WorkerInfo] | None = None) -> int:
    """Replay the phases that hung processes of live workers ran before their begin was written
    (``beats``: the heartbeats with their holdings, as a reconcile pass read them)."""
    beats = read_holdings(store) if beats is None else beats
    if not beats:
        return 0
    hold = holdings(beats, clock.now() if now is None else now)
    replayed = 0
    for node, info in beats.items():
        if node in hold.silent or info.at is None:
            continue
        for held in info.messages:
            if held.since is not None and held.key is not None and info.at - held.since > settings.running_lease_s:
                replayed += _replay(store, settings, send, node, held,
                                    f"has run it for {info.at - held.since:.0f} s without its begin")
    return replayed


def _replay(store: RedisStore, settings: Settings, send: Sender, node: str, phase: Held, why: str) -> int:
    assert phase.key is not None
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

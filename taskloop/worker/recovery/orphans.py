"""What a worker that fell silent held is sent again at once, from the store's records.

taskloop's workers consume with kombu's ack emulation off (connections/broker.py): a message a
worker takes leaves the broker, and the broker keeps no copy of it until it is acknowledged. The
store is what keeps a phase: its record, its lease, its start note. A worker that dies with its
host (SIGKILL, out of memory, a lost node) loses the messages it held; its heartbeat
(worker/liveness/presence.py) lists each of them, with what it names, and the reconciler acts on that list
once the worker has fallen silent while the others went on (runtime/fleet.py, ``holdings``):

- a **phase** still queued under the message's token is sent again (a REDISPATCH, a new token);
  one whose start note says the silent worker began it is replayed, its lost execution counted;
  one the record shows running on that worker is replayed (worker/recovery/executions.py);
- a **taskloop.dispatch** message: each of its phases still queued is sent again;
- a **taskloop.start** of a run still pending: a new one is sent (planning it is idempotent);
- a **taskloop.settle**: nothing, the reconciler settles a cancelled run's gates on every pass.

Each of these is a guarded write, refused if the phase moved on meanwhile (a partitioned worker
that comes back finds its messages stale). A message the worker took after its last heartbeat is
in no list: the census finds its phase within seconds (worker/recovery/census.py), or its lease. The node
is then dropped from the heartbeats, so that its list is acted on once.
"""

from __future__ import annotations

import logging
from typing import Any

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import CorruptRecord, TaskLoopError
from taskloop.core import fields as fld
from taskloop.core.states import QUEUED_STATES, RUNNING_STATES, RunStatus
from taskloop.runtime.celery_app import DISPATCH_TASK, START_TASK
from taskloop.runtime.commit import Sender
from taskloop.runtime.fleet import Held, WorkerInfo, holdings, node_of, read_holdings
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution.deferred import started
from taskloop.worker.execution.handled import Result
from taskloop.worker.recovery import executions as recovery
from taskloop.worker.recovery.outage import PHASE_TASKS, redispatch, workflow_of

log = logging.getLogger("taskloop.orphans")


def settle_orphans(app: Any, store: RedisStore, settings: Settings, send: Sender, now: float | None = None,
                   beats: dict[str, WorkerInfo] | None = None) -> int:
    """Send again what the workers that fell silent held; how many messages were acted on
    (``beats``: the heartbeats with their holdings, as a reconcile pass read them)."""
    beats = read_holdings(store) if beats is None else beats
    hold = holdings(beats, clock.now() if now is None else now)
    acted = 0
    for node in sorted(hold.silent):
        messages = beats[node].messages
        for held in messages:
            try:
                acted += _again(app, store, settings, send, node, held)
            except (TaskLoopError, CorruptRecord) as exc:
                log.warning("run %s: what silent worker %s held is left to the next pass (%s)", held.run_id, node, exc)
                return acted  # the store is away or refuses: this node's list is looked at again
        store.forget_workers(node)
        log.warning("worker %s fell silent holding %d message(s); %d sent again from the store", node,
                    len(messages), acted)
    return acted


def _again(app: Any, store: RedisStore, settings: Settings, send: Sender, node: str, held: Held) -> int:
    if held.task in PHASE_TASKS and held.key is not None and held.token is not None:
        return _phase_again(store, settings, send, node, held.run_id, held.key, held.token)
    if held.task == DISPATCH_TASK:
        return sum(redispatch(store, settings, send, held.run_id, key) for key in held.keys)
    if held.task == START_TASK:
        status = store.hmget(held.run_id, [fld.F_STATUS])[0]
        if status == RunStatus.PENDING.value:
            app.send_task(START_TASK, args=[held.run_id], ignore_result=True)
            return 1
    return 0


def _phase_again(store: RedisStore, settings: Settings, send: Sender, node: str, run_id: str, key: str,
                 token: int) -> int:
    snap = store.snapshot(run_id, [*fld.record_fields(key), fld.F_CONTROL, fld.F_VERSION, fld.F_FINGERPRINT,
                                   fld.started_field(key)])
    record = snap.record(key) if snap.exists else None
    if record is None:
        return 0
    note = started(snap.get(fld.started_field(key)))
    if record.state in QUEUED_STATES and record.token == token:
        if note is None or note.token != token or node_of(note.worker) != node:
            return int(redispatch(store, settings, send, run_id, key, token=token))
        record = record.model_copy(update={"worker": note.worker, "began_at": note.at})  # it ran there
    elif not (record.state in RUNNING_STATES and record.token == token + 1 and node_of(record.worker) == node):
        return 0  # moved on
    workflow = workflow_of(snap)
    if workflow is None:
        return 0  # not imported here: its lease replays it
    return int(recovery.recover(store, settings, send, workflow, snap, record).result is Result.RECOVERED)

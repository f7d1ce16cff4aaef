"""A pool process that died while it ran a phase: the worker's main process queues the replay at
once (replies.py ``PhaseRequest.on_failure`` calls ``replay``).

Celery tells the main process which message a dead pool process was running (WorkerLostError).
The phase's record then shows one of two things:

- **running** under the next token, on that very process: begin.lua (or the watcher) had written
  its begin. The redelivered message would find it too (executor.py, ``_decide``); doing it here
  does not wait for the message to come round.
- **queued** under the message's own token: the phase ran before its begin was written
  (worker/execution/deferred.py), and nothing but this handler knows that its execution was lost. It is
  begun and expired in one write, so that the execution counts (one attempt, one execution: the
  redelivery cap, ``TASKLOOP_MAX_EXECUTIONS``, still ends a phase that keeps killing its
  process).

Either way the replay goes out with a new token, and Celery's own requeue of the message
(``task_reject_on_worker_lost``) is then refused as stale. When the store cannot be reached
here, that requeued message is the fallback: it runs the phase again.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from taskloop.base.config import settings
from taskloop.base.errors import CorruptRecord, TaskLoopError
from taskloop.core import fields as fld
from taskloop.core.states import Phase, Slot, active_state
from taskloop.runtime import celery_app
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution.handled import Handled
from taskloop.worker.recovery import executions as recovery
from taskloop.worker.recovery.outage import PHASE_TASKS, workflow_of

log = logging.getLogger("taskloop.pool_loss")

_lock = threading.Lock()
_parts: tuple[RedisStore, celery_app.PhaseSender] | None = None


def _store_and_sender(app: Any) -> tuple[RedisStore, celery_app.PhaseSender]:
    global _parts
    with _lock:
        if _parts is None:
            config = settings()
            _parts = (RedisStore(config.redis_url, retries=2, events_maxlen=config.events_maxlen),
                      celery_app.PhaseSender(app, config.redis_url))
        return _parts


def replay(app: Any, task_name: str, args: Any, hostname: str | None, pid: int | None) -> Handled | None:
    """Queue the replay of the phase a dead pool process ran (None: not a phase, or nothing to
    replay: the phase moved on). Never raises."""
    if task_name not in PHASE_TASKS or not isinstance(args, (list, tuple)) or len(args) != 4:
        return None
    run_id, key, round_, token = args
    if not (isinstance(run_id, str) and isinstance(key, str) and type(round_) is int and type(token) is int):
        return None
    phase = Phase(task_name.rpartition(".")[2])
    worker = f"{hostname}/{pid}" if hostname and pid else None
    try:
        store, sender = _store_and_sender(app)
        snap = store.snapshot(run_id, [*fld.record_fields(key), fld.F_CONTROL, fld.F_VERSION, fld.F_FINGERPRINT])
        if not snap.exists:
            return None
        record = snap.record(key)
        if record is None or record.round != round_:
            return None
        if record.state is active_state(phase, Slot.QUEUED) and record.token == token:
            record = record.model_copy(update={"worker": worker})  # ran before its begin was written
        elif not (recovery.is_redelivery_of_running(record, phase, round_, token) and worker is not None
                  and record.worker == worker):
            return None
        workflow = workflow_of(snap)
        if workflow is None:
            return None  # not imported here: the redelivered message or the lease replays it
        handled = recovery.recover(store, settings(), sender, workflow, snap, record)
    except (TaskLoopError, CorruptRecord) as exc:
        log.warning("run %s task %s: the pool process running %s round %s died; not replayed from here (%s): "
                    "its message comes back to the queue", run_id, key, phase.value, round_, exc)
        return None
    except Exception:  # never let Celery's failure handling break on this
        log.exception("run %s task %s: replaying the phase of a dead pool process failed", run_id, key)
        return None
    return handled

"""The Celery tasks: thin wrappers that validate the message and hand it to the executor.

``taskloop.attempt``, ``taskloop.check`` and ``taskloop.run`` are registered on the app from
``taskloop.worker``; each is sent with a shadow name ``<workflow>.<key>.<phase>``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery, signals
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from taskloop import executor as executor_module
from taskloop.app import PhaseSender, send_phase
from taskloop.config import settings
from taskloop.executor import Executor
from taskloop.phases import Phase
from taskloop.reconciler import ReconcilerThread, reconcile
from taskloop.store import RedisStore

log = logging.getLogger("taskloop.tasks")


class PhaseMessage(BaseModel):
    """The only payload taskloop puts on the queue: which phase of which run to execute."""

    model_config = ConfigDict(frozen=True)
    run_id: StrictStr
    key: StrictStr
    round: StrictInt
    token: StrictInt


@signals.worker_process_init.connect
def _in_pool_process(**_: Any) -> None:
    """A prefork pool process: it may end itself to stop a callback that overran (the pool forks
    a replacement)."""
    executor_module.hard_stop_allowed = True


_executor: Executor | None = None
_executor_pid: int | None = None


def executor(app: Celery, hostname: str) -> Executor:
    """One executor per worker process, created after the fork."""
    global _executor, _executor_pid
    if _executor is None or _executor_pid != os.getpid():
        config = settings()
        store = RedisStore(config.redis_url, retries=10, single_connection=True)
        _executor = Executor(store, config, PhaseSender(app),
                             f"{hostname}/{os.getpid()}")
        _executor_pid = os.getpid()
    return _executor


def execute(app: Celery, phase: Phase, hostname: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    try:
        if kwargs or len(args) != 4:
            raise ValueError(f"expected 4 positional args (run_id, key, round, token), got {args!r} {kwargs!r}")
        message = PhaseMessage(run_id=args[0], key=args[1], round=args[2], token=args[3])
    except (ValueError, ValidationError) as exc:
        log.error("malformed taskloop.%s message dropped: %s", phase.value, exc)
        return "malformed"
    return executor(app, hostname or "worker").handle(
        phase, message.run_id, message.key, message.round, message.token
    )


def register(app: Celery) -> None:
    """Register the three phase tasks on ``app``."""
    options = dict(bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True, serializer="json")

    @app.task(name="taskloop.attempt", **options)
    def attempt(self: Any, *args: Any, **kwargs: Any) -> str:
        return execute(app, Phase.ATTEMPT, self.request.hostname, args, kwargs)

    @app.task(name="taskloop.check", **options)
    def check(self: Any, *args: Any, **kwargs: Any) -> str:
        return execute(app, Phase.CHECK, self.request.hostname, args, kwargs)

    @app.task(name="taskloop.run", **options)
    def run(self: Any, *args: Any, **kwargs: Any) -> str:
        return execute(app, Phase.RUN, self.request.hostname, args, kwargs)

    @app.task(name="taskloop.reconcile", ignore_result=True)
    def reconcile_task() -> str:
        """Beat entry point: one reconcile pass (see taskloop/reconciler.py)."""
        worker = executor(app, "beat")
        return str(reconcile(worker.store, worker.settings, worker.send))

    interval = settings().reconcile_interval_s
    if interval > 0:
        app.conf.beat_schedule = {
            **(app.conf.beat_schedule or {}),
            "taskloop-reconcile": {"task": "taskloop.reconcile", "schedule": interval},
        }

    @signals.worker_ready.connect(weak=False)
    def start_reconciler(sender: Any = None, **_: Any) -> None:
        """Every worker's main process reconciles too (one pass per interval cluster-wide)."""
        config = settings()
        if config.reconcile_interval_s <= 0:
            return
        store = RedisStore(config.redis_url, retries=10)
        thread = ReconcilerThread(store, config, lambda wf, run_id, d: send_phase(app, wf, run_id, d),
                                  config.reconcile_interval_s)
        thread.start()

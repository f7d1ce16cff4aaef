"""The Celery tasks: thin wrappers that read the message (messages.py), hand it to the executor
and return its reply (replies.py).

``taskloop.attempt``, ``taskloop.check`` and ``taskloop.run`` execute phases (sent with a shadow
name ``<workflow>.<key>.<phase>``); ``taskloop.start`` plans a run recorded by name (or starts one
from any Celery client); ``taskloop.dispatch`` sends the messages of many queued phases of one run;
``taskloop.settle`` ends the paused gates of a cancelled run; ``taskloop.act`` carries out an action
asked by run id (decide, resume, fork from a process without the workflow's code); ``taskloop.reconcile`` is one
reconcile pass (beat).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from celery import Celery, signals

from taskloop.base.config import settings
from taskloop.base.errors import PoolRefused
from taskloop.core.states import Phase
from taskloop.runtime import celery_app as taskloop_app
from taskloop.runtime.instruments import hooks
from taskloop.store.redis_store import RedisStore
from taskloop.worker import pools
from taskloop.worker.execution import messages, process, replies, running, starter
from taskloop.worker.execution.executor import Executor
from taskloop.worker.limits.limiter import Drainer
from taskloop.worker.liveness.presence import Presence
from taskloop.worker.liveness.shutdown import GracefulShutdown
from taskloop.worker.logs import one_line_logs
from taskloop.worker.recovery.census import Census
from taskloop.worker.recovery.orphans import settle_orphans
from taskloop.worker.recovery.reconciler import ReconcilerThread, reconcile
from taskloop.worker.supervisor import EXIT_BAD_IMPORT

log = logging.getLogger("taskloop.tasks")


@signals.worker_process_shutdown.connect
@signals.worker_shutdown.connect
def _ending(**_: Any) -> None:
    """A pool process (which ends without ``atexit``) or the worker's main process ends: the hooks
    send what they buffer (tracing: its spans)."""
    hooks().process_ending(os.getpid())


@signals.worker_process_init.connect
def _in_pool_process(**_: Any) -> None:
    """A prefork pool process: it may end itself to stop a callback that overran (the pool forks
    a replacement)."""
    running.hard_stop_allowed = True


def executor(app: Celery, hostname: str) -> Executor:
    """One executor per worker process, created after the fork."""
    return process.executor(app, hostname)


def register(app: Celery) -> None:
    """Register taskloop's tasks on ``app``."""
    options = dict(bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True, serializer="json",
                   Request=replies.PhaseRequest)

    @app.task(name="taskloop.attempt", **options)
    def attempt(self: Any, *args: Any, **kwargs: Any) -> str:
        return process.execute(app, Phase.ATTEMPT, self.request.hostname, args, kwargs, self.request.shadow,
                               messages.carried_of(self.request), messages.traceparent_of(self.request))

    @app.task(name="taskloop.check", **options)
    def check(self: Any, *args: Any, **kwargs: Any) -> str:
        return process.execute(app, Phase.CHECK, self.request.hostname, args, kwargs, self.request.shadow,
                               messages.carried_of(self.request), messages.traceparent_of(self.request))

    @app.task(name="taskloop.run", **options)
    def run(self: Any, *args: Any, **kwargs: Any) -> str:
        return process.execute(app, Phase.RUN, self.request.hostname, args, kwargs, self.request.shadow,
                               messages.carried_of(self.request), messages.traceparent_of(self.request))

    @app.task(name=taskloop_app.START_TASK, **options)
    def start(self: Any, *args: Any, **kwargs: Any) -> str:
        """Plan a run recorded by name (args: run_id), or start one: kwargs workflow, input,
        version, run_id (any Celery client, any language)."""
        worker = executor(app, self.request.hostname or "worker")
        return starter.handle_start(worker, args, kwargs)

    @app.task(name=taskloop_app.DISPATCH_TASK, **options)
    def dispatch(self: Any, *args: Any, **kwargs: Any) -> str:
        message = messages.read(messages.FanoutMessage, taskloop_app.DISPATCH_TASK, args, kwargs, ("run_id", "keys"))
        if isinstance(message, str):
            return message
        worker = executor(app, self.request.hostname or "worker")
        return starter.handle_fanout(worker, message.run_id, message.keys)

    @app.task(name=taskloop_app.SETTLE_TASK, **options)
    def settle(self: Any, *args: Any, **kwargs: Any) -> str:
        message = messages.read(messages.RunMessage, taskloop_app.SETTLE_TASK, args, kwargs, ("run_id",))
        if isinstance(message, str):
            return message
        worker = executor(app, self.request.hostname or "worker")
        return starter.handle_settle(worker, message.run_id)

    @app.task(name=taskloop_app.ACT_TASK, **options)
    def act(self: Any, *args: Any, **kwargs: Any) -> str:
        """Carry out an action asked by run id (args: request_id): decide, resume or fork."""
        return starter.handle_act(executor(app, self.request.hostname or "worker"), args, kwargs)

    @signals.worker_init.connect(weak=False)
    def check_pool(sender: Any = None, **_: Any) -> None:
        """A pool taskloop cannot run phases on is refused before the worker starts (pools/__init__.py)."""
        from celery.concurrency import get_implementation

        try:
            process.POOL.kind = pools.kind_of(get_implementation(sender.pool_cls))
        except PoolRefused as exc:
            log.critical("%s", exc)
            sys.stderr.flush()
            raise SystemExit(EXIT_BAD_IMPORT) from None

    @signals.worker_ready.connect(weak=False)
    def note_concurrency(sender: Any = None, **_: Any) -> None:
        pool = getattr(sender, "pool", None)
        process.POOL.concurrency = int(getattr(pool, "limit", None) or getattr(pool, "num_processes", None) or 1)
        if process.POOL.shared:  # this process holds many phases (or, asyncio, their messages) at once
            pools.tune_collector()

    censuses: list[Census] = []

    def beat_census(worker: Executor) -> Census:
        """The census of the pool process that runs the beat's reconcile tasks (one per process)."""
        if not censuses or censuses[0].store is not worker.store:
            censuses[:] = [Census(app, worker.store, worker.settings, worker.send)]
        return censuses[0]

    @app.task(name="taskloop.reconcile", ignore_result=True)
    def reconcile_task() -> str:
        """Beat entry point: one reconcile pass (see taskloop/worker/recovery/reconciler.py)."""
        worker = executor(app, "beat")
        return str(reconcile(worker.store, worker.settings, worker.send,
                             restore=lambda beats: settle_orphans(app, worker.store, worker.settings, worker.send,
                                                                   beats=beats),
                             census=beat_census(worker)))

    # a message Celery's own handler chokes on is dropped, never fatal (taskloop/worker/consumer.py)
    app.conf.worker_consumer = "taskloop.worker.consumer:Consumer"
    signals.after_setup_logger.connect(one_line_logs, weak=False)
    signals.after_setup_task_logger.connect(one_line_logs, weak=False)
    signals.after_setup_task_logger.connect(replies.word_replies, weak=False)
    replies.word_replies()

    interval = settings().reconcile_interval_s
    if interval > 0:
        app.conf.beat_schedule = {
            **(app.conf.beat_schedule or {}),
            "taskloop-reconcile": {"task": "taskloop.reconcile", "schedule": interval},
        }

    threads: list[ReconcilerThread] = []

    @signals.worker_ready.connect(weak=False)
    def start_reconciler(sender: Any = None, **_: Any) -> None:
        """Every worker's main process reconciles too (one pass per interval fleet-wide)."""
        config = settings()
        if config.reconcile_interval_s <= 0:
            return
        store = RedisStore(config.redis_url, retries=10, events_maxlen=config.events_maxlen)
        sender = taskloop_app.PhaseSender(app, config.redis_url)
        thread = ReconcilerThread(store, config, sender, config.reconcile_interval_s,
                                  restore=lambda beats: settle_orphans(app, store, config, sender, beats=beats),
                                  census=Census(app, store, config, sender))
        thread.start()
        threads.append(thread)

    drainers: list[Drainer] = []

    @signals.worker_ready.connect(weak=False)
    def start_drainer(sender: Any = None, **_: Any) -> None:
        """Every worker's main process sends again the phases that wait for a fleet limit when
        their rate window reopens (taskloop/worker/limits/limiter.py)."""
        config = settings()
        store = RedisStore(config.redis_url, retries=10, events_maxlen=config.events_maxlen)
        drainer = Drainer(store, taskloop_app.PhaseSender(app, config.redis_url, ahead=store.client).resend)
        drainer.start()
        drainers.append(drainer)

    beats: list[Presence] = []

    @signals.worker_ready.connect(weak=False)
    def start_heartbeat(sender: Any = None, **_: Any) -> None:
        """Every worker's main process writes its heartbeat (taskloop/worker/liveness/presence.py)."""
        config = settings()
        store = RedisStore(config.redis_url, retries=2, events_maxlen=config.events_maxlen)
        presence = Presence(store, sender, getattr(sender, "hostname", None) or "worker")
        presence.start()
        beats.append(presence)

    @signals.worker_shutting_down.connect(weak=False)
    def stop_reconciler(**_: Any) -> None:
        for thread in threads:
            thread.stop()
        for drainer in drainers:
            drainer.stop()
        for presence in beats:
            presence.stop()

    graceful = GracefulShutdown(settings().shutdown_grace_s, lambda: executor(app, "shutdown"))

    @signals.worker_ready.connect(weak=False)
    def note_pool(sender: Any = None, **_: Any) -> None:
        graceful.ready(sender)

    @signals.worker_shutting_down.connect(weak=False)
    def hand_back_later(how: str = "", **_: Any) -> None:
        graceful.shutting_down(how)

"""A phase message as Celery hands it to a worker process: the process's executor (one per process,
made after the fork, with a store client sized for the pool it serves), the message's arguments
read into a ``Call`` or what it came to, and the reply Celery records (replies.py). The Celery
tasks (worker/tasks.py) and the asyncio pool (worker/pools/asyncio_pool.py) both go through here."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from celery import Celery
from celery.exceptions import Reject

from taskloop.base.config import settings
from taskloop.base.errors import StoreUnavailable
from taskloop.core.phases import EventKind
from taskloop.core.states import Phase
from taskloop.runtime import celery_app as taskloop_app
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution import messages, replies
from taskloop.worker.execution.executor import Executor
from taskloop.worker.execution.handled import Handled, Result
from taskloop.worker.execution.running import Call

log = logging.getLogger("taskloop.tasks")


@dataclass
class Pool:
    """The pool this process runs phases on (set when the worker starts: worker/tasks.py): how many
    phases it runs at once, and whether they share the process (threads, gevent, asyncio) or each
    pool process runs one at a time (prefork, solo)."""

    kind: str = "prefork"
    concurrency: int = 1

    @property
    def shared(self) -> bool:
        return self.kind in ("threads", "celery-threads", "gevent", "asyncio")

    @property
    def in_worker(self) -> bool:
        """Whether phases run in the worker's main process (Celery's threads, greenlets, or solo's one
        call), where no pool process can be stopped on its own: a phase handed back is signalled instead."""
        return self.kind in ("celery-threads", "gevent", "solo")

    @property
    def on_loop_process(self) -> bool:
        """Whether phases run in one pool process of taskloop's (asyncio, threads: worker/pools), which
        runs them all: it is stopped once the warm shutdown's grace is over, not for one phase."""
        return self.kind in ("asyncio", "threads")


POOL = Pool()

_executor: Executor | None = None
_executor_pid: int | None = None
_lock = threading.Lock()


def executor(app: Celery, hostname: str) -> Executor:
    """One executor per worker process, created after the fork (the first message makes it)."""
    global _executor, _executor_pid
    with _lock:
        if _executor is None or _executor_pid != os.getpid():
            config = settings()
            shared = POOL.concurrency if POOL.shared else None
            store = RedisStore(config.redis_url, retries=10, single_connection=not shared, shared_by=shared,
                               events_maxlen=config.events_maxlen)
            sender = taskloop_app.PhaseSender(app, config.redis_url, ahead=store.client)
            _executor = Executor(store, config, sender, f"{hostname}/{os.getpid()}", sender.resend)
            _executor_pid = os.getpid()
        return _executor


def prepare(app: Celery, phase: Phase, hostname: str | None, args: tuple[Any, ...], kwargs: dict[str, Any],
            name: str | None = None, carried: messages.Carried | None = None) -> tuple[Executor, Call] | str:
    """One phase message up to its callback: the executor and the call of a phase that may run now,
    or the reply of what the message came to. ``name``: the message's Celery name (its shadow,
    ``<workflow>.<key>.<phase>``); ``carried``: the fields it carries (core/reads.py). Raises Reject
    (the message goes back to the queue) when the store is away before anything ran."""
    message = messages.read(messages.PhaseMessage, f"taskloop.{phase.value}", args, kwargs,
                            ("run_id", "key", "round", "token"))
    if isinstance(message, str):
        return message
    try:
        worker = executor(app, hostname or "worker")
        step = worker.prepare(phase, message.run_id, message.key, message.round, message.token, name, carried)
    except StoreUnavailable as exc:
        # nothing ran yet (the store was away at the begin): the message goes back to the queue
        # instead of being acknowledged, so the phase does not wait for its queued lease
        log.warning("run %s task %s: the store is unreachable before %s round %s began; the message goes back "
                    "to the queue (%s)", message.run_id, message.key, phase.value, message.round, exc)
        raise Reject(f"store unreachable: {exc}", requeue=True) from None
    return reply_of(step) if isinstance(step, Handled) else (worker, step)


def execute(app: Celery, phase: Phase, hostname: str | None, args: tuple[Any, ...], kwargs: dict[str, Any],
            name: str | None = None, carried: messages.Carried | None = None, traceparent: str | None = None) -> str:
    """One phase message, its callback included, in this thread or greenlet: the reply Celery records
    (``traceparent``: the trace context it carried, for the hooks). A store outage after the callback
    ran raises StoreUnavailable (its outcome was retried for TASKLOOP_RECORD_OUTAGE_S; its lease
    replays it)."""
    prepared = prepare(app, phase, hostname, args, kwargs, name, carried)
    if isinstance(prepared, str):
        return prepared
    worker, call = prepared
    call.traceparent = traceparent
    return reply_of(worker.run(call))


def reply_of(handled: Handled) -> str:
    """The reply Celery records for what a phase message came to (replies.py)."""
    if handled.result in (Result.STALE, Result.SUPERSEDED, Result.DROPPED):
        return replies.ignored(f"{handled.result.value}: {handled.reason}")
    if handled.outcome is EventKind.FAIL and handled.error is not None:
        return replies.failed(f"{handled.error.type}: {handled.error.message}")
    return str(handled.result.value)

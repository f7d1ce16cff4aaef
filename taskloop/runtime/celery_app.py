"""The Celery app of taskloop: configuration (celeryconfig.py + environment) and the message sender."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from celery import Celery

from taskloop.base.config import Settings, celery_config_module, settings
from taskloop.base.errors import OutboxUnsupported
from taskloop.celery_fixes.connection import AMQP
from taskloop.celery_fixes.outbox import collect
from taskloop.connections import broker
from taskloop.core import fields as fld
from taskloop.core import reads
from taskloop.core.begin import Dispatch
from taskloop.core.limits import Waiter
from taskloop.define.workflow import Workflow
from taskloop.ops.hooks import Outgoing
from taskloop.runtime import outbox
from taskloop.runtime.instruments import hooks
from taskloop.store.redis_store import RedisStore

log = logging.getLogger("taskloop.runtime.celery_app")

# Used when no celeryconfig module is importable (the same values as the repository's file).
# Celery's own defaults stand for the rest: prefetch 4 per process with fair scheduling, and
# task events off (`taskloop worker -E` turns them on; Flower turns them on by itself).
DEFAULTS: dict[str, Any] = {
    "task_ignore_result": True,
    "broker_transport_options": {"visibility_timeout": 3600},
    "task_default_queue": "taskloop",
    "broker_connection_retry_on_startup": True,
    "broker_connection_max_retries": None,  # reconnect however long the broker is away
    # no result backend, so nothing to expire: beat (-B) would otherwise schedule Celery's daily
    # celery.backend_cleanup, a built-in task that taskloop's workers refuse (worker/app.py)
    "result_expires": None,
}
# taskloop's guarantees rest on these: they override any configuration.
REQUIRED: dict[str, Any] = {
    "task_serializer": "json",
    "accept_content": ["json"],
    "result_serializer": "json",
    "event_serializer": "json",  # a worker's events are read by Flower and the UI's fleet page: never pickle
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
}

PHASE_TASKS = frozenset({"taskloop.attempt", "taskloop.check", "taskloop.run"})  # args: run_id, key, round, token
START_TASK = "taskloop.start"  # plan a run recorded by name (or start one from any Celery client)
DISPATCH_TASK = "taskloop.dispatch"  # send the phase messages of many queued tasks of one run
SETTLE_TASK = "taskloop.settle"  # end what no message will (the paused gates of a cancelled run)
ACT_TASK = "taskloop.act"  # carry out an action asked by run id (decide, resume, fork: runtime/acting.py)

# A plan that queues more phases than this sends the rest through DISPATCH_TASK messages of
# FANOUT_CHUNK tasks each, so that workers send them in parallel (and start() stays fast).
FANOUT_DIRECT = 32
FANOUT_CHUNK = 200


def make_app(config: Settings | None = None) -> Celery:
    config = config or settings()
    app = Celery("taskloop", set_as_current=False, amqp=AMQP)
    module = celery_config_module()
    # DEFAULTS first, the user's module over them; conf.update would outrank the module.
    settings_ = dict(DEFAULTS)
    if module is not None:
        settings_.update({name: getattr(module, name) for name in dir(module) if not name.startswith("_")})
    app.config_from_object(SimpleNamespace(**settings_))
    # already resolved: arguments > env > celeryconfig; password, TLS and Sentinel as kombu expects them
    # a dead broker connection fails instead of hanging (socket timeouts, health checks, keepalive),
    # unless the configuration sets these options itself
    transport_options = {**broker.hang_defaults(config.broker_url), **(app.conf.broker_transport_options or {})}
    app.conf.update(broker.broker_settings(config.broker_url, config, transport_options))
    app.conf.update(REQUIRED)
    if config.imports:
        app.conf.imports = tuple(app.conf.imports or ()) + config.imports
    return app


def phase_name(workflow: Workflow, dispatch: Dispatch) -> str:
    """The name Flower shows for a phase: ``<workflow>.<key>.<phase>``."""
    return f"{workflow.name}.{dispatch.key}.{dispatch.phase.value}"


@dataclass(frozen=True)
class Message:
    """What a taskloop message says: ids only (its task, arguments, shadow name and args repr for
    Flower, queue and countdown); sent by ``send`` or built by the outbox (outbox.Builder)."""

    task: str
    args: list[Any]
    shadow: str
    argsrepr: str
    queue: str | None = None
    countdown: float | None = None
    # the fields whose values the write that queues it puts into it (core/reads.py; the outbox only)
    carry: list[str] | None = None
    headers: dict[str, str] | None = None  # the hooks' (a phase message's traceparent)

    def send(self, app: Celery, producer: Any = None) -> None:
        options: dict[str, Any] = {}
        if producer is not None:
            options["producer"] = producer
        if self.queue:
            options["queue"] = self.queue
        if self.countdown:
            options["countdown"] = self.countdown
        if self.headers:
            options["headers"] = self.headers
        app.send_task(self.task, args=self.args, shadow=self.shadow, argsrepr=self.argsrepr, ignore_result=True,
                      **options)


def _phase(run_id: str, key: str, phase: str, round_: int, token: int, shadow: str, queue: str | None,
           countdown: float | None, carry: list[str] | None = None) -> Message:
    return Message(f"taskloop.{phase}", [run_id, key, round_, token], shadow, f"{run_id} {key} round={round_}",
                   queue, countdown, carry)


def phase_message(workflow: Workflow, run_id: str, dispatch: Dispatch, carry: bool = False) -> Message:
    """One phase message: ids only, named after the workflow for Flower (``carry``: and, from the
    outbox, the fields its write reads into it: core/reads.py)."""
    task = workflow.lookup(dispatch.key)
    fields = reads.carried_fields(workflow, dispatch.key, dispatch.phase, dispatch.round) \
        if carry and task is not None and not dispatch.countdown else None
    return _phase(run_id, dispatch.key, dispatch.phase.value, dispatch.round, dispatch.token,
                  phase_name(workflow, dispatch), task.queue if task is not None else None, dispatch.countdown,
                  fields)


def waiter_message(waiter: Waiter) -> Message:
    """The message of a phase that waited for a fleet limit, sent again (the same token: a duplicate
    is refused as stale)."""
    return _phase(waiter.run_id, waiter.key, waiter.phase, waiter.round, waiter.token,
                  f"{waiter.workflow}.{waiter.key}.{waiter.phase}", waiter.queue or None, None)


def fanout_message(workflow: Workflow, run_id: str, keys: Sequence[str]) -> Message:
    """Ask a worker to send the phase messages of ``keys`` (their current tokens, read there)."""
    return Message(DISPATCH_TASK, [run_id, list(keys)], f"{workflow.name}.dispatch", f"{run_id} {len(keys)} tasks")


def send_phase(app: Celery, workflow: Workflow, run_id: str, dispatch: Dispatch, producer: Any = None) -> None:
    phase_message(workflow, run_id, dispatch).send(app, producer)


def send_fanout(app: Celery, workflow: Workflow, run_id: str, keys: Sequence[str], producer: Any = None) -> None:
    fanout_message(workflow, run_id, keys).send(app, producer)


def messages_of(workflow: Workflow, run_id: str, dispatches: Sequence[Dispatch], carry: bool = False) -> list[Message]:
    """The messages of a plan's dispatches: the first FANOUT_DIRECT phases themselves (``carry``:
    with the fields they read), the rest in DISPATCH_TASK messages of FANOUT_CHUNK keys."""
    rest = [d.key for d in dispatches[FANOUT_DIRECT:]]
    return [*(phase_message(workflow, run_id, d, carry) for d in dispatches[:FANOUT_DIRECT]),
            *(fanout_message(workflow, run_id, rest[i:i + FANOUT_CHUNK]) for i in range(0, len(rest), FANOUT_CHUNK))]


class PhaseSender:
    """Sends phase messages through one producer kept for the life of the process (a worker), or
    taken from kombu's pool for each send (``keep=False``: a client, so that clients a service
    never closes do not use up the pool's ``broker_pool_limit`` connections and block).

    When the broker is the store's own Redis, ``fold`` returns the Redis commands that publish
    the messages, for the commit to run inside its write (outbox.py: built by its ``Builder``, or
    taken from Celery's own send by taskloop's transport, celery_fixes/outbox.py); otherwise the commit calls
    the sender after its write. A pool process sends one message per phase; taking a producer
    from the pool for each costs a noticeable share of the send. Broker errors are retried by
    Celery; if a send still fails, the producer is dropped and the next send takes a fresh one
    (the phase stays queued with its lease, and the reconciler re-sends it)."""

    def __init__(self, app: Celery, store_url: str | None = None, keep: bool = True, ahead: Any = None) -> None:
        self.app = app
        self.keep = keep  # False (a client): the producer goes back to kombu's pool after each send
        # the store's Redis client: when the broker is that Redis, the waiters a fleet limit picked
        # are sent again to the front of their queues (resend)
        self.ahead = ahead
        self._producer: Any = None
        self._lock = threading.Lock()
        self.store_url = store_url
        self._store: RedisStore | None = None  # made when a hook asks for a run's stored context
        self.folds = store_url is not None and outbox.same_redis(app.conf.broker_url, store_url) \
            and not app.conf.task_send_sent_event  # a "sent" event must not announce an unwritten plan
        self.builder = outbox.Builder(app)

    def __call__(self, workflow: Workflow, run_id: str, dispatches: Sequence[Dispatch]) -> None:
        with self._lock:
            try:
                self._locked_publish(workflow, run_id, dispatches)
            finally:
                if not self.keep:
                    self._release()

    def resend(self, waiters: Sequence[Waiter]) -> None:
        """Send the messages of phases that waited for a fleet limit (taskloop/worker/limits/limiter.py).

        A limit picked them for room it has now. At the back of a queue, behind a backlog (the
        messages of phases that will be refused, when many runs start at once), a message would
        spend that room travelling: a rate window counts the start from the moment the phase
        begins, so that time is lost from the window. So, when the broker is the store's Redis
        (``ahead``), the messages go to the front of their queues: ``RPUSH`` at the end of the list
        workers take from (kombu's Redis transport pushes on the left and takes from the right),
        oldest waiter taken first. Otherwise, or when a message needs Celery's own send, they are
        sent the ordinary way."""
        if self.ahead is not None and self.folds and self._push_ahead(waiters):
            return
        with self._lock:
            try:
                producer = self._acquire()
                for message in self.headed([waiter_message(waiter) for waiter in waiters]):
                    message.send(self.app, producer)
            except Exception:
                self._release()
                raise
            finally:
                if not self.keep:
                    self._release()

    def _push_ahead(self, waiters: Sequence[Waiter]) -> bool:
        """Push the waiters' messages at the front of their queues (False: some message needs send_task)."""
        by_queue: dict[str, list[str]] = {}
        for m in self.headed([waiter_message(waiter) for waiter in waiters]):
            push = self.builder.push(m.task, m.args, m.shadow, m.argsrepr, m.queue, m.countdown, extra=m.headers)
            if push is None:
                return False
            by_queue.setdefault(push[0], []).append(push[1])
        for queue, payloads in by_queue.items():
            self.ahead.rpush(queue, *reversed(payloads))  # the last value pushed is taken first: the oldest waiter
        return True

    def fold(self, workflow: Workflow, run_id: str,
             dispatches: Sequence[Dispatch]) -> list[tuple[str, tuple[Any, ...]]] | None:
        """The Redis commands that publish these messages (None: send them after the write)."""
        if not self.folds:
            return None
        messages = self.headed(messages_of(workflow, run_id, dispatches, carry=self.builder.usable))
        built = [self.builder.push(m.task, m.args, m.shadow, m.argsrepr, m.queue, m.countdown, m.carry is not None,
                                   m.headers) for m in messages]
        if all(push is not None for push in built):
            return [("lpush", (*push, m.carry) if m.carry is not None else push)
                    for push, m in zip(built, messages, strict=True) if push is not None]
        with self._lock:
            try:
                return collect(self._acquire(), lambda: self._locked_send(messages))
            except OutboxUnsupported as exc:
                log.info("messages are sent after each write: %s", exc)
                self.folds = False
                return None
            finally:
                if not self.keep:
                    self._release()

    def _acquire(self) -> Any:
        if self._producer is None:
            self._producer = self.app.producer_pool.acquire(block=True)
        return self._producer

    def _locked_publish(self, workflow: Workflow, run_id: str, dispatches: Sequence[Dispatch]) -> None:
        self._locked_send(self.headed(messages_of(workflow, run_id, dispatches)))

    def headed(self, messages: list[Message]) -> list[Message]:
        """The messages, a phase's with the headers the hooks give it (tracing: its ``traceparent``);
        as they are when no hook gives any."""
        told = hooks()
        if not told.wants("message_headers"):
            return messages
        return [replace(m, headers=told.message_headers(Outgoing(
            str(m.args[0]), str(m.args[1]), int(m.args[2]), m.task.rpartition(".")[2],
            functools.partial(self.stored_context, str(m.args[0]))))) if m.task in PHASE_TASKS else m
            for m in messages]

    def stored_context(self, run_id: str) -> str | None:
        """The context a run was started in (``tc``), read from the store (one read, when a hook
        asks for a run it does not know)."""
        if self.store_url is None:
            return None
        if self._store is None:
            self._store = RedisStore(self.store_url, retries=2)
        return self._store.hmget(run_id, [fld.F_TRACE])[0]

    def _locked_send(self, messages: Sequence[Message]) -> None:
        producer = self._acquire()
        try:
            for message in messages:
                message.send(self.app, producer)
        except Exception:
            self._release()
            raise

    def close(self) -> None:
        with self._lock:
            self._release()
            if self._store is not None:
                self._store.close()
                self._store = None

    def _release(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.release()
            except Exception:
                log.debug("could not release a producer", exc_info=True)

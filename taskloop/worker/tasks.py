"""The Celery tasks: thin wrappers that validate the message and hand it to the executor.

``taskloop.attempt``, ``taskloop.check`` and ``taskloop.run`` execute phases (sent with a shadow
name ``<workflow>.<key>.<phase>``); ``taskloop.start`` plans a run recorded by name (or starts one
from any Celery client); ``taskloop.dispatch`` sends the messages of many queued phases of one run;
``taskloop.settle`` ends the paused gates of a cancelled run; ``taskloop.reconcile`` is one
reconcile pass (beat).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from celery import Celery, signals
from celery.worker.request import Request
from celery.worker.state import task_ready
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator

from taskloop import app as taskloop_app
from taskloop import metrics
from taskloop.config import settings
from taskloop.definitions import NAME_PATTERN
from taskloop.graph import ACTION_KEY
from taskloop.jsonvalue import shown
from taskloop.phases import EventKind, Phase
from taskloop.store import RedisStore
from taskloop.store import keys as k
from taskloop.worker import executor as executor_module
from taskloop.worker import starter
from taskloop.worker.executor import Executor, Result
from taskloop.worker.reconciler import ReconcilerThread, reconcile
from taskloop.worker.shutdown import GracefulShutdown

log = logging.getLogger("taskloop.tasks")

UNTRUSTED_LOG_CHARS = 200  # how much of an untrusted value a log line may quote


def untrusted(value: Any) -> str:
    """An untrusted value for a log line: repr'd (no raw newlines) and truncated."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit (JSON can carry one)
        text = shown(value)
    return text if len(text) <= UNTRUSTED_LOG_CHARS else text[:UNTRUSTED_LOG_CHARS] + "...(truncated)"


LOG_ARG_CHARS = 2_000  # how much of one argument of any log record the worker writes
# Line breaks and other control characters (but tab), written as escapes in log arguments.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F) if c != 0x09}
_CONTROL.update({0x0A: "\\n", 0x0D: "\\r", 0x85: "\\x85", 0x2028: "\\u2028", 0x2029: "\\u2029"})


def one_line(value: Any) -> Any:
    """A log argument that cannot start a line of its own: control characters escaped, cut to
    LOG_ARG_CHARS (other values are left to the formatter)."""
    if not isinstance(value, str):
        return value
    if len(value) > LOG_ARG_CHARS:
        value = value[:LOG_ARG_CHARS] + "...(truncated)"
    return value.translate(_CONTROL) if not value.isprintable() else value


class OneLineArgs(logging.Filter):
    """Every record of the worker is written on its own lines only: Celery logs a message's task id,
    shadow name or exception text as it is (``Task %(name)s[%(id)s] received``), so a line break in
    a forged header would forge a log line of its own. The format strings (and tracebacks, which
    are not arguments) keep their line breaks."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(one_line(a) for a in args)
        elif isinstance(args, Mapping):
            record.args = {name: one_line(value) for name, value in args.items()}
        return True


ONE_LINE = OneLineArgs()


def one_line_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    """Put the filter on every handler of ``logger`` (Celery's after_setup_logger signals)."""
    for handler in (logger or logging.getLogger()).handlers:
        if ONE_LINE not in handler.filters:
            handler.addFilter(ONE_LINE)


def _run_id(value: str) -> str:
    if not k.RUN_ID_PATTERN.match(value):
        raise ValueError("run_id does not match the run id pattern")
    return value


def _task_key(value: str) -> str:
    if len(value) > 200 or not (NAME_PATTERN.match(value) or ACTION_KEY.match(value)):
        raise ValueError("key does not match the task key pattern")
    return value


class PhaseMessage(BaseModel):
    """The only payload taskloop puts on the queue for a phase: which phase of which run."""

    model_config = ConfigDict(frozen=True)
    run_id: StrictStr
    key: StrictStr
    round: StrictInt = Field(ge=1)
    token: StrictInt = Field(ge=0)

    @field_validator("run_id")
    @classmethod
    def _check_run(cls, value: str) -> str:
        return _run_id(value)

    @field_validator("key")
    @classmethod
    def _check_key(cls, value: str) -> str:
        return _task_key(value)


class FanoutMessage(BaseModel):
    model_config = ConfigDict(frozen=True)
    run_id: StrictStr
    keys: list[StrictStr] = Field(min_length=1, max_length=10_000)

    @field_validator("run_id")
    @classmethod
    def _check_run(cls, value: str) -> str:
        return _run_id(value)

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        return [_task_key(key) for key in keys]


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
        store = RedisStore(config.redis_url, retries=10, single_connection=True, events_maxlen=config.events_maxlen)
        _executor = Executor(store, config, taskloop_app.PhaseSender(app, config.redis_url),
                             f"{hostname}/{os.getpid()}")
        _executor_pid = os.getpid()
    return _executor


class PhaseFailed(Exception):
    """Raised after a phase's failure is committed, so that Celery (and Flower) show the phase as
    FAILURE with the error type and message. It is expected: the message is acknowledged, never
    retried by Celery, and logged without a traceback."""


class Refused(Exception):
    """Raised for a delivery taskloop refused (stale or duplicate token, superseded execution,
    unknown run, malformed message): acknowledged, and shown by Flower as IGNORED with the reason."""


class PhaseRequest(Request):  # type: ignore[misc]  # Celery is untyped
    """Celery's request of a taskloop phase: a refused delivery is acknowledged and announced with a
    ``task-ignored`` event that carries the reason. Celery's monitors (Flower) take an event they
    do not know as a custom state, here ``IGNORED``, which outranks the ``STARTED`` that the worker
    already sent; a ``task-rejected`` would be ranked below ``STARTED`` and the phase would show as
    running forever, and a failure would make a harmless duplicate look like a broken phase."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = exc_info.exception
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
        if isinstance(exc, Refused):
            task_ready(self)
            self.acknowledge()
            self.send_event("task-ignored", exception=str(exc))
            return None
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


def execute(app: Celery, phase: Phase, hostname: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    try:
        if kwargs or len(args) != 4:
            raise ValueError(f"expected 4 positional args (run_id, key, round, token), got {len(args)} args "
                             f"and {len(kwargs)} kwargs")
        message = PhaseMessage(run_id=args[0], key=args[1], round=args[2], token=args[3])
    except (ValueError, ValidationError) as exc:
        log.error("malformed taskloop.%s message dropped: %s (args %s)", phase.value,
                  untrusted(str(exc).splitlines()[0]), untrusted(args))
        metrics.refused("malformed")
        raise Refused(f"malformed: {untrusted(str(exc).splitlines()[0])}") from None
    handled = executor(app, hostname or "worker").handle(phase, message.run_id, message.key, message.round,
                                                         message.token)
    if handled.result in (Result.STALE, Result.SUPERSEDED, Result.DROPPED):
        raise Refused(f"{handled.result.value}: {handled.reason}")
    if handled.outcome is EventKind.FAIL and handled.error is not None:
        raise PhaseFailed(f"{handled.error.type}: {handled.error.message}")
    return str(handled.result.value)


def register(app: Celery) -> None:
    """Register taskloop's tasks on ``app``."""
    options = dict(bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True, serializer="json",
                   Request=PhaseRequest, throws=(PhaseFailed, Refused))

    @app.task(name="taskloop.attempt", **options)
    def attempt(self: Any, *args: Any, **kwargs: Any) -> str:
        return execute(app, Phase.ATTEMPT, self.request.hostname, args, kwargs)

    @app.task(name="taskloop.check", **options)
    def check(self: Any, *args: Any, **kwargs: Any) -> str:
        return execute(app, Phase.CHECK, self.request.hostname, args, kwargs)

    @app.task(name="taskloop.run", **options)
    def run(self: Any, *args: Any, **kwargs: Any) -> str:
        return execute(app, Phase.RUN, self.request.hostname, args, kwargs)

    @app.task(name=taskloop_app.START_TASK, **options)
    def start(self: Any, *args: Any, **kwargs: Any) -> str:
        """Plan a run recorded by name (args: run_id), or start one: kwargs workflow, input,
        version, run_id (any Celery client, any language)."""
        worker = executor(app, self.request.hostname or "worker")
        return starter.handle_start(worker, args, kwargs)

    @app.task(name=taskloop_app.DISPATCH_TASK, **options)
    def dispatch(self: Any, *args: Any, **kwargs: Any) -> str:
        try:
            if kwargs or len(args) != 2:
                raise ValueError("expected 2 positional args (run_id, keys)")
            message = FanoutMessage(run_id=args[0], keys=args[1])
        except (ValueError, ValidationError) as exc:
            log.error("malformed taskloop.dispatch message dropped: %s", untrusted(str(exc).splitlines()[0]))
            metrics.refused("malformed")
            raise Refused(f"malformed: {untrusted(str(exc).splitlines()[0])}") from None
        worker = executor(app, self.request.hostname or "worker")
        return starter.handle_fanout(worker, message.run_id, message.keys)

    @app.task(name=taskloop_app.SETTLE_TASK, **options)
    def settle(self: Any, *args: Any, **kwargs: Any) -> str:
        try:
            if kwargs or len(args) != 1:
                raise ValueError("expected 1 positional arg (run_id)")
            run_id = _run_id(args[0]) if isinstance(args[0], str) else ""
            if not run_id:
                raise ValueError("run_id must be a string")
        except ValueError as exc:
            log.error("malformed taskloop.settle message dropped: %s", untrusted(str(exc)))
            metrics.refused("malformed")
            raise Refused(f"malformed: {untrusted(str(exc))}") from None
        worker = executor(app, self.request.hostname or "worker")
        return starter.handle_settle(worker, run_id)

    @app.task(name="taskloop.reconcile", ignore_result=True)
    def reconcile_task() -> str:
        """Beat entry point: one reconcile pass (see taskloop/worker/reconciler.py)."""
        worker = executor(app, "beat")
        return str(reconcile(worker.store, worker.settings, worker.send))

    # a message Celery's own handler chokes on is dropped, never fatal (taskloop/worker/consumer.py)
    app.conf.worker_consumer = "taskloop.worker.consumer:Consumer"
    signals.after_setup_logger.connect(one_line_logs, weak=False)
    signals.after_setup_task_logger.connect(one_line_logs, weak=False)

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
        thread = ReconcilerThread(store, config, taskloop_app.PhaseSender(app, config.redis_url),
                                  config.reconcile_interval_s)
        thread.start()
        threads.append(thread)

    @signals.worker_shutting_down.connect(weak=False)
    def stop_reconciler(**_: Any) -> None:
        for thread in threads:
            thread.stop()

    graceful = GracefulShutdown(settings().shutdown_grace_s, lambda: executor(app, "shutdown"))

    @signals.worker_ready.connect(weak=False)
    def note_pool(sender: Any = None, **_: Any) -> None:
        graceful.ready(sender)

    @signals.worker_shutting_down.connect(weak=False)
    def hand_back_later(how: str = "", **_: Any) -> None:
        graceful.shutting_down(how)

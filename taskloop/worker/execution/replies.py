"""What taskloop's Celery tasks return, and how Celery and Flower are told about it.

A phase whose failure taskloop has already recorded (a callback error, a timeout, an exhausted
loop) and a delivery taskloop refused (a stale or duplicate token, a superseded execution, an
unknown run, a malformed message) are expected outcomes, not errors of the task: they are
returned as replies, not raised. Raising them used to cost about 1.8 ms of billiard's exception
info per failure (formatting Celery's own frames), 15 % of an exhausted loop; a reply costs
nothing.

Flower still shows the truth: ``PhaseRequest`` (the tasks' Celery ``Request`` class) announces a
failed reply as ``task-failed`` (FAILURE, with the error type and message) and a refusal as
``task-ignored`` (IGNORED, with the reason) instead of ``task-succeeded``. Celery's monitors take
an event they do not know as a custom state, IGNORED, which outranks the STARTED the worker
already sent. ``ReplyLog`` words the pool's log line the same way ("failed", "ignored"), where
Celery would say "succeeded".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import WorkerLostError
from celery.worker.request import Request

from taskloop.worker.recovery import pool_loss

FAILED = "taskloop failed: "
IGNORED = "taskloop ignored: "


def failed(error: str) -> str:
    """The reply of a phase whose failure is recorded: ``<type>: <message>``."""
    return FAILED + error


def ignored(reason: str) -> str:
    """The reply of a refused delivery."""
    return IGNORED + reason


def read(reply: Any) -> tuple[str, str] | None:
    """``("failed" | "ignored", text)`` for a reply that is not a success, else None. The reply
    may come as it was returned, or as the repr Celery's pool hands to the main process and logs
    (``'taskloop failed: ...'``)."""
    if isinstance(reply, str):
        if len(reply) >= 2 and reply[0] in "'\"" and reply[-1] == reply[0]:
            reply = reply[1:-1]
        for prefix, kind in ((FAILED, "failed"), (IGNORED, "ignored")):
            if reply.startswith(prefix):
                return kind, reply[len(prefix):]
    return None


class PhaseRequest(Request):  # type: ignore[misc]  # Celery is untyped
    """Celery's request of a taskloop task: a failed or refused reply is announced as such, and the
    phase of a pool process that died while it ran is replayed at once (worker/recovery/pool_loss.py)."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        lost = isinstance(exc, WorkerLostError) or (
            isinstance(exc, (SystemExit, KeyboardInterrupt)) and not self._already_cancelled
            and not self._already_revoked)
        if lost:
            pool_loss.replay(self.task.app, self.type, self.args, self.hostname, self.worker_pid)
            # Celery then puts this very message back (task_reject_on_worker_lost). Marked as
            # delivered before, the copy reads the run instead of running on the fields it carried,
            # which are from before the loss (core/reads.py). kombu marks only its own restores
            # this way, and without ack emulation not in the headers.
            headers = getattr(self.message, "headers", None)
            if isinstance(headers, dict):
                headers["redelivered"] = True
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def send_event(self, type: str, **fields: Any) -> Any:
        found = read(fields.get("result")) if type == "task-succeeded" else None
        if found is not None:
            kind, text = found
            if kind == "failed":
                return super().send_event("task-failed", exception=text, traceback=text)
            return super().send_event("task-ignored", exception=text)
        return super().send_event(type, **fields)


class ReplyLog(logging.Filter):
    """On Celery's tracer logger: "Task x[id] succeeded in 0.01s: 'taskloop failed: ...'" reads
    "failed in" (or "ignored in") instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, Mapping) and isinstance(record.msg, str) and " succeeded in " in record.msg:
            found = read(args.get("return_value"))
            if found is not None:
                record.msg = record.msg.replace(" succeeded in ", f" {found[0]} in ")
        return True


REPLY_LOG = ReplyLog()


def word_replies(**_: Any) -> None:
    """Put ReplyLog on Celery's tracer logger (Celery's after_setup_task_logger signal, and at once)."""
    logger = logging.getLogger("celery.app.trace")
    if REPLY_LOG not in logger.filters:
        logger.addFilter(REPLY_LOG)

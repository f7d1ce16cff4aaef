"""The worker's Celery consumer (Celery's ``worker_consumer`` setting names this class): Celery's
own, with taskloop's fix for messages Celery's handler chokes on (taskloop/celery_fixes/
consumer.py), and three things taskloop adds:

- a dropped message is logged with its headers quoted and escaped, and counted in the
  ``refused{reason="malformed"}`` metric;
- a task that is not taskloop's (Celery's built-ins included) is refused, logged escaped and
  counted in ``refused{reason="unknown task"}``;
- when the broker connection dies, the phases this worker had prefetched but not started are
  noted, so that they are sent again as soon as Redis answers (worker/recovery/outage.py) instead of
  after their lease: Celery drops those requests, and kombu restores their messages only after
  the visibility timeout.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker import state as worker_state

from taskloop.base.text import shown
from taskloop.celery_fixes.consumer import Consumer as FixedConsumer
from taskloop.ops.hooks import Refused
from taskloop.runtime.instruments import hooks
from taskloop.worker.recovery import census, outage

log = logging.getLogger("taskloop.consumer")


class Consumer(FixedConsumer):
    def on_unhandled_message(self, message: Any, exc: Exception) -> None:
        headers = message.headers if isinstance(getattr(message, "headers", None), dict) else {}
        log.error("malformed task message dropped: %s: %s (task %s, id %s, content type %s, %s bytes)",
                  type(exc).__name__, shown(str(exc)), shown(headers.get("task")), shown(headers.get("id")),
                  shown(getattr(message, "content_type", None)), len(getattr(message, "body", b"") or b""))
        hooks().delivery_refused(Refused("malformed"))

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        """A task name this worker does not run (not taskloop's: Celery's built-in tasks are
        unregistered too, worker/app.py): refused, logged escaped and counted."""
        headers = message.headers if isinstance(getattr(message, "headers", None), dict) else {}
        log.error("refused a task that is not taskloop's: %s (id %s); only taskloop.* tasks run here",
                  shown(headers.get("task")), shown(headers.get("id")))
        hooks().delivery_refused(Refused("unknown task"))
        super().on_unknown_task(body, message, exc)

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        """The broker connection died: Celery is about to drop the phases this worker had prefetched
        (reserved, or waiting for a retry countdown) but not started. Note them, so that they are
        sent again as soon as Redis answers (worker/recovery/outage.py) instead of after their lease."""
        running = set(worker_state.active_requests)
        held = [r for r in (*worker_state.reserved_requests, *worker_state.scheduled_requests) if r not in running]
        lost = outage.phases_of(held)
        if lost:
            log.warning("broker connection lost holding %d prefetched phase(s); they are sent again once Redis "
                        "is back", len(lost))
            outage.LOST.note(lost)
        census.WANTED.set()  # a message Redis popped for this connection may be lost: count them (recovery/census.py)
        super().on_connection_error_after_connected(exc)

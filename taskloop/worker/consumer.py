"""The worker's Celery consumer: a task message that Celery's own handler chokes on is dropped with
one log line; it never stops the worker.

Seen with celery 5.7.0 (found by tests/fuzz/test_fuzz_messages.py): a task message whose JSON body
is a scalar (an empty body, ``5``, ``null``, ``"x"``) passes Celery's decoding and then raises
TypeError in the task strategy (``'args' not in message.payload``). The consumer does not catch
it: the worker stops with "Unrecoverable error", restores the message to the queue as it shuts
down, and the message stops the next worker that takes it, and the next. Anyone who can publish
to the broker could stop the whole fleet with one message.

`Consumer` wraps Celery's handler of task messages: an exception Celery does not handle itself
(it handles unknown tasks, content it refuses and bodies it cannot decode) is logged on one line
and the message is acknowledged, as Celery does with a body it cannot decode. Connection errors
still propagate: recovering from them is Celery's job. ``register`` (tasks.py) makes it the
worker's consumer (Celery's ``worker_consumer`` setting).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

from taskloop import metrics

log = logging.getLogger("taskloop.consumer")


class Consumer(CeleryConsumer):  # type: ignore[misc]  # Celery is untyped
    def create_task_handler(self, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
        handle = super().create_task_handler(*args, **kwargs)
        connection_errors = tuple(self.connection_errors)

        def on_task_received(message: Any) -> Any:
            try:
                return handle(message)
            except connection_errors:
                raise
            except Exception as exc:
                drop(message, exc, connection_errors)
                return None

        return on_task_received


def drop(message: Any, exc: Exception, connection_errors: tuple[type[BaseException], ...]) -> None:
    """Log a message that could not be handled, on one line, and acknowledge it."""
    from taskloop.worker.tasks import untrusted

    headers = message.headers if isinstance(getattr(message, "headers", None), dict) else {}
    log.error("malformed task message dropped: %s: %s (task %s, id %s, content type %s, %s bytes)",
              type(exc).__name__, untrusted(str(exc)), untrusted(headers.get("task")), untrusted(headers.get("id")),
              untrusted(getattr(message, "content_type", None)), len(getattr(message, "body", b"") or b""))
    metrics.refused("malformed")
    if getattr(message, "acknowledged", False):
        return
    try:
        message.ack()
    except connection_errors:
        log.warning("could not acknowledge the dropped message (the broker is away); it may come back")

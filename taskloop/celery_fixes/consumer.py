"""Celery's worker consumer, as a subclass with one fix: a task message that Celery's own handler
chokes on is dropped with one log line, never fatal (Celery's ``worker_consumer`` setting names
taskloop/worker/consumer.py, which builds on this). Checked against celery 5.7.0; the upstream
report is in docs/upstream.md.

Found by tests/fuzz/test_fuzz_messages.py: a task message whose JSON body is a scalar (an empty
body, ``5``, ``null``, ``"x"``) passes Celery's decoding and then raises TypeError in the task
strategy (``'args' not in message.payload``). The consumer does not catch it: the worker stops
with "Unrecoverable error", restores the message to the queue as it shuts down, and the message
stops the next worker that takes it, and the next. Anyone who can publish to the broker could
stop the whole fleet with one message.

Here the handler of task messages catches what Celery does not handle itself (it handles
unknown tasks, content it refuses and bodies it cannot decode), logs it on one line and
acknowledges the message, as Celery does with a body it cannot decode. Connection errors still
propagate: recovering from them is Celery's job.

``probe()`` says whether Celery's task strategy still raises on a scalar body.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery.worker import strategy
from celery.worker.consumer import Consumer as CeleryConsumer

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
                self.on_unhandled_message(message, exc)
                self._acknowledge(message, connection_errors)
                return None

        return on_task_received

    def on_unhandled_message(self, message: Any, exc: Exception) -> None:
        """A message Celery's handler could not take (logged here; subclasses count it too)."""
        log.error("malformed task message dropped: %s", type(exc).__name__)

    @staticmethod
    def _acknowledge(message: Any, connection_errors: tuple[type[BaseException], ...]) -> None:
        if getattr(message, "acknowledged", False):
            return
        try:
            message.ack()
        except connection_errors:
            log.warning("could not acknowledge the dropped message (the broker is away); it may come back")


def scalar_body_raises() -> bool:
    """Whether Celery's default task strategy raises on a message whose body is a scalar."""
    app = Celery("probe", set_as_current=False)

    @app.task(name="probe.task")  # type: ignore[untyped-decorator]
    def task() -> None:
        """A task to build the strategy for."""

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    consumer = types.SimpleNamespace(
        hostname="probe@localhost", connection_errors=(), event_dispatcher=None, timer=types.SimpleNamespace(
            call_at=noop), apply_eta_task=noop, disable_rate_limits=True, task_buckets={}, on_task_request=noop,
        _limit_task=noop, _limit_post_eta=noop, pool=types.SimpleNamespace(apply_async=noop),
        controller=types.SimpleNamespace(state=types.SimpleNamespace(revoked=set())))
    message = types.SimpleNamespace(payload=5, body=b"5", headers={"task": "probe.task", "id": "probe"},
                                    content_type="application/json", content_encoding="utf-8",
                                    delivery_info={}, properties={}, acknowledged=False)
    try:
        handler = strategy.default(task, app, consumer)
    except Exception:
        return False  # the strategy cannot be built this way any more: look at Celery's code
    try:
        handler(message, None, noop, noop, [])
    except TypeError:
        return True
    except Exception:
        return False
    return False


def probe() -> dict[str, bool]:
    return {"a scalar message body stops the worker": scalar_body_raises()}

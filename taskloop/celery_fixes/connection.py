"""The broker connection class of taskloop's Celery app (Celery's ``amqp`` class, whose
``Connection`` it names): how a connection is re-established. Checked against celery 5.7.0 and
kombu 5.7.0; the upstream report is in docs/upstream.md.

Celery's consumer reconnects through ``Connection.ensure_connection`` with kombu's default
intervals, 2, 4, 6 ... up to 30 s between attempts, and offers no setting to change them. So a
Redis that is back waited up to 30 s for its workers (about 10 s after a 12 s outage, measured,
docs/reliability.md). Here ``ensure_connection`` defaults to trying every 0.5 s, then at most every
2 s; a caller that passes its own intervals keeps them.

``probe()`` says whether Celery's consumer still reconnects at kombu's default intervals.
"""

from __future__ import annotations

import inspect
from typing import Any

from celery.app.amqp import AMQP as CeleryAMQP
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.connection import Connection

from taskloop.celery_fixes.transport import SENTINEL_TRANSPORT, TRANSPORT

SCHEMES = {TRANSPORT: "redis", SENTINEL_TRANSPORT: "sentinel"}  # taskloop's transports, by the scheme they serve
RECONNECT_START_S = 0.5
RECONNECT_STEP_S = 0.5
RECONNECT_MAX_S = 2.0


class BrokerConnection(Connection):
    """kombu's Connection with taskloop's reconnect intervals as the defaults of ``ensure_connection``.

    Its URL names the scheme of the transport's kind (``redis``, ``rediss``, ``sentinel``) rather
    than the class path of taskloop's transport (transport.py), so that what reads it (the
    worker's "Connected to" line, Flower's broker view) sees the Redis it is."""

    def info(self) -> dict[str, Any]:
        found: dict[str, Any] = super().info()  # type: ignore[no-untyped-call]
        scheme = SCHEMES.get(str(found.get("transport")))
        if scheme is not None:
            found["transport"] = "rediss" if scheme == "redis" and self.ssl else scheme
        return found

    def ensure_connection(self, errback: Any = None, max_retries: int | None = None,
                          interval_start: float = RECONNECT_START_S, interval_step: float = RECONNECT_STEP_S,
                          interval_max: float = RECONNECT_MAX_S, **kwargs: Any) -> Any:
        return super().ensure_connection(errback, max_retries, interval_start,  # type: ignore[no-untyped-call]
                                         interval_step, interval_max, **kwargs)


class AMQP(CeleryAMQP):  # type: ignore[misc]  # Celery is untyped
    """Celery's AMQP part of the app, making broker connections of ``BrokerConnection``."""

    Connection = BrokerConnection


def slow_reconnects() -> bool:
    """Whether Celery's consumer reconnects at kombu's default intervals (up to 30 s apart)."""
    defaults = inspect.signature(Connection._ensure_connection).parameters
    slow = defaults["interval_max"].default > RECONNECT_MAX_S
    try:
        passes_intervals = "interval_max" in inspect.getsource(CeleryConsumer.ensure_connected)
    except (OSError, TypeError):
        passes_intervals = False
    return slow and not passes_intervals


def probe() -> dict[str, bool]:
    return {"the consumer reconnects at intervals up to 30 s": slow_reconnects()}

"""The outbox: Celery messages published inside the write that dispatches them.

When the broker is the same Redis as the store, the Redis commands that publish a phase's Celery
message (kombu's ``LPUSH`` onto the queue list) run inside the compare-and-set that records the
phase as queued. A phase is then never recorded as queued without its message, nor sent for a
plan that was not written, and the send costs no round trip of its own.

The ``Builder`` builds the messages itself, as Celery and kombu would. What it does not build
(a countdown, ``task_routes``, a queue with priorities or an expiry ...) Celery and kombu build as
usual: ``send_task`` inside kombu's publish batch, whose session, given by taskloop's transport
channel, keeps the final Redis commands instead of running them
(taskloop/celery_fixes/outbox.py ``collect``). Any other broker (another Redis, RabbitMQ,
Sentinel) gets the messages the ordinary way, right after the write (``folds`` is False).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from celery.utils.nodenames import anon_nodename
from kombu.utils.uuid import uuid

from taskloop.base import clock
from taskloop.connections import urls
from taskloop.core import reads

DELIVERY_MODE = 2  # kombu's PERSISTENT_DELIVERY_MODE: Celery's default for its queues


def same_redis(broker_url: str, store_url: str) -> bool:
    """Whether the broker is the very Redis (host, port, db, TLS) the store writes to, as the same
    ACL user (never for Sentinel or Cluster: see taskloop/connections/urls.py)."""
    return urls.same_redis(broker_url, store_url)


class Builder:
    """Celery messages built directly, for the outbox: the message Celery's ``send_task`` and kombu's
    Redis transport would push (protocol 2: headers, properties, a base64 JSON body, in kombu's
    envelope), without the routing, serialization registry and publish machinery they go through
    per message (about a third of what a phase cost its pool process).
    ``tests/integration/test_outbox_builder.py`` compares every field with what Celery and kombu
    themselves produce.

    Used only where the result is certainly the same: protocol 2, JSON, no compression, no
    ``task_routes``, a plain direct queue (no priority, no expiry, no arguments) and no countdown;
    anything else goes through ``send_task`` (``push`` returns None; then celery_fixes/outbox.py
    ``collect``)."""

    def __init__(self, app: Any) -> None:
        conf = app.conf
        self.app = app
        self.usable = (conf.task_protocol == 2 and conf.task_serializer == "json" and not conf.task_compression
                       and not conf.task_routes and conf.task_default_priority is None)
        self._queues: dict[str, tuple[str, int] | None] = {}
        self._origin_of: tuple[int, str] = (0, "")

    def _queue(self, name: str) -> tuple[str, int] | None:
        """The routing key and delivery mode of a plain direct queue (None: not one)."""
        if name not in self._queues:
            queue = self.app.amqp.queues[name]
            exchange = queue.exchange
            plain = (getattr(exchange, "type", "direct") == "direct" and not queue.expires
                     and not queue.max_priority and not queue.queue_arguments and not queue.message_ttl)
            mode = getattr(exchange, "delivery_mode", None) or DELIVERY_MODE
            self._queues[name] = (name, int(mode)) if plain else None
        return self._queues[name]

    def push(self, task: str, args: list[Any], shadow: str, argsrepr: str, queue: str | None,
             countdown: float | None = None, carry: bool = False,
             extra: dict[str, str] | None = None) -> tuple[str, str] | None:
        """(the queue's list, the payload to LPUSH), or None when this message needs send_task.
        ``carry``: the message gets the headers of one that carries fields (core/reads.py), its
        values left null for cas.lua to fill in; ``extra``: headers of the hooks (``traceparent``),
        as ``send_task(headers=...)`` adds them."""
        if not self.usable or countdown:
            return None
        found = self._queue(queue or self.app.conf.task_default_queue)
        if found is None:
            return None
        routing_key, delivery_mode = found
        task_id = str(uuid())
        parent = self.app.current_worker_task
        parent_id = root_id = None
        if parent is not None and parent.request.id:
            parent_id = parent.request.id
            root_id = parent.request.root_id or parent_id
        headers: dict[str, Any] = {
            "lang": "py", "task": task, "id": task_id, "shadow": shadow, "eta": None, "expires": None,
            "group": None, "group_index": None, "retries": 0, "timelimit": [None, None],
            "root_id": root_id or task_id, "parent_id": parent_id, "argsrepr": argsrepr, "kwargsrepr": "{}",
            "origin": self._origin(), "ignore_result": True, "replaced_task_nesting": 0,
            "stamped_headers": None, "stamps": {},
        }
        if extra:
            headers.update(extra)
        if carry:
            headers[reads.QUEUED_AT_HEADER] = clock.now()
            headers[reads.CARRY_HEADER] = None
        body = json.dumps([args, {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}],
                          separators=(",", ":"))
        message = {
            "body": base64.b64encode(body.encode()).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": {
                "correlation_id": task_id, "reply_to": self.app.thread_oid, "argsrepr": argsrepr,
                "delivery_mode": delivery_mode, "delivery_info": {"exchange": "", "routing_key": routing_key},
                "priority": 0, "body_encoding": "base64", "delivery_tag": str(uuid()),
            },
        }
        return routing_key, json.dumps(message, separators=(",", ":"))

    def _origin(self) -> str:
        pid = os.getpid()
        if self._origin_of[0] != pid:  # the name has the process id in it: a forked pool process has its own
            self._origin_of = (pid, str(anon_nodename()))
        return self._origin_of[1]

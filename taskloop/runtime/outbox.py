"""The outbox: Celery messages published inside the write that dispatches them.

When the broker is the same Redis as the store, the Redis commands that publish a phase's Celery
message (kombu's ``LPUSH`` onto the queue list) run inside the compare-and-set that records the
phase as queued. A phase is then never recorded as queued without its message, nor sent for a
plan that was not written, and the send costs no round trip of its own.

The messages are built by Celery and kombu as usual: ``send_task`` inside kombu's publish batch
(``Producer.batch()``), whose transport-level session collects the final Redis commands instead
of running them. Any other broker (another Redis, RabbitMQ, Sentinel) gets the messages the
ordinary way, right after the write (``folds`` is False).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from typing import Any

from celery.utils.nodenames import anon_nodename
from kombu.utils.uuid import uuid

from taskloop.base import clock
from taskloop.base.errors import OutboxUnsupported
from taskloop.connections import urls
from taskloop.core import reads

# kombu commands the outbox may run inside cas.lua: the list push of a message and the expiry
# that kombu adds for queues declared with an expiry.
ALLOWED = frozenset({"lpush", "pexpire"})
DELIVERY_MODE = 2  # kombu's PERSISTENT_DELIVERY_MODE: Celery's default for its queues


class _Session:
    """A kombu publish-batch session that keeps the final Redis commands instead of sending them
    (the interface kombu's Producer.batch() drives: publish, add, flush, discard, close)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.commands: list[tuple[str, tuple[Any, ...]]] = []
        self._collecting: list[tuple[str, tuple[Any, ...]]] | None = None

    def publish(self, message: Any, **kwargs: Any) -> Any:
        commands: list[tuple[str, tuple[Any, ...]]] = []
        self._collecting = commands
        try:
            result = self.channel.basic_publish(message, _publish_batch=self, **kwargs)
        finally:
            self._collecting = None
        self.commands += commands
        return result

    def add(self, name: str, *args: Any) -> None:
        if self._collecting is None:
            raise RuntimeError("a publish command was added outside a publication")
        if name not in ALLOWED:
            raise OutboxUnsupported(f"the outbox cannot run {name!r} inside a script")
        self._collecting.append((name, args))

    def flush(self) -> None:
        """Nothing to do: the commands run inside the commit."""

    def discard(self) -> None:
        self.commands = []

    def close(self) -> None:
        """Nothing held."""


def same_redis(broker_url: str, store_url: str) -> bool:
    """Whether the broker is the very Redis (host, port, db, TLS) the store writes to, as the same
    ACL user (never for Sentinel or Cluster: see taskloop/connections/urls.py)."""
    return urls.same_redis(broker_url, store_url)


def collect(producer: Any, publish: Callable[[], None]) -> list[tuple[str, tuple[Any, ...]]]:
    """Run ``publish`` (Celery sends through ``producer``) and return the Redis commands it would
    have run, without running them."""
    channel = producer.channel
    batching = callable(getattr(channel, "create_publish_batch", None))
    if not batching or not getattr(channel, "supports_batch_publish", True):
        raise OutboxUnsupported("this transport publishes immediately; messages are sent after the write")
    session = _Session(channel)
    channel.create_publish_batch = lambda max_size: session
    try:
        with producer.batch():
            publish()
    finally:
        del channel.create_publish_batch
    return session.commands


class Builder:
    """Celery messages built directly, for the outbox: the message Celery's ``send_task`` and kombu's
    Redis transport would push (protocol 2: headers, properties, a base64 JSON body, in kombu's
    envelope), without the routing, serialization registry and publish machinery they go through
    per message (about a third of what a phase cost its pool process). ``tests/unit/test_outbox.py``
    compares every field with what Celery and kombu themselves produce.

    Used only where the result is certainly the same: protocol 2, JSON, no compression, no
    ``task_routes``, a plain direct queue (no priority, no expiry, no arguments) and no countdown;
    anything else goes through ``send_task`` (``push`` returns None)."""

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
             countdown: float | None = None, carry: bool = False) -> tuple[str, str] | None:
        """(the queue's list, the payload to LPUSH), or None when this message needs send_task.
        ``carry``: the message gets the headers of one that carries fields (core/reads.py), its
        values left null for cas.lua to fill in."""
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

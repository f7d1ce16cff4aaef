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

from collections.abc import Callable
from typing import Any

from taskloop.base.errors import OutboxUnsupported
from taskloop.connections import urls

# kombu commands the outbox may run inside cas.lua: the list push of a message and the expiry
# that kombu adds for queues declared with an expiry.
ALLOWED = frozenset({"lpush", "pexpire"})


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

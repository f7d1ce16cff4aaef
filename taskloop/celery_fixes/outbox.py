"""The kombu side of the outbox (taskloop/runtime/outbox.py): the Redis commands with which
Celery's ``send_task`` would publish its messages, handed over instead of run, for the store's
script to run inside the write that queues their phases. Not a fix but an extension, through the
extension point of transport.py (the channel class of taskloop's ``broker_transport``). Checked
against celery 5.7.0 and kombu 5.7.0.

Inside ``Producer.batch()`` kombu asks the channel for a publish session
(``create_publish_batch``) and publishes through it; kombu's Redis channel hands each message's
final commands (``LPUSH`` onto the queue's list, ``PEXPIRE`` for a queue declared with an expiry)
to that session, which runs them in a pipeline. While ``collect`` runs, taskloop's channel
(``Collecting``) gives kombu a session that keeps them instead. The outbox's ``Builder`` builds
most messages itself; this is for the rest (a countdown, ``task_routes``, a queue with priorities
or an expiry ...).

``hands_over_commands()`` says whether kombu still does that, on a channel without Redis that
runs no command. ``collect`` asks it once per channel class before relying on it and refuses
(``OutboxUnsupported``: the messages are then sent after the write) when it does not hold;
``python -m taskloop.celery_fixes`` prints it.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import kombu
import redis
from kombu.messaging import Producer

from taskloop.base.errors import OutboxUnsupported

# kombu commands the outbox may run inside cas.lua: the list push of a message and the expiry
# that kombu adds for queues declared with an expiry.
ALLOWED = frozenset({"lpush", "pexpire"})
Commands = list[tuple[str, tuple[Any, ...]]]


class _Session:
    """A kombu publish-batch session that keeps the final Redis commands instead of sending them
    (the interface kombu's Producer.batch() drives: publish, add, flush, discard, close)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.commands: Commands = []
        self._collecting: Commands | None = None

    def publish(self, message: Any, **kwargs: Any) -> Any:
        commands: Commands = []
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


class Collecting:
    """What taskloop's Redis channels add to kombu's (a mixin in front of kombu's Channel): while
    ``collecting`` holds a session, kombu's publish batch gets that session."""

    supports_batch_publish: bool  # kombu's
    _taskloop_outbox: _Session | None = None

    def create_publish_batch(self, max_size: int) -> Any:
        if self._taskloop_outbox is not None:
            return self._taskloop_outbox
        return super().create_publish_batch(max_size)  # type: ignore[misc]

    @contextmanager
    def collecting(self, session: _Session) -> Iterator[None]:
        self._taskloop_outbox = session
        try:
            yield
        finally:
            self._taskloop_outbox = None


def collect(producer: Any, publish: Callable[[], None]) -> Commands:
    """Run ``publish`` (Celery sends through ``producer``) and return the Redis commands it would
    have run, without running them."""
    channel = producer.channel
    if not isinstance(channel, Collecting) or not channel.supports_batch_publish:
        raise OutboxUnsupported("this transport publishes immediately; messages are sent after the write")
    kind: Any = type(channel)
    if not _holds(kind):
        raise OutboxUnsupported(
            f"kombu {kombu.__version__} no longer hands the Redis commands of a batched publish to the "
            "channel's session (taskloop/celery_fixes/outbox.py, hands_over_commands)")
    return _collect(channel, producer, publish)


def _collect(channel: Any, producer: Any, publish: Callable[[], None]) -> Commands:
    session = _Session(channel)
    with channel.collecting(session), producer.batch():
        publish()
    return session.commands


class _NoRedis:
    """A redis client that runs nothing: any command fails (the check sends none)."""

    def __init__(self, connection_pool: Any = None, **kwargs: Any) -> None:
        self.connection_pool = connection_pool

    def __getattr__(self, name: str) -> Any:
        raise redis.exceptions.ConnectionError(f"the outbox check runs no Redis command ({name})")


def offline_channel(channel_class: Any) -> Any:
    """A channel of ``channel_class`` without Redis: any command it would run fails."""
    channel = channel_class.__new__(channel_class)  # no __init__: no Redis, no pools
    channel._pool = types.SimpleNamespace(connection_kwargs={})
    channel.connection = types.SimpleNamespace(client=types.SimpleNamespace(transport_options={}))
    channel.Client = _NoRedis
    channel._expires = {}
    return channel


def hands_over_commands(channel_class: Any) -> bool:
    """Whether a message published inside kombu's ``Producer.batch()`` on a channel of
    ``channel_class`` comes to ``collect`` as its Redis commands, none of them run."""
    try:
        channel = offline_channel(channel_class)
        producer: Any = Producer(channel, auto_declare=False)  # type: ignore[no-untyped-call]
        commands = _collect(channel, producer,
                            lambda: producer.publish({"probe": 1}, routing_key="probe", serializer="json"))
    except Exception:
        return False  # it ran a command, or it cannot be tried this way any more: look at kombu's code
    return [(name, args[0]) for name, args in commands] == [("lpush", "probe")]


_holds = functools.cache(hands_over_commands)


def probe(channel_class: Any) -> dict[str, bool]:
    """For the installed kombu: does what the outbox relies on hold (True: it does)?"""
    return {"kombu's publish batch hands a message's Redis commands to the channel's session (the outbox)":
            hands_over_commands(channel_class)}

"""kombu's Redis transports, as subclasses with two fixes: what taskloop's Celery app names as
its ``broker_transport`` (taskloop/connections/broker.py), for ``redis://``, ``rediss://`` and
Sentinel brokers. Checked against kombu 5.7.0 and redis-py 8.1.0; upstream reports in
docs/upstream.md.

**A detached transport crashed the worker when Redis restarted.** A worker that holds an
unacknowledged message while its BRPOP is in flight exits for good when Redis goes away::

    Restoring 1 unacknowledged message(s)
    CRITICAL/MainProcess Unrecoverable error: AttributeError("'NoneType' object has no attribute 'hostname'")

On the connection error Celery's consumer calls ``connection.collect()``: closing the channels
there fails (it needs Redis), so the task channel stays half open, and ``collect()`` detaches the
transport (``transport.client = None``). Celery next calls ``connection.close()``, which closes
that channel again; restoring its unacknowledged message rebuilds the client pool through
``Channel._connparams``, which reads ``self.connection.client.hostname`` of the detached
transport. AttributeError is not a connection error, so nothing treats it as recoverable. Here
``_connparams`` of a channel whose transport is gone raises redis's ConnectionError instead:
every caller on these paths handles it (the restore is given up, the message stays in kombu's
``unacked`` hash, the consumer reconnects). Nothing is deleted, so no message is lost.

**A new redis client per command batch.** ``Channel.conn_or_acquire`` builds a new
``redis.Redis`` for every synchronous command batch: twice per message on a worker with
``acks_late`` and once per message sent. Each construction copies redis-py's table of about 170
response callbacks into a new dict: 0.25 ms of CPU, about half of what a worker's main process
spent per message (a profile of 500 loops, 3,000 phases). A ``redis.Redis`` over a connection
pool holds no connection and no per-call state, so the channel keeps one, and builds a new one
when kombu rebuilds its pool (after a reconnect).

Their channels also hand over the Redis commands of a publish for the outbox (outbox.py).

``probe()`` says, for the installed kombu, whether each cause is still there.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from kombu.transport import redis as kredis

from taskloop.celery_fixes.outbox import Collecting


class _Fixes:
    """What both channel classes add to kombu's (a mixin in front of kombu's Channel)."""

    connection: Any
    pool: Any

    def _connparams(self, asynchronous: bool = False) -> Any:
        transport = self.connection
        if transport is None or getattr(transport, "client", None) is None:
            raise redis.exceptions.ConnectionError(
                "this kombu Redis channel was closed or detached from its connection; not opening a new "
                "connection for it (its unacknowledged messages stay in the unacked hash)")
        return super()._connparams(asynchronous=asynchronous)  # type: ignore[misc]

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        pool = self.pool
        cached = self.__dict__.get("_taskloop_client")
        if cached is None or cached.connection_pool is not pool:
            cached = self._create_client()  # type: ignore[attr-defined]
            self.__dict__["_taskloop_client"] = cached
        yield cached


class Channel(_Fixes, Collecting, kredis.Channel):
    """kombu's Redis channel with taskloop's two fixes (and the outbox's collection)."""


class SentinelChannel(_Fixes, Collecting, kredis.SentinelChannel):
    """kombu's Sentinel channel with taskloop's two fixes (and the outbox's collection)."""


class Transport(kredis.Transport):
    """``redis://`` and ``rediss://`` brokers."""

    Channel = Channel


class SentinelTransport(kredis.SentinelTransport):
    """``sentinel://`` brokers."""

    Channel = SentinelChannel


TRANSPORT = f"{__name__}:Transport"
SENTINEL_TRANSPORT = f"{__name__}:SentinelTransport"


def detached_transport_crashes(channel_class: Any = kredis.Channel) -> bool:
    """Whether ``channel_class._connparams`` reads an attribute of a detached transport (the bug)."""
    channel = channel_class.__new__(channel_class)  # no __init__: no Redis, no pools
    for transport in (None, types.SimpleNamespace(client=None, default_port=kredis.DEFAULT_PORT)):
        channel.connection = transport
        try:
            channel._connparams()
        except AttributeError as exc:
            if "'NoneType' object has no attribute" in str(exc):
                return True
        except Exception:  # any other outcome: kombu handles a detached transport itself
            pass
    return False


def new_client_per_batch(channel_class: Any = kredis.Channel) -> bool:
    """Whether ``channel_class.conn_or_acquire`` builds a new redis client for each command batch."""
    channel = channel_class.__new__(channel_class)
    channel._pool = redis.ConnectionPool()  # never connects: no command is sent
    channel.connection = types.SimpleNamespace(client=types.SimpleNamespace(transport_options={}))
    channel.Client = redis.Redis
    try:
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            return first is not second
    except Exception:
        return False  # it cannot be tried this way any more: look at kombu's code
    finally:
        channel._pool.disconnect()


def probe() -> dict[str, bool]:
    """For the installed kombu: is each cause still there (True: the fix is still needed)?"""
    return {"detached transport crashes the worker": detached_transport_crashes(),
            "a new redis client per command batch": new_client_per_batch()}

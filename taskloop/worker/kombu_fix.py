"""A local fix for a kombu Redis-transport crash that ends a worker when Redis restarts.

Seen with kombu 5.7.0, celery 5.7.0 and redis-py 8.1.0: a worker that holds an unacknowledged
message while its BRPOP is in flight (a phase running, its prefetch window not full) exits for
good when Redis goes away::

    Restoring 1 unacknowledged message(s)
    CRITICAL/MainProcess Unrecoverable error: AttributeError("'NoneType' object has no attribute 'hostname'")

Cause. On the connection error, Celery's consumer calls ``connection.collect()``: closing the
channels there fails with a redis ``ConnectionError`` (the task channel first drains its pending
BRPOP reply, the control channel deletes its auto-delete queue; both need Redis), so the task
channel stays half open, and ``collect()`` then detaches the transport (``transport.client =
None``). Celery next calls ``connection.close()``, which closes that channel again; restoring its
unacknowledged message needs a Redis client, the pool is rebuilt by ``Channel._connparams``,
which reads ``self.connection.client.hostname`` of the detached transport. AttributeError is not
a connection error, so nothing treats it as recoverable and the worker stops.

Fix. ``Channel._connparams`` of a channel whose transport is gone raises redis's
ConnectionError instead. Every caller on these paths handles connection errors: the restore at
close is given up (the message stays in the Redis ``unacked`` hash, and kombu's visibility-time
restore puts it back), the close is finished, the consumer reconnects. A late ack through the
dead channel is logged ("Couldn't ack") and the message comes back after the visibility timeout;
for taskloop that is a duplicate delivery, which the fencing token refuses. Nothing is deleted
from Redis on these paths, so no message is lost.

``install()`` checks the installed kombu before patching: it calls the original method on a bare
channel whose transport is detached, and patches only if that raises the AttributeError of the
bug. It is idempotent. Worker start-up (taskloop/worker/app.py) calls it.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any

log = logging.getLogger("taskloop.kombu_fix")

_MARK = "_taskloop_detached_transport_fix"


def _channel_class() -> tuple[Any, Any]:
    try:
        from kombu.transport import redis as kredis
    except ImportError:  # pragma: no cover - kombu ships with celery[redis]
        return None, None
    return kredis, kredis.Channel


def _dereferences_none(kredis: Any, connparams: Any) -> bool:
    """Whether ``connparams`` reads an attribute of a detached transport (the bug)."""
    channel = kredis.Channel.__new__(kredis.Channel)  # no __init__: no Redis, no pools
    for transport in (None, types.SimpleNamespace(client=None, default_port=kredis.DEFAULT_PORT)):
        channel.connection = transport
        try:
            connparams(channel)
        except AttributeError as exc:
            if "'NoneType' object has no attribute" in str(exc):
                return True
        except Exception:  # any other outcome: kombu handles a detached transport itself
            pass
    return False


def installed() -> bool:
    _, channel = _channel_class()
    return bool(channel is not None and getattr(channel._connparams, _MARK, False))


def has_bug() -> bool:
    """Whether the installed kombu has the bug (checked on its own, unpatched method)."""
    kredis, channel = _channel_class()
    if channel is None:
        return False
    method = channel._connparams
    return _dereferences_none(kredis, getattr(method, "__wrapped__", method))


def install() -> bool:
    """Patch ``kombu.transport.redis.Channel._connparams`` if (and only if) it has the bug.
    Returns whether the fix is in place."""
    kredis, channel = _channel_class()
    if channel is None:
        return False
    if installed():
        return True
    original = channel.__dict__.get("_connparams")
    if original is None or not _dereferences_none(kredis, original):
        log.debug("kombu handles a detached Redis transport; no fix needed")
        return False
    connection_error = kredis.get_redis_ConnectionError()

    @functools.wraps(original)
    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        transport = self.connection
        if transport is None or getattr(transport, "client", None) is None:
            raise connection_error(
                "this kombu Redis channel was closed or detached from its connection; not opening a new "
                "connection for it (its unacknowledged messages stay in the unacked hash)")
        return original(self, asynchronous=asynchronous)

    setattr(_connparams, _MARK, True)
    channel._connparams = _connparams
    log.info("applied taskloop's fix for kombu's detached Redis transport (worker survives Redis restarts)")
    return True

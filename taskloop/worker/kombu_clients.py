"""One redis-py client per kombu channel, instead of a new one for every message.

Measured with kombu 5.7.0 and redis-py 8.1.0 (a profile of a worker running 500 loops, 3,000
phases): kombu's Redis transport builds a new ``redis.Redis`` object for every synchronous
command batch (``Channel.conn_or_acquire`` calls ``_create_client()`` each time): twice per
message on a worker with ``acks_late`` (parking it in the ``unacked`` hash when it arrives,
removing it when it is acknowledged) and once per message sent. Each construction copies
redis-py's table of about 170 response callbacks into a new case-insensitive dict: 0.25 ms of CPU,
about half of what a worker's main process spends per message.

A ``redis.Redis`` over a connection pool holds no connection and no per-call state (each command
takes a connection from the pool and gives it back), so one per channel is equivalent to one per
call. ``install()`` makes ``conn_or_acquire`` reuse the channel's client while the channel keeps
the same pool, and build a new one when kombu rebuilds the pool (after a reconnect). Nothing else
changes: the same commands on the same connections. Worker start-up (taskloop/worker/app.py)
calls it; ``TASKLOOP_KOMBU_CLIENTS=0`` leaves kombu as it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("taskloop.kombu_clients")

_MARK = "_taskloop_reused_client"
_ATTRIBUTE = "_taskloop_sync_client"


def installed() -> bool:
    from kombu.transport import redis as kredis

    return bool(getattr(kredis.Channel.conn_or_acquire, _MARK, False))


def install() -> bool:
    """Patch kombu's Redis channel (once). Returns whether the patch is in place."""
    if os.environ.get("TASKLOOP_KOMBU_CLIENTS", "1") == "0":
        return False
    from kombu.transport import redis as kredis

    if installed():
        return True
    if not callable(getattr(kredis.Channel, "_create_client", None)) or "pool" not in vars(kredis.Channel):
        log.debug("kombu's Redis channel has no _create_client/pool; left as it is")
        return False

    @contextmanager
    def conn_or_acquire(self: Any, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        pool = self.pool
        cached = self.__dict__.get(_ATTRIBUTE)
        if cached is None or cached.connection_pool is not pool:
            cached = self._create_client()
            self.__dict__[_ATTRIBUTE] = cached
        yield cached

    setattr(conn_or_acquire, _MARK, True)
    kredis.Channel.conn_or_acquire = conn_or_acquire  # type: ignore[method-assign]
    log.debug("kombu's Redis channels reuse one client each")
    return True

"""Messages whose worker is gone go back to their queue at once, not after kombu's visibility
timeout.

With ``acks_late``, kombu's Redis transport keeps every message a worker has taken and not yet
acknowledged in its ``unacked`` hash, scored in ``unacked_index`` by when it was taken, and puts
such a message back in its queue only after the visibility timeout (an hour: longer than the
longest phase). A worker that dies with its host (SIGKILL, out of memory, a lost node) held its
prefetched phases until their queued lease (``TASKLOOP_QUEUED_LEASE_S``, 300 s) and its running
ones until their running lease (``TASKLOOP_LEASE_S``, 30 s).

Every worker's heartbeat lists the ids of the messages it holds (worker/presence.py). A reconcile
pass reads the heartbeats, then the unacked messages taken before the oldest live heartbeat: one
that no live worker lists has no live holder, and kombu's own ``QoS.restore_by_tag`` puts it back
at the front of its queue (one transaction, guarded against an acknowledgement meanwhile). A
phase message that comes back this way is handled like any redelivery: it runs if its phase is
still queued under its token, it is replayed if the record shows it running on a worker that
fell silent (worker/recovery.py, ``execution_lost``), and it is refused as stale otherwise.

Which workers are live is decided from the heartbeats alone (runtime/fleet.py, ``holdings``): a
worker is gone when it fell silent while the others went on, and nothing is restored while the
whole fleet's heartbeats are old (the store itself was away).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from taskloop.base import clock
from taskloop.runtime.fleet import heartbeats, holdings
from taskloop.store.redis_store import RedisStore

log = logging.getLogger("taskloop.orphans")

PAGE = 1000  # unacked messages looked at per pass, oldest first


def message_id(raw: bytes | str) -> str | None:
    """The task id of an entry of kombu's ``unacked`` hash (``[payload, exchange, routing key]``)."""
    try:
        payload = json.loads(raw)[0]
        task_id = payload["headers"]["id"]
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return task_id if isinstance(task_id, str) else None


def restore_orphans(app: Any, store: RedisStore, now: float | None = None, limit: int = PAGE) -> int:
    """Put back in their queues the unacknowledged messages that no live worker holds; how many."""
    hold = holdings(heartbeats(store.workers_seen()), clock.now() if now is None else now)
    if hold.before is None:
        return 0
    restored = 0
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        qos = channel.qos
        with channel.conn_or_acquire() as client:
            tags = client.zrangebyscore(qos.unacked_index_key, "-inf", hold.before, start=0, num=limit)
            if not tags:
                return 0
            for tag, raw in zip(tags, client.hmget(qos.unacked_key, tags), strict=True):
                if raw is None:
                    continue  # acknowledged since
                task_id = message_id(raw)
                if task_id is None or task_id in hold.held:
                    continue
                qos.restore_by_tag(tag, client=client)
                restored += 1
    if restored:
        log.warning("gave %d message(s) back to their queues: no live worker holds them (their worker fell "
                    "silent; silent now: %s)", restored, ", ".join(sorted(hold.silent)[:10]) or "none listed")
    return restored

"""The kombu transport fix (taskloop/celery_fixes/transport.py), at kombu's own level: a Redis connection that is
collected and then closed after Redis died, while it holds an unacknowledged message — exactly
what Celery's consumer does on a connection error — must not raise, and the message must stay
recoverable. Real redis-server, killed with SIGKILL and restarted from its AOF; no mocks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Queue
from kombu.transport import redis as kredis

from taskloop.celery_fixes import transport
from taskloop.ops.embedded import RedisServer

FIXED = transport.TRANSPORT  # what taskloop's app names as its broker_transport


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[RedisServer]:
    found = RedisServer(tmp_path).start()
    yield found
    found.stop()


def _hold_one_unacked_message(url: str, transport_class: str | None = FIXED) -> tuple[Connection, Any]:
    """A consumer with one delivered, unacknowledged message and its next BRPOP in flight, plus a
    second channel with an auto-delete fanout queue (Celery's control channel)."""
    work = Queue("work", Exchange("work", "direct"), "work")
    control = Queue("ctl.q", Exchange("ctl", "fanout"), auto_delete=True)
    with Connection(url) as publisher:
        publisher.Producer().publish({"n": 1}, exchange=work.exchange, routing_key="work", declare=[work],
                                     serializer="json")
    conn = Connection(url, transport=transport_class)
    received: list[Any] = []
    consumer = Consumer(conn.default_channel, [work], accept=["json"],
                        callbacks=[lambda body, message: received.append(message)])
    consumer.qos(prefetch_count=2)  # room for one more: a BRPOP stays pending
    consumer.consume()
    Consumer(conn.channel(), [control], accept=["json"], callbacks=[]).consume()
    deadline = time.monotonic() + 5
    while not received and time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=1)
        except TimeoutError:
            pass
    for _ in range(10):  # drain the subscribe replies until idle, leaving the next BRPOP in flight
        try:
            conn.drain_events(timeout=0.3)
        except TimeoutError:
            break
    assert len(received) == 1 and conn.default_channel._in_poll
    return conn, received[0]


def _collect_and_close(conn: Connection) -> None:
    """celery.worker.consumer.Consumer.on_connection_error_after_connected, kombu calls only."""
    conn.collect(socket_timeout=5.0)
    conn.close()


def test_the_installed_kombu_crashes_without_the_fix(server: RedisServer) -> None:
    if not transport.detached_transport_crashes():
        pytest.skip("this kombu handles a detached transport itself: the fix is not needed any more")
    conn, _ = _hold_one_unacked_message(server.url, transport_class=None)  # kombu's own Redis transport
    server.kill()
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'hostname'"):
        _collect_and_close(conn)


def test_with_the_fix_the_close_goes_through_and_the_message_is_kept(server: RedisServer) -> None:
    conn, message = _hold_one_unacked_message(server.url)
    assert isinstance(conn.default_channel, transport.Channel)
    server.kill()
    _collect_and_close(conn)  # kombu 5.7.0 without the fix: AttributeError 'hostname'
    # nothing was lost: after a restart from the AOF the message is still parked as unacknowledged
    server.start()
    probe = redis.Redis(port=server.port)
    assert probe.hexists("unacked", message.delivery_tag) and probe.llen("work") == 0
    # and kombu's visibility-time restore puts it back on its queue
    with Connection(server.url, transport_options={"visibility_timeout": 0.5}) as again:
        time.sleep(0.6)
        again.default_channel.qos.restore_visible(num=10, interval=1)
    assert not probe.hexists("unacked", message.delivery_tag) and probe.llen("work") == 1
    probe.close()


def test_the_fix_patches_nothing() -> None:
    """kombu's own class is left as it is: the fix is a subclass the app names."""
    assert transport.detached_transport_crashes(kredis.Channel) == transport.detached_transport_crashes()
    assert not transport.detached_transport_crashes(transport.Channel)
    assert kredis.Transport.Channel is kredis.Channel

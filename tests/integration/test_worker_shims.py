"""The two speed shims a worker installs, at Celery's and kombu's own level, on a real redis-server:

- kombu_clients: a channel reuses one redis client for its command batches (kombu builds a new
  one per message), and builds a new one when kombu rebuilds its pool; messages still flow and
  unacknowledged messages are still parked and cleared;
- light_failures: Celery's tracer gets frame-less exception info for taskloop's PhaseFailed and
  Refused, and billiard's full one (frames and traceback) for any other exception.

The end-to-end behaviour (Flower's FAILURE with the error, IGNORED with the reason) is covered by
tests/integration/test_flower.py on workers that run with both shims."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator

import pytest
from billiard.einfo import ExceptionInfo
from kombu import Connection, Exchange, Queue

from taskloop.embedded import RedisServer
from taskloop.worker import kombu_clients, light_failures
from taskloop.worker.tasks import PhaseFailed, Refused


@pytest.fixture()
def patched() -> Iterator[None]:
    from celery.app import trace
    from kombu.transport import redis as kredis

    original_conn, original_einfo = kredis.Channel.conn_or_acquire, trace.ExceptionInfo
    assert kombu_clients.install() and light_failures.install(PhaseFailed, Refused)
    yield
    kredis.Channel.conn_or_acquire = original_conn  # type: ignore[method-assign]
    trace.ExceptionInfo = original_einfo


def test_a_channel_reuses_one_client_and_messages_still_flow(redis_server: RedisServer, patched: None) -> None:
    queue = Queue("shim-probe", Exchange("shim-probe", "direct"), "shim-probe")
    with Connection(redis_server.url) as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
        producer = conn.Producer()
        for n in range(3):
            producer.publish({"n": n}, exchange=queue.exchange, routing_key="shim-probe", declare=[queue],
                             serializer="json")
        simple = conn.SimpleQueue(queue)
        got = []
        for _ in range(3):
            message = simple.get(timeout=5)
            assert channel.client.hlen(channel.unacked_key) == 1  # parked until the ack
            got.append(message.payload["n"])
            message.ack()
        simple.close()
        assert got == [0, 1, 2]
        assert channel.client.hlen(channel.unacked_key) == 0  # parked and cleared through the reused client
        # kombu rebuilds its pool after a reconnect: the channel then builds a new client on it
        with channel.conn_or_acquire() as before:
            pass
        channel._pool = None
        with channel.conn_or_acquire() as after:
            assert after is not before and after.connection_pool is channel.pool
            assert after.ping()


def _info_for(exc: BaseException) -> ExceptionInfo:
    from celery.app import trace

    try:
        raise exc
    except BaseException:
        return trace.ExceptionInfo(sys.exc_info())


def test_expected_failures_get_light_exception_info_and_others_the_full_one(patched: None) -> None:
    light = _info_for(PhaseFailed("LoopTaskExhausted: Loop task fix exhausted its 3 rounds"))
    assert light.tb is None
    assert light.traceback == "PhaseFailed: LoopTaskExhausted: Loop task fix exhausted its 3 rounds\n"
    assert light.exception.exc.args == ("LoopTaskExhausted: Loop task fix exhausted its 3 rounds",)
    assert len(pickle.dumps(light)) < 1_000  # what a pool process sends to the main process
    refused = _info_for(Refused("stale: message for run round 1 token 0 does not match the record"))
    assert refused.tb is None and refused.traceback.startswith("Refused: stale:")
    full = _info_for(ValueError("a bug"))
    assert full.tb is not None and "Traceback (most recent call last)" in full.traceback
    assert "_info_for" in full.traceback

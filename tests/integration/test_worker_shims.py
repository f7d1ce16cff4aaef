"""Two of taskloop's fixes at kombu's and Celery's own level, on a real redis-server:

- the transport (taskloop/celery_fixes/transport.py): a channel reuses one redis client for its
  command batches (kombu builds a new one per message), and builds a new one when kombu rebuilds
  its pool; messages still flow and unacknowledged messages are still parked and cleared;
- replies (taskloop/worker/execution/replies.py): an expected failure or a refusal is a reply, not an
  exception, so Celery's tracer builds no exception info for it, and the reply is announced as
  task-failed or task-ignored, and logged as "failed in" or "ignored in".

The end-to-end behaviour (Flower's FAILURE with the error, IGNORED with the reason) is covered by
tests/integration/test_flower.py."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from kombu import Connection, Exchange, Queue

from taskloop.celery_fixes import transport
from taskloop.ops.embedded import RedisServer
from taskloop.worker.execution import replies


def test_a_channel_reuses_one_client_and_messages_still_flow(redis_server: RedisServer) -> None:
    queue = Queue("shim-probe", Exchange("shim-probe", "direct"), "shim-probe")
    with Connection(redis_server.url, transport=transport.TRANSPORT) as conn:
        channel = conn.default_channel
        assert isinstance(channel, transport.Channel)
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
    with Connection(redis_server.url) as plain:  # kombu's own channel: a new client every time
        with plain.default_channel.conn_or_acquire() as first, plain.default_channel.conn_or_acquire() as second:
            assert first is not second


def test_an_expected_failure_is_a_reply_that_builds_no_exception_info(monkeypatch: Any) -> None:
    from celery.app import trace

    built: list[Any] = []
    real = trace.ExceptionInfo
    monkeypatch.setattr(trace, "ExceptionInfo", lambda *a, **k: built.append(a) or real(*a, **k))  # count them
    app = Celery("replies", set_as_current=False)
    app.conf.task_always_eager = True  # the tracer only: no broker, no worker (what is measured is the tracer)

    @app.task(name="replies.fails")  # type: ignore[untyped-decorator]
    def fails() -> str:
        return replies.failed("LoopTaskExhausted: Loop task fix exhausted its 3 rounds")

    @app.task(name="replies.raises")  # type: ignore[untyped-decorator]
    def raises() -> str:
        raise ValueError("a real bug")

    assert replies.read(fails.apply().get()) == ("failed", "LoopTaskExhausted: Loop task fix exhausted its 3 rounds")
    assert built == []  # no exception info for the expected failure
    raises.apply()
    assert len(built) == 1  # and the full one for a real exception


def test_a_reply_is_announced_and_logged_as_what_it_is() -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    class Eventer:
        enabled = True

        def send(self, type: str, **fields: Any) -> None:
            sent.append((type, fields))

    request = replies.PhaseRequest.__new__(replies.PhaseRequest)
    request._eventer = Eventer()
    request._task = type("T", (), {"send_events": True})()
    request.id = "x"
    for result in ("'taskloop failed: ValueError: boom'", replies.ignored("stale: token 0 of 3"), "'committed'"):
        request.send_event("task-succeeded", result=result, runtime=0.01)
    assert [(t, f.get("exception")) for t, f in sent] == [
        ("task-failed", "ValueError: boom"), ("task-ignored", "stale: token 0 of 3"), ("task-succeeded", None)]
    record = logging.LogRecord("celery.app.trace", logging.INFO, "", 0,
                               "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s",
                               None, None)
    record.args = {"name": "core.fix.check", "id": "x", "runtime": 0.01,
                   "return_value": "'taskloop failed: LoopTaskExhausted: Loop task fix exhausted its 3 rounds'"}
    replies.ReplyLog().filter(record)
    assert record.getMessage().startswith("Task core.fix.check[x] failed in 0.01s: 'taskloop failed: LoopTask")

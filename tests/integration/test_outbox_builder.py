"""The outbox builds phase messages itself (runtime/outbox.py ``Builder``): each one must be the
message Celery's ``send_task`` and kombu's Redis transport would push, field by field (ids and
delivery tags aside). Real redis-server: kombu's channel needs one."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from taskloop.base.config import Settings
from taskloop.celery_fixes import transport
from taskloop.celery_fixes.outbox import collect
from taskloop.core.begin import Dispatch
from taskloop.core.limits import Waiter
from taskloop.core.states import Phase
from taskloop.define.tasks import define_task
from taskloop.define.workflow import Workflow
from taskloop.ops.embedded import RedisServer
from taskloop.runtime import outbox
from taskloop.runtime.celery_app import PhaseSender, make_app, messages_of

ONE = Workflow(name="outbox-test", version="1", tasks=(define_task("a", run=lambda ctx: 1),
                                                       define_task("b", run=lambda ctx: 2, queue="elsewhere")))
IDS = ("id", "root_id", "correlation_id", "delivery_tag")


def _normal(payload: str) -> dict[str, Any]:
    message = json.loads(payload)
    for part in ("headers", "properties"):
        for name in IDS:
            if message[part].get(name) is not None:
                message[part][name] = "<id>"
    message["body"] = json.loads(base64.b64decode(message["body"]))
    return message


@pytest.mark.parametrize("dispatches", [
    [Dispatch("a", Phase.RUN, 1, 1)],
    [Dispatch("b", Phase.RUN, 2, 7)],
    [Dispatch("a", Phase.RUN, 1, 1)] * 40,  # 32 phases, then a taskloop.dispatch message of the rest
], ids=["default queue", "a task's own queue", "a fan-out"])
def test_a_built_message_is_the_one_celery_and_kombu_push(redis_server, dispatches: list[Dispatch]) -> None:
    app = make_app(Settings(redis_url=redis_server.url, broker_url=redis_server.url))
    sender = PhaseSender(app, redis_server.url)
    assert sender.folds and sender.builder.usable
    messages = messages_of(ONE, "run-1", dispatches)
    built = [sender.builder.push(m.task, m.args, m.shadow, m.argsrepr, m.queue, m.countdown) for m in messages]
    by_kombu = collect(sender._acquire(), lambda: sender._locked_send(messages))
    assert [name for name, _ in by_kombu] == ["lpush"] * len(messages)
    assert all(push is not None for push in built)
    assert [key for key, _ in built if key] == [args[0] for _, args in by_kombu]
    for (_, payload), (_, (_, kombu_payload)) in zip(built, by_kombu, strict=True):  # type: ignore[misc]
        assert _normal(payload) == _normal(kombu_payload)
    sender.close()


def test_a_countdown_or_a_routed_app_goes_through_celery(redis_server) -> None:
    app = make_app(Settings(redis_url=redis_server.url, broker_url=redis_server.url))
    builder = outbox.Builder(app)
    assert builder.push("taskloop.run", ["r", "a", 1, 1], "x.a.run", "r a round=1", None, countdown=2.0) is None
    app.conf.task_routes = {"taskloop.*": {"queue": "routed"}}
    assert outbox.Builder(app).push("taskloop.run", ["r", "a", 1, 1], "x.a.run", "r a round=1", None) is None


def test_a_message_the_builder_does_not_build_is_folded_from_celerys_own_send(tmp_path) -> None:
    """A countdown: Celery builds the message, taskloop's transport channel hands its commands over
    (celery_fixes/outbox.py) and runs none; nothing is set on the live channel. A Redis of its own,
    so that an empty queue means nothing was pushed."""
    import redis

    with RedisServer(tmp_path) as server:
        app = make_app(Settings(redis_url=server.url, broker_url=server.url))
        client = redis.Redis.from_url(server.url)
        sender = PhaseSender(app, server.url)
        try:
            commands = sender.fold(ONE, "run-1", [Dispatch("a", Phase.RUN, 1, 1, 5.0)])
            channel = sender._acquire().channel
            assert commands is not None and [name for name, _ in commands] == ["lpush"]
            assert commands[0][1][0] == app.conf.task_default_queue and client.llen(app.conf.task_default_queue) == 0
            assert json.loads(commands[0][1][1])["headers"]["eta"] is not None
            assert type(channel) is transport.Channel and "create_publish_batch" not in vars(channel)
        finally:
            sender.close()
            client.close()


def _taken(client: Any, queue: str) -> list[str]:
    """The run ids of the messages in ``queue``, in the order workers take them (from the right)."""
    order = []
    while (raw := client.rpop(queue)) is not None:
        order.append(json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0])
    return order


def test_waiters_sent_again_go_to_the_front_of_their_queue(tmp_path) -> None:
    """A fleet limit picked them for room it has now: behind a backlog their messages would spend
    that room in the queue (PhaseSender.resend). A Redis of its own: the session's has workers of
    other tests taking from the default queue."""
    import redis

    with RedisServer(tmp_path) as server:
        _front_of_the_queue(server.url, redis.Redis.from_url(server.url))


def _front_of_the_queue(url: str, client: Any) -> None:
    app = make_app(Settings(redis_url=url, broker_url=url))
    queue = app.conf.task_default_queue
    plain = PhaseSender(app, url)
    ahead = PhaseSender(app, url, ahead=client)
    try:
        for run_id in ("backlog-1", "backlog-2", "backlog-3"):
            plain(ONE, run_id, [Dispatch("a", Phase.RUN, 1, 1)])
        older, newer = (Waiter(f"waiter-{n}", "a", "run", 1, 4, ONE.name) for n in (1, 2))
        ahead.resend([older, newer])  # picked oldest first
        assert _taken(client, queue) == ["waiter-1", "waiter-2", "backlog-1", "backlog-2", "backlog-3"]
        # without the store's client (or with another broker) they are sent the ordinary way: at the back
        plain(ONE, "backlog-4", [Dispatch("a", Phase.RUN, 1, 1)])
        plain.resend([older])
        assert _taken(client, queue) == ["backlog-4", "waiter-1"]
    finally:
        plain.close()
        ahead.close()
        client.close()

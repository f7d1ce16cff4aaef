"""Malformed messages on the queue are refused with a logged error; workers keep consuming and
no run state changes."""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults import flows
from tests.faults.harness import RESULTS, Cluster, Outcome
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, 0).start(workers=("m1",))
    try:
        yield c
    finally:
        c.stop()


def _state(cluster: Cluster, run_id: str) -> dict[str, Any]:
    """What the run holds, as every reader sees it: the reconciler may compact the finished run
    meanwhile (its raw keys change then, and these do not: tests/integration/test_compaction.py)."""
    assert cluster.client is not None
    return {
        "view": cluster.client.inspect(run_id).model_dump(),
        "events": cluster.client.events(run_id),
        "result": cluster.client.result(run_id),
    }


def _publish(cluster: Cluster, task: str, body: bytes, content_type: str) -> None:
    assert cluster.client is not None
    app = cluster.client.app
    headers = {"lang": "py", "task": task, "id": str(uuid.uuid4()), "root_id": None, "parent_id": None,
               "group": None, "argsrepr": "", "kwargsrepr": "", "origin": "fault-test"}
    with app.connection_for_write() as conn:
        conn.Producer().publish(body, exchange="taskloop", routing_key="taskloop", content_type=content_type,
                                content_encoding="utf-8", headers=headers, declare=[app.amqp.queues["taskloop"]])


def _json(args: Any, kwargs: Any = None) -> bytes:
    import json

    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    return json.dumps([args, kwargs or {}, embed]).encode()


def test_malformed_messages_are_refused_and_workers_keep_consuming(cluster: Cluster) -> None:
    assert cluster.client is not None
    # Given a finished run whose records we keep a copy of
    first = cluster.client.start(flows.grind, input={"hold_s": 0.01})
    assert first.wait(timeout=60).status == "done"
    before = _state(cluster, first.run_id)
    # When broken JSON, an unknown task, wrong args and a pickle body are put on the queue
    messages = [
        ("taskloop.attempt", b'{"not": json', "application/json"),
        ("taskloop.nope", _json([first.run_id, "work", 1, 0]), "application/json"),
        ("taskloop.attempt", _json(["only-a-run-id"]), "application/json"),
        ("taskloop.check", _json([first.run_id, "work", "one", None]), "application/json"),
        ("taskloop.run", _json([first.run_id, "work", 1, 0], {"extra": True}), "application/json"),
        ("taskloop.attempt", pickle.dumps(((first.run_id, "work", 1, 0), {}, {})), "application/x-python-serialize"),
    ]
    for task, body, content_type in messages:
        _publish(cluster, task, body, content_type)
    # Then the worker keeps consuming: a new run finishes
    second = cluster.client.start(flows.grind, input={"hold_s": 0.01})
    assert second.wait(timeout=60).status == "done"
    # and every message was seen and refused ...
    wait_until(lambda: cluster.log("m1").count("malformed taskloop.") == 3, what="three refusals in the log")
    log = cluster.log("m1")
    assert "Received unregistered task of type 'taskloop.nope'" in log
    # ... with nothing of the first run changed
    assert _state(cluster, first.run_id) == before
    assert "Can't decode message body" in log or "DecodeError" in log
    assert "ContentDisallowed" in log or "untrusted content" in log
    RESULTS.append(Outcome("malformed messages (JSON, unknown task, args, pickle)", None, 2, len(messages)))
    cluster.assert_fleet_whole()  # no message stopped the worker or its pool

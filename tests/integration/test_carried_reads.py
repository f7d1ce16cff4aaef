"""A phase message carries the fields its phase reads (taskloop/core/reads.py): the write that
queues the phase reads them inside cas.lua, after its writes, into the message it pushes, and a
worker that takes a fresh message runs on them without a read of its own. Real redis-server, real
workers; the ``paced-parked`` loop queues on a list no worker consumes, so that a test holds its
messages and hands them over (or copies of them) when it chooses."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis

from taskloop.core import fields as fld
from taskloop.core import reads
from taskloop.core.states import Phase
from taskloop.runtime.client import TaskLoop
from tests.integration import flows
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")

QUEUE = "taskloop"  # the queue the test workers consume


def _parked(probe: redis.Redis, run_id: str, timeout: float = 10.0) -> str:
    """The parked message of ``run_id`` (left where it is)."""
    found: list[str] = []

    def there() -> bool:
        found[:] = [m for m in probe.lrange(flows.PARKED_QUEUE, 0, -1) if run_id in m]
        return bool(found)

    wait_until(there, timeout=timeout, what="the phase message is queued")
    return found[0]


def _take_parked(probe: redis.Redis, run_id: str) -> str:
    payload = _parked(probe, run_id)
    assert probe.lrem(flows.PARKED_QUEUE, 1, payload) == 1
    return payload


def _hand_over(probe: redis.Redis, payload: str) -> None:
    probe.lpush(QUEUE, payload)


def _finish(client: TaskLoop, probe: redis.Redis, run_id: str) -> str:
    """Hand over the run's parked messages until it ends; its status."""
    def ended() -> str | None:
        for message in [m for m in probe.lrange(flows.PARKED_QUEUE, 0, -1) if run_id in m]:
            if probe.lrem(flows.PARKED_QUEUE, 1, message):
                _hand_over(probe, message)
        status = client.status(run_id)
        return status if status not in ("pending", "running", "waiting") else None

    return wait_until(ended, timeout=30, what="the run ends")


def _headers(payload: str) -> dict[str, Any]:
    headers: dict[str, Any] = json.loads(payload)["headers"]
    return headers


def _edited(payload: str, **headers: Any) -> str:
    message = json.loads(payload)
    message["headers"].update(headers)
    return json.dumps(message)


def _calls(probe: redis.Redis, run_id: str, phase: str = "attempt") -> list[dict[str, Any]]:
    return [c for c in flows.recorded(probe, run_id, "paced_calls") if c["phase"] == phase]


def test_a_queued_phase_carries_its_fields_as_the_write_left_them(client: TaskLoop, probe: redis.Redis) -> None:
    handle = client.start(flows.paced_parked, input={"rounds": 1, "note": "x" * 100})
    headers = _headers(_parked(probe, handle.run_id))
    names = reads.carried_fields(flows.paced_parked, "step", Phase.ATTEMPT, 1)
    assert headers[reads.CARRY_HEADER] == probe.hmget(f"tl:{{{handle.run_id}}}", names)
    assert abs(headers[reads.QUEUED_AT_HEADER] - time.time()) < 5
    fields = reads.carried("step", Phase.ATTEMPT, 1, headers[reads.CARRY_HEADER])
    assert fields is not None and json.loads(fields[fld.F_INPUT] or "")["note"] == "x" * 100
    client.cancel(handle.run_id)
    _hand_over(probe, _take_parked(probe, handle.run_id))
    assert handle.wait(timeout=30).status == "cancelled"


def test_values_over_64_kb_stay_out_of_the_message(client: TaskLoop, probe: redis.Redis) -> None:
    # Given a run whose input alone is over what a message carries
    handle = client.start(flows.paced_parked, input={"rounds": 1, "note": "x" * 70_000})
    payload = _take_parked(probe, handle.run_id)
    assert _headers(payload)[reads.CARRY_HEADER] is None
    # Then a worker reads what the phase needs, and the loop runs as any other
    _hand_over(probe, payload)
    wait_until(lambda: _calls(probe, handle.run_id), timeout=30, what="the attempt runs")
    assert _finish(client, probe, handle.run_id) == "done"
    assert [c["phase"] for c in flows.recorded(probe, handle.run_id, "paced_calls")] == ["attempt", "check"]


def test_a_step_reads_nothing_of_its_own(client: TaskLoop, probe: redis.Redis) -> None:
    # Given ten 3-round loops whose callbacks read the run's input
    tag = f"carried-{time.time_ns()}"
    reads_seen: list[str] = []
    notes: list[str] = []
    watching = threading.Event()
    last = f"monitor-end-{time.time_ns()}"

    def watch() -> None:
        with probe.monitor() as monitor:
            watching.set()
            for found in monitor.listen():
                command = str(found["command"])
                if last in command:
                    return  # every command sent before it was seen
                if tag not in command or found.get("client_type") == "lua":
                    continue
                if command.startswith("HMGET") and fld.task_field("step") in command.split():
                    reads_seen.append(command)
                elif command.startswith("HSET") and fld.started_field("step") in command.split():
                    notes.append(command)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert watching.wait(5)
    handles = [client.start(flows.paced, input={"rounds": 3}, run_id=f"{tag}-{n}") for n in range(10)]
    assert [h.wait(timeout=60).status for h in handles] == ["done"] * 10
    probe.echo(last)
    thread.join(timeout=10)
    assert not thread.is_alive()
    # Then no phase read its record, its data or the input: its message carried them; each wrote its start note
    assert reads_seen == []
    assert len(notes) == 10 * 6
    for h in handles:
        assert client.inspect(h.run_id).usage["attempts"] == 3


@pytest.mark.parametrize("copy", ["redelivered", "late"])
def test_a_copy_that_is_not_a_fresh_first_delivery_reads_and_is_refused(
        client: TaskLoop, probe: redis.Redis, copy: str) -> None:
    # Given an attempt that takes 0.8 s (it runs on its start note, not begun yet)
    handle = client.start(flows.paced_parked, input={"hold_s": 0.8, "rounds": 1})
    payload = _take_parked(probe, handle.run_id)
    _hand_over(probe, payload)
    wait_until(lambda: _calls(probe, handle.run_id), timeout=30, what="the attempt starts")
    # When a copy of its message comes meanwhile, marked by kombu as delivered before, or queued too long ago
    before = int(client.store.stats().get("stale_deliveries", 0))
    headers = {"redelivered": True} if copy == "redelivered" else \
        {reads.QUEUED_AT_HEADER: _headers(payload)[reads.QUEUED_AT_HEADER] - reads.CARRY_FRESH_S - 1}
    _hand_over(probe, _edited(payload, **headers))
    # Then the copy reads the run, finds the start note and is refused before its callback
    wait_until(lambda: int(client.store.stats().get("stale_deliveries", 0)) > before, timeout=15,
               what="the copy is refused")
    client.cancel(handle.run_id)
    _finish(client, probe, handle.run_id)
    assert len(_calls(probe, handle.run_id)) == 1
    assert client.inspect(handle.run_id).usage["attempts"] == 1


def test_a_cancel_that_lands_while_a_fresh_message_waits(client: TaskLoop, probe: redis.Redis) -> None:
    # Given a phase queued before its run is cancelled, whose message comes within CARRY_FRESH_S
    handle = client.start(flows.paced_parked, input={"hold_s": 30, "rounds": 1})
    payload = _take_parked(probe, handle.run_id)
    client.cancel(handle.run_id)
    started = time.monotonic()
    _hand_over(probe, payload)
    # Then its callback starts on what the message carried, is signalled within the watch interval, and
    # the run ends cancelled: the phase is recorded cancelled, not done
    assert handle.wait(timeout=30).status == "cancelled"
    assert time.monotonic() - started < 5  # not the 30 s the callback would hold without its signal
    assert len(_calls(probe, handle.run_id)) == 1
    assert client.inspect(handle.run_id).tasks["step"].status == "cancelled"


def test_a_cancel_that_lands_before_a_late_message_stops_it_before_its_callback(
        client: TaskLoop, probe: redis.Redis) -> None:
    handle = client.start(flows.paced_parked, input={"hold_s": 30, "rounds": 1})
    payload = _take_parked(probe, handle.run_id)
    client.cancel(handle.run_id)
    time.sleep(reads.CARRY_FRESH_S + 0.2)
    _hand_over(probe, payload)
    assert handle.wait(timeout=30).status == "cancelled"
    assert _calls(probe, handle.run_id) == []

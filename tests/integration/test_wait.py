"""Waiting for a run: blocking reads that outlast their slice, deadlines kept, CPU starvation."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis

import taskloop as tl
from taskloop.runtime import views, waiting
from taskloop.store import keys as k
from taskloop.store import redis_store
from tests.integration import flows

pytestmark = pytest.mark.usefixtures("workers")


@pytest.fixture()
def cpu_hogs() -> Iterator[None]:
    """Saturate every core with busy loops while the test waits."""
    import os

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_blocking_read_that_outlives_its_socket_timeout_is_not_redis_down(client, monkeypatch) -> None:
    # Given a blocking client whose socket gives up before the block does (the race of issue 10)
    monkeypatch.setattr(redis_store, "BLOCK_MARGIN_S", -0.7)
    run_id = f"never-ends-{time.time_ns()}"
    started = time.monotonic()
    # When the end marker does not come, the read reports "not ended yet", not StoreUnavailable
    assert client.store.block_end(run_id, 1000) is False
    assert time.monotonic() - started < 5
    # and the store keeps working afterwards, on a fresh connection
    monkeypatch.setattr(redis_store, "BLOCK_MARGIN_S", 10.0)
    client.store.client.rpush(k.RunKeys.of(run_id).end, "done")
    assert client.store.block_end(run_id, 1000) is True
    client.store.client.delete(k.RunKeys.of(run_id).end)


def test_wait_gives_up_at_its_timeout_not_later(client) -> None:
    run = client.start(flows.sleeper, input={"seconds": 8})
    started = time.monotonic()
    with pytest.raises(tl.RunTimeout, match="did not finish within 2"):
        run.wait(timeout=2)
    assert 2.0 <= time.monotonic() - started < 3.5
    assert run.wait(timeout=30).values == {"nap": 8.0}


@pytest.mark.parametrize("seconds", [pytest.param(20, id="20s"), pytest.param(60, id="60s", marks=pytest.mark.slow)])
def test_wait_on_a_long_run_with_the_cpu_saturated_returns_the_result(client, cpu_hogs, seconds: int) -> None:
    # Given a run that lasts 20 s (60 s: slow): a 5-second blocking slice each, each one a chance for the race
    run = client.start(flows.sleeper, input={"seconds": seconds})
    # When the client waits while every core is busy
    result = run.wait(timeout=2 * seconds)
    # Then it gets the result, with no StoreUnavailable on the way
    assert result.status == "done" and result.values == {"nap": float(seconds)}


def test_observers_hear_every_event_of_a_run_that_ended_before_the_wait(client) -> None:
    # Given a run that has already ended
    run = client.start(flows.core, {})
    assert run.wait(timeout=30).status == "done"
    heard: list[tl.Event] = []
    # When someone waits for it with an observer
    result = client.wait(run.run_id, timeout=5, on_event=heard.append)
    # Then the observer hears the whole history, in order, ending with run.finished
    assert result.status == "done"
    assert [e.id for e in heard] == [e.id for e in client.events(run.run_id)]
    assert heard[-1].type == "run.finished"
    assert sum(1 for e in heard if e.type == "phase" and e.phase == "complete") == 2


def test_once_woken_wait_reads_the_meta_and_the_result_in_one_round_trip(client, monkeypatch) -> None:
    # Given a run that ended and is not compacted yet (its end marker is there)
    run = client.start(flows.sleeper, input={"seconds": 0})
    first = run.wait(timeout=30)
    assert first.status == "done"
    sent: list[int] = []
    real = redis.connection.AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):  # type: ignore[no-untyped-def]
        sent.append(1)
        return real(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    # When wait wakes on the marker and reads what it returns
    assert client.store.block_end(run.run_id, 1000) is True
    sent.clear()
    meta, result = views.meta_and_result(client.store, run.run_id)
    # Then the meta fields, the task records and their values came in one round trip
    assert len(sent) == 1
    assert meta.stored_status == "done" and result == first


def test_the_first_block_of_a_wait_brings_the_result_in_the_round_trip_of_the_wake(client, monkeypatch) -> None:
    # Given a client whose blocking connection is open (a first wait opened it), and a run that is
    # still going when its wait begins
    client.start(flows.sleeper, input={"seconds": 0}).wait(timeout=30)
    sent: list[int] = []
    real = redis.connection.AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):  # type: ignore[no-untyped-def]
        sent.append(1)
        return real(self, command, check_health)

    run = client.start(flows.sleeper, input={"seconds": 0.5})
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    # When it is waited for
    result = run.wait(timeout=30)
    # Then the wait took two round trips: the run's status first, then the block, which woke on the
    # end marker with the meta, the records and the values read behind it
    assert len(sent) == 2
    assert result.status == "done" and result.values == {"nap": 0.5}
    monkeypatch.undo()
    assert result == client.result(run.run_id)


def test_a_woken_read_is_the_run_as_it_ended_and_none_until_it_ends(client) -> None:
    # Given a run that takes a second
    run = client.start(flows.sleeper, input={"seconds": 1})
    # When its end is waited for less than that, then past its end
    early = views.woken_result(client.store, run.run_id, 200)
    woken = views.woken_result(client.store, run.run_id, 10_000)
    # Then the short block timed out with nothing, and the long one brought the meta and the result
    assert early is None
    assert woken is not None
    meta, result = woken
    assert meta.stored_status == "done" and result is not None
    assert (meta, result) == views.meta_and_result(client.store, run.run_id)


def test_a_run_that_outlasts_the_first_block_is_read_after_a_later_wake(client, monkeypatch) -> None:
    # Given a run that outlasts the first block (5 s as shipped), the one that pipelines the
    # result's read behind it
    seconds = waiting._WAIT_SLICE_S + 1
    calls: list[str] = []
    woken, plain = views.woken_result, client.store.block_end
    monkeypatch.setattr(views, "woken_result", lambda *a: calls.append("woken") or woken(*a))
    monkeypatch.setattr(client.store, "block_end", lambda *a: calls.append("block") or plain(*a))
    run = client.start(flows.sleeper, input={"seconds": seconds})
    # When it is waited for
    result = run.wait(timeout=60)
    # Then only the first block carried the read; the later ones waited alone, and the last one's
    # wake was followed by the read, which found the same result
    assert calls[0] == "woken" and calls.count("woken") == 1
    assert calls[1:] and set(calls[1:]) == {"block"}
    assert result.status == "done" and result.values == {"nap": seconds}
    assert result == client.result(run.run_id)

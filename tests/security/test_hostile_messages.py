"""Hostile messages on the broker, one finding each (docs/security.md): stale deliveries to a
finished run append nothing, a message for an expired run re-creates nothing, a forged run id
cannot forge a log line or flood the log, and every run's event stream is trimmed."""

from __future__ import annotations

import time

import pytest

from taskloop.core.batch import Batch
from taskloop.core.events import Event
from taskloop.store import keys as k
from taskloop.store.redis_store import RedisStore
from tests.security import flows
from tests.security.conftest import Stack
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def _stat(stack: Stack, name: str) -> int:
    return int(stack.probe.hget(k.STATS, name) or 0)


def test_stale_deliveries_to_a_finished_run_are_counted_not_appended(stack: Stack) -> None:
    # Given a finished run
    run = stack.client.start(flows.big_output, input={"size": 1})
    assert run.wait(timeout=30).status == "done"
    keys = k.RunKeys.of(run.run_id)
    length, ttl = stack.probe.xlen(keys.events), stack.probe.ttl(keys.events)
    before = _stat(stack, "stale_deliveries")
    # When 500 forged copies of its phase message arrive
    for token in range(500):
        stack.client.app.send_task("taskloop.run", args=[run.run_id, "emit", 1, token % 7], ignore_result=True)
    wait_until(lambda: _stat(stack, "stale_deliveries") >= before + 500, timeout=60, what="500 refusals")
    # Then its event stream did not grow, and its keys keep their expiry
    assert stack.probe.xlen(keys.events) == length
    assert 0 < stack.probe.ttl(keys.events) <= ttl
    assert 0 < stack.probe.ttl(keys.run)


def test_a_message_for_an_expired_run_recreates_nothing(stack: Stack) -> None:
    # Given a run whose keys have expired
    run = stack.client.start(flows.big_output, input={"size": 1})
    assert run.wait(timeout=30).status == "done"
    keys = k.RunKeys.of(run.run_id)
    stack.probe.delete(keys.run, keys.events, keys.end, keys.leases)
    before = _stat(stack, "dropped_unknown_run")
    # When old messages of it are delivered again
    for token in (0, 1, 2):
        stack.client.app.send_task("taskloop.run", args=[run.run_id, "emit", 1, token], ignore_result=True)
    wait_until(lambda: _stat(stack, "dropped_unknown_run") >= before + 3, timeout=30, what="3 drops")
    # Then none of its keys exists again (inspect and cancel would have met a half-made run)
    assert stack.probe.exists(keys.run, keys.events, keys.end, keys.leases) == 0


def test_a_forged_run_id_cannot_forge_a_log_line_or_flood_the_log(stack: Stack) -> None:
    forged = "abc\n[2026-01-01 00:00:00,000: CRITICAL/MainProcess] forged line"
    huge = "r" * 2_000_000
    for run_id in (forged, huge):
        stack.client.app.send_task("taskloop.run", args=[run_id, "emit", 1, 0], ignore_result=True)
    wait_until(lambda: stack.log().count("malformed taskloop.run message dropped") >= 2, timeout=30,
               what="both messages refused")
    log = stack.log()
    assert not any(line.startswith("[2026-01-01 00:00:00,000: CRITICAL") for line in log.splitlines())
    assert "\\n[2026-01-01" in log  # quoted with %r: the newline is shown, not written
    assert max(len(line) for line in log.splitlines()) < 5_000  # the 2 MB id is cut
    assert stack.probe.exists(k.RunKeys.of("abc").run) == 0


def test_every_write_trims_its_run_s_event_stream(stack: Stack) -> None:
    store = RedisStore(stack.server.url, events_maxlen=10)
    run_id = f"trim-{time.time_ns()}"
    try:
        for n in range(1_000):
            store.apply(Batch(run_id).event(Event(type="phase", key="x", round=n + 1, phase="attempt", at=n)))
        # XADD MAXLEN ~ trims whole stream nodes (100 entries each by default): about 10 are kept
        assert stack.probe.xlen(k.RunKeys.of(run_id).events) <= 10 + 100
    finally:
        stack.probe.delete(k.RunKeys.of(run_id).events, k.RunKeys.of(run_id).run)
        store.close()

"""The one-call step (taskloop/worker/execution/deferred.py): a prepared phase runs on one plain read and is
begun in the write that records its outcome; a phase that runs past MARK_S is begun on the way.
Real redis-server, real workers (two nodes of two processes)."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import redis

from taskloop.core import fields as fld
from taskloop.core.begin import Dispatch
from taskloop.core.states import Phase, Slot
from taskloop.runtime.celery_app import send_phase
from taskloop.runtime.client import TaskLoop
from taskloop.worker.execution.deferred import MARK_S
from tests.integration import flows
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")


def _scripts(client: TaskLoop, probe: redis.Redis, run) -> collections.Counter[str]:  # type: ignore[no-untyped-def]
    """The script calls (by script) and plain reads made for the runs ``run()`` starts, from MONITOR."""
    names = {client.store._scripts[name].sha: name for name in ("begin", "cas", "cas_limits")}
    seen: collections.Counter[str] = collections.Counter()
    watching = threading.Event()
    tag: list[str] = []
    scripts_seen: set[str] = set()
    last = f"monitor-end-{time.time_ns()}"

    def watch() -> None:
        with probe.monitor() as monitor:
            watching.set()
            for found in monitor.listen():
                if last in str(found["command"]):
                    return  # every command sent before it was seen
                words = str(found["command"]).split()
                # (a script's first call on this server is seen twice: NOSCRIPT, then again once loaded)
                if tag and any(tag[0] in word for word in words) and found.get("client_type") != "lua" \
                        and not (words[0] == "EVALSHA" and found["command"] in scripts_seen):
                    scripts_seen.add(found["command"])
                    seen[names.get(words[1], words[1]) if words[0] == "EVALSHA" else words[0]] += 1

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert watching.wait(5)
    run(tag)
    probe.echo(last)
    thread.join(timeout=10)
    assert not thread.is_alive()
    return seen


def test_a_step_costs_one_script_call(client: TaskLoop, probe: redis.Redis) -> None:
    # Given ten 3-round loops (60 steps) whose phases return at once
    handles = []

    def run(tag: list[str]) -> None:
        tag.append(f"onecall-{time.time_ns()}")
        handles.extend(client.start(flows.paced, input={"rounds": 3}, run_id=f"{tag[0]}-{n}") for n in range(10))
        assert [h.wait(timeout=60).status for h in handles] == ["done"] * 10

    calls = _scripts(client, probe, run)
    # Then each step made one script call (the commit) and wrote its start note; nothing called
    # begin.lua; the starts are one script call each too. The steps read nothing: their messages
    # carried what they read (tests/integration/test_carried_reads.py); the reads left are the
    # waits' (two per run)
    steps = 10 * 6
    assert calls["begin"] == 0, calls
    assert calls["cas"] == steps + 10, calls  # the steps' commits, and the ten starts
    assert calls["HSET"] >= steps, calls  # (and a heartbeat that listed a message of these runs)
    assert calls["HMGET"] <= 2 * 10, calls


def test_a_phase_that_runs_past_mark_s_is_begun_on_the_way(client: TaskLoop, probe: redis.Redis) -> None:
    # Given a loop whose phases take 2.5 s
    handle = client.start(flows.paced_long, input={"hold_s": 2.5, "rounds": 1})
    wait_until(lambda: flows.recorded(probe, handle.run_id, "paced_calls"), timeout=30, what="the attempt starts")
    started = flows.recorded(probe, handle.run_id, "paced_calls")[0]["at"]
    # When it has run for more than MARK_S
    time.sleep(max(0.0, started + MARK_S + 0.5 - time.time()))
    record = client.store.snapshot(handle.run_id).record("step")
    lease = client.store.lease_of(handle.run_id, "step")
    # Then its record shows it running on its worker, under a running lease, not the queued one
    assert record is not None and record.slot is Slot.RUNNING and record.worker, record
    assert record.began_at is not None and abs(record.began_at - started) < 0.5
    assert lease is not None and lease < time.time() + client.settings.running_lease_s + 1
    view = client.inspect(handle.run_id).tasks["step"]
    assert view.status == "active" and view.worker == record.worker
    assert handle.wait(timeout=30).status == "done"


def test_a_short_phase_is_written_once_with_who_ran_it(client: TaskLoop, probe: redis.Redis) -> None:
    handle = client.start(flows.paced, input={"rounds": 2})
    assert handle.wait(timeout=30).status == "done"
    rounds = client.inspect(handle.run_id).tasks["step"].rounds
    assert [r.round for r in rounds] == [1, 2]
    calls = flows.recorded(probe, handle.run_id, "paced_calls")
    # each round's attempt and check: its worker and start are recorded with its outcome
    for r, (attempt, check) in zip(rounds, zip(calls[::2], calls[1::2], strict=True), strict=True):
        ran = {e.phase: e for e in r.execs}
        assert set(ran) == {"attempt", "check"} and not any(e.replay or e.lost for e in r.execs), r
        for what, call in (("attempt", attempt), ("check", check)):
            assert ran[what].worker and ran[what].worker.endswith(f"/{call['pid']}"), ran[what]
            assert ran[what].began_at is not None and abs(ran[what].began_at - call["at"]) < 0.5
    assert client.inspect(handle.run_id).usage["attempts"] == 2


def test_a_duplicate_of_a_phase_that_runs_before_its_begin_is_refused_without_running(
        client: TaskLoop, probe: redis.Redis) -> None:
    # Given an attempt that takes 0.8 s (less than MARK_S: its begin is not written while it runs)
    handle = client.start(flows.paced, input={"hold_s": 0.8, "rounds": 1})
    wait_until(lambda: flows.recorded(probe, handle.run_id, "paced_calls"), timeout=30, what="the attempt starts")
    record = client.store.snapshot(handle.run_id).record("step")
    assert record is not None and record.slot is Slot.QUEUED  # not begun yet: it runs on its start note
    note = client.store.hmget(handle.run_id, [fld.started_field("step")])[0]
    assert note is not None and note.startswith(f"{record.token} ")
    # When a copy of its message is delivered meanwhile
    before = int(client.store.stats().get("stale_deliveries", 0))
    send_phase(client.app, flows.paced, handle.run_id, Dispatch("step", Phase.ATTEMPT, 1, record.token))
    wait_until(lambda: int(client.store.stats().get("stale_deliveries", 0)) > before, timeout=15,
               what="the copy is refused")
    # Then the copy is refused before its callback, and the run ends as if it never came
    assert handle.wait(timeout=30).status == "done"
    attempts = [c for c in flows.recorded(probe, handle.run_id, "paced_calls") if c["phase"] == "attempt"]
    assert len(attempts) == 1, attempts
    assert client.inspect(handle.run_id).usage["attempts"] == 1

"""A forged message with the token one below a running phase's (what a redelivery of the message
that began it carries) is refused at once when that phase's lease is live: the worker looks at
the lease first and at the running process once, without waiting. It used to wait up to 1 s per
message for the process to die, so anyone who could publish to the broker could hold pool
processes with a stream of such messages."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from taskloop.core import fields as fld
from taskloop.store import keys as k
from taskloop.worker.recovery.executions import process_gone
from tests.security import flows
from tests.security.conftest import Stack
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

FORGED = 20


def test_forged_redeliveries_at_a_live_running_phase_are_refused_at_once(stack: Stack) -> None:
    run = stack.client.start(flows.hold, input={"hold_s": 60})
    keys = k.RunKeys.of(run.run_id)

    def running() -> dict[str, Any] | None:
        raw = stack.probe.hget(keys.run, fld.task_field("hold"))
        record = json.loads(raw) if raw else None
        return record if record and record.get("slot") == "running" else None

    record = wait_until(running, timeout=30, what="the hold phase running")
    assert record is not None
    worker = stack.probe.hget(keys.run, fld.worker_field("hold"))  # who runs it: apart from the record
    assert worker, "the running phase names no worker"
    assert not process_gone(int(worker.rpartition("/")[2]))  # a live process, on this host
    raw_before = stack.probe.hget(keys.run, fld.task_field("hold"))
    events_before = stack.probe.xlen(keys.events)
    started = time.monotonic()
    for _ in range(FORGED):
        stack.client.app.send_task("taskloop.run", args=[run.run_id, "hold", record["round"], record["token"] - 1],
                                   ignore_result=True)
    # the other pool process refuses them one after another: before the fix, 1 s each
    wait_until(lambda: int(stack.probe.hget(keys.run, fld.stat_field("stale_deliveries")) or 0) >= FORGED,
               timeout=FORGED * 0.5, what=f"{FORGED} forged redeliveries refused")
    elapsed = time.monotonic() - started
    assert elapsed < FORGED * 0.25, f"{FORGED} forged messages took {elapsed:.1f} s of a pool process"
    # nothing changed: the record, the event stream; the phase still runs where it ran
    assert stack.probe.hget(keys.run, fld.task_field("hold")) == raw_before
    assert stack.probe.xlen(keys.events) == events_before
    stack.client.cancel(run.run_id, "test over")
    result = run.wait(timeout=30)
    assert result.status == "cancelled" and result.usage["attempts"] == 1

"""Gates: a run waits for `client.decide`, which applies to the one activation waiting."""

from __future__ import annotations

import time

import pytest

import taskloop as tl
from tests.integration import control_flows as cf

pytestmark = pytest.mark.usefixtures("workers")


def _wait_for_status(client, run_id: str, status: str) -> None:
    deadline = time.monotonic() + 20
    while client.inspect(run_id).status != status:
        assert time.monotonic() < deadline, client.inspect(run_id)
        time.sleep(0.05)


def test_approval_gate_waits_then_continues(client) -> None:
    run = client.start(cf.gated_flow, input={})
    _wait_for_status(client, run.run_id, "waiting")
    assert client.inspect(run.run_id).tasks["approval"].status == "paused"
    with pytest.raises(tl.GateRefused, match="actor 'bob' may not decide gate approval"):
        client.decide(run.run_id, "approval", "approve", actor="bob")
    with pytest.raises(tl.GateRefused, match="is an approval gate; use approve or reject"):
        client.decide(run.run_id, "approval", "resume", actor="alice")
    client.decide(run.run_id, "approval", "approve", actor="alice", reason="looks good")
    result = run.wait(timeout=30)
    assert result.status == "done" and result.values["publish"] == "published first draft"
    with pytest.raises(tl.GateRefused, match="not waiting for a decision"):
        client.decide(run.run_id, "approval", "approve", actor="alice")  # one decision per activation
    gate_events = [e for e in client.events(run.run_id) if e.type == "gate"]
    assert [(e.key, e.phase, e.data["actor"]) for e in gate_events] == [("approval", "approve", "alice")]


def test_rejected_gate_rejects_the_run(client) -> None:
    run = client.start(cf.gated_flow, input={})
    _wait_for_status(client, run.run_id, "waiting")
    client.decide(run.run_id, "approval", "reject", actor="alice", reason="off topic")
    result = run.wait(timeout=30)
    assert (result.status, result.termination_code) == ("rejected", "rejected")
    assert client.inspect(run.run_id).tasks["publish"].status == "skipped"
    with pytest.raises(tl.TaskLoopError, match="was rejected at a gate"):
        result.raise_for_status()


def test_input_gate_resumes_with_a_value(client) -> None:
    run = client.start(cf.input_flow, input={})
    _wait_for_status(client, run.run_id, "waiting")
    with pytest.raises(tl.GateRefused, match="approval is not a task of this workflow"):
        client.decide(run.run_id, "approval", "resume", actor="x")
    client.decide(run.run_id, "edit", "resume", actor="anyone", value="Loops that stop")
    result = run.wait(timeout=30)
    assert result.values == {"edit": "Loops that stop", "titled": "title: Loops that stop"}

"""Payload caps end to end, on a real redis-server and a real `taskloop worker`: a value over its
cap fails the phase with OutputTooLarge (or the client call with InvalidInput), is never written
to Redis, and the worker keeps consuming."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

import taskloop as tl
from taskloop.core import fields as fld
from taskloop.store import keys as k
from tests.security import flows
from tests.security.conftest import Stack
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

MIB = 1_048_576
TWO_MB = 2 * MIB


def _used_memory(stack: Stack) -> int:
    return int(stack.probe.info("memory")["used_memory"])


def _run_bytes(stack: Stack, run_id: str) -> int:
    """What a run's keys hold in Redis (MEMORY USAGE of each, all samples)."""
    keys = k.RunKeys.of(run_id)
    return sum(int(stack.probe.memory_usage(name, samples=0) or 0)
               for name in (keys.run, keys.events, keys.end, keys.leases))


def _largest_field(stack: Stack, run_id: str) -> int:
    return max(len(value) for value in stack.probe.hgetall(k.RunKeys.of(run_id).run).values())


def _keeps_consuming(stack: Stack) -> None:
    result = stack.client.start(flows.small).wait(timeout=30)
    assert (result.status, result.values) == ("done", {"one": 1})


def test_an_output_over_the_cap_fails_with_output_too_large_and_is_never_stored(stack: Stack) -> None:
    before = _used_memory(stack)
    result = stack.client.start(flows.big_output, input={"size": TWO_MB}).wait(timeout=30)
    # the phase failed like any other phase failure, once (no retry of a deterministic failure)
    assert (result.status, result.termination_code) == ("failed", "failed")
    [error] = result.errors
    assert (error.key, error.type) == ("emit", "OutputTooLarge")
    assert "the output of task emit is 2,097,154 bytes of JSON, over the limit of 1,048,576 bytes" in error.message
    assert "TASKLOOP_MAX_OUTPUT_BYTES" in error.message
    assert result.usage["attempts"] == 1
    with pytest.raises(tl.OutputTooLarge):
        result.raise_for_status()
    # the 2 MB value never reached Redis
    assert _largest_field(stack, result.run_id) < 20_000
    assert _run_bytes(stack, result.run_id) < 50_000
    assert _used_memory(stack) - before < MIB
    # and the worker goes on
    _keeps_consuming(stack)


def test_an_accepts_filter_sees_the_typed_error(stack: Stack) -> None:
    result = stack.client.start(flows.big_output_retry, input={"size": TWO_MB}).wait(timeout=30)
    assert result.status == "failed" and result.errors[0].type == "OutputTooLarge"
    assert result.usage["attempts"] == 1  # accepts refused OutputTooLarge: not retried


def test_a_candidate_over_the_cap_fails_before_check_runs(stack: Stack) -> None:
    result = stack.client.start(flows.big_candidate, input={"size": TWO_MB}).wait(timeout=30)
    assert result.status == "failed" and result.errors[0].type == "OutputTooLarge"
    assert "the candidate of task draft round 1" in result.errors[0].message
    fields = stack.probe.hgetall(k.RunKeys.of(result.run_id).run)
    assert fld.candidate_field("draft", 1) not in fields and fld.check_field("draft", 1) not in fields
    assert _largest_field(stack, result.run_id) < 20_000


def test_a_check_feedback_over_the_cap_fails_the_check(stack: Stack) -> None:
    result = stack.client.start(flows.big_feedback, input={"feedback": TWO_MB}).wait(timeout=30)
    assert result.status == "failed" and result.errors[0].type == "OutputTooLarge"
    assert "the check result (its feedback) of task draft round 1" in result.errors[0].message
    assert fld.check_field("draft", 1) not in stack.probe.hgetall(k.RunKeys.of(result.run_id).run)
    assert _largest_field(stack, result.run_id) < 20_000


def test_a_usage_receipt_id_over_its_cap_fails_the_phase(stack: Stack) -> None:
    fine = stack.client.start(flows.receipts, input={"receipt": 1024}).wait(timeout=30)
    assert fine.status == "done" and fine.usage["tokens"]["input"] == 1
    result = stack.client.start(flows.receipts, input={"receipt": 1025}).wait(timeout=30)
    assert result.status == "failed" and result.errors[0].type == "OutputTooLarge"
    assert "usage receipt id reported by task bill is 1,025 bytes" in result.errors[0].message
    fields = stack.probe.hgetall(k.RunKeys.of(result.run_id).run)
    assert not [name for name in fields if str(name).startswith(fld.receipt_field(""))]


def test_notes_over_the_cap_are_dropped_and_the_phase_succeeds(stack: Stack) -> None:
    result = stack.client.start(flows.notes, input={"size": TWO_MB}).wait(timeout=30)
    assert (result.status, result.values) == ("done", {"noted": 1})
    assert _largest_field(stack, result.run_id) < 20_000


def test_a_graph_state_or_activation_input_over_the_cap_fails_the_run(stack: Stack) -> None:
    state = stack.client.start(flows.grow_state, input={"state": TWO_MB}).wait(timeout=30)
    assert state.status == "failed"
    view = stack.client.inspect(state.run_id)
    assert view.error is not None and view.error.type == "OutputTooLarge"
    assert "the state that transition handler grow v1 returned after step@1 is 2,097,163 bytes" in view.error.message
    assert view.state == {"blob": ""}  # the last valid state is kept
    activation = stack.client.start(flows.big_activation, input={"activation": TWO_MB}).wait(timeout=30)
    assert activation.status == "failed"
    view = stack.client.inspect(activation.run_id)
    assert view.error is not None and view.error.type == "OutputTooLarge"
    assert "the input of the activation of next after step@1" in view.error.message
    for run_id in (state.run_id, activation.run_id):
        assert _largest_field(stack, run_id) < 20_000


def test_a_run_input_over_the_cap_is_refused_by_the_client_and_writes_nothing(stack: Stack) -> None:
    before = stack.probe.dbsize()
    big: dict[str, Any] = {"text": "x" * TWO_MB}
    for workflow in (flows.small, "sec-small", "not-imported-anywhere"):  # by definition, by name, pending
        run_id = f"big-input-{uuid.uuid4().hex[:8]}"
        with pytest.raises(tl.InvalidInput, match=r"run input is 2,097,163 bytes of JSON, over the limit of "
                                                  r"1,048,576 bytes.*TASKLOOP_MAX_INPUT_BYTES"):
            stack.client.start(workflow, input=big, run_id=run_id)
        assert not stack.probe.exists(k.RunKeys.of(run_id).run)
    assert stack.probe.dbsize() == before


def test_a_start_message_with_an_input_over_the_cap_is_refused_by_the_worker(stack: Stack) -> None:
    run_id = f"big-start-{uuid.uuid4().hex[:8]}"
    stack.client.app.send_task("taskloop.start", kwargs={"workflow": "sec-small", "input": "x" * TWO_MB,
                                                         "run_id": run_id})
    wait_until(lambda: "taskloop.start refused: InvalidInput" in stack.log(), timeout=30,
               what="the worker refusing the start message")
    assert not stack.probe.exists(k.RunKeys.of(run_id).run)
    _keeps_consuming(stack)


def test_a_gate_value_over_the_cap_is_refused_and_the_gate_keeps_waiting(stack: Stack) -> None:
    run = stack.client.start(flows.gated)
    wait_until(lambda: stack.client.status(run.run_id) == "waiting", timeout=30, what="the gate waiting")
    with pytest.raises(tl.InvalidInput, match=r"the value for gate edit is 2,097,154 bytes of JSON.*"
                                              r"TASKLOOP_MAX_GATE_VALUE_BYTES"):
        stack.client.decide(run.run_id, "edit", "resume", actor="ed", value="v" * TWO_MB)
    assert stack.client.inspect(run.run_id).tasks["edit"].status == "paused"
    assert _largest_field(stack, run.run_id) < 20_000
    # an actor and a reason are recorded in the gate event: cut, not refused
    stack.client.decide(run.run_id, "edit", "resume", actor="e" * 100_000, reason="r" * 100_000, value="short title")
    result = run.wait(timeout=30)
    assert (result.status, result.values["use"]) == ("done", len("short title"))
    gate = [event for event in stack.client.events(run.run_id) if event.type == "gate"]
    assert len(gate) == 1 and len(gate[0].data["actor"]) < 300 and len(gate[0].data["reason"]) < 600
    assert _largest_field(stack, run.run_id) < 20_000


def test_a_recorded_error_message_is_cut(stack: Stack) -> None:
    # a callback's exception message is recorded, so it is bounded as well
    result = stack.client.start(flows.big_output, input={"raise": 10 * MIB}).wait(timeout=30)
    assert result.status == "failed"
    assert len(result.errors[0].message) < 9_000
    assert len(json.dumps(result.errors[0].model_dump())) < 30_000

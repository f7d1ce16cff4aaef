"""SPEC §3 loop-task semantics on a real redis-server and real worker processes."""

from __future__ import annotations

import pytest

import taskloop as tl
from taskloop.runtime.models import executions
from tests.integration import flows
from tests.integration.flows import recorded

pytestmark = pytest.mark.usefixtures("workers")


def test_feedback_dependency_value_and_idempotency_keys(client, probe) -> None:
    # Given the SPEC example (source=10, attempt = source + round, accepted at 12)
    run = client.start(flows.core, input={})
    # When it runs to the end
    result = run.wait(timeout=30)
    # Then fix is accepted in round 2 with the value read from source through ctx.value
    assert result.status == "done" and result.termination_code is None
    assert result.values == {"source": 10, "fix": 12, "publish": 24}
    assert recorded(probe, run.run_id, "feedback") == [None, "Try again"]
    keys = recorded(probe, run.run_id, "keys")
    assert len(keys) == 4 and len(set(keys)) == 4  # two rounds x (attempt, check)
    assert result.usage["attempts"] == 4  # source 1 + fix 2 rounds + publish 1
    result.raise_for_status()


def test_round_phase_event_sequence(client) -> None:
    run = client.start(flows.core, input={})
    run.wait(timeout=30)
    events = client.events(run.run_id)
    phases = [(e.round, e.phase) for e in events if e.type == "phase" and e.key == "fix"]
    assert phases == [(1, "attempt"), (1, "check"), (1, "complete"),
                      (2, "attempt"), (2, "check"), (2, "complete")]
    assert all(isinstance(e.at, float) for e in events)
    assert events[0].type == "run.started" and events[-1].type == "run.finished"
    execs = [(e.round, e.phase, e.attempt) for e in executions(events)["fix"]]
    assert execs == [(1, "attempt", 1), (1, "check", 1), (2, "attempt", 2), (2, "check", 2)]


def test_exhaustion_keeps_last_feedback_and_skips_dependents(client, probe) -> None:
    run = client.start(flows.core, input={"target": 99, "numbered": True})
    result = run.wait(timeout=30)
    assert result.status == "failed" and result.termination_code == "failed"
    assert result.values == {"source": 10}
    [error] = result.errors
    assert (error.key, error.type) == ("fix", "LoopTaskExhausted")
    assert error.message == "Loop task fix exhausted its 3 rounds"
    with pytest.raises(tl.LoopTaskExhausted) as caught:
        result.raise_for_status()
    assert (caught.value.key, caught.value.max_rounds) == ("fix", 3)
    assert caught.value.feedback == "Try again (after round 3)"
    assert str(caught.value) == "Loop task fix exhausted its 3 rounds"
    view = client.inspect(run.run_id)
    assert view.tasks["fix"].status == "failed" and view.tasks["fix"].round == 3
    assert view.tasks["publish"].status == "skipped"
    assert len(recorded(probe, run.run_id, "attempt_calls")) == 3  # never past max_rounds


@pytest.mark.parametrize("phase", ["attempt", "check"])
def test_exception_in_a_phase_fails_at_once(client, probe, phase: str) -> None:
    run = client.start(flows.core, input={"fail": phase})
    result = run.wait(timeout=30)
    assert result.status == "failed" and result.termination_code == "failed"
    [error] = result.errors
    expected = ("ValueError", "attempt exploded") if phase == "attempt" else ("RuntimeError", "check exploded")
    assert (error.key, error.type, error.message) == ("fix", *expected)
    assert "Traceback" in error.details["traceback"] and f"{phase} exploded" in error.details["traceback"]
    # exactly one call of the failing phase, no implicit retry
    assert len(recorded(probe, run.run_id, f"{phase}_calls")) == 1
    if phase == "attempt":
        assert recorded(probe, run.run_id, "check_calls") == []
    with pytest.raises(tl.TaskFailed, match=f"task fix failed: {expected[0]}: {expected[1]}"):
        result.raise_for_status()
    assert client.inspect(run.run_id).tasks["publish"].status == "skipped"


def test_non_json_output_fails_before_check(client, probe) -> None:
    run = client.start(flows.core, input={"non_json": True})
    result = run.wait(timeout=30)
    assert result.status == "failed"
    [error] = result.errors
    assert error.type == "InvalidOutput"
    assert "outputs must be lossless JSON values" in error.message
    assert "$.items[1] is a set" in error.message
    assert recorded(probe, run.run_id, "check_calls") == []


def test_check_returning_garbage_fails_the_task(client) -> None:
    result = client.start(flows.core, input={"bad_check": True}).wait(timeout=30)
    [error] = result.errors
    assert error.type == "InvalidCheckResult"
    assert "loop check must return done=True or done=False with a feedback string" in error.message


def test_condition_false_skips_with_cascade(client) -> None:
    result = client.start(flows.conditions, input={"go": False}).wait(timeout=30)
    assert result.status == "done"
    assert result.values == {"independent": "independent"}
    view = client.inspect(result.run_id)
    assert {k: t.status for k, t in view.tasks.items()} == {
        "gated": "skipped", "child": "skipped", "grandchild": "skipped", "independent": "done"}
    assert view.tasks["gated"].attempts == 0  # the condition is not an attempt


def test_condition_true_runs_the_chain(client) -> None:
    result = client.start(flows.conditions, input={"go": True}).wait(timeout=30)
    assert result.status == "done"
    assert result.values["grandchild"] == "ran+child"


def test_stop_on_error_false_lets_an_independent_branch_finish(client, probe) -> None:
    run = client.start(flows.branches_continue, input={"slow_s": 1.0})
    result = run.wait(timeout=30)
    assert result.status == "failed" and result.termination_code == "failed"
    assert result.values["slow"] == "slow finished"
    assert [(e.key, e.type) for e in result.errors] == [("bad", "KeyError")]
    view = client.inspect(run.run_id)
    assert view.tasks["after_bad"].status == "skipped"
    assert recorded(probe, run.run_id, "slow_signal") == [None]


def test_stop_on_error_true_cancels_running_tasks(client, probe) -> None:
    run = client.start(flows.branches_stop, input={"slow_s": 20.0})
    result = run.wait(timeout=15)  # far less than slow's 20 s: the signal ended it
    assert result.status == "failed" and result.termination_code == "failed"
    view = client.inspect(run.run_id)
    assert view.tasks["bad"].status == "failed"
    assert view.tasks["slow"].status == "cancelled"
    assert view.tasks["after_bad"].status == "skipped"
    assert recorded(probe, run.run_id, "slow_signal") == ["stopped"]


def test_async_callbacks(client) -> None:
    result = client.start(flows.async_flow, input={"words": ["a", "b"]}).wait(timeout=30)
    assert result.status == "done"
    assert result.values == {"draft": "draft 2 after 'more detail'", "count": 2}


def test_attempt_and_check_run_on_different_processes(client, probe) -> None:
    # Given two worker nodes with two processes each, and a 6-round loop
    run = client.start(flows.spread, input={"rounds": 6})
    assert run.wait(timeout=30).status == "done"
    where = recorded(probe, run.run_id, "where")
    by_round: dict[int, dict[str, int]] = {}
    for row in where:
        by_round.setdefault(row["round"], {})[row["phase"]] = row["pid"]
    # Then at least one round's check ran in another process than its attempt
    assert any(r["attempt"] != r["check"] for r in by_round.values()), by_round
    assert len({row["pid"] for row in where}) >= 2
    # and the events name the node and process of each execution
    nodes = {e.worker for e in executions(client.events(run.run_id))["grind"]}
    assert len(nodes) >= 2


def test_inspect_shows_every_round(client) -> None:
    run = client.start(flows.core, input={})
    run.wait(timeout=30)
    view = client.inspect(run.run_id)
    rounds = [(r.round, r.phase, r.output, r.check) for r in view.tasks["fix"].rounds]
    assert rounds == [
        (1, "complete", 11, {"done": False, "feedback": "Try again"}),
        (2, "complete", 12, {"done": True, "feedback": None}),
    ]
    assert view.tasks["fix"].value == 12 and view.status == "done"
    dumped = view.model_dump(mode="json")
    assert dumped["tasks"]["fix"]["rounds"][0]["output"] == 11


def test_start_is_idempotent_on_run_id(client) -> None:
    first = client.start(flows.core, input={}, run_id="idem-1")
    second = client.start(flows.core, input={}, run_id="idem-1")
    assert first.run_id == second.run_id == "idem-1"
    assert first.wait(timeout=30).values["fix"] == 12
    assert len([e for e in client.events("idem-1") if e.type == "run.started"]) == 1
    with pytest.raises(tl.TaskLoopError, match="already belongs to workflow core"):
        client.start(flows.spread, input={"rounds": 1}, run_id="idem-1")


def test_unknown_run_id(client) -> None:
    for call in (client.inspect, client.events, client.wait, client.result):
        with pytest.raises(tl.RunNotFound, match="run 'nope' not found"):
            call("nope")


def test_invalid_run_input(client) -> None:
    with pytest.raises(tl.InvalidInput, match=r"run input must be lossless JSON values: \$\.when is a"):
        client.start(flows.core, input={"when": object()})
    with pytest.raises(tl.InvalidInput, match="run_id"):
        client.start(flows.core, input={}, run_id="bad id with spaces")


def test_runs_lists_recent_runs(client) -> None:
    run = client.start(flows.core, input={"fail": "attempt"})
    run.wait(timeout=30)
    failed = client.runs(status="failed", workflow="core", limit=100)
    assert run.run_id in [r.run_id for r in failed]
    assert all(r.status == "failed" and r.workflow == "core" for r in failed)

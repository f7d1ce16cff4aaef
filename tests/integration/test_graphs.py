"""Graph workflows with business state (SPEC §7) on real Redis and real workers: the Comet
revision example, limits, broken handlers, loop and gate steps, retries, cancellation, views."""

from __future__ import annotations

import pytest

import taskloop as tl
from tests.integration import graph_flows as gf
from tests.integration.flows import recorded
from tests.ledger import assert_balanced
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")


@pytest.mark.parametrize(("approve_in", "reviews", "approved"), [(1, 1, True), (2, 2, True), (None, 2, False)],
                         ids=["approved-in-round-1", "approved-in-round-2", "never-approved"])
def test_the_revision_example(client, probe, approve_in: int | None, reviews: int, approved: bool) -> None:
    run = client.start(gf.revision, {"approve_in": approve_in})
    result = run.wait(timeout=30)
    # the run completes either way: "done" says the loop ended, the state says whether it approved
    assert (result.status, result.termination_code) == ("done", None)
    view = client.inspect(run.run_id)
    assert view.state == {"rounds": reviews, "approved": approved}
    assert [r["round"] for r in recorded(probe, run.run_id, "reviews")] == list(range(1, reviews + 1))
    # each activation is its own action, with its input and outcome
    actions = {key: t for key, t in view.tasks.items() if t.step == "review"}
    assert sorted(actions) == [f"review@{n}" for n in range(1, reviews + 1)]
    assert actions["review@1"].activation is None
    if reviews == 2:
        assert actions["review@2"].activation == {"round": 2}
        assert actions["review@1"].value == {"approved": False}
    assert all(t.status == "done" for t in actions.values())
    events = client.events(run.run_id)
    transitions = [e for e in events if e.type == "transition"]
    assert [e.key for e in transitions] == [f"review@{n}" for n in range(1, reviews + 1)]
    assert transitions[-1].data == {"next": [], "state": {"rounds": reviews, "approved": approved}}
    assert_balanced(events)


def test_a_runaway_handler_stops_at_max_transitions(client) -> None:
    result = client.start(gf.runaway, {}).wait(timeout=30)
    assert (result.status, result.termination_code) == ("failed", "limit")
    [error] = result.errors
    assert error.type == "GraphLimitReached" and "max_transitions is 5" in error.message
    view = client.inspect(result.run_id)
    assert sorted(view.tasks) == [f"spin@{n}" for n in range(1, 6)]  # 5 activations dispatched, no more
    assert view.state == {"count": 5}  # what the handler last wrote: never approval by default
    with pytest.raises(tl.GraphLimitReached, match="max_transitions is 5"):  # the typed error, as docs/graphs.md says
        result.raise_for_status()


@pytest.mark.parametrize(("workflow", "message", "state"), [
    ("undeclared", r"transition write -> publish is not declared .*add \('write', 'publish'\) to transitions=",
     {"stage": "start"}),
    ("invalid-state", r"returned an invalid state after review@1: -1 is less than the minimum of 0 "
                      r"\(at \$\.rounds\); the last valid state is kept", {"rounds": 0}),
    ("invalid-output", r"the output of review@1 does not match the output_schema of step review: 'maybe' is not "
                       r"of type 'boolean' \(at \$\.approved\)", {"rounds": 0}),
])
def test_a_broken_handler_state_or_output_fails_the_run_and_keeps_the_last_valid_state(
        client, workflow: str, message: str, state: dict) -> None:
    result = client.start(workflow, {"approve_in": None}).wait(timeout=30)
    assert (result.status, result.termination_code) == ("failed", "failed")
    [error] = [e for e in result.errors if not e.key]
    assert error.type == "GraphRunFailed"
    assert __import__("re").search(message, error.message), error.message
    assert client.inspect(result.run_id).state == state
    with pytest.raises(tl.GraphRunFailed, match=message):  # the typed error, not a bare TaskLoopError
        result.raise_for_status()


def test_loop_steps_gates_retries_and_parallel_activations(client, probe) -> None:
    run = client.start(gf.pipeline, {})
    wait_until(lambda: client.status(run.run_id) == "waiting", what="the approval gate")
    view = client.inspect(run.run_id)
    assert view.tasks["draft@1"].rounds[-1].round == 2  # a bounded loop inside the graph
    assert sorted(k for k in view.tasks if k.startswith("fetch@")) == ["fetch@1", "fetch@2"]
    assert view.tasks["fetch@1"].attempts == 2 and view.tasks["fetch@2"].attempts == 2  # retried once each
    assert view.tasks["approve@1"].status == "paused"
    with pytest.raises(tl.GateRefused, match="actor 'bob' may not decide"):
        client.decide(run.run_id, "approve@1", "approve", actor="bob")
    client.decide(run.run_id, "approve@1", "approve", actor="editor")
    result = run.wait(timeout=30)
    assert result.status == "done"
    state = client.inspect(run.run_id).state
    assert state["draft"] == "draft 2" and state["approved"] is True
    assert sorted(state["fetched"]) == ["fetched facts", "fetched refs"]
    assert_balanced(client.events(run.run_id))


def test_cancelling_a_graph_run(client, probe) -> None:
    run = client.start(gf.slow_graph, {"seconds": 30})
    wait_until(lambda: recorded(probe, run.run_id, "slow"), what="the step to start")
    assert client.cancel(run.run_id, "not needed").cancelled
    result = run.wait(timeout=20)
    assert (result.status, result.termination_code) == ("cancelled", "aborted")
    assert client.inspect(run.run_id).tasks["wait@1"].status == "cancelled"
    assert_balanced(client.events(run.run_id))


def test_steps_spread_over_worker_processes(client, probe) -> None:
    runs = [client.start(gf.revision, {"approve_in": None, "hold_s": 0.05}) for _ in range(6)]
    assert {r.wait(timeout=30).status for r in runs} == {"done"}
    pids = {row["pid"] for r in runs for row in recorded(probe, r.run_id, "reviews")}
    assert len(pids) >= 2


def test_a_resume_after_the_handler_changed_is_refused(client) -> None:
    from taskloop.define.workflow import REGISTRY

    result = client.start(gf.invalid_state, {"approve_in": None}).wait(timeout=30)
    assert result.status == "failed"
    REGISTRY.unregister("invalid-state", "1")
    try:
        tl.define_graph_workflow(
            "invalid-state", version="1", entry="review", steps={"review": tl.step(gf.review)},
            transitions=[("review", "review")], handler=tl.TransitionHandler("bad-state", "2", gf.bad_state),
            initial_state={"rounds": 0}, state_schema=gf.STATE)
        with pytest.raises(tl.IncompatibleDefinition, match="resumes only under the definition it started with"):
            client.resume(result.run_id)
    finally:
        REGISTRY.unregister("invalid-state", "1")
        REGISTRY.register(gf.invalid_state)


def test_views_inspect_cli_and_mermaid(client) -> None:
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    run = client.start(gf.revision, {"approve_in": 2})
    run.wait(timeout=30)
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    shown = subprocess.run([sys.executable, "-m", "taskloop", "inspect", run.run_id], capture_output=True, text=True,
                           env=env, timeout=60).stdout
    assert 'state {"rounds": 2, "approved": true}' in shown
    assert "review@1" in shown and "review@2" in shown and '{"round": 2}' in shown
    as_json = json.loads(subprocess.run([sys.executable, "-m", "taskloop", "inspect", run.run_id, "--json"],
                                        capture_output=True, text=True, env=env, timeout=60).stdout)
    assert as_json["state"] == {"rounds": 2, "approved": True}
    assert as_json["tasks"]["review@2"]["activation"] == {"round": 2}
    graph = subprocess.run([sys.executable, "-m", "taskloop", "graph", "pipeline", "--import",
                            "tests.integration.graph_flows"], capture_output=True, text=True, env=env, timeout=60)
    assert graph.stdout.splitlines() == [
        "flowchart TD",
        "    start((start)) --> draft",
        '    draft(["draft (loop, max 3 rounds)"])',
        '    approve{"approve (approval gate)"}',
        '    fetch["fetch"]',
        "    draft --> fetch",
        "    fetch --> approve",
    ]

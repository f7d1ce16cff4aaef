"""Fork a run from a round (SPEC §9), on real workers: rounds copied, feedback replaced, upstream
not run again (counted by a side effect), downstream run again, the rounds left, a fork of a fork,
a fork of a run no longer listed, a graph run forked at an action, usage and budget, and each
refusal."""

from __future__ import annotations

import time

import pytest

import taskloop as tl
from taskloop.core import fields as fld
from taskloop.store import keys as k
from tests.integration import control_flows as cf
from tests.integration import fork_flows as ff
from tests.integration import graph_flows as gf
from tests.integration.flows import recorded
from tests.ledger import assert_balanced
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")


def _original(client, workflow=ff.essay, **given):  # type: ignore[no-untyped-def]
    handle = client.start(workflow, input=given, run_id=f"fork-orig-{time.time_ns()}")
    return handle.run_id, handle.wait(timeout=30)


def test_a_fork_keeps_the_rounds_before_and_gives_its_round_the_new_feedback(client, probe) -> None:
    original, result = _original(client, accept_at=3)
    assert result.status == "done" and result.values["draft"] == "draft 3 after round 2: too long"
    fork = client.fork(original, "draft", 2, "shorter, and cite a source")
    result = fork.wait(timeout=30)
    assert result.status == "done"
    assert result.values["draft"] == "draft 2 after shorter, and cite a source"
    assert result.values["publish"] == "published: draft 2 after shorter, and cite a source"  # downstream ran again
    # upstream and independent tasks were not run again: their values are the original's
    assert result.values["source"] == "notes on bounded loops" and result.values["side"] == "an independent branch"
    assert recorded(probe, fork.run_id, "source_calls") == [] and recorded(probe, fork.run_id, "side_calls") == []
    assert recorded(probe, fork.run_id, "publish_calls") == [1]
    assert recorded(probe, fork.run_id, "attempts") == [{"round": 2, "feedback": "shorter, and cite a source"}]
    view = client.inspect(fork.run_id)
    assert view.forked_from == {"run_id": original, "task": "draft", "round": 2}
    draft = view.tasks["draft"]
    assert [(r.round, r.copied) for r in draft.rounds] == [(1, True), (2, False)]
    assert draft.rounds[0].output == "draft 1" and draft.rounds[0].check["feedback"] == "round 1: too long"
    assert draft.rounds[1].feedback_given == "shorter, and cite a source"
    assert view.tasks["source"].copied and view.tasks["side"].copied and not view.tasks["publish"].copied
    started = client.events(fork.run_id)[0]
    assert started.type == "run.started" and started.data["forked_from"] == view.forked_from
    assert_balanced(client.events(fork.run_id))
    # the original is untouched
    assert client.inspect(original).tasks["draft"].round == 3 and client.inspect(original).forked_from is None


def test_without_feedback_the_round_gets_the_feedback_recorded_for_the_round_before(client, probe) -> None:
    original, _ = _original(client, accept_at=3)
    fork = client.fork(original, "draft", 3)
    assert fork.wait(timeout=30).values["draft"] == "draft 3 after round 2: too long"
    assert recorded(probe, fork.run_id, "attempts") == [{"round": 3, "feedback": "round 2: too long"}]
    first = client.fork(original, "draft", 1)  # round 1: no feedback, as in any first round
    first.wait(timeout=30)
    assert recorded(probe, first.run_id, "attempts")[0] == {"round": 1, "feedback": None}


def test_copied_rounds_count_against_max_rounds_and_the_usage(client) -> None:
    original, result = _original(client)  # never accepted: exhausted after 4 rounds
    assert result.status == "failed" and result.errors[0].type == "LoopTaskExhausted"
    fork = client.fork(original, "draft", 3, "one more try")
    result = fork.wait(timeout=30)
    assert result.status == "failed" and result.errors[0].type == "LoopTaskExhausted"  # rounds 3 and 4 were left
    view = client.inspect(fork.run_id)
    assert [r.round for r in view.tasks["draft"].rounds] == [1, 2, 3, 4]
    assert view.copied["usage"]["attempts"] == 1 + 1 + 2  # source, side, and the two copied rounds
    assert view.usage["attempts"] == 1 + 1 + 4


def test_the_budget_counts_the_copied_rounds(client) -> None:
    # Given a run under Budget(attempts=6) that used all 6: source, side, and 4 rejected rounds
    original, result = _original(client, workflow=ff.budgeted)
    assert result.status == "failed" and result.errors[0].type == "LoopTaskExhausted"
    assert client.inspect(original).usage["attempts"] == 6
    # When it is forked at round 4 with the feedback that passes
    fork = client.fork(original, "draft", 4, "shorter")
    result = fork.wait(timeout=30)
    # Then round 4 is the 6th attempt (5 were copied) and publish, the 7th, is refused by the budget
    assert client.inspect(fork.run_id).copied["usage"]["attempts"] == 5
    assert result.status == "failed" and result.values["draft"] == "draft 4 after shorter"
    assert [e.type for e in result.errors] == ["WorkflowBudgetExceeded"] and result.errors[0].key == "publish"


def test_a_fork_of_a_fork_and_the_chain_back(client) -> None:
    original, _ = _original(client, accept_at=4)
    first = client.fork(original, "draft", 2, "keep going")
    assert first.wait(timeout=30).status == "done"
    second = client.fork(first.run_id, "draft", 3, "shorter")
    result = second.wait(timeout=30)
    assert result.values["draft"] == "draft 3 after shorter"
    view = client.inspect(second.run_id)
    rounds = view.tasks["draft"].rounds
    assert [(r.round, r.copied) for r in rounds] == [(1, True), (2, True), (3, False)]
    assert rounds[1].output == "draft 2 after keep going"  # the first fork's round 2, copied on
    chain, at = [], second.run_id
    while at is not None:
        chain.append(at)
        origin = client.inspect(at).forked_from
        at = origin["run_id"] if origin else None
    assert chain == [second.run_id, first.run_id, original]


def test_a_run_no_longer_listed_but_still_stored_can_be_forked(client, probe) -> None:
    original, _ = _original(client, accept_at=2)
    for key in probe.scan_iter("tl:runs*"):
        if probe.type(key) == "zset":
            probe.zrem(key, original)
    assert original not in [r.run_id for r in client.runs(limit=500)]
    assert client.fork(original, "draft", 2, "shorter").wait(timeout=30).status == "done"


def test_a_graph_run_forks_at_an_action_from_the_state_before_it(client, probe) -> None:
    handle = client.start(gf.revision, input={"approve_in": 99}, run_id=f"fork-graph-{time.time_ns()}")
    result = handle.wait(timeout=30)
    assert result.status == "done" and client.inspect(handle.run_id).state == {"rounds": 2, "approved": False}
    fork = client.fork(handle.run_id, "review@2", 1)
    assert fork.wait(timeout=30).status == "done"
    view = client.inspect(fork.run_id)
    assert view.state == {"rounds": 2, "approved": False}  # the second review ran again from rounds=1
    assert [r["round"] for r in recorded(probe, fork.run_id, "reviews")] == [2]  # review@1 was not run again
    assert view.tasks["review@1"].copied and not view.tasks["review@2"].copied
    assert view.tasks["review@2"].activation == {"round": 2}
    transitions = [e for e in client.events(fork.run_id) if e.type == "transition"]
    assert [e.key for e in transitions] == ["review@2"]
    with pytest.raises(tl.InvalidInput, match="is not an action of run"):
        client.fork(handle.run_id, "review", 1)


def test_refusals_name_what_is_wrong(client, probe) -> None:
    running = client.start(cf.cancellable, input={"hold": "attempt"}, run_id=f"fork-live-{time.time_ns()}")
    wait_until(lambda: probe.get(f"test:{running.run_id}:started") is not None, timeout=20, what="attempt began")
    with pytest.raises(tl.NotForkable, match="only a finished run"):
        client.fork(running.run_id, "hold", 1)
    client.cancel(running.run_id, "done testing")
    original, _ = _original(client, accept_at=2)
    with pytest.raises(tl.InvalidInput, match=r"round 3 of task draft was never reached .*reached round 2"):
        client.fork(original, "draft", 3)
    with pytest.raises(tl.InvalidInput, match="task nope is not a task of workflow fork-essay"):
        client.fork(original, "nope", 1)
    with pytest.raises(tl.InvalidInput, match="not a loop: a plain task or a gate forks at round 1"):
        client.fork(original, "source", 2)
    with pytest.raises(tl.InvalidInput, match="round must be a round number"):
        client.fork(original, "draft", 0)
    with pytest.raises(tl.InvalidInput, match="feedback must be None or a string"):
        client.fork(original, "draft", 1, 42)  # type: ignore[arg-type]
    with pytest.raises(tl.RunNotFound):
        client.fork("fork-no-such-run", "draft", 1)
    taken = client.fork(original, "draft", 1, new_run_id=f"fork-taken-{time.time_ns()}")
    with pytest.raises(tl.RunExists):
        client.fork(original, "draft", 1, new_run_id=taken.run_id)
    probe.hset(k.RunKeys.of(original).run, fld.F_FINGERPRINT, "0" * 32)  # as if the definition had changed
    with pytest.raises(tl.IncompatibleDefinition, match="another definition"):
        client.fork(original, "draft", 1)

"""Flow loops (SPEC §8) on real Redis and real workers: Go Micro's loop tests ported, and the
model-judged stops (until_llm, llm_check) against a real local chat-completions server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import taskloop as tl
from tests.conftest import Workers
from tests.integration import graph_flows as gf
from tests.integration.flows import recorded
from tests.ledger import assert_balanced
from tests.llm_server import ChatServer, Reply

pytestmark = pytest.mark.usefixtures("workers")


def test_until_stops_at_iteration_3(client, probe) -> None:
    # Go Micro's example: each pass adds 30 to the quality, until it reaches 90
    result = client.start(gf.refine, {}).wait(timeout=30)
    assert result.status == "done"
    assert result.values["improve"] == {"text": "draft refined (quality 90)", "quality": 90}
    assert [b["iteration"] for b in recorded(probe, result.run_id, "bodies")] == [1, 2, 3]
    assert [b["quality"] for b in recorded(probe, result.run_id, "bodies")] == [0, 30, 60]  # state flows on
    rounds = client.inspect(result.run_id).tasks["improve"].rounds
    assert rounds[-1].check == {"done": True, "feedback": "until: stopped after iteration 3"}


def test_a_cap_of_5_runs_the_body_exactly_5_times_and_returns_the_last_state(client, probe) -> None:
    result = client.start(gf.capped, {}).wait(timeout=30)
    assert (result.status, result.errors) == ("done", [])  # reaching the cap is not an error
    assert result.values["improve"]["quality"] == 150
    assert len(recorded(probe, result.run_id, "bodies")) == 5
    assert client.inspect(result.run_id).tasks["improve"].rounds[-1].check["feedback"].startswith("max_iterations")


def test_on_iteration_sees_iterations_1_2_3_in_order(client, probe) -> None:
    result = client.start(gf.observed, {}).wait(timeout=30)
    assert result.status == "done"
    assert recorded(probe, result.run_id, "iterations") == [1, 2, 3]


def test_a_body_error_fails_the_task_with_loop_iteration_n(client) -> None:
    result = client.start(gf.refine, {"fail_at": 2}).wait(timeout=30)
    assert result.status == "failed"
    [error] = result.errors
    assert error.message.startswith("loop iteration 2: ValueError: the draft caught fire")
    assert error.type == "LoopIterationError"


def test_max_iterations_0_means_10(client, probe) -> None:
    result = client.start(gf.default_cap, {}).wait(timeout=30)
    assert result.status == "done" and result.values["improve"]["quality"] == 300
    assert len(recorded(probe, result.run_id, "bodies")) == 10


def test_the_initial_state_defaults_to_the_run_input(client) -> None:
    result = client.start(gf.from_input, {"text": "x", "quality": 50}).wait(timeout=30)
    assert result.values["improve"]["quality"] == 110
    assert_balanced(client.events(result.run_id))


# --- model-judged stops ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat() -> Iterator[ChatServer]:
    with ChatServer() as server:
        yield server


@pytest.fixture(scope="module")
def model_workers(workers: Workers, chat: ChatServer) -> Iterator[None]:
    """A worker with a model (queue "llm") and one without (queue "no-llm")."""
    env = {"TASKLOOP_LLM_BASE_URL": chat.base_url, "TASKLOOP_LLM_MODEL": "judge-1", "TASKLOOP_LLM_API_KEY": "k-1"}
    workers.start("llm", concurrency=1, env=env, queues="llm")
    workers.start("nollm", concurrency=1, queues="no-llm")
    yield


def test_until_llm_stops_when_the_model_says_yes(client, chat: ChatServer, model_workers: None) -> None:
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}
    chat.script(Reply("No, it is still rough.", usage), Reply("Yes, ready to publish.", usage))
    before = len(chat.requests)
    result = client.start(gf.judged, {}).wait(timeout=60)
    assert result.status == "done" and result.values["improve"]["quality"] == 60
    requests = chat.requests[before:]
    assert len(requests) == 2
    assert requests[0].body["model"] == "judge-1" and requests[0].headers["authorization"] == "Bearer k-1"
    assert "Is the draft good enough to publish?" in requests[0].body["messages"][-1]["content"]
    # the judgement is a recorded part of its phase: prompt, reply and usage in inspect ...
    rounds = client.inspect(result.run_id).tasks["improve"].rounds
    judge = rounds[1].notes["check"]["llm"]
    assert judge["reply"] == "Yes, ready to publish." and judge["affirmative"] is True
    assert judge["usage"] == {"input": 40, "cached": 8, "output": 2}
    assert judge["messages"][-1]["content"] == requests[1].body["messages"][-1]["content"]
    assert rounds[1].check == {"done": True, "feedback": "until_llm: Yes, ready to publish."}
    # ... and counted in the run's token usage (what a token budget caps)
    assert result.usage["tokens"] == {"input": 80, "cached": 16, "output": 4}


def test_a_failed_model_call_is_retried_by_the_loops_retry_policy(client, chat: ChatServer,
                                                                  model_workers: None) -> None:
    chat.script(Reply(status=503), Reply("yes"))
    result = client.start(gf.judged, {}).wait(timeout=60)
    assert result.status == "done" and result.values["improve"]["quality"] == 30
    [retry] = [e for e in client.events(result.run_id) if e.type == "retry"]
    assert (retry.round, retry.phase, retry.data["try"]) == (1, "check", 2)  # the same round's check, again
    assert "503" in retry.data["error"]
    assert_balanced(client.events(result.run_id))


def test_without_a_model_until_llm_fails_clearly(client, model_workers: None) -> None:
    result = client.start(gf.judged_without_model, {}).wait(timeout=60)
    assert result.status == "failed"
    assert result.errors[0].message.startswith("until_llm requires a model")


def test_llm_check_uses_the_reply_as_feedback(client, chat: ChatServer, model_workers: None) -> None:
    chat.script(Reply("No: add a conclusion."), Reply("Done."))
    result = client.start(gf.reviewed_by_model, {}).wait(timeout=60)
    assert result.status == "done" and result.values["essay"] == "essay v2 (No: add a conclusion.)"
    rounds = client.inspect(result.run_id).tasks["essay"].rounds
    assert rounds[0].check == {"done": False, "feedback": "No: add a conclusion."}


def test_loop_definitions_are_checked() -> None:
    with pytest.raises(tl.DefinitionError, match="loop bad: body must be a callable"):
        tl.loop("bad", "not callable")  # type: ignore[arg-type]
    with pytest.raises(tl.DefinitionError, match=r"loop bad: until must accept \(ctx, state, iteration\)"):
        tl.loop("bad", gf.improve, until=lambda state: True)
    with pytest.raises(tl.DefinitionError, match="until_llm must be a yes/no question"):
        tl.loop("bad", gf.improve, until_llm="  ")

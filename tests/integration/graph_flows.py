"""Graph workflows and flow loops for the tests (SPEC §7 and §8); imported by the test process
and by the workers. Callbacks record what they saw in the test Redis, as tests/integration/flows.py."""

from __future__ import annotations

import os
import time
from typing import Any

import taskloop as tl
from tests.integration.flows import record, record_for

# --- the Comet revision example: at most two review rounds, stop as soon as one approves ------------


def review(ctx: tl.TaskContext) -> dict[str, Any]:
    round_ = (ctx.activation or {}).get("round", 1)
    record(ctx, "reviews", {"round": round_, "key": ctx.key, "pid": os.getpid()})
    time.sleep(float(ctx.input.get("hold_s", 0)))
    return {"approved": ctx.input.get("approve_in") == round_}


def revision_policy(run: Any, event: Any) -> tl.Transition:
    if event.kind != "action-outcome":
        return tl.Transition(run.state, [])
    rounds = run.state["rounds"] + 1
    approved = event.outcome.output["approved"] is True
    done = approved or rounds >= 2
    return tl.Transition({"rounds": rounds, "approved": approved},
                         [] if done else [tl.Activation("review", {"round": rounds + 1})])


REVIEW_OUTPUT = {"type": "object", "required": ["approved"], "properties": {"approved": {"type": "boolean"}}}
STATE = {"type": "object", "required": ["rounds"], "additionalProperties": False,
         "properties": {"rounds": {"type": "integer", "minimum": 0, "maximum": 2},
                        "approved": {"type": "boolean"}}}

revision = tl.define_graph_workflow(
    "revision-loop", version="1", entry="review",
    steps={"review": tl.step(review, output_schema=REVIEW_OUTPUT)},
    transitions=[("review", "review")],
    handler=tl.TransitionHandler("revision-policy", "1", revision_policy),
    initial_state={"rounds": 0}, state_schema=STATE, max_transitions=10,
)

# --- a runaway handler: always activates again --------------------------------------------------------


def again(run: Any, event: Any) -> tl.Transition:
    return tl.Transition({"count": run.state["count"] + 1}, ["spin"])


runaway = tl.define_graph_workflow(
    "runaway", version="1", entry="spin", steps={"spin": tl.step(lambda ctx: "spun")},
    transitions=[("spin", "spin")], handler=tl.TransitionHandler("always-again", "1", again),
    initial_state={"count": 0}, max_transitions=5,
)

# --- broken handlers: an undeclared transition, an invalid state, an invalid output -------------------


def to_publish(run: Any, event: Any) -> tl.Transition:
    return tl.Transition({"stage": "writing"}, ["publish"])


def bad_state(run: Any, event: Any) -> tl.Transition:
    return tl.Transition({"rounds": -1}, [])


undeclared = tl.define_graph_workflow(
    "undeclared", version="1", entry="write",
    steps={"write": tl.step(lambda ctx: "draft"), "publish": tl.step(lambda ctx: "published")},
    transitions=[], handler=tl.TransitionHandler("to-publish", "1", to_publish),
    initial_state={"stage": "start"},
)
invalid_state = tl.define_graph_workflow(
    "invalid-state", version="1", entry="review", steps={"review": tl.step(review)},
    transitions=[("review", "review")], handler=tl.TransitionHandler("bad-state", "1", bad_state),
    initial_state={"rounds": 0}, state_schema=STATE,
)
invalid_output = tl.define_graph_workflow(
    "invalid-output", version="1", entry="review",
    steps={"review": tl.step(lambda ctx: {"approved": "maybe"}, output_schema=REVIEW_OUTPUT)},
    transitions=[], handler=tl.TransitionHandler("revision-policy", "1", revision_policy),
    initial_state={"rounds": 0}, state_schema=STATE,
)

# --- a graph with a loop step, a gate, a retried step and parallel activations ------------------------


def draft_attempt(ctx: tl.LoopContext, feedback: str | None) -> str:
    record(ctx, "drafts", {"round": ctx.round, "pid": os.getpid()})
    return f"draft {ctx.round}"


def draft_check(ctx: tl.LoopContext, candidate: str) -> tl.LoopCheck:
    return tl.LoopCheck(done=ctx.round >= 2, feedback=None if ctx.round >= 2 else "more")


def flaky(ctx: tl.TaskContext) -> str:
    record(ctx, "flaky", ctx.attempt)
    if ctx.attempt < 2:
        raise ConnectionError("try again")
    return f"fetched {ctx.activation['what']}"


def pipeline_policy(run: Any, event: Any) -> tl.Transition:
    state = dict(run.state)
    output = event.outcome.output
    if event.step == "draft":
        state["draft"] = output
        fetches = [tl.Activation("fetch", {"what": "facts"}), tl.Activation("fetch", {"what": "refs"})]
        return tl.Transition(state, fetches)
    if event.step == "fetch":
        state.setdefault("fetched", []).append(output)
        if len(state["fetched"]) < 2:
            return tl.Transition(state, [])
        return tl.Transition(state, ["approve"])
    state["approved"] = event.outcome.status == "succeeded"
    return tl.Transition(state, [])


pipeline = tl.define_graph_workflow(
    "pipeline", version="1", entry="draft",
    steps={
        "draft": tl.step(attempt=draft_attempt, check=draft_check, max_rounds=3),
        "fetch": tl.step(flaky, retry=tl.Retry(attempts=3)),
        "approve": tl.step(gate="approval", prompt="Publish?", actors=["editor"]),
    },
    transitions=[("draft", "fetch"), ("fetch", "approve")],
    handler=tl.TransitionHandler("pipeline-policy", "1", pipeline_policy),
    initial_state={}, max_transitions=10,
)

# --- a long graph step (cancel, SIGKILL) ---------------------------------------------------------------


def slow_step(ctx: tl.TaskContext) -> str:
    record(ctx, "slow", {"pid": os.getpid(), "at": time.time()})
    ctx.signal.wait(float(ctx.input.get("seconds", 5)))
    ctx.signal.raise_if_cancelled()
    return "slow done"


def once(run: Any, event: Any) -> tl.Transition:
    return tl.Transition({"done": event.outcome.status}, [])


slow_graph = tl.define_graph_workflow(
    "slow-graph", version="1", entry="wait", steps={"wait": tl.step(slow_step)}, transitions=[],
    handler=tl.TransitionHandler("once", "1", once), initial_state={},
)

# --- flow loops (tl.loop), the Go Micro tests ported ----------------------------------------------------


def improve(ctx: tl.LoopContext, state: dict[str, Any]) -> dict[str, Any]:
    record(ctx, "bodies", {"iteration": ctx.round, "quality": state["quality"], "pid": os.getpid()})
    time.sleep(float(ctx.input.get("hold_s", 0)))
    if ctx.input.get("fail_at") == ctx.round:
        raise ValueError("the draft caught fire")
    quality = state["quality"] + 30
    return {"text": f"draft refined (quality {quality})", "quality": quality}


def good_enough(ctx: tl.LoopContext, state: dict[str, Any], iteration: int) -> bool:
    return bool(state["quality"] >= ctx.input.get("goal", 90))


def seen(ctx: tl.LoopContext) -> Any:
    return {"text": "initial draft", "quality": 0}


def log_iteration(iteration: int, state: dict[str, Any]) -> None:
    record_for(state["run"], "iterations", iteration)  # on_iteration sees no ctx: the state names its run


def tagged_improve(ctx: tl.LoopContext, state: dict[str, Any]) -> dict[str, Any]:
    return {**improve(ctx, state), "run": ctx.run_id}


refine = tl.define_workflow("refine", version="1", tasks=[
    tl.loop("improve", improve, initial=seen, until=good_enough, max_iterations=10),
])
capped = tl.define_workflow("capped", version="1", tasks=[
    tl.loop("improve", improve, initial=seen, until=lambda ctx, state, iteration: False, max_iterations=5),
])
observed = tl.define_workflow("observed", version="1", tasks=[
    tl.loop("improve", tagged_improve, initial=seen, until=good_enough, on_iteration=log_iteration),
])
default_cap = tl.define_workflow("default-cap", version="1", tasks=[
    tl.loop("improve", improve, initial=seen, max_iterations=0),
])
from_input = tl.define_workflow("from-input", version="1", tasks=[
    tl.loop("improve", improve, until=good_enough, max_iterations=4),
])
# model-judged stops run on workers that have a model: their own queue (see test_flow_loops.py)
judged = tl.define_workflow("judged", version="1", tasks=[
    tl.loop("improve", improve, initial=seen, until_llm="Is the draft good enough to publish?",
            max_iterations=4, retry=tl.Retry(attempts=3, delay_ms=100), queue="llm"),
])
judged_without_model = tl.define_workflow("judged-without-model", version="1", tasks=[
    tl.loop("improve", improve, initial=seen, until_llm="Is it good?", queue="no-llm"),
])


def essay_attempt(ctx: tl.LoopContext, feedback: str | None) -> str:
    return f"essay v{ctx.round}" + (f" ({feedback})" if feedback else "")


reviewed_by_model = tl.define_workflow("reviewed-by-model", version="1", tasks=[
    tl.define_loop_task("essay", max_rounds=3, attempt=essay_attempt, check=tl.llm_check("Is this essay done?"),
                        queue="llm"),
])

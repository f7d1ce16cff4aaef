"""The three kinds of taskloop work in one module: a loop task, a graph workflow and a flow loop.

    taskloop worker --import examples.workflows -c 2 &
    taskloop start essay --input '{"topic": "bounded loops"}' --wait
    taskloop start report-revision --input '{"approve_in": 2}' --wait
    taskloop start refine-draft --input '{"text": "first draft", "quality": 0}' --wait

No model is needed: the "reviews" below are plain functions. Swap in ``tl.llm_check(...)`` or
``until_llm=...`` (with TASKLOOP_LLM_BASE_URL and TASKLOOP_LLM_MODEL set) for model-judged stops.
"""

from __future__ import annotations

from typing import Any

import taskloop as tl

# --- a loop task: attempt, check, feedback, at most 3 rounds --------------------------------------


def write(ctx: tl.LoopContext, feedback: str | None) -> str:
    text = f"An essay on {ctx.input['topic']}"
    return text + " with a conclusion." if feedback else text + "."


def review_essay(ctx: tl.LoopContext, essay: str) -> tl.LoopCheck:
    if "conclusion" in essay:
        return tl.LoopCheck(done=True)
    return tl.LoopCheck(done=False, feedback="add a conclusion")


essay = tl.define_workflow("essay", version="1", tasks=[
    tl.define_loop_task("write", max_rounds=3, attempt=write, check=review_essay),
])

# --- a graph workflow with business state: at most two review rounds (the Comet example) ------------


def review(ctx: tl.TaskContext) -> dict[str, bool]:
    round_ = (ctx.activation or {}).get("round", 1)
    return {"approved": ctx.input.get("approve_in") == round_}


def revision_policy(run: Any, event: Any) -> tl.Transition:
    """Pure: the new state and what to activate next, from the state and the action's outcome."""
    rounds = run.state["rounds"] + 1
    approved = event.outcome.output["approved"] is True
    if approved or rounds >= 2:
        return tl.Transition({"rounds": rounds, "approved": approved}, [])
    return tl.Transition({"rounds": rounds, "approved": False}, [tl.Activation("review", {"round": rounds + 1})])


report_revision = tl.define_graph_workflow(
    "report-revision", version="1", entry="review",
    steps={"review": tl.step(review, output_schema={
        "type": "object", "required": ["approved"], "properties": {"approved": {"type": "boolean"}}})},
    transitions=[("review", "review")],
    handler=tl.TransitionHandler("revision-policy", "1", revision_policy),
    initial_state={"rounds": 0},
    state_schema={"type": "object", "required": ["rounds"],
                  "properties": {"rounds": {"type": "integer", "minimum": 0, "maximum": 2},
                                 "approved": {"type": "boolean"}}},
    max_transitions=10,
)

# --- a flow loop: refine a draft until it is good enough, at most 10 passes (the Go Micro example) --


def improve(ctx: tl.LoopContext, draft: dict[str, Any]) -> dict[str, Any]:
    quality = draft["quality"] + 30
    return {"text": f"draft refined (quality {quality})", "quality": quality}


refine_draft = tl.define_workflow("refine-draft", version="1", tasks=[
    tl.loop("improve", improve, until=lambda ctx, draft, iteration: draft["quality"] >= 90, max_iterations=10),
])

"""Workflows of the security tests (imported by the test process and by their worker).

Sizes come from the run input, so that one definition serves a value under and over a cap."""

from __future__ import annotations

from typing import Any

import taskloop as tl


def _blob(ctx: tl.TaskContext) -> str:
    if ctx.input.get("raise"):
        raise ValueError("e" * int(ctx.input["raise"]))
    return "x" * int(ctx.input.get("size", 1))


# a plain task whose output is as large as the input asks
big_output = tl.define_workflow("sec-big-output", version="1", tasks=[tl.define_task("emit", run=_blob)])

# the same, with a retry policy whose accepts refuses OutputTooLarge (it sees the typed error)
big_output_retry = tl.define_workflow("sec-big-output-retry", version="1", tasks=[
    tl.define_task("emit", run=_blob,
                   retry=tl.Retry(attempts=3, accepts=lambda error, attempt: not isinstance(error, tl.OutputTooLarge))),
])


def _candidate(ctx: tl.LoopContext, feedback: str | None) -> str:
    return _blob(ctx)


def _accept(ctx: tl.LoopContext, candidate: Any) -> tl.LoopCheck:
    return tl.LoopCheck(done=True)


def _long_feedback(ctx: tl.LoopContext, candidate: Any) -> tl.LoopCheck:
    return tl.LoopCheck(done=False, feedback="f" * int(ctx.input.get("feedback", 1)))


# a loop whose candidate is as large as the input asks (check accepts anything)
big_candidate = tl.define_workflow("sec-big-candidate", version="1", tasks=[
    tl.define_loop_task("draft", max_rounds=2, attempt=_candidate, check=_accept),
])

# a loop whose check rejects with a feedback as long as the input asks
big_feedback = tl.define_workflow("sec-big-feedback", version="1", tasks=[
    tl.define_loop_task("draft", max_rounds=2, attempt=lambda ctx, feedback: 1, check=_long_feedback),
])


def _receipt(ctx: tl.TaskContext) -> int:
    counted = ctx.report_usage_once("r" * int(ctx.input.get("receipt", 8)), input=1)
    return 1 if counted else 0


receipts = tl.define_workflow("sec-receipt", version="1", tasks=[tl.define_task("bill", run=_receipt)])


def _notes(ctx: tl.TaskContext) -> int:
    ctx.notes["blob"] = "n" * int(ctx.input.get("size", 1))
    return 1


notes = tl.define_workflow("sec-notes", version="1", tasks=[tl.define_task("noted", run=_notes)])

# a gate that takes a value (resume), then a task that reads it
edit = tl.define_gate("edit", kind="input", prompt="the title")
gated = tl.define_workflow("sec-gated", version="1", tasks=[
    edit, tl.define_task("use", run=lambda ctx: len(ctx.value(edit)), after=[edit]),
])

# a cached task with no max_age_ms: its entry gets TASKLOOP_CACHE_TTL_S
cached = tl.define_workflow("sec-cached", version="1", tasks=[
    tl.define_task("lookup", run=lambda ctx: {"n": ctx.input.get("n", 0)},
                   cache=tl.Cache(key=lambda ctx: ctx.input.get("n", 0))),
])


def _hold(ctx: tl.TaskContext) -> str:
    ctx.signal.wait(float(ctx.input.get("hold_s", 30)))
    return "held"


# a running phase to aim forged messages at (cancel the run to end it)
hold = tl.define_workflow("sec-hold", version="1", tasks=[tl.define_task("hold", run=_hold)])

small = tl.define_workflow("sec-small", version="1", tasks=[tl.define_task("one", run=lambda ctx: 1)])


# a graph whose handler grows its state by the size the input asks for
def _grow(run: Any, event: Any) -> tl.Transition:
    return tl.Transition({"blob": "s" * int(run.input.get("state", 1))}, [])


def _activate_big(run: Any, event: Any) -> tl.Transition:
    if event.step == "next":
        return tl.Transition(run.state, [])
    return tl.Transition(run.state, [tl.Activation("next", {"blob": "a" * int(run.input.get("activation", 1))})])


grow_state = tl.define_graph_workflow(
    "sec-graph-state", version="1", entry="step", steps={"step": tl.step(lambda ctx: 1)}, transitions=[],
    handler=tl.TransitionHandler("grow", "1", _grow), initial_state={"blob": ""},
)
big_activation = tl.define_graph_workflow(
    "sec-graph-activation", version="1", entry="step",
    steps={"step": tl.step(lambda ctx: 1), "next": tl.step(lambda ctx: 2)}, transitions=[("step", "next")],
    handler=tl.TransitionHandler("activate-big", "1", _activate_big), initial_state={},
)


# a loop that records untrusted text from its input as its candidate and as every feedback (the
# reviewer model's reply is untrusted); it exhausts its two rounds
def _echo(ctx: tl.LoopContext, feedback: str | None) -> Any:
    return ctx.input.get("output")


def _hostile_review(ctx: tl.LoopContext, candidate: Any) -> tl.LoopCheck:
    return tl.LoopCheck(done=False, feedback=ctx.input["feedback"])


hostile_text = tl.define_workflow("sec-hostile-text", version="1", tasks=[
    tl.define_loop_task("review", max_rounds=2, attempt=_echo, check=_hostile_review),
])

"""Workflows the UI tests and the screenshot script run (imported by the shared test workers)."""

from __future__ import annotations

import time

import taskloop as tl

PARAGRAPH = ("Bounded loops give a reviewer something to push against: each round the writer sees the last "
             "verdict and tries again, and the run stops when the check accepts or the rounds run out. ")


def write(ctx: tl.LoopContext, feedback: str | None) -> str:
    if ctx.input.get("pace"):
        ctx.signal.wait(float(ctx.input["pace"]))
    body = PARAGRAPH * (6 if ctx.round == 1 else 2)
    return f"Draft {ctx.round} on {ctx.input.get('topic', 'bounded loops')}.\n\n{body}" + (
        f"\n\n(revised after: {feedback})" if feedback else "")


def review(ctx: tl.LoopContext, draft: str) -> tl.LoopCheck:
    if ctx.input.get("pace"):
        ctx.signal.wait(float(ctx.input["pace"]))
    accept_in = int(ctx.input.get("accept_in", 3))
    if ctx.round >= accept_in:
        return tl.LoopCheck(done=True)
    hostile = ctx.input.get("feedback")
    return tl.LoopCheck(done=False, feedback=hostile or f"round {ctx.round}: cite a source for the second claim")


writer = tl.define_workflow("ui-writer", version="1", tasks=[
    tl.define_task("outline", run=lambda ctx: ["why loops", "why bounds", "how to watch them"]),
    tl.define_loop_task("draft", max_rounds=4, attempt=write, check=review, after=["outline"]),
    tl.define_task("publish", run=lambda ctx: {"words": len(ctx.value("draft").split())}, after=["draft"]),
])

never_good = tl.define_workflow("ui-exhaust", version="1", tasks=[
    tl.define_loop_task("polish", max_rounds=2, attempt=lambda ctx, feedback: f"try {ctx.round}",
                        check=lambda ctx, candidate: tl.LoopCheck(done=False, feedback="still not good enough")),
])

gated = tl.define_workflow("ui-gate", version="1", tasks=[
    tl.define_task("draft", run=lambda ctx: "a draft to approve"),
    tl.define_gate("approval", prompt="Publish this draft?", after=["draft"]),
    tl.define_task("publish", run=lambda ctx: f"published: {ctx.value('draft')}", after=["draft", "approval"]),
])


def _slow(ctx: tl.TaskContext) -> str:
    time.sleep(float(ctx.input.get("seconds", 0.05)))
    return "ok"


wide = tl.define_workflow("ui-wide", version="1", tasks=[tl.define_task(f"t{i:04d}", run=_slow) for i in range(1000)])

"""Workflows the ops tests run on workers besides examples.workflows: a cached task (under a fleet
limit), a slow loop
(to cancel while it runs), a task that fails until a marker file exists (to resume), and a gate
(to approve)."""

from __future__ import annotations

import os
import time

import taskloop as tl

cached = tl.define_workflow("ops-cached", version="1", tasks=[
    tl.define_task("lookup", run=lambda ctx: {"n": ctx.input["n"] * 2},
                   cache=tl.Cache(key=lambda ctx: ctx.input["n"]),
                   limits=[tl.Concurrency("ops-lookups", limit=4)]),  # the worker role runs fleet limits too
])


def _slow_attempt(ctx: tl.LoopContext, feedback: object) -> int:
    time.sleep(0.2)
    return ctx.round


slow = tl.define_workflow("ops-slow", version="1", tasks=[
    tl.define_loop_task("grind", max_rounds=200, attempt=_slow_attempt,
                        check=lambda ctx, candidate: tl.LoopCheck(done=False, feedback="again")),
])


def _flaky(ctx: tl.TaskContext) -> str:
    marker = ctx.input["marker"]
    if not os.path.exists(marker):
        raise RuntimeError(f"no marker file {marker} yet")
    return "recovered"


flaky = tl.define_workflow("ops-flaky", version="1", tasks=[tl.define_task("fragile", run=_flaky)])


budgeted = tl.define_workflow("ops-budgeted", version="1", budget=tl.Budget(attempts=10), tasks=[
    tl.define_loop_task("draft", max_rounds=3, attempt=lambda ctx, feedback: ctx.round,
                        check=lambda ctx, candidate: tl.LoopCheck(done=candidate >= 2, feedback="more")),
])


gated = tl.define_workflow("ops-gate", version="1", tasks=[
    tl.define_task("draft", run=lambda ctx: "a draft"),
    tl.define_gate("approval", prompt="Publish the draft?", after=["draft"]),
    tl.define_task("publish", run=lambda ctx: f"published: {ctx.value('draft')}", after=["draft", "approval"]),
])

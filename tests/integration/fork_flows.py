"""Workflows the fork tests run (SPEC §9); imported by the test process and by the workers. Each
callback records its call under the run's id (tests/integration/flows.py), so a test can tell
what ran in which run."""

from __future__ import annotations

import os

import taskloop as tl
from tests.integration.flows import _redis, record


def source(ctx: tl.TaskContext) -> str:
    record(ctx, "source_calls", ctx.attempt)
    return "notes on bounded loops"


def side(ctx: tl.TaskContext) -> str:
    record(ctx, "side_calls", ctx.attempt)
    return "an independent branch"


def write(ctx: tl.LoopContext, feedback: str | None) -> str:
    record(ctx, "attempts", {"round": ctx.round, "feedback": feedback})
    record(ctx, "attempt_pids", {"round": ctx.round, "pid": os.getpid()})
    pace = _redis().get(ctx.input["pace_key"]) if ctx.input.get("pace_key") else None  # set by the test
    if pace:
        ctx.signal.wait(float(pace))
    return f"draft {ctx.round} after {feedback}" if feedback else f"draft {ctx.round}"


def review(ctx: tl.LoopContext, draft: str) -> tl.LoopCheck:
    record(ctx, "checks", ctx.round)
    if "shorter" in draft or ctx.round == ctx.input.get("accept_at"):
        return tl.LoopCheck(done=True, score=1.0)
    return tl.LoopCheck(done=False, feedback=f"round {ctx.round}: too long", score=ctx.round / 10)


def publish(ctx: tl.TaskContext) -> str:
    record(ctx, "publish_calls", ctx.attempt)
    return f"published: {ctx.value('draft')}"


def _tasks() -> list[tl.Task]:
    return [
        tl.define_task("source", run=source),
        tl.define_task("side", run=side),
        tl.define_loop_task("draft", max_rounds=4, attempt=write, check=review, after=["source"]),
        tl.define_task("publish", run=publish, after=["draft"]),
    ]


essay = tl.define_workflow("fork-essay", version="1", tasks=_tasks())
budgeted = tl.define_workflow("fork-budget", version="1", tasks=_tasks(), budget=tl.Budget(attempts=6))

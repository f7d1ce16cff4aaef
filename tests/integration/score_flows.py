"""Loops that score their rounds (SPEC §3, scores, plateaus and best-of): the check gives the
score the run's input lists for that round (``inf`` is sent as the string "inf")."""

from __future__ import annotations

import taskloop as tl


def draft(ctx: tl.LoopContext, feedback: str | None) -> str:
    return f"draft {ctx.round}"


def judge(ctx: tl.LoopContext, candidate: str) -> tl.LoopCheck:
    listed = ctx.input["scores"]
    score = listed[ctx.round - 1] if ctx.round <= len(listed) else None
    if score == "inf":
        score = float("inf")
    if ctx.input.get("accept_at") == ctx.round:
        return tl.LoopCheck(done=True, score=score)
    return tl.LoopCheck(done=False, feedback=f"round {ctx.round} scored {score}", score=score)


def _after(ctx: tl.TaskContext) -> str:
    return f"published {ctx.value('draft')}"


plateau = tl.define_workflow("score-plateau", version="1", tasks=[
    tl.define_loop_task("draft", max_rounds=6, attempt=draft, check=judge, plateau=tl.Plateau(rounds=2, min_gain=0.01)),
])
best = tl.define_workflow("score-best", version="1", tasks=[
    tl.define_loop_task("draft", max_rounds=3, attempt=draft, check=judge, on_exhausted="best"),
    tl.define_task("publish", run=_after, after=["draft"]),
])
best_plateau = tl.define_workflow("score-best-plateau", version="1", tasks=[
    tl.define_loop_task("draft", max_rounds=8, attempt=draft, check=judge, on_exhausted="best",
                        plateau=tl.Plateau(rounds=2)),
])

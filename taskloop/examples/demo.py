"""The README example: a loop task fed by a plain task, accepted in round 2."""

import taskloop as tl

source = tl.define_task("source", run=lambda ctx: 10)


def write(ctx: tl.LoopContext, feedback: str | None) -> int:
    return int(ctx.value(source)) + ctx.round  # feedback is None in round 1


def review(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    if candidate == 12:
        return tl.LoopCheck(done=True)
    return tl.LoopCheck(done=False, feedback="Try again")


fix = tl.define_loop_task("fix", max_rounds=3, attempt=write, check=review, after=[source])
demo = tl.define_workflow("demo", version="1", tasks=[source, fix])

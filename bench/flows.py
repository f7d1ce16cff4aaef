"""The benchmark's workflows: the loop of the baseline on taskloop (attempt returns the round,
check accepts in round 3, or never), wide runs of independent no-op tasks, a chain, and a wide
run of tasks that wait (the cancel measurement)."""

from __future__ import annotations

import os

import redis

import taskloop as tl
from bench import shared_client

_redis: redis.Redis | None = None


def _finished(event: tl.Event) -> None:
    """Observer: push each finished run id, as the baseline pushes each finished loop."""
    global _redis
    if event.type == "run.finished":
        if _redis is None:  # bench/scaling.py keeps the list off the measured (clustered) store
            _redis = shared_client(os.environ.get("BENCH_FINISHED_URL") or os.environ["TASKLOOP_REDIS_URL"])
        _redis.rpush("bench:finished", event.run_id or "")


def attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
    return ctx.round


def accept_at_3(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    return tl.LoopCheck(done=True) if candidate >= 3 else tl.LoopCheck(done=False, feedback="again")


def never(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    return tl.LoopCheck(done=False, feedback="again")


def noop(ctx: tl.TaskContext) -> int:
    return 1


def hold(ctx: tl.TaskContext) -> int:
    ctx.signal.wait(0.2)
    return 1


accept = tl.define_workflow("bench-accept", version="1", observers=[_finished], tasks=[
    tl.define_loop_task("loop", max_rounds=3, attempt=attempt, check=accept_at_3),
])
exhaust = tl.define_workflow("bench-exhaust", version="1", observers=[_finished], tasks=[
    tl.define_loop_task("loop", max_rounds=3, attempt=attempt, check=never),
])
single = tl.define_workflow("bench-single", version="1", observers=[_finished], tasks=[
    tl.define_task("only", run=noop),
])

SIZES = (1, 100, 1000, 10_000)
wide = {n: tl.define_workflow(f"bench-wide-{n}", version="1",
                              tasks=[tl.define_task(f"t{i}", run=noop) for i in range(n)]) for n in SIZES}
CHAINS = (200, 1000)
chain = {n: tl.define_workflow(f"bench-chain-{n}", version="1", tasks=[
    tl.define_task(f"c{i}", run=noop, after=[f"c{i - 1}"] if i else []) for i in range(n)]) for n in CHAINS}
held = tl.define_workflow("bench-held", version="1",
                          tasks=[tl.define_task(f"h{i}", run=hold) for i in range(10_000)])

WATCHED_ROUNDS = 40


def accept_at_last(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    return tl.LoopCheck(done=True) if candidate >= WATCHED_ROUNDS else tl.LoopCheck(done=False, feedback="again")


# the runs bench/ui.py keeps open in UI pages while the loops run: long loops, each step queued
# behind the others, so they go on through the whole measurement
watched = tl.define_workflow("bench-watched", version="1", observers=[_finished], tasks=[
    tl.define_loop_task("loop", max_rounds=WATCHED_ROUNDS, attempt=attempt, check=accept_at_last),
])

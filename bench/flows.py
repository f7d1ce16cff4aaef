"""The same loop on taskloop: attempt returns the round, check accepts in round 3 (or never)."""

from __future__ import annotations

import os

import redis

import taskloop as tl

_redis: redis.Redis | None = None


def _finished(event: tl.Event) -> None:
    """Observer: push each finished run id, as the baseline pushes each finished loop."""
    global _redis
    if event.type == "run.finished":
        if _redis is None:
            _redis = redis.Redis.from_url(os.environ["TASKLOOP_REDIS_URL"])
        _redis.rpush("bench:finished", event.run_id or "")


def attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
    return ctx.round


def accept_at_3(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    return tl.LoopCheck(done=True) if candidate >= 3 else tl.LoopCheck(done=False, feedback="again")


def never(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    return tl.LoopCheck(done=False, feedback="again")


accept = tl.define_workflow("bench-accept", version="1", observers=[_finished], tasks=[
    tl.define_loop_task("loop", max_rounds=3, attempt=attempt, check=accept_at_3),
])
exhaust = tl.define_workflow("bench-exhaust", version="1", observers=[_finished], tasks=[
    tl.define_loop_task("loop", max_rounds=3, attempt=attempt, check=never),
])

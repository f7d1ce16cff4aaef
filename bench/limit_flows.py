"""The workflows of bench/limits.py: single-task runs under a rate limit (one per rate measured),
and runs that take turns on one concurrency key. Each callback notes its time in Redis."""

from __future__ import annotations

import json
import os
import time

import redis

import taskloop as tl

_redis: redis.Redis | None = None


def _r() -> redis.Redis:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(os.environ["TASKLOOP_REDIS_URL"], decode_responses=True)
    return _redis


def _started(ctx: tl.TaskContext) -> int:
    _r().rpush("bench:limits:starts", repr(time.time()))
    return 1


def _turn(ctx: tl.TaskContext) -> int:
    began = time.time()
    time.sleep(0.2)
    _r().rpush("bench:limits:spans", json.dumps([began, time.time()]))
    return 1


rated = {rate: tl.define_workflow(f"bench-rated-{rate}", version="1", tasks=[
    tl.define_task("call", _started, limits=[tl.RateLimit(f"bench-rate-{rate}", rate=rate, per_s=1.0)])])
    for rate in (20, 50, 100)}
one_at_a_time = tl.define_workflow("bench-one-at-a-time", version="1", tasks=[
    tl.define_task("turn", _turn, limits=[tl.Concurrency("bench-turns", limit=1)])])

"""Workflows under fleet limits (SPEC §10) for tests/integration/test_limits.py: each phase notes
when it started and ended in a Redis list of the test's (``test:limits:<tag>``), so the test can
check the limits from what really ran."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

import taskloop as tl

_redis: redis.Redis | None = None


def note(ctx: tl.TaskContext, what: str) -> None:
    """Note ``what`` now (kept trying while Redis is away: the fault tests restart it)."""
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(os.environ["TASKLOOP_REDIS_URL"], decode_responses=True)
    entry = json.dumps([what, ctx.run_id, time.time(), os.getpid()])
    for _ in range(300):
        try:
            _redis.rpush(f"test:limits:{ctx.input['tag']}", entry)
            return
        except redis.exceptions.ConnectionError:
            time.sleep(0.1)
    raise RuntimeError("the test's Redis did not come back")


def _hold(ctx: tl.TaskContext) -> Any:
    note(ctx, "start")
    time.sleep(float(ctx.input.get("hold_s", 1.0)))
    note(ctx, "end")
    return ctx.input.get("doc")


def _quick(ctx: tl.TaskContext) -> Any:
    note(ctx, "start")
    return ctx.input.get("n")


def _spend(ctx: tl.TaskContext) -> Any:
    note(ctx, "start")
    ctx.report_usage(input=int(ctx.input["tokens"]), output=0)
    return ctx.input["tokens"]


per_doc = tl.Concurrency("test-doc", limit=1, key=lambda ctx: ctx.input["doc"])
five_per_s = tl.RateLimit("test-five", rate=5, per_s=1.0)
tokens = tl.RateLimit("test-tokens", rate=100, per_s=2.0, unit="tokens")
lowered = tl.Concurrency("test-lowered", limit=3)
one_writer = tl.Concurrency("test-writer", limit=1)
wide = tl.Concurrency("test-wide", limit=1000)
wide_rate = tl.RateLimit("test-wide-rate", rate=1000, per_s=1.0)

held = tl.define_workflow("limits-held", version="1", tasks=[tl.define_task("hold", _hold, limits=[per_doc])])
free = tl.define_workflow("limits-free", version="1", tasks=[tl.define_task("free", _quick)])
rated = tl.define_workflow("limits-rated", version="1", tasks=[tl.define_task("rated", _quick, limits=[five_per_s])])
spent = tl.define_workflow("limits-tokens", version="1", tasks=[tl.define_task("spend", _spend, limits=[tokens])])
roomy = tl.define_workflow("limits-roomy", version="1",
                           tasks=[tl.define_task("roomy", _quick, limits=[wide, wide_rate])])
changed = tl.define_workflow("limits-changed", version="1",
                             tasks=[tl.define_task("hold", _hold, limits=[lowered])])


def _write(ctx: tl.LoopContext, feedback: str | None) -> str:
    note(ctx, f"attempt-{ctx.round}")
    time.sleep(float(ctx.input.get("hold_s", 0.3)))
    note(ctx, f"attempt-end-{ctx.round}")
    return f"draft {ctx.round}"


def _review(ctx: tl.LoopContext, candidate: str) -> tl.LoopCheck:
    note(ctx, f"check-{ctx.round}")
    return tl.LoopCheck(done=ctx.round >= 2, feedback="again")


writers = tl.define_workflow("limits-writers", version="1", tasks=[
    tl.define_loop_task("draft", max_rounds=3, attempt=_write, check=_review, attempt_limits=[one_writer])])

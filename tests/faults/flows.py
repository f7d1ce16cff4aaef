"""Workflows for the fault-injection suite; imported by the test process and the workers.

Every execution announces itself in ``fault:running`` (pid -> what it runs) while it works, so
the injector can pick a process that is inside a callback, and logs itself in ``fault:execs``.
The test Redis client retries for about three minutes, so that the callbacks survive a Redis
restart and the 60 s outage. It talks to ``FAULT_PROBE_URL`` when set (the proxy tests: the
workers' Redis goes through tests/proxy.py, the test's own bookkeeping does not).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

import taskloop as tl

_client: redis.Redis | None = None
_pid: int | None = None


def probe() -> redis.Redis:
    global _client, _pid
    if _client is None or _pid != os.getpid():
        _client = redis.Redis.from_url(
            os.environ.get("FAULT_PROBE_URL") or os.environ["TASKLOOP_REDIS_URL"], decode_responses=True,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 180),  # rides out a 60 s outage
            retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
        )
        _pid = os.getpid()
    return _client


def _work(ctx: tl.TaskContext, phase: str, round: int) -> None:
    me = {"run": ctx.run_id, "key": ctx.key, "round": round, "phase": phase, "pid": os.getpid(), "at": time.time()}
    r = probe()
    r.rpush("fault:execs", json.dumps(me))
    r.hset("fault:running", str(os.getpid()), json.dumps(me))
    if ctx.input.get("suicide") == phase:
        os.kill(os.getpid(), signal.SIGKILL)  # a phase that always kills its worker process
    time.sleep(ctx.input.get(f"{phase}_hold_s", ctx.input.get("hold_s", 0.3)))
    r.hdel("fault:running", str(os.getpid()))


def attempt(ctx: tl.LoopContext, feedback: str | None) -> dict[str, Any]:
    _work(ctx, "attempt", ctx.round)
    return {"round": ctx.round, "feedback": feedback}


def check(ctx: tl.LoopContext, candidate: dict[str, Any]) -> tl.LoopCheck:
    _work(ctx, "check", ctx.round)
    if candidate["round"] >= ctx.input.get("accept_round", 3):
        return tl.LoopCheck(done=True)
    return tl.LoopCheck(done=False, feedback=f"round {ctx.round} rejected")


MAX_ROUNDS = 5
grind = tl.define_workflow("fault-grind", version="1", tasks=[
    tl.define_loop_task("work", max_rounds=MAX_ROUNDS, attempt=attempt, check=check),
])

"""Flows for the pool tests (tests/integration/test_pools.py): loops that wait like a model call,
as sync callbacks (threads, gevent) and as ``async def`` ones (the asyncio pool), each logging
its executions, its cancellations and its timeouts in the test's Redis."""

from __future__ import annotations

import asyncio
import os
import time

import taskloop as tl
from tests.integration.flows import _redis, record, recorded


def _note(ctx: tl.TaskContext, what: str, round: int, phase: str) -> None:
    record(ctx, what, {"key": ctx.key, "round": round, "phase": phase, "pid": os.getpid(), "at": time.time()})


def _hold_s(ctx: tl.LoopContext, phase: str) -> float:
    """``hold_s`` the first time a phase runs; ``replay_hold_s`` (default: the same) when it runs again."""
    earlier = [c for c in recorded(_redis(), ctx.run_id, "calls") if c["round"] == ctx.round and c["phase"] == phase]
    key = "replay_hold_s" if len(earlier) > 1 else "hold_s"
    return float(ctx.input.get(key, ctx.input.get("hold_s", 0.2)))


# --- sync: a wait a cancel cuts short (ctx.signal) -------------------------------------------


def waited_attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
    _note(ctx, "calls", ctx.round, "attempt")
    ctx.signal.wait(_hold_s(ctx, "attempt"))
    return ctx.round


def waited_check(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    _note(ctx, "calls", ctx.round, "check")
    ctx.signal.wait(float(ctx.input.get("hold_s", 0.2)))
    return tl.LoopCheck(done=candidate >= int(ctx.input.get("rounds", 2)), feedback="again")


waiting = tl.define_workflow("pool-waiting", version="1", tasks=[
    tl.define_loop_task("loop", max_rounds=4, attempt=waited_attempt, check=waited_check)])

# --- sync: a callback that ignores its signal (what a timeout can stop, by pool) ----------------


def _sleeper(ctx: tl.TaskContext) -> str:
    _note(ctx, "calls", 1, "run")
    time.sleep(float(ctx.input.get("sleep_s", 5.0)))
    _note(ctx, "returned", 1, "run")
    return "slept"


sleeper = tl.define_workflow("pool-sleeper", version="1", tasks=[
    tl.define_task("sleep", _sleeper, timeout_ms=1000)])

# --- async: callbacks on the worker's event loop ---------------------------------------------


async def awaited_attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
    _note(ctx, "calls", ctx.round, "attempt")
    try:
        await asyncio.sleep(_hold_s(ctx, "attempt"))
    except asyncio.CancelledError:
        _note(ctx, "cancelled", ctx.round, "attempt")
        raise
    return ctx.round


def sync_check(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    """A sync check in an asyncio worker: it runs on the worker's threads, off the event loop."""
    _note(ctx, "calls", ctx.round, "check")
    time.sleep(0.05)
    return tl.LoopCheck(done=candidate >= int(ctx.input.get("rounds", 2)), feedback="again")


awaiting = tl.define_workflow("pool-awaiting", version="1", tasks=[
    tl.define_loop_task("loop", max_rounds=4, attempt=awaited_attempt, check=sync_check)])


async def _long_await(ctx: tl.TaskContext) -> str:
    _note(ctx, "calls", 1, "run")
    try:
        await asyncio.sleep(float(ctx.input.get("sleep_s", 30.0)))
    except asyncio.CancelledError:
        _note(ctx, "cancelled", 1, "run")
        raise
    return "slept"


long_await = tl.define_workflow("pool-long-await", version="1", tasks=[tl.define_task("wait", _long_await)])
timed_await = tl.define_workflow("pool-timed-await", version="1", tasks=[
    tl.define_task("wait", _long_await, timeout_ms=1000)])

# --- many in flight, under a fleet rate limit ------------------------------------------------

per_second = tl.RateLimit("pool-per-second", rate=20, per_s=1.0)


async def _rated(ctx: tl.TaskContext) -> float:
    _note(ctx, "calls", 1, "run")
    await asyncio.sleep(0.05)
    return time.time()


def _rated_sync(ctx: tl.TaskContext) -> float:
    _note(ctx, "calls", 1, "run")
    time.sleep(0.05)
    return time.time()


rated_async = tl.define_workflow("pool-rated-async", version="1", tasks=[
    tl.define_task("call", _rated, limits=[per_second])])
rated_sync = tl.define_workflow("pool-rated-sync", version="1", tasks=[
    tl.define_task("call", _rated_sync, limits=[per_second])])


# --- a pool class taskloop does not know (test_pools: `celery worker --pool` refuses it) -------

from celery.concurrency.base import BasePool  # noqa: E402


class OddPool(BasePool):  # type: ignore[misc]  # Celery is untyped
    """A pool of nobody's: taskloop cannot tell what it does with a message."""

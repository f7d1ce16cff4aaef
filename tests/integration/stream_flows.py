"""Flows for the streaming tests (tests/integration/test_streaming.py): loops whose attempt streams
its output token by token with ``ctx.stream`` (sync, and ``async def`` for the asyncio pool), and
can hold at given tokens until the test lets it go on.

The input says what to stream: ``tokens`` (a list of strings) or ``count`` tokens ``w0 w1 ...``,
``gap_s`` between tokens, ``holds`` (token indexes at which the first execution of an attempt
waits for the key ``test:<run>:go:<index>``), ``rounds`` (the check accepts that round). The callbacks log their
executions (``calls``) and the tokens they streamed (``streamed``) in the test's Redis:
``STREAM_PROBE_URL`` when the workers reach Redis through a proxy, else TASKLOOP_REDIS_URL.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import redis

import taskloop as tl

_client: redis.Redis | None = None
_client_pid: int | None = None
HOLD_LIMIT_S = 60.0


def probe() -> redis.Redis:
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        url = os.environ.get("STREAM_PROBE_URL") or os.environ["TASKLOOP_REDIS_URL"]
        _client = redis.Redis.from_url(url, decode_responses=True)
        _client_pid = os.getpid()
    return _client


def note(ctx: tl.LoopContext, what: str, value: Any) -> None:
    probe().rpush(f"test:{ctx.run_id}:{what}", json.dumps(value))


def tokens(ctx: tl.TaskContext) -> list[str]:
    given = ctx.input.get("tokens")
    return list(given) if given is not None else [f"w{i} " for i in range(int(ctx.input.get("count", 10)))]


def _go(ctx: tl.TaskContext, index: int) -> bool:
    return bool(probe().exists(f"test:{ctx.run_id}:go:{index}"))


def _begin(ctx: tl.LoopContext) -> tuple[set[int], float, list[str]]:
    """Log this execution; what to stream: the holds (the first execution of a round's attempt
    only: a replay runs through), the gap, the tokens."""
    note(ctx, "calls", {"round": ctx.round, "phase": ctx.phase, "pid": os.getpid(), "attempt": ctx.attempt})
    calls = [json.loads(c) for c in probe().lrange(f"test:{ctx.run_id}:calls", 0, -1)]
    again = sum(1 for c in calls if c["round"] == ctx.round and c["phase"] == ctx.phase) > 1
    holds = set() if again else set(ctx.input.get("holds", ()))
    return holds, float(ctx.input.get("gap_s", 0.0)), tokens(ctx)


def write(ctx: tl.LoopContext, feedback: str | None) -> str:
    holds, gap, parts = _begin(ctx)
    for index, token in enumerate(parts):
        if index in holds:
            note(ctx, "held", index)
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not _go(ctx, index) and time.monotonic() < deadline:
                time.sleep(0.02)
        ctx.stream(token)
        if gap:
            time.sleep(gap)
    note(ctx, "streamed", len(parts))
    return "".join(parts)


async def awrite(ctx: tl.LoopContext, feedback: str | None) -> str:
    holds, gap, parts = _begin(ctx)
    for index, token in enumerate(parts):
        if index in holds:
            note(ctx, "held", index)
            while not _go(ctx, index):
                await asyncio.sleep(0.02)
        ctx.stream(token)
        await asyncio.sleep(gap)
    note(ctx, "streamed", len(parts))
    return "".join(parts)


def review(ctx: tl.LoopContext, candidate: str) -> tl.LoopCheck:
    ctx.stream(f"[review of round {ctx.round}: {len(candidate)} characters]")
    done = ctx.round >= int(ctx.input.get("rounds", 1))
    return tl.LoopCheck(done=done, feedback=None if done else "again")


streamed = tl.define_workflow("streamed", version="1", tasks=[
    tl.define_loop_task("write", max_rounds=3, attempt=write, check=review)])
astreamed = tl.define_workflow("astreamed", version="1", tasks=[
    tl.define_loop_task("write", max_rounds=3, attempt=awrite, check=review)])

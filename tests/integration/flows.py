"""Workflows used by the integration tests; imported by the test process and by the workers.

Callbacks record what they saw in the test Redis (keys ``test:<run_id>:<what>``) so the tests
can count calls and compare feedback, idempotency keys and process ids. Behaviour is chosen
per run through the run input.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any

import redis

import taskloop as tl

_client: redis.Redis | None = None
_client_pid: int | None = None
_client_lock = threading.Lock()


def _redis() -> redis.Redis:
    """The callbacks' client of the test Redis, one per process. Its pool blocks for a connection:
    hundreds of threads of one worker record at once (redis-py's default pool refuses a 101st
    connection with MaxConnectionsError, which would fail the phase that records)."""
    global _client, _client_pid
    with _client_lock:
        if _client is None or _client_pid != os.getpid():
            pool = redis.BlockingConnectionPool.from_url(os.environ["TASKLOOP_REDIS_URL"], decode_responses=True,
                                                         max_connections=64, timeout=30)
            _client = redis.Redis(connection_pool=pool)
            _client_pid = os.getpid()
        return _client


def record(ctx: tl.TaskContext, what: str, value: Any) -> None:
    record_for(ctx.run_id, what, value)


def record_for(run_id: str, what: str, value: Any) -> None:
    _redis().rpush(f"test:{run_id}:{what}", json.dumps(value))


def recorded(r: redis.Redis, run_id: str, what: str) -> list[Any]:
    return [json.loads(v) for v in r.lrange(f"test:{run_id}:{what}", 0, -1)]


def where(ctx: tl.LoopContext) -> None:
    record(ctx, "where", {"round": ctx.round, "phase": ctx.phase, "pid": os.getpid()})


# --- the SPEC §2 example, extended with switches ------------------------------------------------

source = tl.define_task("source", run=lambda ctx: 10)


def write(ctx: tl.LoopContext, feedback: str | None) -> Any:
    record(ctx, "attempt_calls", ctx.round)
    record(ctx, "feedback", feedback)
    record(ctx, "keys", ctx.idempotency_key)
    where(ctx)
    if ctx.input.get("fail") == "attempt":
        raise ValueError("attempt exploded")
    if ctx.input.get("non_json"):
        return {"items": [1, {2, 3}]}
    return ctx.value(source) + ctx.round


def review(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    record(ctx, "check_calls", ctx.round)
    record(ctx, "keys", ctx.idempotency_key)
    where(ctx)
    if ctx.input.get("fail") == "check":
        raise RuntimeError("check exploded")
    if ctx.input.get("bad_check"):
        return "looks fine"  # type: ignore[return-value]
    if candidate == ctx.input.get("target", 12):
        return tl.LoopCheck(done=True)
    feedback = "Try again"
    if ctx.input.get("numbered"):
        feedback += f" (after round {ctx.round})"
    return tl.LoopCheck(done=False, feedback=feedback)


fix = tl.define_loop_task("fix", max_rounds=3, attempt=write, check=review, after=[source])
publish = tl.define_task("publish", run=lambda ctx: ctx.value(fix) * 2, after=[fix])
core = tl.define_workflow("core", version="1", tasks=[source, fix, publish])

# --- a long loop to watch phases move between processes ------------------------------------------


def long_attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
    where(ctx)
    return ctx.round


def long_check(ctx: tl.LoopContext, candidate: int) -> dict[str, Any]:
    where(ctx)
    done = candidate >= ctx.input["rounds"]
    return {"done": True} if done else {"done": False, "feedback": f"round {candidate} is not enough"}


spread = tl.define_workflow("spread", version="1", tasks=[
    tl.define_loop_task("grind", max_rounds=20, attempt=long_attempt, check=long_check),
])

# --- conditions and skip cascades ---------------------------------------------------------------

gated = tl.define_task("gated", run=lambda ctx: "ran", condition=lambda ctx: ctx.input["go"])
child = tl.define_task("child", run=lambda ctx: ctx.value(gated) + "+child", after=[gated])
grandchild = tl.define_loop_task(
    "grandchild", max_rounds=2, after=[child],
    attempt=lambda ctx, fb: ctx.value(child), check=lambda ctx, c: tl.LoopCheck(done=True),
)
independent = tl.define_task("independent", run=lambda ctx: "independent")
conditions = tl.define_workflow("conditions", version="1", tasks=[gated, child, grandchild, independent])

# --- failure handling across branches -----------------------------------------------------------


def explode(ctx: tl.TaskContext) -> None:
    raise KeyError("no such thing")


def slow(ctx: tl.TaskContext) -> str:
    record(ctx, "slow_started", time.time())
    cancelled = ctx.signal.wait(ctx.input.get("slow_s", 1.0))
    record(ctx, "slow_signal", ctx.signal.reason if cancelled else None)
    ctx.signal.raise_if_cancelled()
    return "slow finished"


def _branches(name: str, stop_on_error: bool) -> tl.Workflow:
    # "bad" waits for "warmup" so that "slow" is already running when it fails.
    warmup = tl.define_task("warmup", run=lambda ctx: time.sleep(0.3))
    bad = tl.define_task("bad", run=explode, after=[warmup])
    after_bad = tl.define_task("after_bad", run=lambda ctx: "never", after=[bad])
    slow_task = tl.define_task("slow", run=slow)
    return tl.define_workflow(name, version="1", stop_on_error=stop_on_error,
                              tasks=[warmup, bad, after_bad, slow_task])


branches_continue = _branches("branches-continue", stop_on_error=False)
branches_stop = _branches("branches-stop", stop_on_error=True)

# --- async callbacks ----------------------------------------------------------------------------


async def async_attempt(ctx: tl.LoopContext, feedback: str | None) -> str:
    await asyncio.sleep(0.01)
    return f"draft {ctx.round}" + (f" after '{feedback}'" if feedback else "")


async def async_check(ctx: tl.LoopContext, candidate: str) -> tl.LoopCheck:
    await asyncio.sleep(0.01)
    return tl.LoopCheck(done=ctx.round == 2, feedback=None if ctx.round == 2 else "more detail")


async_flow = tl.define_workflow("async-flow", version="1", tasks=[
    tl.define_loop_task("draft", max_rounds=3, attempt=async_attempt, check=async_check),
    tl.define_task("count", run=lambda ctx: len(ctx.input["words"])),
])

# --- a run that lasts as long as its input says (waiting tests) ---------------------------------


def nap(ctx: tl.TaskContext) -> float:
    seconds = float(ctx.input["seconds"])
    ctx.signal.wait(seconds)
    ctx.signal.raise_if_cancelled()
    return seconds


sleeper = tl.define_workflow("sleeper", version="1", tasks=[tl.define_task("nap", run=nap)])

# --- a run deleted as it succeeds -----------------------------------------------------------------

ephemeral = tl.define_workflow("ephemeral", version="1", delete_on_success=True,
                               tasks=[tl.define_task("once", run=lambda ctx: 1)])

# --- a loop whose phases take as long as the input says (the one-call step) ---------------------


def paced_attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
    record(ctx, "paced_calls", {"round": ctx.round, "phase": "attempt", "pid": os.getpid(), "at": time.time()})
    ctx.signal.wait(float(ctx.input.get("hold_s", 0.0)))
    return ctx.round


def paced_check(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    record(ctx, "paced_calls", {"round": ctx.round, "phase": "check", "pid": os.getpid(), "at": time.time()})
    ctx.signal.wait(float(ctx.input.get("hold_s", 0.0)))
    return tl.LoopCheck(done=candidate >= int(ctx.input.get("rounds", 1)), feedback="again")


paced = tl.define_workflow("paced", version="1", tasks=[
    tl.define_loop_task("step", max_rounds=5, attempt=paced_attempt, check=paced_check),
])
# the same loop under another name, for phases that run past MARK_S: a worker process that saw one
# of them begins every later phase of that name before its callback (executor.slow), and the tests
# of `paced` look at phases that run on their start note
paced_long = tl.define_workflow("paced-long", version="1", tasks=[
    tl.define_loop_task("step", max_rounds=5, attempt=paced_attempt, check=paced_check),
])
# the same loop on a queue no test worker consumes: a test moves its messages (tests/integration/test_carried_reads.py)
PARKED_QUEUE = "parked"
paced_parked = tl.define_workflow("paced-parked", version="1", tasks=[
    tl.define_loop_task("step", max_rounds=5, attempt=paced_attempt, check=paced_check, queue=PARKED_QUEUE),
])

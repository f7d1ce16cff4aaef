"""Workflows of the chaos soak (`python -m tests.faults.soak`); imported by the driver and the workers.

Every callback writes its real executions to the soak Redis: when it begins, an ``exec`` entry
(``soak:execs``: run, key, round, phase, pid, start) and its pid in ``soak:running`` (what the
injectors pick from); when it returns, an ``end`` entry with the same id and its end time. The
offline checker compares these entries, the ground truth of what ran, with what taskloop recorded.
The Redis client retries for about a minute, so that a callback rides out a Redis restart.

What a run must end with follows from its input alone (`expected`):

========================  ===========================================================================
``soak-loop``             loop ``work`` (attempt/check, at most MAX_ROUNDS rounds), then task ``report``
  mode ``accept``         check accepts round ``accept_round``: done, ``work`` = that round's candidate
  mode ``exhaust``        check never accepts: failed, LoopTaskExhausted after MAX_ROUNDS rounds
  mode ``raise``          the ``raise_phase`` of round ``raise_round`` raises SoakError: failed
``soak-retry``            task ``fetch`` with Retry(attempts=3): tries 1 and 2 raise, try 3 returns
``soak-gate``             task ``draft``, approval gate ``approval``, task ``publish`` after both
  decision ``approve``    done, ``publish`` = "published draft"
  decision ``reject``     rejected, ``publish`` skipped
========================  ===========================================================================

A run the driver cancels (``run.cancel`` in its history) ends cancelled with termination
``aborted`` whatever its workflow; a cancel that came after the end changes nothing.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

import taskloop as tl

EXECS = "soak:execs"  # list of JSON entries: {"ev": "exec"|"end", "id", ...}
RUNNING = "soak:running"  # hash pid -> JSON of the execution inside a callback right now
MAX_ROUNDS = 4
RETRY_ATTEMPTS = 3
GATE_ACTOR = "soak-driver"

_client: redis.Redis | None = None
_pid: int | None = None


class SoakError(Exception):
    """The error a ``raise`` run's callback raises."""


def probe() -> redis.Redis:
    """A Redis client for this process that retries through a Redis restart (about a minute)."""
    global _client, _pid
    if _client is None or _pid != os.getpid():
        _client = redis.Redis.from_url(
            os.environ.get("FAULT_PROBE_URL") or os.environ["TASKLOOP_REDIS_URL"], decode_responses=True,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 60),
            retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
        )
        _pid = os.getpid()
    return _client


class _Execution:
    """Logs one real execution of a callback: its begin, then (if it returns) its end."""

    def __init__(self, ctx: tl.TaskContext, round: int, phase: str) -> None:
        self.me = {"id": uuid.uuid4().hex, "run": ctx.run_id, "key": ctx.key, "round": round, "phase": phase,
                   "pid": os.getpid(), "at": time.time()}
        pipe = probe().pipeline(transaction=False)
        pipe.rpush(EXECS, json.dumps({"ev": "exec", **self.me}))
        pipe.hset(RUNNING, str(os.getpid()), json.dumps(self.me))
        pipe.execute()

    def hold(self, ctx: tl.TaskContext) -> None:
        """The work: a pause that a cancel (ctx.signal) cuts short."""
        ctx.signal.wait(float(ctx.input.get("hold_s", 0.2)))

    def end(self, outcome: str) -> None:
        pipe = probe().pipeline(transaction=False)
        pipe.hdel(RUNNING, str(os.getpid()))
        pipe.rpush(EXECS, json.dumps({"ev": "end", "id": self.me["id"], "at": time.time(), "outcome": outcome}))
        pipe.execute()


def _ran(ctx: tl.TaskContext) -> None:
    """One logged execution of a plain task that works, then returns."""
    run = _Execution(ctx, 1, "run")
    run.hold(ctx)
    run.end("ok")


def _raises(ctx: tl.LoopContext, phase: str) -> bool:
    data: dict[str, Any] = ctx.input
    return bool(data.get("mode") == "raise" and data.get("raise_round") == ctx.round
                and data.get("raise_phase") == phase)


# --- soak-loop --------------------------------------------------------------------------------------


def attempt(ctx: tl.LoopContext, feedback: str | None) -> dict[str, Any]:
    run = _Execution(ctx, ctx.round, "attempt")
    run.hold(ctx)
    if _raises(ctx, "attempt"):
        run.end("raise")
        raise SoakError(f"attempt of round {ctx.round} failed on purpose")
    run.end("ok")
    return {"round": ctx.round, "feedback": feedback}


def check(ctx: tl.LoopContext, candidate: dict[str, Any]) -> tl.LoopCheck:
    run = _Execution(ctx, ctx.round, "check")
    run.hold(ctx)
    if _raises(ctx, "check"):
        run.end("raise")
        raise SoakError(f"check of round {ctx.round} failed on purpose")
    run.end("ok")
    if ctx.input.get("mode") == "accept" and candidate["round"] >= ctx.input["accept_round"]:
        return tl.LoopCheck(done=True)
    return tl.LoopCheck(done=False, feedback=f"round {ctx.round} rejected")


def report(ctx: tl.TaskContext) -> str:
    _ran(ctx)
    return f"accepted in round {ctx.value('work')['round']}"


loop_flow = tl.define_workflow("soak-loop", version="1", tasks=[
    tl.define_loop_task("work", max_rounds=MAX_ROUNDS, attempt=attempt, check=check),
    tl.define_task("report", run=report, after=["work"]),
])

# --- soak-retry -------------------------------------------------------------------------------------


def fetch(ctx: tl.TaskContext) -> str:
    # The try number is the round of the idempotency key (<run>/<key>/<try>/run): a replay of a
    # lost execution keeps it, so the outcome does not depend on the faults.
    try_ = int(ctx.idempotency_key.split("/")[-2])
    run = _Execution(ctx, try_, "run")
    run.hold(ctx)
    if try_ < RETRY_ATTEMPTS:
        run.end("raise")
        raise ConnectionError(f"try {try_} failed on purpose")
    run.end("ok")
    return f"ok on try {try_}"


retry_flow = tl.define_workflow("soak-retry", version="1", tasks=[
    tl.define_task("fetch", run=fetch, retry=tl.Retry(attempts=RETRY_ATTEMPTS, delay_ms=50)),
])

# --- soak-gate --------------------------------------------------------------------------------------


def draft(ctx: tl.TaskContext) -> str:
    _ran(ctx)
    return "draft"


def publish(ctx: tl.TaskContext) -> str:
    _ran(ctx)
    return f"published {ctx.value('draft')}"


gate_flow = tl.define_workflow("soak-gate", version="1", tasks=[
    tl.define_task("draft", run=draft),
    tl.define_gate("approval", prompt="Publish the draft?", actors=[GATE_ACTOR], after=["draft"]),
    tl.define_task("publish", run=publish, after=["draft", "approval"]),
])

WORKFLOWS = {wf.name: wf for wf in (loop_flow, retry_flow, gate_flow)}

# --- what a run must end with -----------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """How a run that was not cancelled must end, from its input."""

    status: str
    termination: str | None = None
    values: dict[str, Any] = field(default_factory=dict)
    error: tuple[str, str] | None = None  # (task key, error type) of the first task error
    rounds: dict[str, int] = field(default_factory=dict)  # task key -> rounds (tries) it must reach
    label: str = ""


def expected(workflow: str, data: dict[str, Any]) -> Expected:
    if workflow == "soak-loop":
        mode = data["mode"]
        if mode == "accept":
            k = int(data["accept_round"])
            candidate = {"round": k, "feedback": None if k == 1 else f"round {k - 1} rejected"}
            return Expected("done", None, {"work": candidate, "report": f"accepted in round {k}"},
                            rounds={"work": k, "report": 1}, label=f"loop accept@{k}")
        if mode == "exhaust":
            return Expected("failed", "failed", error=("work", "LoopTaskExhausted"),
                            rounds={"work": MAX_ROUNDS}, label="loop exhaust")
        r = int(data["raise_round"])
        return Expected("failed", "failed", error=("work", "SoakError"), rounds={"work": r},
                        label=f"loop raise in {data['raise_phase']}")
    if workflow == "soak-retry":
        return Expected("done", None, {"fetch": f"ok on try {RETRY_ATTEMPTS}"}, rounds={"fetch": RETRY_ATTEMPTS},
                        label="retry 3 tries")
    if workflow == "soak-gate":
        if data["decision"] == "approve":
            return Expected("done", None, {"draft": "draft", "approval": None, "publish": "published draft"},
                            rounds={"draft": 1, "publish": 1}, label="gate approve")
        return Expected("rejected", "rejected", {"draft": "draft"}, rounds={"draft": 1}, label="gate reject")
    raise ValueError(f"not a soak workflow: {workflow}")

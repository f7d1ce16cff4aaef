"""Workflows for the controls: timeouts, retries, budgets, usage, cache and cancellation."""

from __future__ import annotations

import os
import time
from typing import Any

import taskloop as tl
from tests.integration.flows import _redis, record

# --- timeouts -----------------------------------------------------------------------------------


def polite_sleep(ctx: tl.TaskContext, seconds: float) -> None:
    """Sleep, but stop as soon as the phase is cancelled (the well-behaved callback)."""
    record(ctx, "signal", ctx.signal.reason if ctx.signal.wait(seconds) else None)


def slow_attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
    record(ctx, "attempt_calls", ctx.round)
    if ctx.input.get("slow") == "attempt":
        polite_sleep(ctx, 10)
    return 1


def slow_check(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    record(ctx, "check_calls", ctx.round)
    if ctx.input.get("slow") == "check":
        polite_sleep(ctx, 10)
    return tl.LoopCheck(done=True)


timed_loop = tl.define_workflow("timed-loop", version="1", tasks=[
    tl.define_loop_task("think", max_rounds=3, timeout_ms=600, attempt=slow_attempt, check=slow_check),
])


def stubborn(ctx: tl.TaskContext) -> str:
    record(ctx, "stubborn_pid", os.getpid())
    time.sleep(60)  # ignores ctx.signal: only the hard limit stops it
    return "never"


stubborn_flow = tl.define_workflow("stubborn", version="1", tasks=[
    tl.define_task("sleeper", run=stubborn, timeout_ms=500),
])

# --- retries ------------------------------------------------------------------------------------


def flaky(ctx: tl.TaskContext) -> str:
    record(ctx, "tries", {"attempt": ctx.attempt, "at": time.time(), "key": ctx.idempotency_key})
    if ctx.attempt <= ctx.input.get("failures", 0):
        error = ctx.input.get("error", "ConnectionError")
        raise {"ConnectionError": ConnectionError, "ValueError": ValueError}[error](f"try {ctx.attempt} failed")
    return f"ok on try {ctx.attempt}"


retry_exponential = tl.define_workflow("retry-exponential", version="1", tasks=[
    tl.define_task("fetch", run=flaky, retry=tl.Retry(attempts=4, delay_ms=200, backoff="exponential",
                                                      max_delay_ms=500)),
])
retry_filtered = tl.define_workflow("retry-filtered", version="1", tasks=[
    tl.define_task("fetch", run=flaky, retry=tl.Retry(
        attempts=3, delay_ms=50, accepts=lambda error, attempt: isinstance(error, ConnectionError))),
])
retry_jitter = tl.define_workflow("retry-jitter", version="1", tasks=[
    tl.define_task("fetch", run=flaky, retry=tl.Retry(attempts=3, delay_ms=300, jitter="full")),
])


def slow_first_try(ctx: tl.TaskContext) -> str:
    record(ctx, "tries", {"attempt": ctx.attempt, "at": time.time()})
    if ctx.attempt == 1:
        polite_sleep(ctx, 10)
    return f"ok on try {ctx.attempt}"


retry_timeout = tl.define_workflow("retry-timeout", version="1", tasks=[
    tl.define_task("fetch", run=slow_first_try, timeout_ms=400, retry=tl.Retry(attempts=2, delay_ms=10)),
])

# --- budgets and usage --------------------------------------------------------------------------


def spend_attempt(ctx: tl.LoopContext, feedback: str | None) -> str:
    record(ctx, "attempt_calls", ctx.round)
    ctx.report_usage(input=10, output=ctx.input.get("output_per_attempt", 0))
    ctx.report_usage_once("prompt-cache-warmup", cached=7)  # counted once per run
    return f"draft {ctx.round}"


def never_satisfied(ctx: tl.LoopContext, candidate: str) -> tl.LoopCheck:
    record(ctx, "check_calls", ctx.round)
    return tl.LoopCheck(done=False, feedback="not yet")


def _budget_flow(name: str, budget: tl.Budget) -> tl.Workflow:
    return tl.define_workflow(name, version="1", budget=budget, tasks=[
        tl.define_loop_task("write", max_rounds=5, attempt=spend_attempt, check=never_satisfied),
    ])


attempt_budget = _budget_flow("attempt-budget", tl.Budget(attempts=2))
token_budget = _budget_flow("token-budget", tl.Budget(output_tokens=150))
no_budget = _budget_flow("no-budget", tl.Budget(input_tokens=10_000))

# --- cache --------------------------------------------------------------------------------------


def cached_attempt(ctx: tl.LoopContext, feedback: str | None) -> str:
    record(ctx, "cache_calls", ["attempt", ctx.round])
    return f"{ctx.input['topic']} v{ctx.round}"


def cached_check(ctx: tl.LoopContext, candidate: str) -> tl.LoopCheck:
    record(ctx, "cache_calls", ["check", ctx.round])
    return tl.LoopCheck(done=ctx.round == 2, feedback=None if ctx.round == 2 else "again")


def _cached_flow(name: str, cache: tl.Cache) -> tl.Workflow:
    return tl.define_workflow(name, version="1", tasks=[
        tl.define_loop_task("essay", max_rounds=3, attempt=cached_attempt, check=cached_check, cache=cache),
    ])


def topic_key(ctx: tl.TaskContext) -> Any:
    return {"topic": ctx.input["topic"]}


cached_reuse = _cached_flow("cached-reuse", tl.Cache(key=topic_key))
cached_refresh = _cached_flow("cached-refresh", tl.Cache(key=topic_key, mode="refresh"))
cached_expiring = _cached_flow("cached-expiring", tl.Cache(key=topic_key, max_age_ms=400))


class BrokenStore:
    """A cache store whose every operation fails."""

    def read(self, fingerprint: str) -> dict[str, Any] | None:
        raise ConnectionError("cache backend is down")

    def write(self, fingerprint: str, entry: dict[str, Any]) -> None:
        raise ConnectionError("cache backend is down")


cached_broken = _cached_flow("cached-broken", tl.Cache(key=topic_key, store=BrokenStore()))


def bad_key(ctx: tl.TaskContext) -> Any:
    if ctx.input.get("key") == "raise":
        raise LookupError("no key for this input")
    return {"when": {1, 2}}


cached_bad_key = tl.define_workflow("cached-bad-key", version="1", tasks=[
    tl.define_task("compute", run=lambda ctx: 1, cache=tl.Cache(key=bad_key)),
])

# --- cancellation -------------------------------------------------------------------------------


def _started(ctx: tl.LoopContext) -> None:
    _redis().set(f"test:{ctx.run_id}:started", ctx.phase)


def waiting_attempt(ctx: tl.LoopContext, feedback: str | None) -> str:
    if ctx.input["hold"] == "attempt":
        _started(ctx)
        polite_sleep(ctx, 20)
    return "candidate"


def waiting_check(ctx: tl.LoopContext, candidate: str) -> tl.LoopCheck:
    if ctx.input["hold"] == "check":
        _started(ctx)
        polite_sleep(ctx, 20)
    return tl.LoopCheck(done=True)


cancellable = tl.define_workflow("cancellable", version="1", tasks=[
    tl.define_loop_task("hold", max_rounds=2, attempt=waiting_attempt, check=waiting_check),
    tl.define_task("later", run=lambda ctx: "never", after=["hold"]),
])

# --- gates --------------------------------------------------------------------------------------

draft_task = tl.define_task("draft", run=lambda ctx: "first draft")
approval = tl.define_gate("approval", prompt="Publish this draft?", actors=["alice"], after=[draft_task])
publish_task = tl.define_task("publish", run=lambda ctx: f"published {ctx.value(draft_task)}",
                              after=[draft_task, approval])
gated_flow = tl.define_workflow("gated", version="1", tasks=[draft_task, approval, publish_task])

edit = tl.define_gate("edit", kind="input", prompt="Give the title")
titled = tl.define_task("titled", run=lambda ctx: f"title: {ctx.value(edit)}", after=[edit])
input_flow = tl.define_workflow("input-gate", version="1", tasks=[edit, titled])

# --- resume -------------------------------------------------------------------------------------


def fragile_attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
    record(ctx, "attempt_calls", ctx.round)
    return ctx.round


def fragile_check(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    record(ctx, "check_calls", {"round": ctx.round, "key": ctx.idempotency_key, "attempt": ctx.attempt})
    if ctx.round == 2 and _redis().get(f"test:{ctx.run_id}:broken"):
        raise RuntimeError("reviewer crashed")
    return tl.LoopCheck(done=candidate == 2, feedback="one more")


def _resume_condition(ctx: tl.TaskContext) -> bool:
    record(ctx, "condition_calls", ctx.attempt)
    return True


resumable = tl.define_workflow("resumable", version="1", tasks=[
    tl.define_loop_task("fix", max_rounds=3, attempt=fragile_attempt, check=fragile_check,
                        condition=_resume_condition),
    tl.define_task("report", run=lambda ctx: f"fixed in {ctx.value('fix')}", after=["fix"]),
])

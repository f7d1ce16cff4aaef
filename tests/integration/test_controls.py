"""SPEC §3 controls on real Redis and workers: timeout, Retry, Budget and usage, Cache, cancel."""

from __future__ import annotations

import itertools
import os
import time

import pytest

import taskloop as tl
from taskloop.base.config import settings
from taskloop.runtime.models import ExecView, executions
from tests.integration import control_flows as cf
from tests.integration.flows import recorded
from tests.ledger import assert_balanced
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")

GRACE = settings().timeout_grace_s  # the documented hard-limit grace (TASKLOOP_TIMEOUT_GRACE_S)


def _events(client, run_id: str, type_: str, key: str | None = None) -> list[tl.Event]:
    return [e for e in client.events(run_id) if e.type == type_ and (key is None or e.key == key)]


def _reaped(pid: int) -> bool:
    """The process is gone and its parent (the worker's pool) has collected it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _execs(client, run_id: str) -> list[ExecView]:
    return [e for found in executions(client.events(run_id)).values() for e in found]


# --- timeout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["attempt", "check"])
def test_timeout_in_a_phase_ends_with_one_call(client, probe, phase: str) -> None:
    run = client.start(cf.timed_loop, input={"slow": phase})
    result = run.wait(timeout=30)
    assert (result.status, result.termination_code) == ("failed", "timeout")
    [error] = result.errors
    assert error.type == "TaskTimeout" and "ran past timeout_ms=600" in error.message
    assert len(recorded(probe, run.run_id, f"{phase}_calls")) == 1
    assert recorded(probe, run.run_id, "signal") == ["timeout"]  # the callback saw ctx.signal
    with pytest.raises(tl.TaskTimeout):
        result.raise_for_status()
    assert_balanced(client.events(run.run_id))


def test_a_callback_that_ignores_the_signal_is_stopped_by_the_hard_limit(client, probe) -> None:
    run = client.start(cf.stubborn_flow, input={})
    result = run.wait(timeout=30)
    assert (result.status, result.termination_code) == ("failed", "timeout")
    [started] = _execs(client, run.run_id)
    [failed] = [e for e in _events(client, run.run_id, "task") if e.data["status"] == "failed"]
    # recorded within timeout_ms + the grace (+ the watcher's polling slack)
    assert started.began_at is not None
    elapsed = failed.at - started.began_at
    assert 0.5 <= elapsed <= 0.5 + GRACE + 1.5, elapsed  # slack for a loaded machine
    # the pool process that ran time.sleep(60) was stopped ...
    [pid] = recorded(probe, run.run_id, "stubborn_pid")
    wait_until(lambda: _reaped(pid), timeout=10, what=f"process {pid} (the sleeping callback) to be stopped")
    # ... its worker forked a replacement, and keeps serving other work
    stats = client.app.control.inspect(timeout=5, limit=2).stats() or {}
    pools = {node: info["pool"]["processes"] for node, info in stats.items()}
    assert len(pools) == 2 and all(len(procs) == 2 for procs in pools.values()), pools
    assert all(pid not in procs for procs in pools.values())
    assert client.start(cf.timed_loop, input={}).wait(timeout=30).status == "done"


# --- retry --------------------------------------------------------------------------------------


def _tries(probe, run_id: str) -> list[dict]:
    return recorded(probe, run_id, "tries")


def test_retry_count_and_exponential_delays_follow_the_policy(client, probe) -> None:
    run = client.start(cf.retry_exponential, input={"failures": 3})
    result = run.wait(timeout=30)
    assert result.status == "done" and result.values == {"fetch": "ok on try 4"}
    tries = _tries(probe, run.run_id)
    assert [t["attempt"] for t in tries] == [1, 2, 3, 4]
    assert len({t["key"] for t in tries}) == 4  # each try is its own idempotency key
    gaps = [b["at"] - a["at"] for a, b in itertools.pairwise(tries)]
    for gap, delay in zip(gaps, [0.2, 0.4, 0.5], strict=True):  # 200, 400, 800 capped at 500
        assert delay <= gap <= delay + 1.0, (gaps, delay)  # never early; late only by scheduling
    execs = _execs(client, run.run_id)
    assert [e.attempt for e in execs] == [1, 2, 3, 4]
    assert [(e.round, e.phase) for e in _events(client, run.run_id, "phase")] == [
        (1, "run"), (2, "run"), (3, "run"), (4, "run")]
    assert result.usage["attempts"] == 4
    assert_balanced(client.events(run.run_id))


def test_retry_gives_up_after_its_attempts(client, probe) -> None:
    result = client.start(cf.retry_exponential, input={"failures": 9}).wait(timeout=30)
    assert result.status == "failed"
    assert [(e.type, e.message) for e in result.errors] == [("ConnectionError", "try 4 failed")]
    assert len(_tries(probe, result.run_id)) == 4


def test_accepts_filters_which_errors_retry(client, probe) -> None:
    result = client.start(cf.retry_filtered, input={"failures": 1, "error": "ValueError"}).wait(timeout=30)
    assert result.status == "failed" and result.errors[0].type == "ValueError"
    assert len(_tries(probe, result.run_id)) == 1
    retried = client.start(cf.retry_filtered, input={"failures": 2}).wait(timeout=30)
    assert retried.values == {"fetch": "ok on try 3"}


def test_full_jitter_waits_at_most_the_delay(client, probe) -> None:
    run = client.start(cf.retry_jitter, input={"failures": 2})
    assert run.wait(timeout=30).status == "done"
    tries = _tries(probe, run.run_id)
    gaps = [b["at"] - a["at"] for a, b in itertools.pairwise(tries)]
    assert len(gaps) == 2 and all(0 <= gap <= 0.3 + 1.0 for gap in gaps), gaps


def test_a_timeout_is_retried_when_the_policy_allows_it(client, probe) -> None:
    result = client.start(cf.retry_timeout, input={}).wait(timeout=30)
    assert result.status == "done" and result.values == {"fetch": "ok on try 2"}
    assert recorded(probe, result.run_id, "signal") == ["timeout"]


# --- budget and usage ---------------------------------------------------------------------------


def test_attempt_budget_stops_a_five_round_loop_after_two_rounds(client, probe) -> None:
    run = client.start(cf.attempt_budget, input={})
    result = run.wait(timeout=30)
    assert (result.status, result.termination_code) == ("failed", "limit")
    [error] = result.errors
    assert error.type == "WorkflowBudgetExceeded" and "budget of 2 attempts" in error.message
    assert len(recorded(probe, run.run_id, "attempt_calls")) == 2
    assert len(recorded(probe, run.run_id, "check_calls")) == 2
    assert result.usage["attempts"] == 2
    with pytest.raises(tl.WorkflowBudgetExceeded):
        result.raise_for_status()
    assert_balanced(client.events(run.run_id))


def test_token_budget_blocks_the_next_review(client, probe) -> None:
    run = client.start(cf.token_budget, input={"output_per_attempt": 100})
    result = run.wait(timeout=30)
    assert (result.status, result.termination_code) == ("failed", "limit")
    # round 1: attempt (100 tokens), review; round 2: attempt (200 tokens); the review is refused
    assert len(recorded(probe, run.run_id, "attempt_calls")) == 2
    assert len(recorded(probe, run.run_id, "check_calls")) == 1
    assert "output tokens" in result.errors[0].message
    assert result.usage["tokens"]["output"] == 200


def test_usage_is_reported_and_receipts_count_once(client) -> None:
    result = client.start(cf.no_budget, input={"output_per_attempt": 3}).wait(timeout=30)
    assert result.status == "failed" and result.errors[0].type == "LoopTaskExhausted"
    assert result.usage == {"attempts": 5, "tokens": {"input": 50, "cached": 7, "output": 15}}


# --- cache --------------------------------------------------------------------------------------


def test_cold_cache_runs_the_loop_and_a_warm_run_makes_no_calls(client, probe) -> None:
    topic = f"t-{time.time_ns()}"
    cold = client.start(cf.cached_reuse, input={"topic": topic})
    cold_result = cold.wait(timeout=30)
    assert cold_result.values == {"essay": f"{topic} v2"}
    assert recorded(probe, cold.run_id, "cache_calls") == [["attempt", 1], ["check", 1], ["attempt", 2], ["check", 2]]
    assert [e.type for e in client.events(cold.run_id) if e.type.startswith("cache.")] == [
        "cache.miss", "cache.stored"]

    warm = client.start(cf.cached_reuse, input={"topic": topic})
    warm_result = warm.wait(timeout=30)
    assert warm_result.values == cold_result.values
    assert recorded(probe, warm.run_id, "cache_calls") == []
    view = client.inspect(warm.run_id).tasks["essay"]
    assert (view.cache_hit, view.attempts, view.rounds, view.status) == (True, 0, [], "done")
    assert warm_result.usage["attempts"] == 0
    assert [e.type for e in client.events(warm.run_id) if e.type.startswith("cache.")] == ["cache.hit"]
    assert_balanced(client.events(warm.run_id))


def test_refresh_mode_runs_again(client, probe) -> None:
    topic = f"r-{time.time_ns()}"
    for _ in range(2):
        run = client.start(cf.cached_refresh, input={"topic": topic})
        assert run.wait(timeout=30).values == {"essay": f"{topic} v2"}
        assert len(recorded(probe, run.run_id, "cache_calls")) == 4
        misses = _events(client, run.run_id, "cache.miss")
        assert [e.data["reason"] for e in misses] == ["refresh"]


def test_expired_entries_run_again(client, probe) -> None:
    topic = f"e-{time.time_ns()}"
    first = client.start(cf.cached_expiring, input={"topic": topic})
    first.wait(timeout=30)
    second = client.start(cf.cached_expiring, input={"topic": topic})
    second.wait(timeout=30)
    assert recorded(probe, second.run_id, "cache_calls") == []  # still fresh
    time.sleep(0.6)  # max_age_ms=400
    third = client.start(cf.cached_expiring, input={"topic": topic})
    assert third.wait(timeout=30).values == {"essay": f"{topic} v2"}
    assert len(recorded(probe, third.run_id, "cache_calls")) == 4
    assert [e.data["reason"] for e in _events(client, third.run_id, "cache.miss")] in (["expired"], ["absent"])


def test_a_broken_cache_store_leaves_the_outcome_unchanged(client, probe) -> None:
    run = client.start(cf.cached_broken, input={"topic": "x"})
    result = run.wait(timeout=30)
    assert result.status == "done" and result.values == {"essay": "x v2"}
    failed = _events(client, run.run_id, "cache.failed")
    assert [e.data["operation"] for e in failed] == ["read", "write"]
    assert "cache backend is down" in failed[0].data["error"]
    assert [e.data["reason"] for e in _events(client, run.run_id, "cache.miss")] == ["store failed"]


@pytest.mark.parametrize(("key", "error_type"), [("raise", "LookupError"), ("set", "InvalidCacheKey")])
def test_cache_key_errors_fail_the_task(client, key: str, error_type: str) -> None:
    result = client.start(cf.cached_bad_key, input={"key": key}).wait(timeout=30)
    assert result.status == "failed" and result.errors[0].type == error_type
    if error_type == "InvalidCacheKey":
        assert "must be lossless JSON values: $.when is a set" in result.errors[0].message


# --- cancellation -------------------------------------------------------------------------------


def _wait_started(probe, run_id: str) -> str:
    return wait_until(lambda: probe.get(f"test:{run_id}:started"), what="the phase to start")


@pytest.mark.parametrize("phase", ["attempt", "check"])
def test_cancel_during_a_phase_ends_aborted_with_balanced_records(client, probe, phase: str) -> None:
    run = client.start(cf.cancellable, input={"hold": phase})
    assert _wait_started(probe, run.run_id) == phase
    cancelled = client.cancel(run.run_id, "user changed their mind")
    assert cancelled.cancelled
    result = run.wait(timeout=15)
    assert (result.status, result.termination_code) == ("cancelled", "aborted")
    result.raise_for_status()  # cancellation is a normal ending
    assert recorded(probe, run.run_id, "signal") == ["user changed their mind"]
    view = client.inspect(run.run_id)
    assert view.tasks["hold"].status == "cancelled" and view.tasks["hold"].phase == phase
    assert view.tasks["later"].status == "cancelled"
    events = client.events(run.run_id)
    assert_balanced(events)
    assert len([e for found in executions(events).values() for e in found]) == (1 if phase == "attempt" else 2)
    again = client.cancel(run.run_id)
    assert not again.cancelled and "already finished (cancelled)" in again.message


def test_cancel_from_the_command_line(client, probe) -> None:
    import subprocess
    import sys

    run = client.start(cf.cancellable, input={"hold": "attempt"})
    _wait_started(probe, run.run_id)
    done = subprocess.run([sys.executable, "-m", "taskloop", "cancel", run.run_id, "--reason", "cli"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "cancelling" in done.stdout
    assert run.wait(timeout=15).status == "cancelled"

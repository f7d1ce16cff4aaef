"""Fleet flow control on real workers (SPEC §10), two workers x two processes at the shipped
defaults: a concurrency key never lets two phases of one key value overlap while another value
runs alongside and an unlimited run goes straight through; a rate limit spreads its starts and
no window holds more than its rate; token reports close a token window; a cancel ends the
phases that wait at once; an operator's override applies to phases already waiting."""

from __future__ import annotations

import collections
import itertools
import json
import threading
import time
from typing import Any

import pytest
import redis

from taskloop.runtime.client import TaskLoop
from tests.integration import limit_flows as lf

pytestmark = [pytest.mark.usefixtures("workers"), pytest.mark.timeout(120)]


def _notes(probe: redis.Redis, tag: str) -> list[tuple[str, str, float, int]]:
    return [tuple(json.loads(raw)) for raw in probe.lrange(f"test:limits:{tag}", 0, -1)]  # type: ignore[misc]


def _intervals(notes: list[tuple[str, str, float, int]]) -> dict[str, tuple[float, float]]:
    starts = {run: at for what, run, at, _ in notes if what == "start"}
    ends = {run: at for what, run, at, _ in notes if what == "end"}
    return {run: (starts[run], ends[run]) for run in starts if run in ends}


def _left(client: TaskLoop, name: str, value: str = "") -> tuple[int, int]:
    """What a limit's key value still holds and has waiting (a value with neither is not listed)."""
    for use in client.store.limit_uses(time.time()):
        if (use.name, use.value) == (name, value):
            return use.used, use.waiting
    return 0, 0


def _start(client: TaskLoop, workflow: Any, tag: str, n: int, **given: Any) -> list[Any]:
    return [client.start(workflow, input={"tag": tag, **given}, run_id=f"{tag}-{i}-{time.time_ns()}")
            for i in range(n)]


def test_a_concurrency_key_never_overlaps_and_other_work_goes_past(client: TaskLoop, probe: redis.Redis) -> None:
    tag = f"conc-{time.time_ns()}"
    on_a = _start(client, lf.held, tag, 8, doc="A", hold_s=1.0)
    on_b = _start(client, lf.held, tag, 2, doc="B", hold_s=1.0)
    time.sleep(1.5)  # A's runs wait now (one holds the slot)
    waiting = [client.inspect(h.run_id).tasks["hold"] for h in on_a]
    throttled = [t.throttled for t in waiting if t.throttled is not None]
    assert throttled and all(t.limit == "test-doc" and t.value == "A" for t in throttled), waiting
    began = time.monotonic()
    unlimited = client.start(lf.free, input={"tag": tag, "n": 1}, run_id=f"{tag}-free").wait(timeout=10)
    took = time.monotonic() - began
    assert unlimited.status == "done" and took < 2.0, f"a run with no limit waited {took:.2f} s behind throttled ones"
    results = [h.wait(timeout=60) for h in on_a + on_b]
    assert [r.status for r in results] == ["done"] * 10
    intervals = _intervals(_notes(probe, tag))
    a = sorted(intervals[h.run_id] for h in on_a)
    b = sorted(intervals[h.run_id] for h in on_b)
    assert all(first[1] <= second[0] for first, second in itertools.pairwise(a)), f"A overlapped: {a}"
    assert b[0][0] < a[-1][0], "key B did not run alongside key A"
    # each waited phase says how long it waited (exec.wait of its outcome) and its throttled event
    events = client.events(on_a[-1].run_id)
    assert any(e.type == "throttled" and e.data["limit"] == "test-doc" for e in events)
    assert all(client.inspect(h.run_id).tasks["hold"].throttled is None for h in on_a)
    # nothing is left held or waiting
    assert _left(client, "test-doc", "A") == (0, 0)


def test_a_rate_limit_spreads_the_starts_and_no_window_holds_more(client: TaskLoop, probe: redis.Redis) -> None:
    from taskloop.store.keys import LimitKeys

    tag = f"rate-{time.time_ns()}"
    window = LimitKeys.of("test-five").use
    probe.delete(window)
    admitted: dict[str, float] = {}  # the limit's own log of admissions, sampled while it lasts (>= 1 s)
    handles = _start(client, lf.rated, tag, 20)
    deadline = time.monotonic() + 60
    while len(admitted) < 20 and time.monotonic() < deadline:
        admitted.update(probe.zrange(window, 0, -1, withscores=True))
        time.sleep(0.1)
    assert [h.wait(timeout=60).status for h in handles] == ["done"] * 20
    starts = sorted(at for what, _, at, _ in _notes(probe, tag) if what == "start")
    assert len(starts) == 20
    assert starts[-1] - starts[0] >= 3.0, f"20 starts under 5/s took {starts[-1] - starts[0]:.2f} s"
    # the limit counts admissions: no window (t - 1 s, t] of them holds more than 5 (the callbacks
    # start a few ms after their admission, so their own clocks may show 6 in a second under load)
    times = sorted(admitted.values())
    assert len(times) >= 15, f"sampled only {len(times)} of 20 admissions"
    most = max(sum(1 for t in times if s - 1.0 < t <= s) for s in times)
    assert most <= 5, f"{most} admissions in one second under a limit of 5/s"


def test_token_reports_stop_new_starts_while_the_window_is_over(client: TaskLoop, probe: redis.Redis) -> None:
    tag = f"tokens-{time.time_ns()}"
    # 100 tokens per 2 s: two phases of 60 tokens put the window over (a phase starts while the
    # window is under, whatever it will report)
    first = _start(client, lf.spent, tag, 2, tokens=60)
    assert [h.wait(timeout=30).status for h in first] == ["done"] * 2
    reported = max(at for what, _, at, _ in _notes(probe, tag) if what == "start")
    later = _start(client, lf.spent, tag, 2, tokens=60)
    assert [h.wait(timeout=30).status for h in later] == ["done"] * 2
    starts = sorted(at for what, run, at, _ in _notes(probe, tag) if what == "start" and
                    run in {h.run_id for h in later})
    # the later ones start only once the earlier reports left the window, 2 s after them
    assert starts[0] - reported >= 1.9, (reported, starts)
    throttled = [e for e in client.events(later[0].run_id) if e.type == "throttled"]
    assert throttled and throttled[0].data["limit"] == "test-tokens"


def test_cancel_ends_the_phases_that_wait_at_once(client: TaskLoop, probe: redis.Redis) -> None:
    tag = f"cancel-{time.time_ns()}"
    holder = client.start(lf.held, input={"tag": tag, "doc": "C", "hold_s": 4.0}, run_id=f"{tag}-holder")
    time.sleep(0.5)
    waiters = _start(client, lf.held, tag, 3, doc="C", hold_s=4.0)
    time.sleep(1.0)
    assert all(client.inspect(h.run_id).tasks["hold"].throttled is not None for h in waiters)
    began = time.monotonic()
    for h in waiters:
        assert client.cancel(h.run_id, "not needed").cancelled
    results = [h.wait(timeout=10) for h in waiters]
    took = time.monotonic() - began
    assert [r.status for r in results] == ["cancelled"] * 3 and took < 2.0, (results, took)
    assert holder.wait(timeout=30).status == "done"
    assert _left(client, "test-doc", "C") == (0, 0)


def test_a_lowered_limit_applies_to_phases_already_waiting(client: TaskLoop, probe: redis.Redis) -> None:
    from click.testing import CliRunner

    from taskloop.cli import cli as main

    tag = f"lower-{time.time_ns()}"
    runner = CliRunner()
    env = {"TASKLOOP_REDIS_URL": client.settings.redis_url}
    assert runner.invoke(main, ["limits", "set", "test-lowered", "--limit", "1"], env=env).exit_code == 0
    try:
        handles = _start(client, lf.changed, tag, 4, hold_s=0.6)
        time.sleep(1.0)
        shown = runner.invoke(main, ["limits", "--json"], env=env)
        found = [u for u in json.loads(shown.output) if u["name"] == "test-lowered"]
        assert found and found[0]["allowed"] == 1 and found[0]["waiting"] >= 1, shown.output
        assert runner.invoke(main, ["limits", "set", "test-lowered", "--limit", "2"], env=env).exit_code == 0
        assert [h.wait(timeout=60).status for h in handles] == ["done"] * 4
    finally:
        assert runner.invoke(main, ["limits", "set", "test-lowered", "--clear"], env=env).exit_code == 0
    intervals = sorted(_intervals(_notes(probe, tag)).values())
    most = max(sum(1 for s, e in intervals if s < at < e) for at in [s + 1e-6 for s, _ in intervals])
    assert most <= 2, f"{most} phases ran at once under a limit lowered to 1, then 2"


def test_a_loop_with_attempt_limits_limits_its_attempts_only(client: TaskLoop, probe: redis.Redis) -> None:
    tag = f"writers-{time.time_ns()}"
    handles = _start(client, lf.writers, tag, 3, hold_s=0.4)
    assert [h.wait(timeout=60).status for h in handles] == ["done"] * 3
    notes = _notes(probe, tag)
    spans = []
    for run in {run for _, run, _, _ in notes}:
        for n in (1, 2):
            start = next(at for what, r, at, _ in notes if r == run and what == f"attempt-{n}")
            end = next(at for what, r, at, _ in notes if r == run and what == f"attempt-end-{n}")
            spans.append((start, end))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), f"attempts overlapped: {spans}"


def test_a_phase_whose_limits_need_no_key_takes_its_room_in_the_call_that_begins_it(
        client: TaskLoop, probe: redis.Redis) -> None:
    """SPEC §10: an unkeyed concurrency limit and a rate limit cost a phase no call of their own. A
    worker process learns a message name's limits on its first message (the full path, whose
    write takes the room: cas_limits.lua acquire); after that the room is taken in begin.lua, and
    the slot is released with the outcome's write (cas_limits.lua wake). Counted from Redis's
    MONITOR, for the calls that name the limits."""
    names = {client.store._scripts[name].sha: name for name in ("limits", "begin", "cas", "cas_limits")}
    calls: collections.Counter[str] = collections.Counter()
    seen_before: set[str] = set()
    watching = threading.Event()
    stop = threading.Event()

    def watch() -> None:
        with probe.monitor() as monitor:
            watching.set()
            for seen in monitor.listen():
                if stop.is_set():
                    return
                words = str(seen["command"]).split()
                # (a script's first call on this server is seen twice: NOSCRIPT, then again once loaded)
                named = words[:1] == ["EVALSHA"] and any("test-wide" in word for word in words)
                if named and seen["command"] not in seen_before:
                    seen_before.add(seen["command"])
                    script = names.get(words[1], words[1])
                    op = next((w for w in words if w.strip('"') in ("acquire", "wake")), "").strip('"')
                    calls[f"{script}:{op}" if script == "cas_limits" else script] += 1

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert watching.wait(5)
    tag = f"roomy-{time.time_ns()}"
    n = 24
    results = [h.wait(timeout=60) for h in _start(client, lf.roomy, tag, n)]
    stop.set()
    probe.ping()  # one more command ends the monitor's wait
    thread.join(timeout=5)
    assert [r.status for r in results] == ["done"] * n
    learned = calls["cas_limits:acquire"]  # the full path: a process's first message of this name
    assert learned <= 4, f"the full path took room {learned} times (two workers x two processes): {calls}"
    assert calls["begin"] + learned == n, calls  # every other phase took its room in begin.lua (it names the limits)
    assert calls["limits"] == 0, f"limits.lua was called on its own: {calls}"
    assert calls["cas_limits:wake"] == n, calls  # every slot went back with its outcome, in the same call
    assert _left(client, "test-wide") == (0, 0)

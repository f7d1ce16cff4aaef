"""Pools for loops that wait on models (SPEC §12), on real `taskloop worker` processes:

- a pool taskloop cannot run phases on is refused at start, by `taskloop worker` and by
  `celery worker`, with the reason;
- on threads, gevent and asyncio, many loops in flight in one worker process all end done, each
  phase run once;
- a cancel reaches a phase that waits (the asyncio pool cancels its task: CancelledError);
- a timeout ends a phase whose callback ignores its signal (threads), and cancels an async
  callback's task (asyncio);
- a fleet RateLimit holds with a hundred phases in flight;
- a warm shutdown with phases in flight hands them back within the grace, and another worker ends
  them;
- a SIGKILLed Celery worker with phases in flight loses no run and commits nothing twice;
- a SIGKILLed supervisor takes its Celery worker with it.

Each test has a Redis of its module's own, so that only the workers it starts take its messages.
The 1,000-in-flight versions of the kill test (threads, gevent, asyncio) are marked slow:
`pytest -m slow tests/integration/test_pools.py`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from taskloop.ops.embedded import RedisServer
from taskloop.runtime.client import TaskLoop
from tests.integration import pool_flows
from tests.integration.flows import recorded
from tests.ledger import ledger_problems
from tests.waiting import wait_until
from tests.workers import WorkerProcess, alive

IMPORTS = ("tests.integration.pool_flows",)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """This module's own Redis (conftest's ``client`` and ``probe`` then use it)."""
    server = RedisServer(tmp_path_factory.mktemp("pools-redis")).start()
    yield server
    server.stop()


@pytest.fixture()
def start(redis_server: RedisServer, tmp_path: Path) -> Iterator[object]:
    """Start `taskloop worker` processes on this module's Redis; stopped at the end of the test."""
    started: list[WorkerProcess] = []

    def start_worker(name: str, pool: str, concurrency: int, env: dict[str, str] | None = None) -> WorkerProcess:
        worker = WorkerProcess(redis_server.url, IMPORTS, tmp_path / f"{name}.log", name=name, pool=pool,
                               concurrency=concurrency, env=env)
        started.append(worker)
        return worker.ready(60)

    yield start_worker
    for worker in started:
        worker.stop()


def calls(probe: redis.Redis, run_id: str, what: str = "calls") -> list[dict[str, object]]:
    return recorded(probe, run_id, what)


def once_each(probe: redis.Redis, run_ids: list[str]) -> Counter[tuple[str, object, object]]:
    """How many times each (run, round, phase) ran: 1 each when nothing ran twice."""
    return Counter((rid, c["round"], c["phase"]) for rid in run_ids for c in calls(probe, rid))


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize("pool, why", [("eventlet", "Celery deprecated eventlet"),
                                        ("processes2", "cannot tell whether it runs phases correctly")])
def test_a_pool_taskloop_cannot_run_on_is_refused_by_taskloop_worker(redis_server: RedisServer, pool: str,
                                                                      why: str) -> None:
    env = {**os.environ, "TASKLOOP_REDIS_URL": redis_server.url, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "taskloop", "worker", "-P", pool, "--import", IMPORTS[0]],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert f"pool {pool!r} is refused" in done.stderr and why in done.stderr, done.stderr
    assert "prefork, threads, gevent, asyncio, solo" in done.stderr


def test_a_pool_class_taskloop_cannot_run_on_is_refused_by_celery_worker(redis_server: RedisServer,
                                                                         tmp_path: Path) -> None:
    env = {**os.environ, "TASKLOOP_REDIS_URL": redis_server.url, "PYTHONPATH": str(REPO),
           "TASKLOOP_IMPORTS": IMPORTS[0], "CELERY_CUSTOM_WORKER_POOL": "tests.integration.pool_flows:OddPool"}
    log = tmp_path / "celery.log"
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "taskloop", "worker", "--pool", "custom",
                           "--logfile", str(log)],
                          env=env, capture_output=True, text=True, timeout=90)
    text = done.stderr + (log.read_text() if log.exists() else "")
    assert done.returncode == 78, (done.returncode, text[-2000:])
    assert "tests.integration.pool_flows.OddPool' is refused" in text, text[-2000:]


def test_celery_worker_on_celerys_own_thread_pool_runs_phases_and_cancels(redis_server: RedisServer, client: TaskLoop,
                                                                          probe: redis.Redis, tmp_path: Path) -> None:
    """`celery worker --pool threads` is Celery's thread pool (taskloop's -P threads is its own
    pool process): taken, as ``celery-threads``, with the phases in the worker's own process."""
    env = {**os.environ, "TASKLOOP_REDIS_URL": redis_server.url, "PYTHONPATH": str(REPO),
           "TASKLOOP_IMPORTS": IMPORTS[0]}
    env.pop("TASKLOOP_POOL", None)
    log = tmp_path / "celery-threads.log"
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "taskloop", "worker", "--pool", "threads",
                               "-c", "20", "--without-gossip", "--without-mingle", "-n", "celery-threads@%h",
                               "--loglevel", "INFO", "--logfile", str(log)], env=env)
    try:
        handles = [client.start(pool_flows.waiting, input={"hold_s": 0.5, "rounds": 2}) for _ in range(20)]
        for handle in handles:
            assert handle.wait(timeout=90).status == "done"
        assert {c["pid"] for h in handles for c in calls(probe, h.run_id)} == {worker.pid}
        held = client.start(pool_flows.waiting, input={"hold_s": 60.0})
        wait_until(lambda: calls(probe, held.run_id), timeout=30, what="the attempt runs")
        assert client.cancel(held.run_id, "test cancel").cancelled
        assert held.wait(timeout=20).status == "cancelled"
        assert ledger_problems(client.events(held.run_id)) == []
    finally:
        worker.terminate()
        worker.wait(90)


# --- many in flight, cancel, timeout ---------------------------------------------------------


@pytest.mark.parametrize("pool", ["threads", "gevent", "asyncio"])
def test_many_loops_in_flight_in_one_process_end_done_each_phase_once(start, client: TaskLoop, probe: redis.Redis,
                                                                       pool: str) -> None:
    worker = start(f"many-{pool}", pool, 200)
    flow = pool_flows.awaiting if pool == "asyncio" else pool_flows.waiting
    handles = [client.start(flow, input={"hold_s": 1.0, "rounds": 2}) for _ in range(200)]
    # all 200 first attempts are in flight in the one process at once
    wait_until(lambda: sum(1 for h in handles if calls(probe, h.run_id)) == 200, timeout=30,
               what="every run's first attempt runs")
    for handle in handles:
        result = handle.wait(timeout=60)
        assert result.status == "done", (result, client.inspect(handle.run_id).tasks, worker.log()[-3000:])
    counts = once_each(probe, [h.run_id for h in handles])
    assert len(counts) == 200 * 4 and set(counts.values()) == {1}, counts.most_common(3)
    pids = {c["pid"] for h in handles for c in calls(probe, h.run_id) if c["phase"] == "attempt"}
    assert len(pids) == 1, pids  # one process ran them all
    for handle in handles[:20]:
        assert ledger_problems(client.events(handle.run_id)) == []
    assert worker.alive()


@pytest.mark.parametrize("pool, callbacks", [("threads", "sync"), ("gevent", "sync"), ("asyncio", "async"),
                                             ("threads", "async"), ("asyncio", "sync")])
def test_a_cancel_reaches_a_waiting_phase(start, client: TaskLoop, probe: redis.Redis, pool: str,
                                          callbacks: str) -> None:
    start(f"cancel-{pool}-{callbacks}", pool, 20)
    flow = pool_flows.awaiting if callbacks == "async" else pool_flows.waiting
    handle = client.start(flow, input={"hold_s": 60.0})
    wait_until(lambda: calls(probe, handle.run_id), timeout=30, what="the attempt runs")
    began = time.monotonic()
    assert client.cancel(handle.run_id, "test cancel").cancelled
    assert handle.wait(timeout=20).status == "cancelled"
    assert time.monotonic() - began < 10
    if callbacks == "async":  # its task was cancelled: the callback saw CancelledError
        wait_until(lambda: calls(probe, handle.run_id, "cancelled"), timeout=10, what="CancelledError in the callback")
    assert ledger_problems(client.events(handle.run_id)) == []


@pytest.mark.parametrize("pool", ["threads", "asyncio"])
def test_a_timeout_ends_a_sync_callback_that_ignores_its_signal(start, client: TaskLoop, probe: redis.Redis,
                                                                pool: str) -> None:
    start(f"timeout-sync-{pool}", pool, 10)
    handle = client.start(pool_flows.sleeper, input={"sleep_s": 8.0})
    result = handle.wait(timeout=60)
    # the round's 1 s timeout, then TASKLOOP_TIMEOUT_GRACE_S: the task fails while its thread sleeps on
    assert result.status == "failed", result
    view = client.inspect(handle.run_id)
    assert view.tasks["sleep"].error is not None and "Timeout" in view.tasks["sleep"].error.type
    assert not calls(probe, handle.run_id, "returned")  # recorded before the callback returned
    assert ledger_problems(client.events(handle.run_id)) == []


def test_a_timeout_cancels_an_async_callbacks_task(start, client: TaskLoop, probe: redis.Redis) -> None:
    start("timeout-asyncio", "asyncio", 10)
    handle = client.start(pool_flows.timed_await, input={"sleep_s": 30.0})
    result = handle.wait(timeout=30)
    assert result.status == "failed", result
    view = client.inspect(handle.run_id)
    assert view.tasks["wait"].error is not None and "Timeout" in view.tasks["wait"].error.type
    wait_until(lambda: calls(probe, handle.run_id, "cancelled"), timeout=10, what="CancelledError in the callback")


# --- a fleet limit with many in flight -------------------------------------------------------


@pytest.mark.parametrize("pool", ["threads", "asyncio"])
def test_a_rate_limit_holds_with_a_hundred_phases_in_flight(start, client: TaskLoop, probe: redis.Redis,
                                                            pool: str) -> None:
    from taskloop.store.keys import LimitKeys

    start(f"rated-{pool}", pool, 200)
    window = LimitKeys.of(pool_flows.per_second.name).use
    probe.delete(window)
    flow = pool_flows.rated_async if pool == "asyncio" else pool_flows.rated_sync
    handles = [client.start(flow) for _ in range(100)]
    admitted: dict[str, float] = {}  # the limit's own log of admissions, sampled while it lasts (1 s)
    deadline = time.monotonic() + 60
    while len(admitted) < 100 and time.monotonic() < deadline:
        admitted.update(probe.zrange(window, 0, -1, withscores=True))
        time.sleep(0.1)
    for handle in handles:
        assert handle.wait(timeout=60).status == "done"
    starts = sorted(float(c["at"]) for h in handles for c in calls(probe, h.run_id))  # type: ignore[arg-type]
    assert len(starts) == 100
    assert starts[-1] - starts[0] >= 100 / 20 - 1.5, "100 starts under 20/s took less than 3.5 s"
    # no window (t - 1 s, t] of admissions holds more than 20
    times = sorted(admitted.values())
    assert len(times) >= 75, f"sampled only {len(times)} of 100 admissions"
    most = max(sum(1 for t in times if s - 1.0 < t <= s) for s in times)
    assert most <= 20, f"{most} admissions in one second under a limit of 20/s"


# --- shutdown and kills ----------------------------------------------------------------------


@pytest.mark.parametrize("pool, in_flight", [("threads", 100), ("asyncio", 100), ("solo", 1)])
def test_a_warm_shutdown_hands_back_the_phases_in_flight(start, client: TaskLoop, probe: redis.Redis,
                                                         pool: str, in_flight: int) -> None:
    first = start(f"leaving-{pool}", pool, in_flight)
    flow = pool_flows.awaiting if pool == "asyncio" else pool_flows.waiting
    handles = [client.start(flow, input={"hold_s": 40.0, "replay_hold_s": 0.5, "rounds": 1})
               for _ in range(in_flight)]
    wait_until(lambda: sum(1 for h in handles if calls(probe, h.run_id)) == in_flight, timeout=30,
               what="every attempt runs")
    start(f"staying-{pool}", pool, in_flight, env={})
    began = time.monotonic()
    first.terminate()  # SIGTERM: warm shutdown, TASKLOOP_SHUTDOWN_GRACE_S (shipped default) then hand-back
    assert first.wait(timeout=90) == 0
    took = time.monotonic() - began
    assert "handed back by" in first.log()
    assert "could not hand back" not in first.log()  # (solo: its pool cannot terminate a task; none is asked to)
    for handle in handles:  # the other worker ran them again at once, not after a lease
        assert handle.wait(timeout=120).status == "done"
    assert took < 60, took
    for handle in handles[:20]:
        assert ledger_problems(client.events(handle.run_id)) == []


@pytest.mark.parametrize("pool, in_flight", [
    ("threads", 200), ("asyncio", 200),
    pytest.param("threads", 1000, marks=pytest.mark.slow), pytest.param("gevent", 1000, marks=pytest.mark.slow),
    pytest.param("asyncio", 1000, marks=pytest.mark.slow)])
def test_a_killed_worker_with_phases_in_flight_loses_no_run(start, client: TaskLoop, probe: redis.Redis,
                                                            pool: str, in_flight: int) -> None:
    doomed = start(f"doomed-{pool}", pool, in_flight)
    flow = pool_flows.awaiting if pool == "asyncio" else pool_flows.waiting
    hold = 5.0 if in_flight <= 200 else 20.0
    handles = [client.start(flow, input={"hold_s": hold, "replay_hold_s": 0.5, "rounds": 1}) for _ in range(in_flight)]
    wait_until(lambda: sum(1 for h in handles if calls(probe, h.run_id)) == in_flight, timeout=60,
               what="every attempt runs")
    start(f"survivor-{pool}", pool, in_flight)
    celery_pid = doomed.celery_pid()
    assert celery_pid is not None
    killed_at = time.time()
    os.kill(celery_pid, signal.SIGKILL)
    for handle in handles:
        assert handle.wait(timeout=180).status == "done"
    ended = max(client.inspect(h.run_id).finished_at or 0.0 for h in handles)
    print(f"{pool}: {in_flight} in flight, Celery worker SIGKILLed; every run done {ended - killed_at:.1f} s later")
    for handle in handles:
        assert ledger_problems(client.events(handle.run_id)) == [], handle.run_id


def test_a_killed_supervisor_takes_its_celery_worker_with_it(start) -> None:
    worker = start("orphaned", "threads", 10)
    celery_pid = worker.celery_pid()
    assert celery_pid is not None and alive(celery_pid)
    worker.kill()  # SIGKILL: the supervisor has no chance to stop its child
    worker.wait(10)
    wait_until(lambda: not alive(celery_pid), timeout=15, what="the Celery worker exits with its supervisor")

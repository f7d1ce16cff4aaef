"""Connections that hang instead of failing (issue 21, point 3; docs/reliability.md, *Connections
that hang*).

A TCP proxy (tests/proxy.py) sits between the workers and Redis: the store URL and the broker URL
of 2 workers x 2 processes both go through it, at the shipped defaults (no lease, reconcile or
connection setting shortened). With loop runs in flight it

- black-holes every connection for 30 s, and for 120 s (slow): nothing is forwarded and nothing
  is closed, as when a network drops packets; when it heals, the connections from before are
  dead (RST) and new ones work;
- adds 200 ms of latency in each direction for 20 s;
- cuts every connection with a TCP RST, three times, 2 s apart.

Each must end with every run done, none lost, no phase committed twice, the same worker
processes (their pools whole, still consuming), and every run moving again within seconds of the
proxy healing: the recovery times are printed and recorded in docs/reliability.md. A waiting
``client.wait()`` through the proxy rides out the 30 s black hole, and rides out the 120 s one or
gives up with StoreUnavailable and a clear message.

The test's own bookkeeping (the client that checks, the callbacks' log) talks to Redis directly
(``FAULT_PROBE_URL``, tests/faults/flows.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from taskloop.base.config import Settings
from taskloop.base.errors import StoreUnavailable
from taskloop.runtime.client import TaskLoop
from taskloop.runtime.models import executions
from tests.faults import flows
from tests.faults.harness import RESULTS, Cluster, Fault, in_flight
from tests.proxy import FaultProxy
from tests.workers import WorkerProcess

RESUME_LIMIT_S = 15.0  # every run in flight moves again within this long after the proxy heals
RUNS = 8
HOLD_S = 0.5  # each callback's work: 8 runs x 6 phases x 0.5 s on 4 processes, about 6 s of work


class ProxiedCluster(Cluster):
    """The harness's cluster at the shipped defaults, whose workers reach Redis (store and broker)
    through one FaultProxy; the test's client and the callbacks' log go to Redis directly."""

    proxy: FaultProxy | None = None

    def start_worker(self, name: str, concurrency: int = 2) -> None:
        if self.proxy is None:
            self.proxy = FaultProxy("127.0.0.1", self.redis.port).start()
        url = self.proxy.url_for(0)
        worker = WorkerProcess(url, self.imports, self.tmp / f"{name}.log", name=name, concurrency=concurrency,
                               broker_url=url, env={**self.env, "FAULT_PROBE_URL": self.redis.url},
                               pool=self.pool)
        self.workers[name] = worker
        worker.ready(30)
        self.celery_pids[name] = self.celery_pid(name)
        self.concurrency[name] = concurrency

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.heal()  # a warm shutdown needs Redis
        try:
            super().stop()
        finally:
            if self.proxy is not None:
                self.proxy.stop()


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[ProxiedCluster]:
    c = ProxiedCluster(tmp_path, 21, timers={})
    try:
        c.start(workers=("p1", "p2"), concurrency=2)
        yield c
    finally:
        c.stop()


@dataclass
class Recovery:
    """After the proxy healed: when every run in flight moved again, and when all were done."""

    first_s: float | None = None  # the first run to move again (a phase began or committed)
    all_moving_s: float | None = None  # the last of the runs in flight to move again
    all_done_s: float | None = None  # the last run to finish
    live_at_heal: int = 0
    during: int = 0  # phases committed while the fault lasted
    stalled: list[str] = field(default_factory=list)  # runs in flight at the heal that never moved again

    def line(self) -> str:
        def s(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"
        return (f"{self.during} phases committed during the fault; "
                f"{self.live_at_heal} runs in flight at the heal; first moved again after {s(self.first_s)} s, "
                f"all after {s(self.all_moving_s)} s, all done after {s(self.all_done_s)} s")


def measure(cluster: Cluster, run_ids: list[str], at: float, healed_at: float) -> Recovery:
    assert cluster.client is not None
    found = Recovery()
    moved: list[float] = []
    done: list[float] = []
    for run_id in run_ids:
        found.during += sum(1 for e in cluster.client.events(run_id) if e.type == "phase" and at < e.at < healed_at)
        view = cluster.client.inspect(run_id)
        if view.finished_at is not None:
            done.append(view.finished_at - healed_at)
            if view.finished_at <= healed_at:
                continue
        found.live_at_heal += 1
        events = cluster.client.events(run_id)
        times = [e.at for e in events if e.type == "phase" and e.at > healed_at]
        times += [x.began_at for xs in executions(events).values() for x in xs
                  if x.began_at is not None and x.began_at > healed_at]
        if times:
            moved.append(min(times) - healed_at)
        else:
            found.stalled.append(run_id)
    if moved:
        found.first_s, found.all_moving_s = min(moved), max(moved)
    if done and len(done) == len(run_ids):
        found.all_done_s = max(0.0, max(done))
    return found


class Waiter:
    """``client.wait()`` in a thread, through the proxy (a client that knows only the proxy)."""

    def __init__(self, url: str, run_id: str) -> None:
        self.client = TaskLoop(url, config=Settings(redis_url=url))
        self.run_id = run_id
        self.result: Any = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.notices: list[str] = []
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        try:
            self.result = self.client.wait(self.run_id, timeout=600, on_notice=self.notices.append)
        except BaseException as exc:
            self.error = exc
        finally:
            self.ended_at = time.time()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        self.client.close()


def scenario(cluster: ProxiedCluster, name: str, fault: Callable[[FaultProxy], None],
             waiter_expect: str | None = None) -> tuple[Recovery, Waiter | None]:
    """Start the runs, hit them with ``fault`` (which returns once the proxy has healed), check."""
    assert cluster.client is not None and cluster.proxy is not None
    run_ids = cluster.start_runs(RUNS, hold_s=HOLD_S, accept_round=3)
    waiter = Waiter(cluster.proxy.url_for(0), run_ids[-1]) if waiter_expect else None
    time.sleep(1.5)
    targets = in_flight(cluster, run_ids)
    at = time.time()
    fault(cluster.proxy)
    healed_at = time.time()
    cluster.wait_all(run_ids, timeout=120)
    outcome = cluster.check(name, run_ids, [Fault(name, at, targets)], flows.MAX_ROUNDS)
    found = measure(cluster, run_ids, at, healed_at)
    outcome.max_recovery_s = found.all_moving_s or 0.0
    RESULTS.append(outcome)
    print(f"\n{name}: {found.line()}")
    assert outcome.lost == 0 and outcome.duplicate_commits == 0, outcome.problems
    assert not outcome.problems, "\n".join(outcome.problems)
    assert not found.stalled, f"runs in flight at the heal that never moved again: {found.stalled}"
    results = [cluster.client.result(run_id) for run_id in run_ids]
    assert all(r is not None and r.status == "done" and r.values["work"]["round"] == 3 for r in results), results
    assert found.all_moving_s is None or found.all_moving_s <= RESUME_LIMIT_S, found.line()
    # the fleet is whole: the same worker processes, their pools, still consuming
    cluster.assert_fleet_whole()
    return found, waiter


def black_hole(seconds: float) -> Callable[[FaultProxy], None]:
    def fault(proxy: FaultProxy) -> None:
        proxy.black_hole()
        time.sleep(seconds)
        proxy.heal(cut=False)  # the old connections stay silent: the workers must notice by themselves
    return fault


def latency(ms: float, seconds: float) -> Callable[[FaultProxy], None]:
    def fault(proxy: FaultProxy) -> None:
        proxy.latency(ms)
        time.sleep(seconds)
        proxy.heal()
    return fault


def resets(times: int, apart_s: float) -> Callable[[FaultProxy], None]:
    def fault(proxy: FaultProxy) -> None:
        for i in range(times):
            if i:
                time.sleep(apart_s)
            proxy.reset()
    return fault


@pytest.mark.timeout(300)
def test_black_hole_30s_at_the_shipped_defaults(cluster: ProxiedCluster) -> None:
    _, waiter = scenario(cluster, "black hole 30 s (store and broker, proxy) at the defaults",
                             black_hole(30.0), waiter_expect="done")
    assert waiter is not None
    waiter.join(60)
    # a wait() through the proxy rode out the black hole (TASKLOOP_WAIT_OUTAGE_S, 30 s)
    assert waiter.error is None, (waiter.error, waiter.notices)
    assert waiter.result is not None and waiter.result.status == "done"
    print(f"wait() through the proxy: {waiter.notices}")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_black_hole_120s_at_the_shipped_defaults(cluster: ProxiedCluster) -> None:
    _, waiter = scenario(cluster, "black hole 120 s (store and broker, proxy) at the defaults",
                         black_hole(120.0), waiter_expect="either")
    assert waiter is not None
    waiter.join(60)
    # a wait() through the proxy either rode out the black hole or gave up with a clear error
    if waiter.error is not None:
        assert isinstance(waiter.error, StoreUnavailable), (waiter.error, waiter.notices)
        assert "cannot reach Redis" in str(waiter.error), str(waiter.error)
        print(f"wait() through the proxy gave up: {waiter.error}; {waiter.notices}")
    else:
        assert waiter.result is not None and waiter.result.status == "done", waiter.result
        print(f"wait() through the proxy rode out the black hole: {waiter.notices}")


@pytest.mark.timeout(240)
def test_latency_200ms_at_the_shipped_defaults(cluster: ProxiedCluster) -> None:
    found, _ = scenario(cluster, "latency 200 ms each way for 20 s (proxy) at the defaults", latency(200, 20.0))
    assert found.during > 0, "no phase was committed under 200 ms of latency: the workers time out instead of working"


@pytest.mark.timeout(240)
def test_rst_of_every_connection_at_the_shipped_defaults(cluster: ProxiedCluster) -> None:
    scenario(cluster, "RST of every connection x3, 2 s apart (proxy) at the defaults", resets(3, 2.0))


@pytest.mark.timeout(240)
def test_a_phase_that_cannot_begin_for_want_of_the_store_goes_back_to_the_queue(tmp_path: Path) -> None:
    """The store away, the broker fine (a store of its own: a Cluster failing over, a store behind
    another network path): a worker takes a phase message and cannot begin it. The message goes
    back to the queue instead of being acknowledged, so the phase starts as soon as the store
    answers, not after its queued lease (TASKLOOP_QUEUED_LEASE_S, 300 s)."""
    cluster = Cluster(tmp_path, 24, timers={})
    cluster.redis.start()
    proxy = FaultProxy("127.0.0.1", cluster.redis.port).start()
    worker = WorkerProcess(proxy.url_for(0), cluster.imports, tmp_path / "s1.log", name="s1", concurrency=1,
                           broker_url=cluster.redis.url, env={**cluster.env, "FAULT_PROBE_URL": cluster.redis.url})
    client = TaskLoop(cluster.redis.url, config=Settings(redis_url=cluster.redis.url))
    try:
        worker.ready(30)
        # Given a worker that reaches its broker but not its store (refused: the proxy is gone)
        proxy.stop()
        down = time.time()
        # When a run starts: its first message reaches the worker, whose begin cannot reach the store
        run = client.start(flows.grind, input={"hold_s": 0.05, "accept_round": 1})
        deadline = time.monotonic() + 60
        while "goes back to the queue" not in worker.log():  # the begin gave up at least once
            assert time.monotonic() < deadline, worker.log()[-3000:]
            time.sleep(0.5)
        assert client.status(run.run_id) == "running"
        proxy = FaultProxy("127.0.0.1", cluster.redis.port, listen_port=proxy.port).start()
        back = time.time()
        # Then the run is done within seconds of the store answering again
        result = run.wait(timeout=60)
        assert result.status == "done", result
        took = (client.inspect(run.run_id).finished_at or 0) - back
        print(f"\nstore refused for {back - down:.1f} s, broker fine: the run was done {took:.2f} s after the "
              "store answered again")
        assert took < RESUME_LIMIT_S
        assert worker.alive()
    finally:
        client.close()
        worker.stop()
        proxy.stop()
        cluster.redis.stop()

"""Fleet limits under real faults, at the shipped defaults (SPEC §10): a worker killed with the
slot it holds (SIGKILL of its supervisor, Celery process and pool) does not leak the slot, which
comes back by the phase's lease, and the phases waiting behind it start; Redis killed and restarted
from its AOF in the middle of throttled and running phases loses no run, leaks no slot and lets no
limit be exceeded afterwards. Each checks the fleet too (the surviving workers' same processes,
whole pools, still consuming)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.faults.harness import Cluster
from tests.integration import limit_flows as lf
from tests.workers import children_of

pytestmark = pytest.mark.timeout(240)
IMPORTS = ("tests.faults.flows", "tests.integration.limit_flows")


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, 23, timers={}, appendfsync="always", imports=IMPORTS).start(workers=("l1", "l2"))
    try:
        yield c
    finally:
        c.stop()


def _notes(cluster: Cluster, tag: str) -> list[list]:  # type: ignore[type-arg]
    assert cluster.probe is not None
    return [json.loads(raw) for raw in cluster.probe.lrange(f"test:limits:{tag}", 0, -1)]


def _left(cluster: Cluster, name: str, value: str = "") -> tuple[int, int]:
    assert cluster.client is not None
    for use in cluster.client.store.limit_uses(time.time()):
        if (use.name, use.value) == (name, value):
            return use.used, use.waiting
    return 0, 0


def _wait_done(cluster: Cluster, run_ids: list[str], timeout: float) -> None:
    cluster.wait_all(run_ids, timeout=timeout)
    assert cluster.client is not None
    statuses = [cluster.client.status(run_id) for run_id in run_ids]
    errors = [[(t.key, t.error) for t in cluster.client.inspect(r).tasks.values() if t.error]
              for r, s in zip(run_ids, statuses, strict=True) if s != "done"]
    assert statuses == ["done"] * len(run_ids), (statuses, errors)


def test_a_killed_worker_gives_its_slot_back_by_the_lease(cluster: Cluster) -> None:
    assert cluster.client is not None
    tag = f"kill-{time.time_ns()}"
    runs = [cluster.client.start(lf.held, input={"tag": tag, "doc": "K", "hold_s": 3.0}).run_id for _ in range(4)]
    deadline = time.monotonic() + 20
    holder_pid = None
    while holder_pid is None and time.monotonic() < deadline:
        started = [n for n in _notes(cluster, tag) if n[0] == "start"]
        holder_pid = started[0][3] if started else None
        time.sleep(0.05)
    assert holder_pid is not None, "no phase started under the limit"
    victim = next(name for name in cluster.workers if holder_pid in children_of(cluster.celery_pid(name)))
    for pid in cluster.tree(victim):  # the whole machine goes: supervisor, worker, pool
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    killed_at = time.time()
    cluster.killed.add(victim)
    cluster.workers[victim].wait(10)
    _wait_done(cluster, runs, timeout=150)
    starts = sorted(n[2] for n in _notes(cluster, tag) if n[0] == "start")
    ends = sorted(n[2] for n in _notes(cluster, tag) if n[0] == "end")
    # the holder's phase ran again (a replay) and the three others ran, never two at once
    assert len(starts) == 5 and len(ends) == 4, (starts, ends)
    after = sorted(n[2] for n in _notes(cluster, tag) if n[0] == "start" and n[2] > killed_at)
    spans = sorted(zip(after, ends, strict=True))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    first_after = after[0] - killed_at
    # the slot came back no later than the lease (30 s) plus a reconcile interval and a drainer look
    assert first_after <= 30.0 + 10.0, f"the next phase started {first_after:.1f} s after the kill"
    print(f"\nslot back after a SIGKILLed worker: next phase started {first_after:.1f} s after the kill")
    assert _left(cluster, "test-doc", "K") == (0, 0)
    cluster.assert_fleet_whole()


def test_a_redis_restart_loses_no_run_and_leaks_no_slot(cluster: Cluster) -> None:
    assert cluster.client is not None and cluster.probe is not None
    from taskloop.store.keys import LimitKeys

    tag = f"restart-{time.time_ns()}"
    window = LimitKeys.of("test-five").use
    cluster.probe.delete(window)
    admitted: dict[str, float] = {}  # the limit's own log of admissions, sampled while it lasts (>= 1 s)
    sampling = threading.Event()

    def sample() -> None:
        assert cluster.probe is not None
        while not sampling.is_set():
            try:
                admitted.update(cluster.probe.zrange(window, 0, -1, withscores=True))
            except redis.RedisError:
                pass  # Redis is down: nothing is admitted meanwhile
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    held = [cluster.client.start(lf.held, input={"tag": tag, "doc": "R", "hold_s": 1.0}).run_id for _ in range(5)]
    rated = [cluster.client.start(lf.rated, input={"tag": tag}).run_id for _ in range(15)]
    time.sleep(1.5)  # some run, most wait
    cluster.redis.kill()
    time.sleep(2.0)
    cluster.redis.start(timeout=60)
    back_at = time.time()
    _wait_done(cluster, held + rated, timeout=120)
    took = time.time() - back_at
    sampling.set()
    sampler.join(5)
    notes = _notes(cluster, tag)
    # the concurrency key: never two at once (a phase cut by the restart may have run again)
    spans = sorted((n[2], next(e[2] for e in notes if e[0] == "end" and e[1] == n[1] and e[2] > n[2]))
                   for n in notes if n[0] == "start" and n[1] in held
                   and any(e[0] == "end" and e[1] == n[1] and e[2] > n[2] for e in notes))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    # the rate: no window (t - 1 s, t] of admissions holds more than 5, before or after the restart
    times = sorted(admitted.values())
    assert len(times) >= 11, f"sampled only {len(times)} of 15 admissions"
    most = max(sum(1 for t in times if s - 1.0 < t <= s) for s in times)
    assert most <= 5, f"{most} admissions in one second under 5/s"
    # the callbacks start a few ms after their admission, so their own clocks may show one more
    # (docs/controls.md), never two
    starts = sorted(n[2] for n in notes if n[0] == "start" and n[1] in rated)
    most = max(sum(1 for t in starts if s <= t < s + 1.0) for s in starts)
    assert most <= 6, f"{most} callback starts in one second under 5/s"
    assert _left(cluster, "test-doc", "R") == (0, 0)
    print(f"\nafter a Redis restart: every limited run done {took:.1f} s after Redis was back")
    cluster.assert_fleet_whole()

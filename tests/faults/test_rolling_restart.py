"""Graceful shutdown and a rolling restart under load (taskloop/worker/liveness/shutdown.py).

Two workers run phases that take longer than the shutdown grace period. Each worker in turn gets
SIGTERM and is replaced. A phase still running when the grace period ends is handed back: queued
again at once, so the other worker replays it well before its (60 s) lease could expire. No run is
lost, nothing is committed twice, the stopped workers exit 0, and the new fleet consumes."""

from __future__ import annotations

import json
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskloop.runtime.models import executions
from tests.faults.harness import RESULTS, Cluster, Fault
from tests.workers import alive

pytestmark = pytest.mark.timeout(240)

GRACE_S = 1.0
HOLD_S = 2.0  # every phase outlasts the grace period: a worker stopped mid-phase hands it back
LEASE_S = 60.0  # no recovery may wait for this
RUNS = 4
CONCURRENCY = 4  # each worker can take every run's phase: a handed-back phase never waits for a slot


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    env = {"TASKLOOP_SHUTDOWN_GRACE_S": str(GRACE_S), "TASKLOOP_LEASE_S": str(LEASE_S)}
    c = Cluster(tmp_path, 11, env=env).start(workers=("r1", "r2"), concurrency=CONCURRENCY)
    try:
        yield c
    finally:
        c.stop()


def test_a_rolling_restart_hands_running_phases_back_at_once(cluster: Cluster) -> None:
    client, probe = cluster.client, cluster.probe
    assert client is not None and probe is not None
    run_ids = cluster.start_runs(RUNS, hold_s=HOLD_S, accept_round=2)
    stops: list[tuple[str, float, set[int]]] = []
    for name in ("r1", "r2"):
        # wait until this worker is inside callbacks, then stop it
        pool = set(cluster.tree(name)[2:])
        cluster.pick_running(pids=pool, timeout=30)
        proc = cluster.workers[name]
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(GRACE_S + 15) == 0, cluster.log(name)[-3000:]
        exited_s = time.time() - sent
        assert exited_s < GRACE_S + 10
        stops.append((name, sent, pool))
        assert "handed back" in cluster.log(name) or not _handed_back(client, run_ids)
        cluster.start_worker(name, CONCURRENCY)  # the replacement, as a deploy would start it

    cluster.wait_all(run_ids, timeout=120)
    statuses = [client.status(run_id) for run_id in run_ids]
    assert statuses == ["done"] * len(run_ids)

    handed = _handed_back(client, run_ids)
    assert handed, "no phase was running past the grace period: the test did not test a hand-back"
    # no phase waited for a lease: no execution was lost (a lease expiry writes a `lost` event),
    # and every hand-back resumed within seconds
    events = {run_id: client.events(run_id) for run_id in run_ids}
    assert not [e for es in events.values() for e in es if e.type == "lost"]
    resumes, after_hand_back = [], []
    for run_id, key, round_, phase, at in handed:
        stop_at = max(sent for _, sent, _ in stops if sent <= at)
        later = [e.began_at for e in executions(events[run_id])[key]
                 if e.round == round_ and e.phase == phase and e.began_at and e.began_at > at]
        assert later, f"{run_id} {key} {round_}/{phase} was handed back and never ran again"
        resumes.append(min(later) - stop_at)
        after_hand_back.append(min(later) - at)
    assert max(resumes) < GRACE_S + 5 < LEASE_S

    # stopped workers took no new phase after their SIGTERM (a message already in a pool
    # process's hands at that instant may still start)
    for name, sent, pool in stops:
        late = [e for e in map(json.loads, probe.lrange("fault:execs", 0, -1))
                if e["pid"] in pool and e["at"] > sent + 0.5]
        assert not late, f"{name} began phases after SIGTERM: {late}"

    faults = [Fault("hand back", at, [(run_id, key, round_, phase)]) for run_id, key, round_, phase, at in handed]
    outcome = cluster.check("rolling restart of 2 workers (SIGTERM, grace 1 s)", run_ids, faults, max_rounds=2)
    outcome.max_recovery_s = max(resumes)
    RESULTS.append(outcome)
    assert (outcome.lost, outcome.duplicate_commits, outcome.problems) == (0, 0, [])
    print(f"\nrolling restart: {len(handed)} phases handed back; SIGTERM -> resumed elsewhere "
          f"p50 {statistics.median(resumes):.2f} s, max {max(resumes):.2f} s (grace {GRACE_S} s); "
          f"hand-back -> resumed p50 {statistics.median(after_hand_back):.3f} s, max {max(after_hand_back):.3f} s")

    # the new fleet is alive and consuming
    assert all(alive(pid) for name in ("r1", "r2") for pid in cluster.tree(name))
    more = cluster.start_runs(2, hold_s=0.05, accept_round=1)
    cluster.wait_all(more, timeout=60)
    assert [client.status(run_id) for run_id in more] == ["done", "done"]


def _handed_back(client: object, run_ids: list[str]) -> list[tuple[str, str, int, str, float]]:
    found = []
    for run_id in run_ids:
        for event in client.events(run_id):  # type: ignore[attr-defined]
            if event.type == "handed_back":
                found.append((run_id, event.key, event.round, event.phase, event.at))
    return found


def test_sigterm_on_an_idle_worker_exits_at_once(cluster: Cluster) -> None:
    proc = cluster.workers["r1"]
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert time.monotonic() - sent < 10
    assert "handed back" not in cluster.log("r1")

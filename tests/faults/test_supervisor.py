"""The second line of defence: `taskloop worker` restarts its Celery worker if it dies, says so
in the log, and passes a shutdown on to it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import Cluster
from tests.waiting import wait_until
from tests.workers import alive

pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, 0).start(workers=("s1",))
    try:
        yield c
    finally:
        c.stop()


def test_a_dead_worker_is_restarted_and_its_phases_finish(cluster: Cluster) -> None:
    assert cluster.client is not None
    # Given a supervised worker in the middle of a run
    supervisor, first = cluster.workers["s1"].pid, cluster.celery_pid("s1")
    run_ids = cluster.start_runs(3, hold_s=0.3)
    cluster.pick_running()
    # When its Celery worker process is killed (the supervisor is not)
    os.kill(first, signal.SIGKILL)
    # Then the supervisor logs it and starts a new one, which finishes the runs
    wait_until(lambda: "exited unexpectedly" in cluster.log("s1"), timeout=20, what="the supervisor's log line")
    second = wait_until(lambda: _new_celery(cluster, first), timeout=30, what="a restarted worker")
    cluster.wait_all(run_ids, timeout=90)
    assert {cluster.client.status(run_id) for run_id in run_ids} == {"done"}
    assert alive(supervisor) and alive(second) and second != first
    assert "restart 1" in cluster.log("s1")


def test_sigterm_stops_the_worker_and_its_supervisor_cleanly(cluster: Cluster) -> None:
    proc = cluster.workers["s1"]
    celery = cluster.celery_pid("s1")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    wait_until(lambda: not alive(celery), timeout=10, what="the Celery worker to exit")
    assert "exited unexpectedly" not in cluster.log("s1")


def _new_celery(cluster: Cluster, old: int) -> int | None:
    try:
        pid = cluster.celery_pid("s1")
    except ValueError:
        return None
    if pid == old:
        return None
    time.sleep(0.5)  # let it open its log before we look for " ready."
    return pid if " ready." in cluster.log("s1").rpartition("exited unexpectedly")[2] else None

"""The pool fix (taskloop/celery_fixes/pool.py): both pool processes of a worker killed at once, then
a broker reconnect (Redis killed and restarted). Celery 5.7's prefork pool used to stop the worker
at that reconnect ("Unrecoverable error: ValueError('file descriptor is None')"), in about one try
out of three here. With the fix the same Celery process survives every try and keeps consuming.

The crash itself, with Celery's own pool, is shown by the slow test (it is random: up to 25 tries);
tests/unit/test_celery_fixes.py shows its cause, a live process untracked, in every CI run."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import Cluster
from tests.workers import alive, children_of

CELERY_POOL = "celery.concurrency.prefork:TaskPool"  # Celery's own prefork pool, without taskloop's fix

pytestmark = pytest.mark.timeout(400)


@pytest.fixture()
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    plain = getattr(request, "param", "fixed") == "celery as it is"
    c = Cluster(tmp_path, 0, pool=CELERY_POOL if plain else None).start(workers=("p1",))
    try:
        yield c
    finally:
        c.stop()


def _kill_the_pool_then_reconnect(cluster: Cluster) -> None:
    celery = cluster.celery_pid("p1")
    pool = [pid for pid in children_of(celery) if alive(pid)]
    for pid in pool:  # both pool processes die in the same instant
        os.kill(pid, signal.SIGKILL)
    time.sleep(2.0)  # the pool forks replacements
    cluster.redis.kill()  # the consumer reconnects once Redis is back
    time.sleep(0.5)
    cluster.redis.start()
    time.sleep(4.0)


def test_the_worker_survives_pool_deaths_followed_by_a_reconnect(cluster: Cluster) -> None:
    assert cluster.client is not None
    celery = cluster.celery_pid("p1")
    for _ in range(4):
        _kill_the_pool_then_reconnect(cluster)
        assert "Unrecoverable error" not in cluster.log("p1"), cluster.log("p1")[-3000:]
        assert cluster.celery_pid("p1") == celery
    # the same Celery process, with a whole pool, still consumes
    assert len([pid for pid in children_of(celery) if alive(pid)]) == 2
    runs = cluster.start_runs(2, hold_s=0.05)
    cluster.wait_all(runs, timeout=60)
    assert [cluster.client.status(run_id) for run_id in runs] == ["done", "done"]


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["celery as it is"], indirect=True)
def test_without_the_fix_celery_stops_the_worker(cluster: Cluster) -> None:
    for _ in range(25):
        _kill_the_pool_then_reconnect(cluster)
        if "Unrecoverable error: ValueError('file descriptor is None')" in cluster.log("p1"):
            return
    pytest.fail("no crash in 25 tries: this Celery may not have the bug any more "
                "(taskloop/celery_fixes/pool.py can go)")

"""The last resort of a warm shutdown (taskloop/worker/liveness/shutdown.py): a pool process still there
STUCK_S after the grace period is stopped, so that the worker ends (Celery would wait for it
for good). Real processes stand for the pool's."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from taskloop.worker.liveness.shutdown import GracefulShutdown


class _Pool:
    def __init__(self, pids: list[int]) -> None:
        self.info: dict[str, Any] = {"processes": pids}


def test_a_pool_process_that_does_not_end_is_stopped() -> None:
    stuck = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        graceful = GracefulShutdown(0.0, executor=lambda: None)  # type: ignore[arg-type,return-value]
        graceful.pool = _Pool([p.pid for p in stuck])
        graceful.stop_stuck_pool()
        assert [p.wait(10) for p in stuck] == [-15, -15]
    finally:
        for p in stuck:
            p.kill()


def test_no_pool_or_a_stopped_pool_is_left_alone() -> None:
    graceful = GracefulShutdown(0.0, executor=lambda: None)  # type: ignore[arg-type,return-value]
    graceful.stop_stuck_pool()  # no pool yet (the worker never got ready)
    graceful.pool = object()  # Celery's TaskPool after its join: no info any more
    graceful.stop_stuck_pool()

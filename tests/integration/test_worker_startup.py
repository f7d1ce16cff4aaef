"""How `taskloop worker` starts: its supervisor stays a small process (it finds the workflow
modules but does not import them, nor Celery), and a module that cannot be imported stops the
worker with one clear line instead of a restart loop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from taskloop.ops.embedded import RedisServer, spawn_worker, wait_until_ready
from taskloop.worker.supervisor import EXIT_BAD_IMPORT
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)


def _worker(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TASKLOOP_REDIS_URL": url}
    return subprocess.run([sys.executable, "-m", "taskloop", "worker", "-c", "1", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=90)


def test_a_module_that_is_not_there_is_refused_before_the_worker_starts(tmp_path: Path) -> None:
    done = _worker("redis://127.0.0.1:1/0", "--import", "tests.integration.no_such_flows")
    assert done.returncode == 1, done.stderr
    assert "cannot import workflow module 'tests.integration.no_such_flows'" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_module_that_fails_to_import_stops_the_worker_without_restarts(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    try:
        started = time.monotonic()
        done = _worker(server.url, "--import", "tests.integration.broken_flows")
        assert done.returncode == EXIT_BAD_IMPORT, done.stderr[-2000:]
        assert "cannot import workflow module 'tests.integration.broken_flows'" in done.stderr
        assert "taskloop_no_such_dependency" in done.stderr
        assert "restart 1" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert time.monotonic() - started < 30
    finally:
        server.stop()


def test_the_supervisor_loads_neither_celery_nor_the_workflows(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()
    log = tmp_path / "worker.log"
    proc = spawn_worker(server.url, ["tests.integration.flows"], concurrency=1, loglevel="INFO", logfile=str(log),
                        extra_env={"PYTHONPATH": str(REPO)})
    try:
        wait_until_ready(proc, log, 60)
        # Compiled modules stand for what a process imported: kombu's msgpack, Celery's greenlet
        # and redis-py's hiredis are mapped in the Celery worker, and none of them in its supervisor.
        markers = ("_cmsgpack", "_greenlet", "hiredis")
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert children, "the supervisor runs the Celery worker as a child"
        celery_maps = Path(f"/proc/{children[0]}/maps").read_text()
        assert all(m in celery_maps for m in markers), [m for m in markers if m not in celery_maps]
        supervisor_maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert not [m for m in markers if m in supervisor_maps]
    finally:
        proc.terminate()
        proc.wait(30)
        server.stop()

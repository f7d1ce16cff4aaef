"""A private redis-server and one real `taskloop worker` (two pool processes) for the security
tests: its own server, so that the integration tests' workers (which do not import these
workflows) never take these messages, and the machine's Redis on 6379 is never touched."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from taskloop.ops.embedded import RedisServer
from taskloop.runtime.client import TaskLoop
from tests.conftest import Workers, _redis_available

FLOWS = ("tests.security.flows",)


@dataclass
class Stack:
    server: RedisServer
    workers: Workers
    client: TaskLoop
    probe: redis.Redis

    def log(self) -> str:
        return self.workers.log("sec")


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not _redis_available():
        pytest.skip("redis-server not found")
    server = RedisServer(tmp_path_factory.mktemp("security-redis"), appendonly=False).start()
    workers = Workers(server.url, tmp_path_factory.mktemp("security-workers"))
    client = TaskLoop(server.url)
    probe = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        workers.start("sec", concurrency=2, imports=FLOWS)
        yield Stack(server, workers, client, probe)
    finally:
        workers.stop()
        client.close()
        probe.close()
        server.stop()

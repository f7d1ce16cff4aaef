"""The instrumentation interface on real `taskloop worker` processes (prefork, and asyncio with an
``async def`` attempt) and a real Redis: a hook that raises at every point never changes a run's
outcome (it is logged), and the hooks after it hear every phase begin and end around its callback,
in the process that runs it, with its outcome, score, usage and error, and the run's end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from taskloop.ops.embedded import RedisServer
from taskloop.runtime.client import TaskLoop
from tests.integration import hook_flows
from tests.waiting import wait_until
from tests.workers import WorkerProcess

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """This module's own Redis (conftest's ``client`` and ``probe`` use it)."""
    with RedisServer(tmp_path_factory.mktemp("hooks-redis")) as server:
        yield server


def _worker(url: str, tmp_path: Path, pool: str | None = None) -> WorkerProcess:
    return WorkerProcess(url, ["tests.integration.hook_flows"], tmp_path / "worker.log", name="hooks",
                         env={"TL_HOOKS": "1"}, pool=pool).ready()


def _told(probe: redis.Redis, run_id: str, until: str) -> list[dict]:
    def found() -> list[dict] | None:
        told = [json.loads(v) for v in probe.lrange(f"test:{run_id}:told", 0, -1)]
        return told if any(t["point"] == until for t in told) else None
    return wait_until(found, timeout=20, what=f"the hooks to hear {until}")


@pytest.mark.parametrize(("pool", "workflow"), [(None, hook_flows.hooked), ("asyncio", hook_flows.hooked_async)],
                         ids=["prefork", "asyncio"])
def test_a_failing_hook_changes_no_outcome_and_the_next_hears_every_phase(
        redis_server: RedisServer, client: TaskLoop, probe: redis.Redis, tmp_path: Path, pool: str | None,
        workflow: object) -> None:
    worker = _worker(redis_server.url, tmp_path, pool)
    try:
        result = client.start(workflow, {}).wait(timeout=30)  # type: ignore[arg-type]
        assert result.status == "done" and result.values["draft"] == 2 and result.usage["tokens"]["input"] == 20
        told = _told(probe, result.run_id, "run_ended")
    finally:
        worker.terminate()
        worker.wait(30)
    phases = [(t["point"], t["round"], t["phase"]) for t in told if t["point"].startswith("phase_")]
    assert phases == [("phase_began", 1, "attempt"), ("phase_ended", 1, "attempt"),
                      ("phase_began", 1, "check"), ("phase_ended", 1, "check"),
                      ("phase_began", 2, "attempt"), ("phase_ended", 2, "attempt"),
                      ("phase_began", 2, "check"), ("phase_ended", 2, "check")]
    ended = [t for t in told if t["point"] == "phase_ended"]
    assert [t["outcome"] for t in ended] == ["candidate", "reject", "candidate", "accept"]
    assert [t["score"] for t in ended] == [None, 0.5, None, 1.0]
    assert ended[0]["usage"] == {"input": 10, "cached": 0, "output": 5} and ended[1]["usage"] == {}
    began = [t for t in told if t["point"] == "phase_began"]
    assert {(t["workflow"], t["version"], t["task"]) for t in began} == {(workflow.name, "1", "draft")}  # type: ignore[attr-defined]
    assert all(t["worker"] and t["worker"].startswith("hooks@") for t in began)
    assert [t["attempt"] for t in began] == [1, 1, 2, 2]
    assert [t["status"] for t in told if t["point"] == "run_ended"] == ["done"]
    if pool is None:  # the sync attempt streams its draft
        assert [(t["round"], t["size"]) for t in told if t["point"] == "chunk_streamed"] == [(1, 7), (2, 7)]
    log = worker.log()
    for point in ("phase_began", "phase_ended", "committed", "run_ended"):
        assert f"instrumentation hook Broken.{point} failed" in log
    assert "RuntimeError: exporter down" in log


def test_a_failing_callback_is_told_with_its_error(redis_server: RedisServer, client: TaskLoop, probe: redis.Redis,
                                                   tmp_path: Path) -> None:
    worker = _worker(redis_server.url, tmp_path)
    try:
        result = client.start(hook_flows.hooked_fails, {}).wait(timeout=30)
        told = _told(probe, result.run_id, "run_ended")
    finally:
        worker.terminate()
        worker.wait(30)
    assert result.status == "failed" and [e.type for e in result.errors] == ["ValueError"]
    ended = [t for t in told if t["point"] == "phase_ended"]
    assert [(t["outcome"], t["error"], t["exception"]) for t in ended] == [("fail", "ValueError", "ValueError")]
    assert [t["status"] for t in told if t["point"] == "run_ended"] == ["failed"]

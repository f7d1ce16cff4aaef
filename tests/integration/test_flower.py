"""Flower tells the truth: a real Flower (basic auth) watches a real worker. Every phase appears
under `<workflow>.<key>.<phase>` with `run_id key round=N`; failed, timed-out and exhausted phases
are FAILURE with their error; refused deliveries are IGNORED with the reason; no credentials, 401."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taskloop.core.begin import Dispatch
from taskloop.core.states import Phase
from taskloop.ops.embedded import RedisServer, free_port
from taskloop.runtime.celery_app import send_phase
from taskloop.runtime.client import TaskLoop
from tests.conftest import REPO
from tests.integration import flows
from tests.waiting import wait_until
from tests.workers import WorkerProcess

pytestmark = pytest.mark.timeout(240)
AUTH = "inspector:s3cret-pass"


@pytest.fixture()
def watched(tmp_path: Path) -> Iterator[tuple[TaskLoop, int]]:
    (tmp_path / "redis").mkdir()
    with RedisServer(tmp_path / "redis") as server:
        log = tmp_path / "worker.log"
        env = {"PYTHONPATH": str(REPO)}
        worker = WorkerProcess(server.url, ["tests.integration.flows"], log, name="fw")
        port = free_port()
        flower = subprocess.Popen([sys.executable, "-m", "celery", "--broker", server.url, "flower", f"--port={port}",
                                   "--address=127.0.0.1", f"--basic-auth={AUTH}"],
                                  env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = TaskLoop(server.url)
        try:
            worker.ready()
            wait_until(lambda: _get(port, "/api/workers?refresh=1", AUTH)[0] == 200, timeout=60,
                       what="Flower to answer")
            # Flower turns task events on in the workers it watches (they ship with events off)
            wait_until(lambda: "Events of group {task} enabled" in log.read_text(), timeout=30,
                       what="the worker to enable events on Flower's request")
            yield client, port
        finally:
            client.close()
            flower.terminate()
            worker.terminate()
            flower.wait(30)
            worker.wait(30)


def _get(port: int, path: str, auth: str | None) -> tuple[int, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


def test_flower_shows_every_phase_as_it_happened(watched: tuple[TaskLoop, int]) -> None:
    client, port = watched
    accepted = client.start(flows.core, {})
    failing = client.start(flows.core, {"fail": "attempt"})
    exhausted = client.start(flows.core, {"target": 99})
    assert [r.wait(timeout=30).status for r in (accepted, failing, exhausted)] == ["done", "failed", "failed"]
    # a stale copy of a message that was already committed: refused
    send_phase(client.app, flows.core, accepted.run_id, Dispatch("source", Phase.RUN, 1, 0))
    expected = {  # run -> (task name, args repr, state) of every phase
        accepted.run_id: [("core.source.run", "round=1", "SUCCESS")]
        + [(f"core.fix.{p}", f"round={r}", "SUCCESS") for r in (1, 2) for p in ("attempt", "check")]
        + [("core.publish.run", "round=1", "SUCCESS"), ("core.source.run", "round=1", "IGNORED")],
        failing.run_id: [("core.source.run", "round=1", "SUCCESS"), ("core.fix.attempt", "round=1", "FAILURE")],
        exhausted.run_id: [("core.source.run", "round=1", "SUCCESS")]
        + [(f"core.fix.{p}", f"round={r}", "SUCCESS") for r in (1, 2) for p in ("attempt", "check")]
        + [("core.fix.attempt", "round=3", "SUCCESS"), ("core.fix.check", "round=3", "FAILURE")],
    }

    def seen() -> dict[str, list[tuple[str, str, str]]] | None:
        status, tasks = _get(port, "/api/tasks?limit=1000", AUTH)
        if status != 200 or not tasks:
            return None
        found: dict[str, list[tuple[str, str, str]]] = {}
        for task in sorted(tasks.values(), key=lambda t: t.get("received") or 0):
            run_id, _, rest = (task.get("args") or "").partition(" ")
            found.setdefault(run_id, []).append((task["name"], rest.split(" ")[-1], task["state"]))
            task_by_run.setdefault(run_id, []).append(task)
        done = all(sorted(found.get(run, [])) == sorted(want) for run, want in expected.items())
        return found if done else None

    task_by_run: dict[str, list[dict[str, Any]]] = {}
    wait_until(seen, timeout=60, what="Flower to show every phase with its name, args and final state")
    failure = [t for t in task_by_run[failing.run_id] if t["state"] == "FAILURE"][-1]
    assert "ValueError: attempt exploded" in failure["exception"]
    exhaustion = [t for t in task_by_run[exhausted.run_id] if t["state"] == "FAILURE"][-1]
    assert "LoopTaskExhausted: Loop task fix exhausted its 3 rounds" in exhaustion["exception"]
    rejected = [t for t in task_by_run[accepted.run_id] if t["state"] == "IGNORED"][-1]
    assert "stale: message for run round 1 token 0 does not match the record" in rejected["exception"]
    assert all(t["args"].startswith(f"{run} ") for run, ts in task_by_run.items() for t in ts)


def test_flower_refuses_requests_without_credentials(watched: tuple[TaskLoop, int]) -> None:
    _, port = watched
    assert _get(port, "/api/tasks", None)[0] == 401
    assert _get(port, "/api/tasks", "inspector:wrong")[0] == 401
    assert _get(port, "/api/tasks", AUTH)[0] == 200


@pytest.mark.parametrize("app", ["taskloop", "taskloop.worker", "taskloop.worker.app"])
def test_celery_finds_the_app_by_its_conventions(tmp_path: Path, app: str) -> None:
    """`celery -A taskloop flower` (and -A taskloop.worker, -A taskloop.worker.app) load taskloop's
    app: Flower gets the broker from taskloop's settings (TASKLOOP_REDIS_URL, no --broker) and sees
    the worker there."""
    (tmp_path / "redis").mkdir()
    with RedisServer(tmp_path / "redis") as server:
        log = tmp_path / "worker.log"
        env = {"PYTHONPATH": str(REPO), "TASKLOOP_REDIS_URL": server.url}
        worker = WorkerProcess(server.url, ["tests.integration.flows"], log, name="conv", concurrency=1)
        port = free_port()
        flower = subprocess.Popen([sys.executable, "-m", "celery", "-A", app, "flower", f"--port={port}",
                                   "--address=127.0.0.1", f"--basic-auth={AUTH}"],
                                  env={**os.environ, **env}, cwd=tmp_path, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.STDOUT)
        try:
            worker.ready()
            workers = wait_until(lambda: (_get(port, "/api/workers?refresh=1", AUTH)[1] or None), timeout=60,
                                 what=f"Flower started with -A {app} to see the worker")
            assert any(name.startswith("conv@") for name in workers)
        finally:
            flower.terminate()
            worker.terminate()
            flower.wait(30)
            worker.wait(30)

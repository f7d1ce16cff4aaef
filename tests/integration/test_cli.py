"""The `taskloop` command line, run as a real subprocess against the test Redis and workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.usefixtures("workers")


def taskloop(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "taskloop", *args], capture_output=True, text=True,
                          env=full_env, cwd=REPO, timeout=timeout)


def test_start_wait_inspect_runs_and_graph() -> None:
    started = taskloop("start", "core", "--import", "tests.integration.flows", "--input", "{}", "--wait")
    assert started.returncode == 0, started.stderr
    out = started.stdout
    assert "round 2 check" in out and "status done" in out and "fix = 12" in out
    run_id = out.split("run ", 1)[1].split()[0]

    inspected = taskloop("inspect", run_id, "--json")
    assert inspected.returncode == 0, inspected.stderr
    view = json.loads(inspected.stdout)
    assert view["status"] == "done"
    assert [(r["round"], r["output"]) for r in view["tasks"]["fix"]["rounds"]] == [(1, 11), (2, 12)]

    table = taskloop("inspect", run_id)
    assert "fix: rounds" in table.stdout and "Try again" in table.stdout

    listed = taskloop("runs", "--workflow", "core", "--json")
    assert run_id in [r["run_id"] for r in json.loads(listed.stdout)]

    events = taskloop("events", run_id)
    assert "run.finished" in events.stdout

    cancelled = taskloop("cancel", run_id)
    assert cancelled.returncode == 0 and "already finished (done)" in cancelled.stdout

    graph = taskloop("graph", "core", "--import", "tests.integration.flows")
    assert "flowchart TD" in graph.stdout and "source --> fix" in graph.stdout


def test_start_without_wait_prints_the_run_id() -> None:
    started = taskloop("start", "spread", "--import", "tests.integration.flows", "--input", '{"rounds": 1}')
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.strip()
    waited = taskloop("inspect", run_id, "--json")
    assert json.loads(waited.stdout)["workflow"] == "spread"


def test_failed_run_exits_non_zero() -> None:
    started = taskloop("start", "core", "--import", "tests.integration.flows", "--input",
                       '{"fail": "check"}', "--wait", "--json")
    assert started.returncode == 1
    result = json.loads(started.stdout)
    assert result["status"] == "failed" and result["errors"][0]["type"] == "RuntimeError"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("start", "core", "--import", "tests.integration.flows", "--input", "{oops"), "not valid JSON"),
        (("start", "nosuch", "--wait", "--timeout", "30"), "workflow 'nosuch' is not registered"),
        (("start", "core", "--import", "no_such_module"), "cannot import workflow module 'no_such_module'"),
        (("inspect", "no-such-run"), "run 'no-such-run' not found"),
    ],
)
def test_bad_input_gets_a_clear_error(args: tuple[str, ...], message: str) -> None:
    done = taskloop(*args)
    assert done.returncode != 0
    assert message in done.stderr + done.stdout


def test_dead_redis_is_a_clear_error() -> None:
    done = taskloop("inspect", "x", env={"TASKLOOP_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert done.returncode != 0
    assert "StoreUnavailable: cannot reach Redis at redis://127.0.0.1:1/0" in done.stderr
    assert "TASKLOOP_REDIS_URL" in done.stderr

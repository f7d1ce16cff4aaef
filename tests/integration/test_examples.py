"""The examples in examples/ run as documented: the producer (by name, without the workflow code),
the three kinds of workflow, `celery call` as a non-taskloop client, and a shell script (sh,
base64, redis-cli: no Python) as a non-Python Celery client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.usefixtures("workers")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"})


def test_the_producer_starts_runs_by_name() -> None:
    done = _run(sys.executable, "-m", "examples.producer")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 10 and all(line.split()[1] == "done" for line in lines)
    assert "An essay on topic 0 with a conclusion." in done.stdout
    assert "'approved': True" in done.stdout and "'rounds': 2, 'approved': False" in done.stdout


@pytest.mark.parametrize(("workflow", "input", "expected"), [
    ("essay", {"topic": "bounded loops"}, "write = \"An essay on bounded loops with a conclusion.\""),
    ("refine-draft", {"text": "first draft", "quality": 0}, '"quality": 90'),
])
def test_the_example_workflows_from_the_command_line(workflow: str, input: dict, expected: str) -> None:
    done = _run(sys.executable, "-m", "taskloop", "start", workflow, "--input", json.dumps(input), "--wait",
                "--timeout", "60")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "status done" in done.stdout and expected in done.stdout


def test_celery_call_starts_a_run(client) -> None:
    run_id = f"celery-call-{uuid.uuid4().hex}"
    body = json.dumps({"workflow": "report-revision", "input": {"approve_in": 1}, "run_id": run_id})
    done = _run("celery", "-A", "taskloop.worker.app", "call", "taskloop.start", "--kwargs", body)
    assert done.returncode == 0, done.stderr
    from tests.waiting import wait_until

    wait_until(lambda: _exists(client, run_id), timeout=30, what="the run to be created")
    assert client.wait(run_id, timeout=30).status == "done"
    assert client.inspect(run_id).state == {"rounds": 1, "approved": True}


def test_a_non_python_client_starts_a_run_with_a_raw_celery_message(client) -> None:
    run_id = f"from-shell-{uuid.uuid4().hex}"
    url = client.settings.redis_url
    done = subprocess.run(["sh", "examples/start-from-shell.sh", "report-revision", '{"approve_in": 1}', run_id],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={"PATH": os.environ["PATH"], "TASKLOOP_REDIS_URL": url})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == run_id
    from tests.waiting import wait_until

    wait_until(lambda: _exists(client, run_id), timeout=30, what="the run to be created")
    assert client.wait(run_id, timeout=30).status == "done"
    assert client.inspect(run_id).state == {"rounds": 1, "approved": True}


def _exists(client, run_id: str) -> bool:
    import taskloop as tl

    try:
        client.status(run_id)
        return True
    except tl.RunNotFound:
        return False

"""Starting runs from services that do not import the workflow code: by name, and through the
Celery protocol (taskloop.start) from any Celery client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

import taskloop as tl
from tests.conftest import REPO
from tests.integration import flows

pytestmark = pytest.mark.usefixtures("workers")

PRODUCER = """
import json, sys
import taskloop as tl

client = tl.TaskLoop()
handles = [client.start("core", {"n": i}) for i in range(50)]
results = [h.wait(timeout=120) for h in handles]
print(json.dumps({
    "imported_the_workflow": "tests.integration.flows" in sys.modules,
    "results": [[r.status, r.values] for r in results],
}))
"""

BARE_CELERY = """
import json, os, sys, uuid
from celery import Celery

app = Celery(broker=os.environ["TASKLOOP_REDIS_URL"])
run_id = "celery-" + uuid.uuid4().hex
app.send_task("taskloop.start", kwargs={"workflow": "core", "input": {"from": "celery"}, "run_id": run_id},
              queue="taskloop", serializer="json")
print(json.dumps({"run_id": run_id, "modules": sorted(m for m in sys.modules if m.startswith("taskloop"))}))
"""


IDEMPOTENT_BY_NAME = """
import json, uuid
import taskloop as tl

client = tl.TaskLoop()
run_id = "name-" + uuid.uuid4().hex
first = client.start("core", {"a": 1}, run_id=run_id)
second = client.start("core", {"a": 1}, run_id=run_id)
try:
    client.start("core", {"a": 2}, run_id=run_id)
    refused = ""
except tl.RunExists as exc:
    refused = str(exc)
print(json.dumps({"same": first.run_id == second.run_id == run_id, "status": second.wait(timeout=60).status,
                  "refused": refused}))
"""


def _python(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_producer_that_never_imports_the_workflow_starts_50_runs_by_name() -> None:
    # Given a producer process that imports taskloop only (not the module that defines "core")
    found = _python(PRODUCER)
    # Then workers that have the module planned and ran every run, and the producer got every result
    assert found["imported_the_workflow"] is False
    assert found["results"] == [["done", {"source": 10, "fix": 12, "publish": 24}]] * 50


def test_any_celery_client_starts_a_run_with_taskloop_start(client) -> None:
    # Given a bare Celery app (no taskloop import) that sends taskloop.start with a JSON body
    sent = _python(BARE_CELERY)
    assert sent["modules"] == []
    # Then the run exists under the given id and ends like any other
    result = client.wait(sent["run_id"], timeout=60) if _exists_soon(client, sent["run_id"]) else None
    assert result is not None and result.status == "done" and result.values["fix"] == 12
    assert client.inspect(sent["run_id"]).input == {"from": "celery"}


def _exists_soon(client, run_id: str) -> bool:
    from tests.waiting import wait_until

    def exists() -> bool:
        try:
            client.status(run_id)
            return True
        except tl.RunNotFound:
            return False

    return wait_until(exists, timeout=30, what=f"run {run_id} to be created by a worker")


def test_an_unknown_workflow_ends_failed_and_wait_says_why(client) -> None:
    run = client.start("no-such-workflow", {"x": 1})
    result = run.wait(timeout=30)
    assert (result.status, result.termination_code) == ("failed", "failed")
    [error] = result.errors
    assert error.type == "WorkflowNotRegistered" and "'no-such-workflow' is not registered" in error.message
    with pytest.raises(tl.TaskLoopError, match="is not registered"):
        result.raise_for_status()
    view = client.inspect(run.run_id)
    assert view.error is not None and view.error.type == "WorkflowNotRegistered"


def test_an_unknown_version_ends_failed() -> None:
    client = tl.TaskLoop()
    try:
        result = client.start("core", {}, version="99").wait(timeout=30)
    finally:
        client.close()
    assert result.status == "failed" and "version '99'" in result.errors[0].message


def test_the_same_run_id_with_the_same_input_is_the_same_run_and_another_input_is_refused(client) -> None:
    run_id = f"idem-{uuid.uuid4().hex}"
    first = client.start(flows.core, {"topic": "loops", "n": 1}, run_id=run_id)
    again = client.start(flows.core, {"n": 1, "topic": "loops"}, run_id=run_id)  # same input, other key order
    assert again.run_id == first.run_id and again.wait(timeout=30).status == "done"
    assert len([e for e in client.events(run_id) if e.type == "run.started"]) == 1
    with pytest.raises(tl.RunExists, match=rf"run_id '{run_id}' already exists with another input "
                                           r"\(\$\.topic: \"loops\" \(stored\) vs \"pipes\" \(given\)\)"):
        client.start(flows.core, {"topic": "pipes", "n": 1}, run_id=run_id)
    with pytest.raises(tl.RunExists, match="already belongs to workflow core v1, not spread"):
        client.start(flows.spread, {"topic": "loops", "n": 1}, run_id=run_id)


def test_by_name_the_same_run_id_is_idempotent_and_another_input_is_refused() -> None:
    found = _python(IDEMPOTENT_BY_NAME)
    assert found["same"] is True and found["status"] == "done"
    assert "already exists with another input ($.a: 1 (stored) vs 2 (given))" in found["refused"]


def test_a_run_recorded_by_name_whose_start_was_lost_is_planned_by_the_reconciler(client, monkeypatch) -> None:
    """A worker that died holding a taskloop.start, or a start lost in the broker: the run stays
    pending until a reconcile pass more than 30 s after it was recorded plans it (runtime/starting.py
    plan_pending, idempotent), here with the pass's clock moved on."""
    from taskloop.base.config import settings
    from taskloop.runtime.celery_app import PhaseSender
    from taskloop.worker.recovery.reconciler import reconcile

    # Given a run recorded by name whose taskloop.start message never left the client
    monkeypatch.setattr(client.app, "send_task", lambda *a, **kw: None)
    from taskloop.define.workflow import REGISTRY

    monkeypatch.setattr(REGISTRY, "has", lambda name, version=None: False)  # as a service that never imported it
    run = client.start("core", {"lost": True}, run_id=f"lost-start-{uuid.uuid4().hex}")
    monkeypatch.undo()
    assert client.inspect(run.run_id).status == "pending"
    # When a reconcile pass looks at it within 30 s: nothing; after: it is planned, and runs
    early = reconcile(client.store, settings(), PhaseSender(client.app, settings().redis_url))
    assert early.planned == 0 and client.inspect(run.run_id).status == "pending"
    later = reconcile(client.store, settings(), PhaseSender(client.app, settings().redis_url), now=time.time() + 31.0)
    assert later.planned == 1
    result = run.wait(timeout=30)
    assert result.status == "done" and result.values["publish"] is not None

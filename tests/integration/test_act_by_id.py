"""Acting on a run by its id alone (SPEC §15): decide, resume and fork from a process that never
imported the workflow, and from the command line without --import. A worker that has the code
carries the request out (taskloop.act); the caller gets its verdict, or its refusal as the same
typed error, or ActionTimeout when no worker takes the request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import pytest

from taskloop.base.config import settings
from taskloop.runtime.acting import carry_out, fork_run_id
from taskloop.store.redis_store import RedisStore
from tests.conftest import REPO
from tests.integration import control_flows as cf
from tests.integration import fork_flows as ff
from tests.ui.conftest import UIServer

pytestmark = pytest.mark.usefixtures("workers")

# A caller that imports taskloop only: it acts as the arguments say (twice with "twice"), and says
# what it got and whether it ever imported a module of the tests' workflows.
CALLER = """
import json, sys
import taskloop as tl

client = tl.TaskLoop()
args = json.loads(sys.argv[1])


def act():
    op, given = args["op"], {k: args[k] for k in ("actor", "request_id") if k in args}
    if op == "decide":
        return client.decide(args["run_id"], args["key"], args["action"], reason=args.get("reason", ""),
                             value=args.get("value"), **given).run_id
    if op == "resume":
        return client.resume(args["run_id"], **given).run_id
    return client.fork(args["run_id"], args["task"], args["round"], args.get("feedback"), **given).run_id


found = {}
for n in range(2 if args.get("twice") else 1):
    try:
        found.setdefault("results", []).append(act())
    except tl.TaskLoopError as exc:
        found.setdefault("errors", []).append([type(exc).__name__, str(exc)])
found["imported"] = sorted(m for m in sys.modules if m.split(".")[0] in ("tests", "examples"))
print(json.dumps(found))
"""


def _caller(env: dict[str, str] | None = None, **args: Any) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", CALLER, json.dumps(args)], capture_output=True, text=True,
                          timeout=120, cwd="/", env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["imported"] == []  # the caller never had the workflow's code
    return found


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "taskloop", *args], capture_output=True, text=True, timeout=120,
                          cwd="/", env={**os.environ, "PYTHONPATH": str(REPO), "TASKLOOP_IMPORTS": ""})


def _waiting(client, workflow) -> str:  # type: ignore[no-untyped-def]
    run = client.start(workflow, input={})
    deadline = time.monotonic() + 20
    while client.status(run.run_id) != "waiting":
        assert time.monotonic() < deadline, client.inspect(run.run_id)
        time.sleep(0.05)
    return str(run.run_id)


def _broken(client, probe) -> str:  # type: ignore[no-untyped-def]
    """A run of cf.resumable that failed on its check's error, the error gone since: resumable."""
    run_id = f"act-resume-{uuid.uuid4().hex}"
    probe.set(f"test:{run_id}:broken", "1")
    assert client.start(cf.resumable, input={}, run_id=run_id).wait(timeout=30).status == "failed"
    probe.delete(f"test:{run_id}:broken")
    return run_id


def _finished_essay(client) -> str:  # type: ignore[no-untyped-def]
    handle = client.start(ff.essay, input={"accept_at": 3}, run_id=f"act-fork-{uuid.uuid4().hex}")
    assert handle.wait(timeout=30).status == "done"
    return str(handle.run_id)


def test_a_process_without_the_code_decides_a_gate_and_a_refusal_comes_back_typed(client) -> None:
    run_id = _waiting(client, cf.gated_flow)
    # When a caller without the code decides the gate as an actor the gate does not allow
    refused = _caller(op="decide", run_id=run_id, key="approval", action="approve", actor="bob")
    # Then the worker's refusal reaches it as GateRefused with the worker's message, and nothing moved
    assert refused["errors"] == [["GateRefused", "decide: actor 'bob' may not decide gate approval; allowed: "
                                                 "['alice']"]]
    assert client.status(run_id) == "waiting"
    # When it decides as alice: the worker decides, the run goes on, and the event names the actor
    decided = _caller(op="decide", run_id=run_id, key="approval", action="approve", actor="alice",
                      reason="looks good")
    assert decided["results"] == [run_id]
    result = client.wait(run_id, timeout=30)
    assert result.status == "done" and result.values["publish"] == "published first draft"
    gates = [e for e in client.events(run_id) if e.type == "gate"]
    assert [(e.key, e.phase, e.data["actor"], e.data["reason"]) for e in gates] == \
        [("approval", "approve", "alice", "looks good")]


def test_an_input_gate_takes_its_value_from_a_process_without_the_code(client) -> None:
    run_id = _waiting(client, cf.input_flow)
    _caller(op="decide", run_id=run_id, key="edit", action="resume", actor="ann", value="Loops that stop")
    assert client.wait(run_id, timeout=30).values == {"edit": "Loops that stop", "titled": "title: Loops that stop"}


def test_a_process_without_the_code_resumes_a_failed_run_with_its_actor(client, probe) -> None:
    run_id = _broken(client, probe)
    resumed = _caller(op="resume", run_id=run_id, actor="ops")
    assert resumed["results"] == [run_id]
    result = client.wait(run_id, timeout=30)
    assert result.status == "done" and result.values == {"fix": 2, "report": "fixed in 2"}
    [event] = [e for e in client.events(run_id) if e.type == "run.resumed"]
    assert event.data["actor"] == "ops"
    # a done run resumed again: the worker's NotResumable, as such
    again = _caller(op="resume", run_id=run_id)
    assert again["errors"] == [["NotResumable", f"run {run_id} is done; only a failed run can be resumed"]]


def test_a_fork_asked_twice_with_one_request_id_makes_one_run(client, store) -> None:
    original = _finished_essay(client)
    request = f"req-{uuid.uuid4().hex}"
    forked = _caller(op="fork", run_id=original, task="draft", round=2, feedback="shorter", actor="carol",
                     request_id=request, twice=True)
    # Then both asks got the same new run, whose id the request id gives
    assert forked["results"] == [fork_run_id(request)] * 2 and "errors" not in forked
    new = forked["results"][0]
    result = client.wait(new, timeout=30)
    assert result.status == "done" and result.values["draft"] == "draft 2 after shorter"
    assert client.inspect(new).forked_from == {"run_id": original, "task": "draft", "round": 2}
    started = [e for e in client.events(new) if e.type == "run.started"]
    assert len(started) == 1 and started[0].data["actor"] == "carol"
    # a copy of the request's message that comes later is answered with the stored verdict, not acted on
    assert carry_out(store, _never_sends, settings(), request, "late-worker") == "answered before"
    # the same request id with other arguments is refused in the caller
    other = _caller(op="fork", run_id=original, task="draft", round=1, request_id=request)
    assert other["errors"][0][0] == "InvalidInput" and f"request_id {request!r} was already used" in \
        other["errors"][0][1]


def test_the_workers_refusals_of_a_fork_come_back_as_their_own_errors(client) -> None:
    original = _finished_essay(client)
    never = _caller(op="fork", run_id=original, task="draft", round=9)
    assert never["errors"] == [["InvalidInput", f"fork: round 9 of task draft was never reached (run {original} "
                                                "reached round 3); fork at a round from 1 to 3"]]
    # what needs no code is checked in the caller, with the same words
    shape = _caller(op="fork", run_id=original, task="draft", round=0)
    assert shape["errors"] == [["InvalidInput", "fork: round must be a round number (1, 2, ...), got 0"]]
    waiting = _waiting(client, cf.gated_flow)
    live = _caller(op="fork", run_id=waiting, task="draft", round=1)
    [[kind, message]] = live["errors"]
    assert kind == "NotForkable" and message.startswith(f"run {waiting} is waiting; only a finished run")
    client.cancel(waiting)


def test_a_workflow_no_worker_has_comes_back_as_workflow_not_registered(client) -> None:
    # Given a run of a workflow nobody defines (it ended failed), resumed from a process without code
    run_id = client.start("act-nowhere", {}).run_id
    assert client.wait(run_id, timeout=30).status == "failed"
    found = _caller(op="resume", run_id=run_id, actor="ops")
    # Then the worker that took the request says it lacks the module, and how to give it one
    [[kind, message]] = found["errors"]
    assert kind == "WorkflowNotRegistered"
    assert message.startswith("workflow 'act-nowhere' is not registered in this process (no version is); import "
                              "the module that defines it (--import MODULE on the command, e.g. taskloop worker "
                              "--import MODULE")


def test_the_command_line_acts_without_import(client, probe) -> None:
    # decide: a gate approved by a command with no --import (and no TASKLOOP_IMPORTS)
    run_id = _waiting(client, cf.gated_flow)
    done = _cli("decide", run_id, "approval", "approve", "--actor", "alice")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"run {run_id}: ")
    assert client.wait(run_id, timeout=30).status == "done"
    # resume, by a unique prefix of the id
    broken = _broken(client, probe)
    done = _cli("resume", broken[:-4], "--wait", "--timeout", "60")
    assert done.returncode == 0, done.stderr
    assert f"run {broken} resumed" in done.stdout and "status done" in done.stdout
    # fork, and a refusal: one line naming the worker's error, never a hint to import here
    original = _finished_essay(client)
    done = _cli("fork", original, "draft", "2", "--feedback", "shorter", "--wait", "--timeout", "60")
    assert done.returncode == 0, done.stderr
    assert f"forked from {original} at draft round 2" in done.stdout and "status done" in done.stdout
    refused = _cli("fork", original, "draft", "9")
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1] == (
        f"Error: InvalidInput: fork: round 9 of task draft was never reached (run {original} reached round 3); "
        "fork at a round from 1 to 3")


def _post(url: str, body: dict[str, Any], csrf: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "X-CSRF-Token": csrf})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_ui_without_the_code_decides_and_forks_through_a_worker(client, redis_server, tmp_path) -> None:
    # Given `taskloop ui` started without any --import (and no TASKLOOP_IMPORTS)
    ui = UIServer(redis_server.url, tmp_path / "ui.log", env={"TASKLOOP_IMPORTS": ""}, modules=())
    try:
        with urllib.request.urlopen(f"{ui.url}/api/session", timeout=10) as reply:
            csrf = json.loads(reply.read())["csrf"]
        # When its API approves a gate: a worker decides it, with the actor the body gives
        run_id = _waiting(client, cf.gated_flow)
        status, body = _post(f"{ui.url}/api/runs/{run_id}/gates/approval", {"action": "approve", "actor": "alice"},
                             csrf)
        assert status == 200 and body["ok"] is True, body
        assert client.wait(run_id, timeout=30).status == "done"
        assert [e.data["actor"] for e in client.events(run_id) if e.type == "gate"] == ["alice"]
        # And a fork the worker refuses is answered with the worker's error, typed
        original = _finished_essay(client)
        status, body = _post(f"{ui.url}/api/runs/{original}/fork", {"task": "draft", "round": 9}, csrf)
        assert status == 400 and body["error"]["type"] == "InvalidInput"
        assert body["error"]["message"].startswith("fork: round 9 of task draft was never reached")
        # And a fork it carries out answers with the new run
        status, body = _post(f"{ui.url}/api/runs/{original}/fork", {"task": "draft", "round": 1, "actor": "dee"},
                             csrf)
        assert status == 200 and body["run"]["forked_from"] == {"run_id": original, "task": "draft", "round": 1}
        assert client.wait(body["run_id"], timeout=30).status == "done"
    finally:
        ui.stop()


def _never_sends(*args: Any) -> None:
    raise AssertionError("nothing may be sent")


def test_no_worker_for_the_request_is_a_clear_timeout(redis_server) -> None:
    # Given a database that no worker serves (store and broker: db 5), and a run recorded there by name
    url = redis_server.url.rsplit("/", 1)[0] + "/5"
    env = {"TASKLOOP_REDIS_URL": url, "TASKLOOP_BROKER_URL": url, "TASKLOOP_ACT_TIMEOUT_S": "1.5"}
    script = "import taskloop as tl; print(tl.TaskLoop().start('gated', {}).run_id)"
    made = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert made.returncode == 0, made.stderr
    run_id = made.stdout.strip()
    started = time.monotonic()
    found = _caller(env, op="resume", run_id=run_id, request_id="lonely-1")
    assert time.monotonic() - started < 30
    [[kind, message]] = found["errors"]
    assert kind == "ActionTimeout"
    assert message.startswith(f"resume of run {run_id}: no worker took the request within 1.5 s: is a worker "
                              "running with the workflow's module imported (taskloop worker --import MODULE) and "
                              "consuming queue 'taskloop'? Nothing was done")
    # and a worker that comes later does not carry out what its caller gave up on
    late = RedisStore(url)
    try:
        assert carry_out(late, _never_sends, settings(), "lonely-1", "late-worker") == "abandoned by its caller"
        assert late.request_verdict("lonely-1") is None
    finally:
        late.close()

"""Actions by run id alone (SPEC §15): ``decide``, ``resume`` and ``fork`` in a process that never
imported the workflow. As with starting by name, the caller records the request and a worker that
has the code carries it out (the ``taskloop.act`` task, on the queue of ``taskloop.start``).

- **The caller** (``ask``) records the request under its id (given, or new), sends
  ``taskloop.act`` with that id, and blocks on the request's reply list for the worker's verdict:
  the run acted on (the new run for a fork), or the worker's refusal, raised here as its own class
  with the worker's message (base/errors.py ``action_error``). Past ``TASKLOOP_ACT_TIMEOUT_S`` it
  marks the request abandoned, so that no worker carries it out after the caller was told it
  failed, and raises ActionTimeout saying what to check.
- **A worker** (``carry_out``) takes the request with one atomic claim (store/lua/request.lua):
  only one execution of it ever acts, and not after its caller gave up. It runs the action as the
  client does in-process (runtime/actions.py, runtime/forking.py), with the request's actor, and
  stores the verdict.
- **The same request id** asked again gives the same verdict (stored for ``REQUEST_TTL_S``); with
  other arguments it is InvalidInput. A fork's new run id, when not given, comes from the request
  id, so a fork asked twice makes one run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from typing import Any

from celery import Celery

from taskloop.base import names
from taskloop.base.config import Settings
from taskloop.base.errors import ActionTimeout, InvalidInput, RunExists, TaskLoopError, action_error
from taskloop.base.text import shown
from taskloop.core import fields as fld
from taskloop.runtime import actions, forking
from taskloop.runtime.celery_app import ACT_TASK
from taskloop.runtime.commit import Sender
from taskloop.store.redis_store import RedisStore
from taskloop.store.requests import ABANDONED

log = logging.getLogger("taskloop.runtime.acting")

REQUEST_TTL_S = 3600  # a request and its verdict are kept this long: a retry within it gets the same verdict
_SLICE_S = 1.0  # the caller's blocking read, in slices: between them it reads the stored verdict


def request_id_of(action: str, request_id: object) -> str:
    """The request's id: the one given (InvalidInput if it is not shaped like a run id), or a new one."""
    if request_id is None:
        return uuid.uuid4().hex
    if not names.is_run_id(request_id):
        raise InvalidInput(f"{action}: request_id {shown(request_id, 80)} is invalid: use {names.RUN_ID_RULE} "
                           "(or None for a new one)")
    assert isinstance(request_id, str)
    return request_id


def fork_run_id(request_id: str) -> str:
    """The new run of a fork asked by run id without a run id of its own: one per request."""
    return "fork-" + hashlib.sha256(f"fork:{request_id}".encode()).hexdigest()[:32]


def ask(store: RedisStore, app: Celery, settings: Settings, workflow: str, body: dict[str, Any],
        request_id: str) -> str:
    """Ask a worker to carry out ``body`` (``action``, ``run_id``, ``actor`` and the action's
    arguments) and wait for its verdict: the id of the run it acted on. Its refusal is raised as
    its own class; no verdict in time is ActionTimeout."""
    action, run_id = body["action"], body["run_id"]
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    stored = store.record_request(request_id, raw, REQUEST_TTL_S)
    if stored != raw:
        raise InvalidInput(f"{action}: request_id {request_id!r} was already used for another request "
                           f"({shown(stored, 200)}): asking again takes the same arguments; use another request_id "
                           "for another request")
    verdict = store.request_verdict(request_id)
    if verdict is None:
        store.reopen_request(request_id)  # asked again after its caller gave up: a worker may take it now
        app.send_task(ACT_TASK, args=[request_id], ignore_result=True, shadow=f"{workflow}.{action}",
                      argsrepr=f"{run_id} {action} request={request_id}")
        verdict = _wait(store, settings.act_timeout_s, request_id)
    if verdict is not None:
        return _outcome(verdict)
    taken = store.abandon_request(request_id)
    verdict = store.request_verdict(request_id)  # it may have come as the caller gave up
    if verdict is not None:
        return _outcome(verdict)
    seconds = f"{settings.act_timeout_s:g}"
    queue = app.conf.task_default_queue
    if taken is None or taken == ABANDONED:
        raise ActionTimeout(
            f"{action} of run {run_id}: no worker took the request within {seconds} s: is a worker running with "
            f"the workflow's module imported (taskloop worker --import MODULE) and consuming queue {queue!r}? "
            f"Nothing was done (request {request_id} is abandoned; asking again with request_id={request_id!r} "
            "sends it again); TASKLOOP_ACT_TIMEOUT_S sets how long to wait")
    raise ActionTimeout(
        f"{action} of run {run_id}: worker {taken.rpartition(':')[0]} took the request but gave no verdict within "
        f"{seconds} s; it may still carry it out: ask again with request_id={request_id!r} to learn its verdict")


def _wait(store: RedisStore, timeout_s: float, request_id: str) -> str | None:
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        verdict = store.block_verdict(request_id, min(left, _SLICE_S))
        if verdict is not None:
            return verdict


def _outcome(verdict: str) -> str:
    found = json.loads(verdict)
    if found.get("ok"):
        return str(found["run_id"])
    raise action_error(str(found.get("type") or TaskLoopError.__name__), str(found.get("message") or ""))


# --- on a worker --------------------------------------------------------------------------------

def carry_out(store: RedisStore, send: Sender, settings: Settings, request_id: str, worker: str) -> str:
    """``taskloop.act``: take the request and carry it out, or say why not (what the task replies)."""
    claim = store.take_request(request_id, f"{worker}:{uuid.uuid4().hex[:12]}")
    if claim is None:
        return "unknown request (expired, or never recorded)"
    if claim.verdict is not None:
        store.give_verdict(request_id, claim.verdict, REQUEST_TTL_S)  # for a caller that asked again
        return "answered before"
    if not claim.won:
        return "abandoned by its caller" if claim.taken == ABANDONED else "taken by another execution"
    verdict: dict[str, Any]
    try:
        verdict = {"ok": True, "run_id": _perform(store, send, settings, json.loads(claim.body))}
    except TaskLoopError as exc:
        verdict = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    except Exception as exc:  # a bug: its caller hears of it now rather than at its timeout
        log.exception("taskloop.act %s failed", request_id)
        verdict = {"ok": False, "type": TaskLoopError.__name__,
                   "message": f"the worker failed to carry out the request: {type(exc).__name__}: {exc}"}
    store.give_verdict(request_id, json.dumps(verdict, ensure_ascii=False), REQUEST_TTL_S)
    return "done" if verdict["ok"] else f"refused: {verdict['type']}"


def _perform(store: RedisStore, send: Sender, settings: Settings, body: Any) -> str:
    if not isinstance(body, dict):
        raise InvalidInput(f"the request is not a JSON object: {shown(body, 200)}")
    action, run_id, actor = body.get("action"), names.check_run_id(body.get("run_id")), body.get("actor")
    if actor is not None and not isinstance(actor, str):
        raise InvalidInput(f"{action}: actor must be None or a string, got {shown(actor)}")
    if action == "resume":
        actions.resume(store, send, settings, run_id, actor)
        return run_id
    if action == "decide":
        key, gate_action = body.get("key"), body.get("gate_action")
        reason, value = body.get("reason"), body.get("value")
        if not isinstance(actor, str) or not isinstance(reason, str) or not (value is None or isinstance(value, str)):
            raise InvalidInput(f"decide: the request's actor, reason or value is malformed: {shown(body, 200)}")
        actor, reason, _ = actions.check_decision(settings, key, gate_action, actor, reason, None)
        actions.decide(store, send, settings, run_id, str(key), str(gate_action), actor, reason, value)
        return run_id
    if action == "fork":
        task, round, new_run_id = body.get("task"), body.get("round"), body.get("new_run_id")
        try:
            return forking.fork(store, send, settings, run_id, task, round, body.get("feedback"), new_run_id, actor)
        except RunExists:
            if _forked_here(store, new_run_id, run_id, task, round):
                return str(new_run_id)  # this request's fork, made by an execution that did not store its verdict
            raise
    raise InvalidInput(f"unknown action {shown(action)}: decide, resume or fork")


def _forked_here(store: RedisStore, new_run_id: Any, run_id: str, task: Any, round: Any) -> bool:
    if not names.is_run_id(new_run_id):
        return False
    forked = store.hmget(new_run_id, [fld.F_FORKED_FROM])[0]
    return forked is not None and json.loads(forked) == {"run_id": run_id, "task": task, "round": round}

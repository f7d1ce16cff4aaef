"""The worker side of starting, fanning out and settling runs, and of actions asked by run id (the
non-phase tasks)."""

from __future__ import annotations

import logging
from typing import Any

from taskloop.base import clock
from taskloop.base.errors import CommitConflict, TaskLoopError, WorkflowNotRegistered
from taskloop.core import fields as fld
from taskloop.core.begin import Dispatch
from taskloop.core.rules import CANCEL_PREFIX
from taskloop.core.states import QUEUED_STATES
from taskloop.define.workflow import REGISTRY
from taskloop.runtime import acting, starting
from taskloop.runtime.celery_app import ACT_TASK, START_TASK
from taskloop.runtime.gates import settle_gates
from taskloop.worker.execution import messages
from taskloop.worker.execution.executor import Executor

log = logging.getLogger("taskloop.starter")


def handle_start(worker: Executor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``taskloop.start``: plan a run recorded by name (one positional arg, its id), or start one
    (keyword arguments, from any Celery client). A malformed message is refused (messages.py)."""
    if len(args) == 1 and not kwargs and isinstance(args[0], str):
        pending = messages.read(messages.RunMessage, START_TASK, args, kwargs, ("run_id",))
        if isinstance(pending, str):
            return pending
        return starting.plan_pending(worker.store, worker.send, pending.run_id, worker.settings)
    message = messages.read(messages.StartMessage, START_TASK, args, kwargs)
    if isinstance(message, str):
        return message
    try:
        try:
            workflow = REGISTRY.get(message.workflow, message.version)
        except WorkflowNotRegistered:
            # record it by name, so that whoever waits for this run id sees why it failed
            started = starting.record_pending(worker.store, message.workflow, message.version, message.input,
                                              message.run_id, worker.settings)
            return starting.plan_pending(worker.store, worker.send, started.run_id, worker.settings)
        started = starting.start_defined(worker.store, worker.send, workflow, message.input, message.run_id,
                                         worker.settings)
    except TaskLoopError as exc:
        log.error("taskloop.start refused: %s: %s", type(exc).__name__, str(exc)[:500])
        return f"refused: {type(exc).__name__}"
    log.info("run %s of %s started from a taskloop.start message", started.run_id, message.workflow)
    return "started" if started.created else "exists"


def handle_act(worker: Executor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``taskloop.act``: carry out an action asked by run id (runtime/acting.py); one positional
    arg, the request's id (a malformed message is refused: messages.py)."""
    message = messages.read(messages.RequestMessage, ACT_TASK, args, kwargs, ("request_id",))
    if isinstance(message, str):
        return message
    return acting.carry_out(worker.store, worker.send, worker.settings, message.request_id, worker.worker)


def handle_fanout(worker: Executor, run_id: str, keys: list[str]) -> str:
    """Send the phase messages of the queued tasks among ``keys``, with their current tokens."""
    snap = worker.store.snapshot(run_id, [fld.F_VERSION, *(fld.task_field(key) for key in keys)])
    if not snap.exists:
        return "unknown run"
    try:
        workflow = REGISTRY.get(snap.get(fld.F_WORKFLOW) or "", snap.get(fld.F_VERSION) or None)
    except TaskLoopError as exc:
        log.error("taskloop.dispatch for run %r: %s", run_id, exc)
        return "workflow not registered"
    now = clock.now()
    dispatches = []
    for key in keys:
        record = snap.record(key)
        if record is None or record.state not in QUEUED_STATES or record.phase is None:
            continue
        countdown = record.not_before - now if record.not_before and record.not_before > now else None
        dispatches.append(Dispatch(key, record.phase, record.round, record.token, countdown))
    worker.send(workflow, run_id, dispatches)
    return f"sent {len(dispatches)}"


def handle_settle(worker: Executor, run_id: str) -> str:
    """End the paused gates of a cancelled run (no message will come for them)."""
    snap = worker.store.snapshot(run_id, fld.META_FIELDS)
    if not snap.exists:
        return "unknown run"
    meta = snap.meta()
    if meta.control is None or not meta.control.startswith(CANCEL_PREFIX) or not meta.paused:
        return "nothing to settle"
    try:
        workflow = REGISTRY.get(meta.workflow, meta.version or None)
    except TaskLoopError:
        return "workflow not registered"

    try:
        settle_gates(worker.store, worker.settings, worker.send, workflow, run_id)
    except CommitConflict:
        return "conflict (the reconciler will settle it)"
    return "settled"


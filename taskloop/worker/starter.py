"""The worker side of starting, fanning out and settling runs (the non-phase tasks)."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError, field_validator

from taskloop import clock, starting
from taskloop.commit import commit
from taskloop.definitions import NAME_PATTERN, REGISTRY, is_text
from taskloop.errors import CommitConflict, TaskLoopError, WorkflowNotRegistered
from taskloop.phases import QUEUED_STATES
from taskloop.scheduler import CANCEL_PREFIX, Dispatch, Planner
from taskloop.store import Snapshot
from taskloop.store import keys as k
from taskloop.worker.executor import Executor

log = logging.getLogger("taskloop.starter")


class StartMessage(BaseModel):
    """``taskloop.start`` from any Celery client: kwargs workflow, input, and optionally version
    and run_id (JSON body; the input is the only user payload taskloop accepts on the queue)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    workflow: StrictStr
    input: Any = None
    version: StrictStr | None = None
    run_id: StrictStr | None = None

    @field_validator("workflow")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError("workflow is not a workflow name ([A-Za-z0-9][A-Za-z0-9._-]*)")
        return value

    @field_validator("version")
    @classmethod
    def _version(cls, value: str | None) -> str | None:
        if value is not None and not is_text(value):
            raise ValueError("version must be a non-empty string")
        return value

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str | None) -> str | None:
        if value is not None and not k.RUN_ID_PATTERN.match(value):
            raise ValueError("run_id does not match the run id pattern")
        return value


def handle_start(worker: Executor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    if len(args) == 1 and not kwargs and isinstance(args[0], str):
        run_id = args[0]
        if not k.RUN_ID_PATTERN.match(run_id):
            log.error("malformed taskloop.start message dropped: run_id %r is invalid", run_id[:200])
            return "malformed"
        return starting.plan_pending(worker.store, worker.send, run_id, worker.settings)
    try:
        if args:
            raise ValueError("pass the run by keyword: workflow=..., input=..., version=..., run_id=...")
        message = StartMessage(**kwargs)
    except (ValueError, TypeError, ValidationError) as exc:
        log.error("malformed taskloop.start message dropped: %r", _first_problem(exc))
        return "malformed"
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


def _first_problem(exc: Exception) -> str:
    """The first line of an error about a message, cut short (a validation error quotes the input)."""
    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"[:300]
    return (str(exc).splitlines() or [""])[0][:300]


def handle_fanout(worker: Executor, run_id: str, keys: list[str]) -> str:
    """Send the phase messages of the queued tasks among ``keys``, with their current tokens."""
    snap = worker.store.snapshot(run_id, [k.F_VERSION, *(k.task_field(key) for key in keys)])
    if not snap.exists:
        return "unknown run"
    try:
        workflow = REGISTRY.get(snap.get(k.F_WORKFLOW) or "", snap.get(k.F_VERSION) or None)
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
    snap = worker.store.snapshot(run_id, k.META_FIELDS)
    if not snap.exists:
        return "unknown run"
    meta = snap.meta()
    if meta.control is None or not meta.control.startswith(CANCEL_PREFIX) or not meta.paused:
        return "nothing to settle"
    try:
        workflow = REGISTRY.get(meta.workflow, meta.version or None)
    except TaskLoopError:
        return "workflow not registered"

    def plan(view: Snapshot) -> Planner:
        planner = Planner(workflow, view, clock.now(), worker.settings)
        planner.cancel_gates()
        planner.settle()
        return planner

    try:
        commit(worker.store, plan, snap, worker.send)
    except CommitConflict:
        return "conflict (the reconciler will settle it)"
    return "settled"


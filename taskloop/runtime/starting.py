"""Starting runs, by definition or by name.

- **By definition** (the workflow is imported here): the run is planned at once — every record
  written and the roots dispatched in one guarded write.
- **By name** (it is not): the run is recorded ``pending`` with its input, and a
  ``taskloop.start`` message asks a worker that has the definition to plan it. An unknown
  workflow or version ends the run ``failed`` with WorkflowNotRegistered.

Both are idempotent on the run id: the same id with the same workflow and input is the same run;
with another workflow or input, RunExists says what differs.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from taskloop.base import clock, limits, names
from taskloop.base.config import Settings, min_lease_s
from taskloop.base.errors import CommitConflict, RunExists, WorkflowNotRegistered
from taskloop.base.jsonvalue import canonical
from taskloop.base.text import preview
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.batch import Batch, Index, ended_score
from taskloop.core.begin import Dispatch
from taskloop.core.events import Event
from taskloop.core.planner import Planner
from taskloop.core.records import ErrorRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import QUEUED_STATES, RunStatus
from taskloop.define.workflow import REGISTRY, Workflow
from taskloop.ops.hooks import RunStarting
from taskloop.runtime import shapes
from taskloop.runtime.commit import Sender, commit, never
from taskloop.runtime.instruments import hooks
from taskloop.runtime.writes import write
from taskloop.store.redis_store import Applied, RedisStore

START_FIELDS = (fld.F_WORKFLOW, fld.F_VERSION, fld.F_STATUS, fld.F_INPUT_DIGEST, fld.F_INPUT, fld.F_CONTROL,
                fld.F_CREATED)


@dataclass(frozen=True)
class Started:
    run_id: str
    created: bool  # False: the run already existed (an idempotent start)
    pending: bool  # recorded by name, waiting for a worker to plan it


def digest(input_raw: str) -> str:
    return hashlib.sha256(input_raw.encode()).hexdigest()


def prepare_input(input: Any, max_bytes: int = limits.DEFAULT_BYTES) -> tuple[str, str]:
    """The stored form of a run input and its digest (InvalidInput when it is not lossless JSON,
    or larger than ``max_bytes``: TASKLOOP_MAX_INPUT_BYTES)."""
    raw = limits.require_storable(input, "run input", max_bytes, limits.INPUT_ENV)
    return raw, digest(canonical(input))


def new_run_id(run_id: str | None) -> str:
    return names.check_run_id(run_id) if run_id is not None else uuid.uuid4().hex


def start_defined(store: RedisStore, send: Sender, workflow: Workflow, input: Any, run_id: str | None,
                  settings: Settings, resend: Callable[[str], None] | None = None) -> Started:
    """Start a run of a workflow defined in this process: plan it and dispatch its roots."""
    input_raw, input_digest = prepare_input(input, settings.max_input_bytes)
    run_id = new_run_id(run_id)
    now = clock.now()
    context = hooks().run_context(RunStarting(run_id, workflow.name, workflow.version))

    def plan(snap: Snapshot) -> Planner:
        return traced(Planner.start_run(workflow, run_id, input_raw, input_digest, now, settings), context)

    shapes.publish(store, workflow, settings)
    try:
        commit(store, plan, Snapshot(run_id), send, retry=never)
    except CommitConflict:
        existing = store.snapshot(run_id, START_FIELDS)
        _same_run(existing, workflow.name, workflow.version, input, input_digest)
        resend_queued(store, send, workflow, run_id)
        return Started(run_id, created=False, pending=existing.get(fld.F_STATUS) == RunStatus.PENDING.value)
    return Started(run_id, created=True, pending=False)


def record_pending(store: RedisStore, name: str, version: str | None, input: Any, run_id: str | None,
                   settings: Settings) -> Started:
    """Record a run by workflow name, for a worker to plan (the caller sends taskloop.start)."""
    input_raw, input_digest = prepare_input(input, settings.max_input_bytes)
    run_id = new_run_id(run_id)
    now = clock.now()
    batch = Batch(run_id).expect(fld.F_WORKFLOW, None, "run exists")
    batch.index(Index.LIVE, run_id, now + min_lease_s(settings))
    batch.list_run(name, RunStatus.PENDING.value, now, new=True)
    for field, value in ((fld.F_FORMAT, fld.FORMAT), (fld.F_WORKFLOW, name), (fld.F_VERSION, version or ""),
                         (fld.F_STATUS, RunStatus.PENDING.value), (fld.F_INPUT, input_raw),
                         (fld.F_INPUT_DIGEST, input_digest), (fld.F_CREATED, repr(now))):
        batch.set(field, value)
    batch.event(Event(type=ev.RUN_PENDING, at=now, data={"workflow": name, "version": version}))
    context = hooks().run_context(RunStarting(run_id, name, version))
    if context is not None:  # kept when a worker plans it
        batch.set(fld.F_TRACE, context)
    if isinstance(write(store, batch), Applied):
        return Started(run_id, created=True, pending=True)
    existing = store.snapshot(run_id, START_FIELDS)
    _same_run(existing, name, version, input, input_digest)
    return Started(run_id, created=False, pending=existing.get(fld.F_STATUS) == RunStatus.PENDING.value)


def traced(planner: Planner, context: str | None) -> Planner:
    """A new run's plan, with the context it is started in (the hooks' ``run_context``: a trace
    context, stored in ``tc``), if any."""
    if context is not None:
        planner.run_updates[fld.F_TRACE] = context
    return planner


def plan_pending(store: RedisStore, send: Sender, run_id: str, settings: Settings) -> str:
    """On a worker: plan a run that was recorded by name (or end it failed if it cannot be)."""
    snap = store.snapshot(run_id, START_FIELDS)
    if not snap.exists:
        return "unknown run"
    if snap.get(fld.F_STATUS) != RunStatus.PENDING.value:
        return "already planned"
    name, version = snap.get(fld.F_WORKFLOW) or "", snap.get(fld.F_VERSION) or None
    try:
        workflow = REGISTRY.get(name, version)
    except WorkflowNotRegistered as exc:
        fail_pending(store, snap, ErrorRecord(type=WorkflowNotRegistered.__name__, message=str(exc)), settings)
        return "workflow not registered"
    if snap.control is not None:
        fail_pending(store, snap, None, settings)
        return "cancelled before it was planned"
    input_raw, input_digest = snap.get(fld.F_INPUT) or "null", snap.get(fld.F_INPUT_DIGEST) or ""

    def plan(view: Snapshot) -> Planner:
        return Planner.start_run(workflow, run_id, input_raw, input_digest, clock.now(), settings, pending=view)

    shapes.publish(store, workflow, settings)
    try:
        commit(store, plan, snap, send, retry=never)
    except CommitConflict:
        return "already planned"
    return "planned"


def fail_pending(store: RedisStore, snap: Snapshot, error: ErrorRecord | None, settings: Settings) -> None:
    """End a pending run (read with START_FIELDS) without planning it: failed with ``error``, or
    cancelled (error None)."""
    now = clock.now()
    status = RunStatus.FAILED if error is not None else RunStatus.CANCELLED
    term = "failed" if error is not None else "aborted"
    batch = Batch(snap.run_id).expect(fld.F_STATUS, RunStatus.PENDING.value, "pending run")
    batch.list_run(snap.get(fld.F_WORKFLOW) or "", status.value, float(snap.get(fld.F_CREATED) or now),
                   was=RunStatus.PENDING.value)
    batch.set(fld.F_STATUS, status.value).set(fld.F_FINISHED, repr(now)).set(fld.F_TERMINATION, term)
    batch.set(fld.F_OPEN, "0")
    if error is not None:
        batch.set(fld.F_ERROR, error.model_dump_json())
    batch.event(Event(type=ev.RUN_FINISHED, at=now, data={"status": status.value, "termination": term,
                                                          **({"error": error.message} if error else {})}))
    batch.end_marker = status.value
    batch.ttl = settings.retention_s
    batch.look_at(ended_score(now))  # the next pass forgets and compacts it (store/compacted.py)
    write(store, batch)


def resend_queued(store: RedisStore, send: Sender, workflow: Workflow, run_id: str) -> None:
    """Send again the messages of every queued phase of a run (a start repeated after a crash
    between the write and the send; duplicates are refused by their tokens)."""
    snap = Snapshot(run_id, store.scan_fields(run_id, fld.TASK_PREFIX))
    dispatches = []
    for field in list(snap.fields):
        record = snap.record(fld.key_of_task_field(field))
        if record is not None and record.state in QUEUED_STATES and record.phase is not None:
            dispatches.append(Dispatch(record.key, record.phase, record.round, record.token))
    if dispatches:
        send(workflow, run_id, dispatches)


def _same_run(existing: Snapshot, name: str, version: str | None, input: Any, input_digest: str) -> None:
    """An existing run under this id must be the same start: RunExists says what differs."""
    run_id = existing.run_id
    stored_name, stored_version = existing.get(fld.F_WORKFLOW), existing.get(fld.F_VERSION) or None
    if stored_name != name or (version is not None and stored_version is not None and stored_version != version):
        raise RunExists(
            f"run_id {run_id!r} already belongs to workflow {stored_name} v{stored_version}, not {name} "
            f"v{version}; use another run_id (or none for a generated one)"
        )
    if existing.get(fld.F_INPUT_DIGEST) != input_digest:
        stored = existing.json(fld.F_INPUT)
        raise RunExists(
            f"run_id {run_id!r} already exists with another input ({first_difference(stored, input)}); "
            "the same run_id with the same input returns the existing run: use another run_id, or the "
            "input it was started with"
        )


def first_difference(old: Any, new: Any, path: str = "$") -> str:
    """Where two JSON values first differ, e.g. ``$.topic: 'a' (stored) vs 'b' (given)``."""
    if isinstance(old, dict) and isinstance(new, dict):
        for name in sorted(set(old) | set(new)):
            if name not in old:
                return f"{path}.{name} is new"
            if name not in new:
                return f"{path}.{name} is missing"
            if canonical(old[name]) != canonical(new[name]):
                return first_difference(old[name], new[name], f"{path}.{name}")
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return f"{path} has {len(new)} items, the stored input {len(old)}"
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            if canonical(a) != canonical(b):
                return first_difference(a, b, f"{path}[{i}]")
    return f"{path}: {preview(old)} (stored) vs {preview(new)} (given)"

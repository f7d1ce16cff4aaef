"""Recovery: executions that were lost, records that cannot be trusted, runs that cannot go on.

- A **lost execution**: a phase recorded as running whose worker process died (Celery re-queues
  the message of a killed pool process) or whose lease expired. It is queued again as a replay
  (same round, same idempotency key, one more attempt consumed), or failed with PhaseAbandoned
  after ``TASKLOOP_MAX_EXECUTIONS`` executions.
- A **corrupt or inconsistent record**: it does not parse, or contradicts its definition or its
  round data. The task fails with CorruptRecord before any callback runs on it.
- A run whose definition is **not available** here (not imported, or another fingerprint) is
  aborted: it ends failed at once, and its remaining phases end cancelled as they are delivered.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import (
    CorruptRecord,
    IncompatibleDefinition,
    PhaseAbandoned,
    Superseded,
    WorkflowNotRegistered,
)
from taskloop.core import fields as fld
from taskloop.core.checks import StoredCheck
from taskloop.core.leases import own_lease_if_kept
from taskloop.core.phases import EventKind, PhaseEvent
from taskloop.core.planner import Planner
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase, Slot, TaskStatus, active_state
from taskloop.define.tasks import Task, TaskKind
from taskloop.define.workflow import REGISTRY, Workflow
from taskloop.runtime.commit import Sender, commit
from taskloop.runtime.fleet import ONLINE_WITHIN_S, WorkerInfo, heartbeats, holdings, node_of
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution.handled import Handled, Result

log = logging.getLogger("taskloop.executor")


def process_gone(pid: int) -> bool:
    """True when no live process has this pid (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a killed child that its parent has not reaped yet is a zombie: dead all the same
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return False


def worker_is_dead(worker: str | None, wait: float = 0.0) -> bool:
    """True when ``worker`` ("node@host/pid") ran on this host and its process is gone.

    ``wait``: how long to keep looking at a process that is still there (a killed process can
    be seen alive for a moment after its pool has already re-queued its message)."""
    if not worker or "/" not in worker:
        return False
    node, _, pid_text = worker.rpartition("/")
    host = node.partition("@")[2]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    deadline = time.monotonic() + wait
    while not process_gone(int(pid_text)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def execution_lost(store: RedisStore, run_id: str, record: TaskRecord, queued_lease_s: float) -> bool:
    """The running execution behind a redelivered message is gone: its lease expired, its process
    died (Celery re-queues the message of a killed pool process), or its worker fell silent (the
    reconciler gave a silent worker's messages back: worker/recovery/orphans.py). The lease is looked at
    first, and the process only once, without waiting: anyone who can publish a message with a
    token one below a running phase's must not be able to hold a pool process with it."""
    now = clock.now()
    # a queued record whose message began to run before its begin was written (worker/execution/deferred.py)
    own = own_lease_if_kept(record, queued_lease_s)
    expiry = own if own is not None else store.lease_of(run_id, record.key)
    if expiry is not None and expiry < now:
        return True
    if worker_is_dead(record.worker, wait=0.0):
        return True
    return worker_silent(record, heartbeats(store.workers_seen()), now)


def worker_silent(record: TaskRecord, beats: dict[str, WorkerInfo], now: float) -> bool:
    """True when the worker that began ``record`` fell silent while the rest of the fleet went on
    (runtime/fleet.py, ``holdings``), or has no heartbeat at all although it began the phase longer
    ago than a worker takes to be counted silent."""
    node = node_of(record.worker)
    if node is None:
        return False
    if node in beats:
        return node in holdings(beats, now).silent
    return record.began_at is not None and now - record.began_at > ONLINE_WITHIN_S


def is_redelivery_of_running(record: TaskRecord, phase: Phase, round: int, token: int) -> bool:
    """The message is the one whose execution the record shows running (BEGIN added one to its token)."""
    return record.state is active_state(phase, Slot.RUNNING) and record.round == round and record.token == token + 1


def abandoned_error(record: TaskRecord, max_executions: int) -> ErrorRecord:
    phase = record.phase.value if record.phase else "phase"
    return ErrorRecord(
        type=PhaseAbandoned.__name__,
        message=(f"{phase} of task {record.key} round {record.round} was started {record.execs} times and "
                 f"every execution was lost (its worker died, hung or lost its lease); giving up after "
                 f"TASKLOOP_MAX_EXECUTIONS={max_executions}. Check the worker logs for what kills it"),
        details={"executions": record.execs, "lost": record.lost + 1},
    )


def plan_recovery(planner: Planner, record: TaskRecord, max_executions: int) -> TaskRecord:
    """Plan the replay of a running phase whose execution was lost (or give up on it). A queued
    record whose execution was lost before its begin was written (worker/execution/deferred.py) is begun
    first, where it began: that execution counts like any other."""
    now = planner.now
    if record.slot is Slot.QUEUED:
        began = record.began_at if record.began_at is not None else now
        record = planner.move(record.key, PhaseEvent(EventKind.BEGIN, began, worker=record.worker))
    if record.execs >= max_executions:
        event = PhaseEvent(EventKind.FAIL, now, error=abandoned_error(record, max_executions))
    else:
        event = PhaseEvent(EventKind.EXPIRE, now)
    planner.exec_info[record.key] = {"lost": True, "worker": record.worker, "began": record.began_at,
                                     "execs": record.execs, "attempt": record.attempts}
    return planner.outcome(record.key, event)


def workflow_for(snap: Snapshot, worker: str) -> Workflow:
    """The definition a run was started with, from this process's registry: WorkflowNotRegistered
    when it is not imported here, IncompatibleDefinition when its fingerprint differs."""
    name, version, fingerprint = snap.get(fld.F_WORKFLOW), snap.get(fld.F_VERSION), snap.get(fld.F_FINGERPRINT)
    assert name is not None
    try:
        workflow = REGISTRY.get(name, version or None)
    except WorkflowNotRegistered as exc:
        raise WorkflowNotRegistered(f"{exc} [worker {worker}]") from None
    if fingerprint and fingerprint != workflow.fingerprint:
        raise IncompatibleDefinition(
            f"run {snap.run_id} was started with another definition of workflow {name} v{version} "
            f"(fingerprint {fingerprint}, this worker has {workflow.fingerprint}); deploy the same "
            "definition to every worker, or give the changed workflow a new version"
        )
    return workflow


def recover(store: RedisStore, settings: Settings, send: Sender, workflow: Workflow, snap: Snapshot,
            record: TaskRecord) -> Handled:
    """Queue a replay of a lost execution at once (or give up on it), as the reconciler would."""
    raw = snap.raw_record(record.key)

    def plan(view: Snapshot) -> Planner:
        if view.raw_record(record.key) != raw:
            raise Superseded("recovered elsewhere")
        planner = Planner(workflow, view, clock.now(), settings)
        plan_recovery(planner, record, settings.max_executions)
        return planner

    try:
        committed = commit(store, plan, snap, send)
    except Superseded:
        return Handled(Result.STALE, reason="the lost execution was recovered elsewhere")
    after = committed.planner.tasks[record.key]
    log.warning("run %r task %r: the execution of %s round %s by %s was lost; %s", snap.run_id, record.key,
                record.phase.value if record.phase else "-", record.round, record.worker,
                "giving up" if after.terminal else "replaying it")
    return Handled(Result.RECOVERED, outcome=EventKind.FAIL if after.terminal else EventKind.EXPIRE,
                   error=after.error)


def abort_run(store: RedisStore, settings: Settings, send: Sender, snap: Snapshot, error: ErrorRecord) -> None:
    """The run cannot go on here: end it failed with ``error`` now (its definition is not
    available, or it cannot be planned); its phases still in flight end cancelled as they come."""
    log.error("run %r: %s: %s; ending the run", snap.run_id, error.type, error.message)
    workflow = placeholder_workflow(snap)

    def plan(view: Snapshot) -> Planner:
        planner = Planner(workflow, view, clock.now(), settings)
        planner.abort(error)
        return planner

    commit(store, plan, snap, send)


def inconsistency(task: Task, record: TaskRecord, snap: Snapshot) -> str | None:
    """What is wrong with an (otherwise readable) record and its round data, if anything."""
    if record.kind is not task.kind:
        return f"the record is a {record.kind.value} but the definition declares a {task.kind.value}"
    if not 1 <= record.round <= record.limit:
        return f"round {record.round} is outside 1..{record.limit}"
    if task.is_loop and record.limit != task.max_rounds:
        return f"the record allows {record.limit} rounds, the definition {task.max_rounds}"
    if record.phase is Phase.CHECK:
        raw = snap.get(fld.candidate_field(task.key, record.round))
        if raw is None:
            return f"round {record.round} is in check but has no recorded candidate"
        try:
            json.loads(raw)
        except ValueError:
            return f"the candidate of round {record.round} is not JSON"
    if record.phase is Phase.ATTEMPT and record.round > 1:
        check = StoredCheck.read(snap.get(fld.check_field(task.key, record.round - 1)))
        if check is None or not check.rejected:
            return f"round {record.round} started but round {record.round - 1} has no recorded rejection"
    return None


def corrupt_error(run_id: str, key: str, problem: str) -> ErrorRecord:
    return ErrorRecord(type=CorruptRecord.__name__, message=str(CorruptRecord(run_id, key, problem)))


def stand_in(key: str, kind: TaskKind) -> TaskRecord:
    """A record from which FAIL is legal, for a field that does not parse (the guard still
    compares the corrupt bytes, so nobody else can have changed it meanwhile)."""
    return TaskRecord(key=key, kind=kind, status=TaskStatus.ACTIVE,
                      phase=Phase.ATTEMPT if kind is TaskKind.LOOP else Phase.RUN, slot=Slot.QUEUED, round=1)


def placeholder_workflow(snap: Snapshot) -> Workflow:
    """Stands in for a definition that is not available: an abort touches no task."""
    return Workflow(name=snap.get(fld.F_WORKFLOW) or "?", version=snap.get(fld.F_VERSION) or "?", tasks=())

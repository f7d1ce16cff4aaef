"""The reconciler: re-dispatches phases whose lease expired, and settles what no message will.

Every dispatched phase has a lease in its run's ``leases`` set. A lease expires when nothing
renewed it:

- a **queued** phase whose message never arrived (lost by the broker, or the process that
  recorded it died before sending): the phase gets a new fencing token and a new message;
- a **running** phase whose worker died, hung or was paused: the phase is queued again as a
  replay, or fails with PhaseAbandoned after ``TASKLOOP_MAX_EXECUTIONS`` (recovery.py);
- any other task (finished, waiting): the stale lease is dropped.

It also ends the paused gates of a cancelled run (no message would), and forgets finished runs.

Which runs to look at comes from ``tl:live``: each live run is listed with the time of its
earliest possible lease expiry. A lease is always written at least ``min(running lease, queued
lease)`` into the future, so after a look at time T the run needs no look before
``min(its earliest lease, T + that minimum)``. A pass therefore reads only the runs that are due.

Every change is a compare-and-set, so several reconcilers (the beat task, ``taskloop
reconcile`` and the thread in each worker) can run at once: at most one wins each lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from dataclasses import asdict, dataclass, fields

from taskloop import clock, metrics
from taskloop.commit import Sender, commit
from taskloop.config import Settings, min_lease_s
from taskloop.definitions import REGISTRY, Workflow
from taskloop.errors import CommitConflict, CorruptRecord, TaskLoopError
from taskloop.phases import QUEUED_STATES, RUNNING_STATES, EventKind, PhaseEvent, State
from taskloop.scheduler import CANCEL_PREFIX, Planner
from taskloop.store import Batch, RedisStore, RunMeta, Snapshot
from taskloop.store import keys as k
from taskloop.worker import recovery

log = logging.getLogger("taskloop.reconciler")


@dataclass
class Report:
    """What one reconcile pass did."""

    examined: int = 0  # expired leases looked at
    runs: int = 0  # live runs looked at
    redispatched: int = 0  # queued, message presumed lost: sent again with a new token
    replayed: int = 0  # running, worker gone: queued again
    abandoned: int = 0  # lost too many times: failed with PhaseAbandoned
    cleaned: int = 0  # lease of a task that no longer needs one: dropped
    gates_cancelled: int = 0  # paused gates of a cancelled run
    forgotten: int = 0  # finished or expired runs taken off the live index
    conflicts: int = 0  # another reconciler or worker got there first
    unknown_workflow: int = 0  # definition not importable here: left for a reconciler that has it

    def __str__(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self))


def reconcile(store: RedisStore, settings: Settings, send: Sender, now: float | None = None,
              limit: int = 500, batches: int = 20) -> Report:
    """One pass over the live runs that are due (``limit`` at a time, at most ``batches`` times)."""
    now = clock.now() if now is None else now
    report = Report()
    for _ in range(batches):
        due = store.due_runs(now, limit)
        rows = store.run_metas(due)
        metas = {run_id: RunMeta.from_fields(run_id, dict(zip(k.META_FIELDS, row, strict=True)))
                 for run_id, row in zip(due, rows, strict=True) if row[1] is not None}
        over = [run_id for run_id in due if run_id not in metas or metas[run_id].terminal]
        store.unlive(over)  # finished (or expired) runs leave the live index here, in bulk
        store.count_finished([metas[run_id] for run_id in over if run_id in metas])
        report.forgotten += len(over)
        for run_id, meta in metas.items():
            if meta.terminal:
                continue
            report.runs += 1
            try:
                _reconcile_run(store, settings, send, meta, now, report)
            except TaskLoopError as exc:
                log.warning("reconcile %r: %s", run_id, exc)
        if len(due) < limit:
            break
    store.trim_runs_index(now - settings.retention_s)
    if report.examined or report.gates_cancelled:
        log.info("reconcile: %s", report)
    store.note_reconcile(json.dumps({"at": now, **asdict(report)}))
    metrics.reconciled(report)
    return report


def _reconcile_run(store: RedisStore, settings: Settings, send: Sender, meta: RunMeta, now: float,
                   report: Report) -> None:
    run_id = meta.run_id
    workflow: Workflow | None = None
    try:
        workflow = REGISTRY.get(meta.workflow, meta.version or None)
    except TaskLoopError:
        report.unknown_workflow += 1
    expired = store.leases(run_id, now)
    for key, _ in expired:
        report.examined += 1
        if workflow is None:
            log.warning("reconcile: workflow %s v%s is not imported here; leaving %s/%s to another reconciler",
                        meta.workflow, meta.version, run_id, key)
            continue
        _reconcile_lease(store, settings, send, workflow, run_id, key, now, report)
    if workflow is not None and meta.control is not None and meta.control.startswith(CANCEL_PREFIX) and meta.paused:
        _cancel_gates(store, settings, send, workflow, run_id, report)
    if expired and workflow is None:
        return  # look again at the next pass: maybe another reconciler has the definition
    first = store.first_lease(run_id)
    look_at = now + min_lease_s(settings)
    store.look_again(run_id, min(first, look_at) if first is not None else look_at)


def _reconcile_lease(store: RedisStore, settings: Settings, send: Sender, workflow: Workflow, run_id: str,
                     key: str, now: float, report: Report) -> None:
    snap = store.snapshot(run_id, [k.task_field(key), k.F_CONTROL])
    lease = store.lease_of(run_id, key)
    if lease is None or lease > now:
        report.conflicts += 1  # renewed or settled since the lease list was read
        return
    try:
        record = snap.record(key)
    except CorruptRecord:
        record = None
    if record is None or (record.state not in QUEUED_STATES and record.state not in RUNNING_STATES):
        raw = snap.raw_record(key)
        store.apply(Batch(run_id).expect(k.task_field(key), raw).lease(key, None))
        report.cleaned += 1
        return
    raw = snap.raw_record(key)

    def plan(view: Snapshot) -> Planner:
        if view.raw_record(key) != raw:
            raise CommitConflict(f"{run_id}/{key} moved on")
        planner = Planner(workflow, view, now, settings)
        if record.state in QUEUED_STATES:
            planner.outcome(key, PhaseEvent(EventKind.REDISPATCH, now))
        else:
            recovery.plan_recovery(planner, record, settings.max_executions)
        return planner

    try:
        committed = commit(store, plan, snap, send, attempts=3)
    except CommitConflict:
        report.conflicts += 1
        return
    if record.state in QUEUED_STATES:
        counter = "redispatched"
    else:
        counter = "abandoned" if committed.planner.tasks[key].terminal else "replayed"
    setattr(report, counter, getattr(report, counter) + 1)
    log.warning("reconcile: %s %s of %s/%s round %s", counter, record.phase.value if record.phase else "-",
                run_id, key, record.round)


def _cancel_gates(store: RedisStore, settings: Settings, send: Sender, workflow: Workflow, run_id: str,
                  report: Report) -> None:
    snap = store.snapshot(run_id, [k.F_CONTROL, *(k.task_field(g) for g in workflow.gates)])

    def plan(view: Snapshot) -> Planner:
        planner = Planner(workflow, view, clock.now(), settings)
        planner.cancel_gates()
        planner.settle()
        return planner

    try:
        committed = commit(store, plan, snap, send, attempts=3)
    except CommitConflict:
        report.conflicts += 1
        return
    report.gates_cancelled += sum(1 for key in committed.planner.changed
                                  if committed.planner.tasks[key].state is State.CANCELLED)


class ReconcilerThread:
    """Runs ``reconcile`` every ``interval`` seconds in a worker's main process. A short Redis lock
    lets one worker of the fleet do each pass (any other reconciler stays safe regardless)."""

    def __init__(self, store: RedisStore, settings: Settings, send: Sender, interval: float) -> None:
        self.store = store
        self.settings = settings
        self.send = send
        self.interval = interval
        self.token = f"{socket.gethostname()}/{os.getpid()}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="taskloop-reconciler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Called on worker shutdown: the current pass finishes, no new one starts."""
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                acquired = self.store.client.set(k.RECONCILER_LOCK, self.token, nx=True,
                                                 px=max(int(self.interval * 900), 1))
                if acquired:
                    reconcile(self.store, self.settings, self.send)
            except Exception:  # keep reconciling whatever happens (Redis away, ...)
                log.exception("reconcile pass failed")

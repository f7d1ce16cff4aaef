"""The reconciler: re-dispatches phases whose lease expired.

Every dispatched phase has a lease in ``tl:leases``. A lease expires when nothing renewed it:

- a **queued** phase whose message never arrived (lost by the broker, or the process that
  recorded it died before sending): the phase gets a new fencing token and a new message;
- a **running** phase whose worker died, hung or was paused: the phase is queued again (a
  replay: same round, same idempotency key, one more attempt consumed). The replay finds an
  elapsed deadline itself and records TaskTimeout. A phase that was lost
  ``TASKLOOP_MAX_EXECUTIONS`` times fails with ``PhaseAbandoned`` instead of looping forever;
- any other task (finished, waiting): the stale lease is dropped.

Every change is a compare-and-set on the task record, so several reconcilers (beat, the
``taskloop reconcile`` command and the thread in each worker) can run at once: at most one
wins each lease, the others see a conflict and move on.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from taskloop import clock
from taskloop.config import Settings
from taskloop.definitions import REGISTRY, Workflow
from taskloop.errors import TaskLoopError
from taskloop.phases import QUEUED_STATES, RUNNING_STATES, ErrorRecord, EventKind, PhaseEvent, TaskRecord
from taskloop.scheduler import Dispatch, Planner
from taskloop.store import Batch, RedisStore
from taskloop.store import keys as k

log = logging.getLogger("taskloop.reconciler")

Sender = Callable[[Workflow, str, Dispatch], None]


@dataclass
class Report:
    """What one reconcile pass did."""

    examined: int = 0
    redispatched: int = 0  # queued, message presumed lost: sent again with a new token
    replayed: int = 0  # running, worker gone: queued again
    abandoned: int = 0  # lost too many times: failed with PhaseAbandoned
    cleaned: int = 0  # lease of a task that no longer needs one: dropped
    conflicts: int = 0  # another reconciler or worker got there first
    unknown_workflow: int = 0  # definition not importable here: left for a reconciler that has it

    def __str__(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self))


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


def abandoned_error(record: TaskRecord, max_executions: int) -> ErrorRecord:
    phase = record.phase.value if record.phase else "phase"
    return ErrorRecord(
        type="PhaseAbandoned",
        message=(f"{phase} of task {record.key} round {record.round} was started {record.execs} times and "
                 f"every execution was lost (its worker died, hung or lost its lease); giving up after "
                 f"TASKLOOP_MAX_EXECUTIONS={max_executions}. Check the worker logs for what kills it"),
        details={"executions": record.execs, "lost": record.lost + 1},
    )


def recover(planner: Planner, record: TaskRecord, max_executions: int) -> None:
    """Plan the replay of a running phase whose execution was lost (or give up on it)."""
    now = planner.now
    if record.execs >= max_executions:
        planner.move(record.key, PhaseEvent(EventKind.FAIL, now, error=abandoned_error(record, max_executions)))
    else:
        planner.move(record.key, PhaseEvent(EventKind.EXPIRE, now))
    planner.settle()


def reconcile(store: RedisStore, settings: Settings, send: Sender, now: float | None = None,
              limit: int = 500) -> Report:
    """One pass over the expired leases."""
    now = clock.now() if now is None else now
    report = Report()
    for run_id, key, _ in store.expired_leases(now, limit):
        report.examined += 1
        try:
            _reconcile_one(store, settings, send, run_id, key, now, report)
        except TaskLoopError as exc:
            log.warning("reconcile %s/%s: %s", run_id, key, exc)
    if report.examined:
        log.info("reconcile: %s", report)
    return report


def _reconcile_one(store: RedisStore, settings: Settings, send: Sender, run_id: str, key: str,
                   now: float, report: Report) -> None:
    snap, lease = store.snapshot_with_lease(run_id, key)
    if snap is None or key not in snap.raw_tasks:
        store.apply(Batch(run_id).lease(key, None))
        report.cleaned += 1
        return
    if lease is not None and lease > now:
        report.conflicts += 1  # another reconciler or a worker renewed it since the lease list was read
        return
    record = snap.task(key)
    if record.state not in QUEUED_STATES and record.state not in RUNNING_STATES:
        store.apply(Batch(run_id).expect_task(key, snap.raw_tasks[key]).lease(key, None))
        report.cleaned += 1
        return
    try:
        workflow = REGISTRY.get(snap.run["wf"], snap.run["ver"])
    except TaskLoopError:
        report.unknown_workflow += 1
        log.warning("reconcile: workflow %s v%s is not imported here; leaving %s/%s to another reconciler",
                    snap.run.get("wf"), snap.run.get("ver"), run_id, key)
        return
    planner = Planner(workflow, snap, now, settings)
    if record.state in QUEUED_STATES:
        planner.move(key, PhaseEvent(EventKind.REDISPATCH, now))
        counter = "redispatched"
    else:
        recover(planner, record, settings.max_executions)
        counter = "abandoned" if planner.tasks[key].terminal else "replayed"
    if store.apply(planner.batch()) is not None:
        report.conflicts += 1
        return
    setattr(report, counter, getattr(report, counter) + 1)
    log.warning("reconcile: %s %s of %s/%s round %s", counter, record.phase.value if record.phase else "-",
                run_id, key, record.round)
    for dispatch in planner.dispatches:
        send(workflow, run_id, dispatch)


class ReconcilerThread:
    """Runs ``reconcile`` every ``interval`` seconds in a worker's main process. A short Redis lock
    lets one worker of the cluster do each pass (any other reconciler stays safe regardless)."""

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

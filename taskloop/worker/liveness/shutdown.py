"""Graceful shutdown: a worker told to stop (SIGTERM, SIGINT: Celery's warm shutdown) stops
taking phases, lets the running ones finish for ``TASKLOOP_SHUTDOWN_GRACE_S``, then hands back
those still running, and exits 0.

Celery's warm shutdown does the first part: the consumer stops, and the messages this worker had
prefetched but not started go back to the queue when its broker connection closes (they were
never acknowledged: ``acks_late``). Celery would then wait for the running tasks however long they
take. This module bounds that wait. In the worker's main process, a thread started by
``worker_shutting_down`` watches the running taskloop phases; when the grace period is over, for
each phase still running it

1. **hands the phase back** (Executor.hand_back): one guarded write that moves the record from
   running to queued with a new fencing token and sends a new message (``handed_back`` event), so
   another worker replays it at once instead of after the lease expires; the write is refused
   if the phase finished meanwhile, and then nothing else happens;
2. acknowledges the old message (it must not come back: the new one replaces it);
3. stops the pool process running it (SIGTERM; Flower shows the task REVOKED, "terminated").

Should the callback still commit after that, its write is refused: its token is no longer the
record's. A handed-back execution is a replay like a lost one (it consumes an attempt when it
begins again), but it is not counted as lost. Cold shutdown (SIGQUIT, or a second SIGTERM) skips
all this: leases expire and the reconciler replays, as for a crash.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

from taskloop.base import clock
from taskloop.base.errors import Superseded, TaskLoopError
from taskloop.core import fields as fld
from taskloop.core.phases import EventKind, PhaseEvent
from taskloop.core.planner import Planner
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase
from taskloop.runtime.commit import commit
from taskloop.worker.execution import process
from taskloop.worker.execution.executor import Executor
from taskloop.worker.recovery import executions as recovery

log = logging.getLogger("taskloop.shutdown")

PHASE_TASKS = {"taskloop.attempt": Phase.ATTEMPT, "taskloop.check": Phase.CHECK, "taskloop.run": Phase.RUN}


def running_phases() -> list[Any]:
    """The requests of taskloop phases that a pool process is executing now (Celery's own list;
    ``type`` is the registered task name, ``name`` the workflow-named shadow Flower shows)."""
    return [request for request in list(worker_state.active_requests)
            if getattr(request, "type", None) in PHASE_TASKS and getattr(request, "worker_pid", None)]


class GracefulShutdown:
    """Owned by a worker's main process: ``ready`` records the pool, ``shutting_down`` starts the
    grace period (see the module docstring)."""

    def __init__(self, grace_s: float, executor: Callable[[], Executor]) -> None:
        self.grace_s = grace_s
        self.executor = executor
        self.pool: Any = None
        self.handed_back = 0
        self._thread: threading.Thread | None = None

    def ready(self, consumer: Any) -> None:
        self.pool = getattr(consumer, "pool", None)

    def shutting_down(self, how: str) -> None:
        if how != "Warm" or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="taskloop-shutdown", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        running = running_phases()
        if running:
            log.warning("warm shutdown: taking no new phases; %d running get %.1f s (TASKLOOP_SHUTDOWN_GRACE_S) "
                        "to finish before they are handed back", len(running), self.grace_s)
        # The whole grace period, even when nothing runs now: a message the pool was given as the
        # shutdown began may start a phase a moment later, and that phase gets its grace too.
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
        for request in running_phases():
            try:
                self.hand_back(request)
            except Exception:  # a shutdown must go on: the lease still guards the phase
                log.exception("could not hand back %s %r; its lease will expire and the reconciler replays it",
                              request.name, request.argsrepr)
        # This thread dies with the process. Still here STUCK_S later, Celery is waiting for a pool
        # process that does not end (seen once in CI: a message given to the pool as the shutdown
        # began, after which the pool's join never returned): stop the pool's processes, so that
        # the worker ends. What they ran is guarded by its lease and fencing token, as after a crash.
        time.sleep(self.STUCK_S)
        self.stop_stuck_pool()

    STUCK_S = 10.0  # after the grace period and the hand-backs

    def stop_stuck_pool(self) -> None:
        if process.POOL.in_worker:
            # a callback that ignores its signal holds Celery's join of the pool's threads (solo: its
            # main thread); every phase of this process was handed back (or ended), so it ends here
            log.warning("warm shutdown: %d phase(s) still running %.0f s after the grace period ignore their "
                        "signal; they were handed back; exiting", len(running_phases()), self.STUCK_S)
            logging.shutdown()
            os._exit(0)
        pids = [pid for pid in (getattr(self.pool, "info", None) or {}).get("processes", []) if pid]
        if not pids:
            return
        log.warning("warm shutdown: the pool's processes %s have not ended %.0f s after the grace period; "
                    "stopping them (SIGTERM) so that the worker ends (running now: %d)",
                    pids, self.STUCK_S, len(running_phases()))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass

    def hand_back(self, request: Any) -> bool:
        args = tuple(request.args)
        if len(args) != 4:
            return False
        run_id, key, round_, token = args
        worker = f"{request.hostname}/{request.worker_pid}"
        handed = hand_back(self.executor(), PHASE_TASKS[request.type], run_id, key, round_, token, worker)
        if not handed:
            return False  # it finished (or was taken over) meanwhile: Celery waits for its process
        self.handed_back += 1
        request.acknowledge()
        if process.POOL.in_worker:
            # the phase's thread or greenlet (solo: the main thread) runs in this process: its signal
            # says it was superseded (its late outcome is refused: its token is no longer the record's;
            # Celery's solo pool cannot terminate a task, its other pools here would stop them all)
            self.executor().watcher.supersede(run_id, key)
        elif self.pool is not None and not process.POOL.on_loop_process:
            request.terminate(self.pool, signal="SIGTERM")
        # (asyncio, threads: the pool process runs every phase; the pool stops it after the grace, asyncio_pool.py)
        return True


def hand_back(executor: Executor, phase: Phase, run_id: str, key: str, round_: int, token: int, worker: str) -> bool:
    """Give back the phase that ``worker`` (a pool process of this worker, which is shutting
    down) is running: it is queued again at once, with a new token and a new message, so that
    another worker replays it without waiting for its lease to expire. False when that execution
    no longer owns the phase (it finished meanwhile, or was taken over), or the run's definition is
    not available here. (A slot the phase holds under a fleet limit stays with its task: the
    replay takes it over, worker/limits/limiter.py.)"""
    store = executor.store
    snap = store.snapshot(run_id, [fld.task_field(key), fld.F_CONTROL, fld.F_WORKFLOW, fld.F_VERSION,
                                   fld.F_FINGERPRINT])
    if snap.get(fld.F_WORKFLOW) is None:
        return False
    try:
        record = snap.record(key)
        workflow = executor.workflow_of(snap)
    except TaskLoopError:
        return False
    if record is None or record.worker != worker or \
            not recovery.is_redelivery_of_running(record, phase, round_, token):
        return False
    raw = snap.raw_record(key)

    def plan(view: Snapshot) -> Planner:
        if view.raw_record(key) != raw:
            raise Superseded(f"task {key} finished or was taken over")
        planner = Planner(workflow, view, clock.now(), executor.settings)
        took = round(planner.now - record.began_at, 6) if record.began_at is not None else None
        planner.exec_info[key] = {"handed_back": True, "worker": record.worker, "began": record.began_at,
                                  "execs": record.execs, "attempt": record.attempts, "took": took}
        planner.outcome(key, PhaseEvent(EventKind.HAND_BACK, planner.now))
        return planner

    try:
        commit(store, plan, snap, executor.send)
    except Superseded:
        return False
    log.warning("run %r task %r: %s round %s handed back by %s (shutting down); queued again for another worker",
                run_id, key, phase.value, round_, worker)
    return True

"""The reconciler: re-dispatches phases whose lease expired, and settles what no message will.

Every dispatched phase has a lease in its run's ``leases`` set. A lease expires when nothing
renewed it:

- a **queued** phase whose message never arrived (lost by the broker, or the process that
  recorded it died before sending): the phase gets a new fencing token and a new message;
- a **running** phase whose worker died, hung or was paused: the phase is queued again as a
  replay, or fails with PhaseAbandoned after ``TASKLOOP_MAX_EXECUTIONS`` (worker/recovery/executions.py);
- any other task (finished, waiting): the stale lease is dropped;
- a phase queued again under the lease of its earlier queueing (a loop's next phase keeps the
  lease its first one got, and its record says so: core/leases.py ``kept_lease``): the lease
  moves to the phase's own end (``own_lease_if_kept``), and the message is sent again only after
  that.

It also ends the paused gates of a cancelled run (no message would), and forgets finished runs.

Which runs to look at comes from ``tl:live``: each live run is listed with the time of its
earliest possible lease expiry. A lease is always written at least ``min(running lease, queued
lease)`` into the future, so after a look at time T the run needs no look before
``min(its earliest lease, T + that minimum)``. A pass therefore reads only the runs that are due.
A run that ended is listed below every time (core/batch.py ``ended_score``): the next pass reads
it whole at once, takes its meta from that read, forgets it and compacts it.

Every change is a compare-and-set, so several reconcilers (the beat task, ``taskloop
reconcile`` and the thread in each worker) can run at once: at most one wins each lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

from taskloop.base import clock
from taskloop.base.config import Settings, min_lease_s
from taskloop.base.errors import CommitConflict, CorruptRecord, StoreAccessDenied, TaskLoopError
from taskloop.core import fields as fld
from taskloop.core.batch import Batch, is_ended_score
from taskloop.core.leases import own_lease_if_kept
from taskloop.core.phases import EventKind, PhaseEvent
from taskloop.core.planner import Planner
from taskloop.core.rules import CANCEL_PREFIX
from taskloop.core.snapshot import RunMeta, Snapshot
from taskloop.core.states import QUEUED_STATES, RUNNING_STATES, RunStatus
from taskloop.define.workflow import REGISTRY, Workflow
from taskloop.ops.hooks import Reconciled
from taskloop.runtime.commit import Sender, commit
from taskloop.runtime.fleet import WorkerInfo, read_holdings
from taskloop.runtime.gates import settle_gates
from taskloop.runtime.instruments import hooks
from taskloop.runtime.starting import plan_pending
from taskloop.runtime.writes import write
from taskloop.store import keys as k
from taskloop.store.compacted import Whole
from taskloop.store.redis_store import Conflict, RedisStore
from taskloop.worker.execution.deferred import started
from taskloop.worker.recovery import census as census_module
from taskloop.worker.recovery import executions as recovery
from taskloop.worker.recovery import outage, unbegun
from taskloop.worker.recovery.census import Census

log = logging.getLogger("taskloop.reconciler")


@dataclass
class Report:
    """What one reconcile pass did."""

    examined: int = 0  # expired leases looked at
    runs: int = 0  # live runs looked at
    redispatched: int = 0  # queued, message presumed lost: sent again with a new token
    replayed: int = 0  # running (or begun on its start note), execution lost: queued again
    abandoned: int = 0  # lost too many times: failed with PhaseAbandoned
    cleaned: int = 0  # lease of a task that no longer needs one: dropped
    moved: int = 0  # lease of a phase queued again, kept from its earlier queueing: moved to its own
    gates_cancelled: int = 0  # paused gates of a cancelled run
    forgotten: int = 0  # finished or expired runs taken off the live index
    conflicts: int = 0  # another reconciler or worker got there first
    unknown_workflow: int = 0  # definition not importable here: left for a reconciler that has it
    redis_restarts: int = 0  # Redis restarted since the fleet's last pass (INFO run_id changed)
    resent_after_restart: int = 0  # queued phases whose messages were sent again because of it
    orphans_restored: int = 0  # messages held by a worker that fell silent, sent again from the store
    compacted: int = 0  # finished runs rewritten as one compact record (store/compacted.py)
    census_resent: int = 0  # queued phases whose message was lost in the broker, sent again (worker/recovery/census.py)
    planned: int = 0  # pending runs whose start was lost, planned here (runtime/starting.py)
    # ran before their begin was written, on a silent or hung process (worker/recovery/unbegun.py)
    unbegun_replayed: int = 0

    def __str__(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self))


# sends again what silent workers held (worker/recovery/orphans.py), given the fleet's heartbeats
# with their holdings as the pass read them (None: it reads them itself)
Restore = Callable[[dict[str, WorkerInfo] | None], int]


def reconcile(store: RedisStore, settings: Settings, send: Sender, now: float | None = None,
              limit: int = 500, batches: int = 20, restore: Restore | None = None,
              census: Census | None = None) -> Report:
    """One pass over the live runs that are due (``limit`` at a time, at most ``batches`` times),
    after sending again what workers gone silent held (``restore``) and, when one did
    or every CENSUS_S seconds, sending again the phases whose message was lost in the broker
    (``census``)."""
    now = clock.now() if now is None else now
    report = Report()
    _after_restart(store, settings, send, report)
    beats: dict[str, WorkerInfo] | None = None
    try:  # the heartbeats and holdings, read once for the pass (thousands of messages per worker)
        beats = read_holdings(store)
    except TaskLoopError as exc:
        log.warning("reconcile: the workers' heartbeats were not read: %s", exc)
    try:  # before the messages of silent workers go back: they come back stale then
        report.unbegun_replayed = unbegun.recover(store, settings, send, now, beats=beats)
    except TaskLoopError as exc:
        log.warning("reconcile: the phases workers ran before their begin were not looked at: %s", exc)
    if restore is not None:
        try:
            report.orphans_restored = restore(beats)
        except Exception as exc:  # the broker may be away or refuse this user: the pass goes on
            log.warning("reconcile: the messages of silent workers were not looked at: %s: %s",
                        type(exc).__name__, exc)
    if census is not None:
        try:  # each pass dates the queues' tails; a census compares the heartbeats with an earlier dating
            census.observe(now, beats=beats)
        except Exception as exc:
            log.warning("reconcile: the queues' tails were not dated: %s: %s", type(exc).__name__, exc)
    if census is not None and (report.orphans_restored or census.due(now)):
        try:
            report.census_resent = census.run(now, beats=beats)
        except Exception as exc:  # as above: the next pass tries again
            log.warning("reconcile: no census of lost messages: %s: %s", type(exc).__name__, exc)
    for _ in range(batches):
        entries = store.due_entries(now, limit)
        due = [run_id for run_id, _ in entries]
        # A run that ended is listed so (core/batch.py ended_score): it is read whole at once, for
        # its meta and its compaction; every other due run has its meta fields read.
        ended = [run_id for run_id, score in entries if is_ended_score(score)]
        wholes = store.read_whole(ended)
        others = [run_id for run_id in due if run_id not in wholes]
        rows = {run_id: dict(zip(fld.META_FIELDS, row, strict=True))
                for run_id, row in zip(others, store.run_metas(others), strict=True)}
        rows.update({run_id: {name: whole.fields.get(name) for name in fld.META_FIELDS}
                     for run_id, whole in wholes.items()})
        metas = {run_id: RunMeta.from_fields(run_id, row) for run_id, row in rows.items()
                 if row[fld.F_WORKFLOW] is not None}
        over = [run_id for run_id in due if run_id not in metas or metas[run_id].terminal]
        store.unlive(over)  # finished (or expired) runs leave the live index here, in bulk
        store.count_finished([metas[run_id] for run_id in over if run_id in metas])
        store.relist([(run_id, metas[run_id].workflow, metas[run_id].stored_status, metas[run_id].created)
                      for run_id in over if run_id in metas])
        report.forgotten += len(over)
        report.compacted += _compact(store, [run_id for run_id in over if run_id in metas], wholes)
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
    if report.examined or report.gates_cancelled or report.orphans_restored or report.census_resent \
            or report.unbegun_replayed:
        log.info("reconcile: %s", report)
    store.note_reconcile(json.dumps({"at": now, **asdict(report)}))
    hooks().reconciled(Reconciled(asdict(report)))
    return report


def _compact(store: RedisStore, run_ids: list[str], wholes: dict[str, Whole]) -> int:
    """Compact the finished runs just forgotten (as read whole, where they were); a run that fails
    to compact stays as it was."""
    done = 0
    for run_id in run_ids:
        try:
            done += store.compact(run_id, wholes.get(run_id))
        except TaskLoopError as exc:
            log.warning("reconcile: run %s not compacted: %s", run_id, exc)
    return done


_NO_INFO: list[str] = []  # said once per process: INFO is refused, restarts are not looked for


def _after_restart(store: RedisStore, settings: Settings, send: Sender, report: Report) -> None:
    """If Redis restarted since the fleet last looked, re-send what may have died with it (recovery/outage.py)."""
    try:
        started = outage.restarted_at(store)
    except StoreAccessDenied as exc:
        if not _NO_INFO:
            _NO_INFO.append(str(exc))
            log.warning("reconcile: Redis refuses INFO to this user (%s); a Redis restart is then noticed only "
                        "through the queued lease (TASKLOOP_QUEUED_LEASE_S): grant +info", exc)
        return
    if started is None:
        return
    swept = outage.sweep(store, settings, send, sent_before=started)
    report.redis_restarts += 1
    report.resent_after_restart += swept.resent
    report.replayed += swept.replayed
    log.warning("reconcile: Redis restarted %.1f s ago; re-sent %d queued phase message(s) of %d live run(s), "
                "replayed %d phase(s) whose process died", clock.now() - started, swept.resent, swept.runs,
                swept.replayed)


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
    if workflow is not None and meta.stored_status == RunStatus.PENDING.value \
            and now - meta.created > min_lease_s(settings):
        # recorded by name and never planned: its taskloop.start was lost (a worker that died holding
        # it, a message lost in the broker) or waits in a backlog; planning it twice plans it once
        report.planned += plan_pending(store, send, run_id, settings) == "planned"
    if expired and workflow is None:
        return  # look again at the next pass: maybe another reconciler has the definition
    first = store.first_lease(run_id)
    look_at = now + min_lease_s(settings)
    store.look_again(run_id, min(first, look_at) if first is not None else look_at)


def _reconcile_lease(store: RedisStore, settings: Settings, send: Sender, workflow: Workflow, run_id: str,
                     key: str, now: float, report: Report) -> None:
    snap = store.snapshot(run_id, [fld.task_field(key), fld.F_CONTROL, fld.started_field(key)])
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
        write(store, Batch(run_id).expect(fld.task_field(key), raw).lease(key, None))
        report.cleaned += 1
        return
    raw = snap.raw_record(key)
    own = own_lease_if_kept(record, settings.queued_lease_s)
    if own is not None and own > now:
        # a phase queued again under the lease of its earlier queueing: its own lease is still
        # ahead, so its message is not lost yet; the lease moves there (the record keeps its mark:
        # when this lease expires, the phase's own has)
        if isinstance(write(store, Batch(run_id).expect(fld.task_field(key), raw).lease(key, own)), Conflict):
            report.conflicts += 1
        else:
            report.moved += 1
        return

    # a queued phase whose message began to run before its begin was written (worker/execution/deferred.py)
    # and never got further in its queued lease: that execution is lost, and counts
    note = started(snap.get(fld.started_field(key)))
    ran = record.model_copy(update={"worker": note.worker, "began_at": note.at}) \
        if record.state in QUEUED_STATES and note is not None and note.token == record.token else None

    def plan(view: Snapshot) -> Planner:
        if view.raw_record(key) != raw:
            raise CommitConflict(f"{run_id}/{key} moved on")
        planner = Planner(workflow, view, now, settings)
        if record.state in QUEUED_STATES and ran is None:
            planner.outcome(key, PhaseEvent(EventKind.REDISPATCH, now))
        else:
            recovery.plan_recovery(planner, ran or record, settings.max_executions)
        return planner

    try:
        committed = commit(store, plan, snap, send, attempts=3)
    except CommitConflict:
        report.conflicts += 1
        return
    if record.state in QUEUED_STATES and ran is None:
        counter = "redispatched"
    else:
        counter = "abandoned" if committed.planner.tasks[key].terminal else "replayed"
    setattr(report, counter, getattr(report, counter) + 1)
    log.warning("reconcile: %s %s of %s/%s round %s", counter, record.phase.value if record.phase else "-",
                run_id, key, record.round)


def _cancel_gates(store: RedisStore, settings: Settings, send: Sender, workflow: Workflow, run_id: str,
                  report: Report) -> None:
    try:
        report.gates_cancelled += settle_gates(store, settings, send, workflow, run_id, attempts=3)
    except CommitConflict:
        report.conflicts += 1


LOST_RETRY_S = 0.5  # how often phases lost with a broker connection are tried again while Redis is away


class ReconcilerThread:
    """Runs ``reconcile`` every ``interval`` seconds in a worker's main process. A short Redis lock
    lets one worker of the fleet do each pass (any other reconciler stays safe regardless)."""

    def __init__(self, store: RedisStore, settings: Settings, send: Sender, interval: float,
                 restore: Restore | None = None, census: Census | None = None) -> None:
        self.store = store
        self.settings = settings
        self.send = send
        self.interval = interval
        self.restore = restore
        self.census = census
        self.token = f"{socket.gethostname()}/{os.getpid()}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="taskloop-reconciler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _census_after_a_lost_connection(self) -> None:
        """This worker's broker connection died: a message Redis popped for it may be lost (worker/
        census.py). Once such a message is old enough to be counted (MARGIN_S), take a census, outside
        the fleet's pass lock (a census is safe to run anywhere at once); again until it succeeds."""
        if self.census is None or not census_module.WANTED.is_set():
            return
        if time.monotonic() - census_module.WANTED.since < census_module.MARGIN_S:
            return
        try:
            self.census.run()
            census_module.WANTED.clear()
        except Exception as exc:  # Redis still away: the next turn of the loop tries again
            log.info("census after a lost broker connection not taken yet: %s: %s", type(exc).__name__, exc)

    def stop(self) -> None:
        """Called on worker shutdown: the current pass finishes, no new one starts."""
        self._stop.set()

    def _loop(self) -> None:
        next_pass = time.monotonic() + self.interval
        while not self._stop.is_set():
            outage.LOST.noted.wait(min(max(next_pass - time.monotonic(), 0.0), LOST_RETRY_S))
            if self._stop.is_set():
                return
            if outage.LOST.noted.is_set():  # this worker's broker connection died holding phases
                try:
                    outage.resend_lost(self.store, self.settings, self.send)
                except Exception:
                    log.exception("re-sending lost phase messages failed")
                if outage.LOST.noted.is_set():
                    self._stop.wait(LOST_RETRY_S)  # Redis is still away: try again shortly
            self._census_after_a_lost_connection()
            if time.monotonic() < next_pass:
                continue
            next_pass = time.monotonic() + self.interval
            try:
                acquired = self.store.client.set(k.RECONCILER_LOCK, self.token, nx=True,
                                                 px=max(int(self.interval * 900), 1))
                if acquired:
                    reconcile(self.store, self.settings, self.send, restore=self.restore, census=self.census)
            except Exception:  # keep reconciling whatever happens (Redis away, ...)
                log.exception("reconcile pass failed")

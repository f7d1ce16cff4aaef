"""The client: start runs, wait for them, inspect, list, cancel and decide gates."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery

from taskloop import clock
from taskloop import events as ev
from taskloop.app import PhaseSender, make_app
from taskloop.config import Settings, settings
from taskloop.definitions import REGISTRY, Workflow
from taskloop.errors import (
    DefinitionError,
    IncompatibleDefinition,
    NotResumable,
    RunExists,
    RunNotFound,
    RunTimeout,
    StoreUnavailable,
    TaskLoopError,
)
from taskloop.events import Event, Observer, notify
from taskloop.jsonvalue import dumps, require_lossless
from taskloop.models import ErrorInfo, RoundView, RunResult, RunSummary, RunView, TaskView
from taskloop.phases import (
    QUEUED_STATES,
    TERMINAL_RUN,
    UNRESUMABLE_ERRORS,
    EventKind,
    PhaseEvent,
    RunStatus,
    State,
    TaskRecord,
    TaskStatus,
)
from taskloop.scheduler import CANCEL_PREFIX, Dispatch, Planner
from taskloop.store import RedisStore, Snapshot
from taskloop.store import keys as k

log = logging.getLogger("taskloop.client")
_TERMINAL = {s.value for s in TERMINAL_RUN}
_WAIT_SLICE_S = 5.0


class _Outage:
    """How a waiting client rides out a Redis outage: back off, say so, and give up only after
    ``limit`` seconds without an answer (then StoreUnavailable)."""

    def __init__(self, limit: float, notice: Callable[[str], None]) -> None:
        self.limit = limit
        self.notice = notice
        self.since: float | None = None
        self.delay = 0.1

    def failed(self, exc: StoreUnavailable, deadline: float | None) -> None:
        now = clock.now()
        if self.since is None:
            self.since = now
            self.notice(f"Redis unreachable, retrying for up to {self.limit:g}s ({exc})")
        if now - self.since >= self.limit:
            raise exc
        if deadline is not None and now >= deadline:
            raise RunTimeout(f"gave up waiting: Redis has been unreachable for {now - self.since:.1f}s "
                             "and the wait's timeout passed") from exc
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 2.0)

    def recovered(self) -> None:
        if self.since is not None:
            self.notice(f"Redis reachable again after {clock.now() - self.since:.1f}s")
        self.since = None
        self.delay = 0.1


class RunHandle:
    """A started run. ``wait()`` blocks on the run's event stream until it ends."""

    def __init__(self, client: TaskLoop, run_id: str, known: bool = False) -> None:
        self.client = client
        self.run_id = run_id
        self.known = known  # start() just wrote the run: wait() need not look it up first

    def __repr__(self) -> str:
        return f"<RunHandle {self.run_id}>"

    def wait(self, timeout: float | None = None, on_event: Observer | None = None) -> RunResult:
        return self.client.wait(self.run_id, timeout=timeout, on_event=on_event, known=self.known)

    def inspect(self) -> RunView:
        return self.client.inspect(self.run_id)

    def result(self) -> RunResult | None:
        return self.client.result(self.run_id)

    def cancel(self, reason: str = "cancelled") -> CancelResult:
        return self.client.cancel(self.run_id, reason)


@dataclasses.dataclass(frozen=True)
class CancelResult:
    run_id: str
    cancelled: bool
    status: str
    message: str


class TaskLoop:
    """Entry point for services: ``TaskLoop()`` reads TASKLOOP_REDIS_URL / TASKLOOP_BROKER_URL
    (or celeryconfig.py); pass URLs to override."""

    def __init__(
        self,
        redis_url: str | None = None,
        broker_url: str | None = None,
        *,
        app: Celery | None = None,
        config: Settings | None = None,
    ) -> None:
        base = config or settings()
        if redis_url or broker_url:
            base = dataclasses.replace(
                base,
                redis_url=redis_url or base.redis_url,
                broker_url=broker_url or redis_url or base.broker_url,
            )
        self.settings = base
        self.store = RedisStore(base.redis_url)
        self._app = app
        self._sender: PhaseSender | None = None
        self._observers: list[Observer] = []

    @property
    def app(self) -> Celery:
        if self._app is None:
            self._app = make_app(self.settings)
        return self._app

    def send(self, workflow: Workflow, run_id: str, dispatch: Dispatch) -> None:
        """Send one phase message (through a producer this client keeps)."""
        if self._sender is None:
            self._sender = PhaseSender(self.app)
        self._sender(workflow, run_id, dispatch)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self.store.close()

    def observe(self, fn: Observer) -> None:
        """Call ``fn(event)`` for every event of the runs this client waits for."""
        if not callable(fn):
            raise DefinitionError("client.observe needs a callable (event) -> None")
        self._observers.append(fn)

    # starting -------------------------------------------------------------------------------
    def start(
        self,
        workflow: Workflow | str,
        input: Any = None,
        *,
        run_id: str | None = None,
        version: str | None = None,
    ) -> RunHandle:
        """Start a run (idempotent on ``run_id``: the same id twice gives the same run)."""
        wf = workflow if isinstance(workflow, Workflow) else REGISTRY.get(workflow, version)
        require_lossless(input, "run input")
        run_id = k.check_run_id(run_id) if run_id is not None else uuid.uuid4().hex
        now = clock.now()
        planner = Planner.for_new_run(wf, run_id, now, self.settings)
        planner.run_updates.update(
            wf=wf.name, ver=wf.version, fp=wf.fingerprint, input=dumps(input), created=repr(now)
        )
        planner.events.append(Event(type=ev.RUN_STARTED, at=now,
                                    data={"workflow": wf.name, "version": wf.version}))
        planner.settle()
        batch = planner.batch()
        batch.expect(k.K_RUN, "wf", None, "run exists")
        batch.index(now)
        if self.store.apply(batch) is None:
            for dispatch in planner.dispatches:
                self.send(wf, run_id, dispatch)
        else:
            self._restart(wf, run_id)
        return RunHandle(self, run_id, known=True)

    def _restart(self, wf: Workflow, run_id: str) -> None:
        """``start`` with an existing run id: same workflow -> re-send its queued phases."""
        snap = self._snapshot(run_id)
        if (snap.run.get("wf"), snap.run.get("ver")) != (wf.name, wf.version):
            raise RunExists(
                f"run_id {run_id!r} already belongs to workflow {snap.run.get('wf')} "
                f"v{snap.run.get('ver')}; use another run_id (or none for a generated one)"
            )
        for record in snap.tasks().values():
            if record.state in QUEUED_STATES and record.phase is not None:
                # Duplicates are harmless: the first delivery begins, the other is refused as stale.
                self.send(wf, run_id, Dispatch(record.key, record.phase, record.round, record.token))

    # reading --------------------------------------------------------------------------------
    def _snapshot(self, run_id: str, data_fields: list[str] | None = None) -> Snapshot:
        snap = self.store.snapshot(run_id, data_fields or [])
        if snap is None:
            raise RunNotFound(run_id)
        return snap

    def wait(self, run_id: str, timeout: float | None = None, on_event: Observer | None = None,
             known: bool = False, on_notice: Callable[[str], None] | None = None) -> RunResult:
        """Block until the run ends and return its result. Without observers it blocks on the run's
        end marker (one wake-up); with observers it reads every event as it is appended.
        ``known``: the run is known to exist (a handle from start), skip looking it up first.

        A Redis outage shorter than ``TASKLOOP_WAIT_OUTAGE_S`` (30 s) is ridden out with backoff
        (``on_notice`` hears about it); the wait keeps its place in the event stream."""
        deadline = None if timeout is None else clock.now() + timeout
        notice = on_notice or (lambda message: log.warning("%s", message))
        outage = _Outage(self.settings.wait_outage_s, notice)
        status: str | None = "running" if known else None
        while status is None:
            try:
                status = self.store.run_fields(run_id, "status")[0]
                if status is None:
                    raise RunNotFound(run_id)
            except StoreUnavailable as exc:
                outage.failed(exc, deadline)
        outage.recovered()
        observers = [*self._observers, *([on_event] if on_event else [])]
        last = "0-0"
        failures: list[dict[str, str]] = []
        while status not in _TERMINAL:
            remaining = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, deadline - clock.now())
            if remaining <= 0:
                raise RunTimeout(
                    f"run {run_id} did not finish within {timeout}s (status {status}); it keeps running: "
                    "wait again, or look at it with `taskloop inspect`"
                )
            try:
                if not observers:
                    if self.store.block_end(run_id, int(remaining * 1000)):
                        break
                    events = []
                else:
                    events = self.store.block_events(run_id, last, int(remaining * 1000))
                if events:
                    last = events[-1].id or last
                    failures += notify(observers, events)
                    if any(e.type == ev.RUN_FINISHED for e in events):
                        break
                else:
                    (status,) = self.store.run_fields(run_id, "status")
                    if status is None:
                        raise RunNotFound(run_id)
                outage.recovered()
            except StoreUnavailable as exc:
                outage.failed(exc, deadline)
        while True:
            try:
                result = self.result(run_id)
                break
            except StoreUnavailable as exc:
                outage.failed(exc, deadline)
        assert result is not None
        if failures:
            result = result.model_copy(update={"observer_errors": [*result.observer_errors, *failures]})
        return result

    def result(self, run_id: str) -> RunResult | None:
        """The result of a finished run, or None while it is still going."""
        snap = self.store.snapshot_with_values(run_id)
        if snap is None:
            raise RunNotFound(run_id)
        status = snap.run.get("status")
        if status not in _TERMINAL:
            return None
        tasks = snap.tasks()
        values = {key: json.loads(snap.data.get(k.value_field(key)) or "null")
                  for key, rec in tasks.items() if rec.status is TaskStatus.DONE}
        observer_errors: list[dict[str, Any]] = []
        if int(snap.run.get("stat:observer_errors", 0)):
            observer_errors = [e.data or {} for e in self.store.events(run_id) if e.type == ev.OBSERVER_ERROR]
        return RunResult(
            run_id=run_id,
            status=status,
            termination_code=snap.run.get("term"),
            values=values,
            errors=_errors(tasks),
            usage=RedisStore.decode_usage(snap.run),
            observer_errors=observer_errors,
        )

    def inspect(self, run_id: str) -> RunView:
        """Everything recorded about a run, including every round's output and check."""
        snap = self._snapshot(run_id)
        tasks = snap.tasks()
        data = self.store.data_matching(run_id, "")
        views = {key: _task_view(rec, data) for key, rec in tasks.items()}
        run = snap.run
        return RunView(
            run_id=run_id,
            workflow=run["wf"],
            version=run["ver"],
            status=run.get("status", "running"),
            termination_code=run.get("term"),
            input=json.loads(run.get("input", "null")),
            created_at=float(run["created"]),
            finished_at=float(run["finished"]) if "finished" in run else None,
            usage=RedisStore.decode_usage(run),
            tasks=views,
            stats={name.removeprefix("stat:"): int(v) for name, v in run.items() if name.startswith("stat:")},
        )

    def events(self, run_id: str, after: str | None = None) -> list[Event]:
        """The run's events in order (optionally only those after the event id ``after``)."""
        found = self.store.events(run_id, after)
        if not found and self.store.snapshot(run_id) is None:
            raise RunNotFound(run_id)
        return found

    def runs(self, status: str | None = None, workflow: str | None = None, limit: int = 50) -> list[RunSummary]:
        """Recent runs, newest first, optionally filtered by status and workflow name."""
        found: list[RunSummary] = []
        offset, page = 0, max(limit, 100)
        while len(found) < limit:
            ids = self.store.run_ids(page, offset)
            if not ids:
                break
            offset += len(ids)
            hashes = self.store.run_hashes(ids)
            self.store.forget_runs([rid for rid, h in zip(ids, hashes, strict=True) if not h])
            for run_id, run in zip(ids, hashes, strict=True):
                if not run or (status and run.get("status") != status) or (workflow and run.get("wf") != workflow):
                    continue
                found.append(RunSummary(
                    run_id=run_id, workflow=run["wf"], version=run["ver"], status=run.get("status", "running"),
                    termination_code=run.get("term"), created_at=float(run["created"]),
                    finished_at=float(run["finished"]) if "finished" in run else None,
                ))
                if len(found) == limit:
                    break
        return found

    # control --------------------------------------------------------------------------------
    def cancel(self, run_id: str, reason: str = "cancelled") -> CancelResult:
        """Cancel a run: running phases see ctx.signal, nothing new starts, queued phases end
        cancelled; the run ends ``cancelled`` (termination ``aborted``) once nothing runs."""
        if not isinstance(reason, str) or not reason:
            raise DefinitionError("cancel: reason must be a non-empty string")
        while True:
            snap = self._snapshot(run_id)
            status = snap.run.get("status", "running")
            if status in _TERMINAL:
                message = f"run {run_id} already finished ({status}); nothing to cancel"
                return CancelResult(run_id, False, status, message)
            if snap.control is not None:
                return CancelResult(run_id, False, status, f"run {run_id} is already stopping ({snap.control})")
            wf = REGISTRY.get(snap.run["wf"], snap.run["ver"]) if _registered(snap) else None
            planner = Planner(wf or _graphless(snap), snap, clock.now(), self.settings)
            planner.control = CANCEL_PREFIX + reason
            planner.run_updates["ctl"] = planner.control
            planner.guard_all = True
            planner.settle()
            if self.store.apply(planner.batch()) is None:
                state = "cancelled" if planner.finished else "cancelling: running phases were signalled"
                return CancelResult(run_id, True, planner.status or status, f"run {run_id} {state}")

    def resume(self, run_id: str) -> RunHandle:
        """Replay the interrupted phases of a run that failed on a callback error (or a timeout, or a
        lost worker). Exhausted loops stay exhausted; a changed definition is refused."""
        while True:
            snap = self._snapshot(run_id)
            status = snap.run.get("status")
            if status != RunStatus.FAILED.value:
                raise NotResumable(f"run {run_id} is {status}; only a failed run can be resumed")
            wf = REGISTRY.get(snap.run["wf"], snap.run["ver"])
            if snap.run.get("fp") != wf.fingerprint:
                raise IncompatibleDefinition(
                    f"run {run_id} was started with another definition of workflow {wf.name} v{wf.version} "
                    f"(fingerprint {snap.run.get('fp')}, this process has {wf.fingerprint}); a run resumes only "
                    "under the definition it started with: restore it, or start a new run"
                )
            tasks = snap.tasks()  # CorruptRecord: refused before any callback runs
            failed = [r for r in tasks.values() if r.status is TaskStatus.FAILED]
            replayable = [r for r in failed if r.error is None or r.error.type not in UNRESUMABLE_ERRORS]
            if not replayable:
                why = "; ".join(f"task {r.key}: {r.error.message if r.error else 'failed'}" for r in failed)
                raise NotResumable(
                    f"run {run_id} has nothing to resume ({why}): an exhausted loop stays exhausted and a "
                    "spent budget stays spent; start a new run instead"
                )
            now = clock.now()
            planner = Planner(wf, snap, now, self.settings)
            planner.control = None
            planner.run_deletes += ["ctl", "term", "finished"]
            planner.revive = planner.guard_all = True
            planner.events.append(Event(type=ev.RUN_RESUMED, at=now, data={"tasks": [r.key for r in replayable]}))
            replay = {r.key for r in replayable}
            for key in wf.order:
                record = tasks[key]
                reopen = key in replay or record.status is TaskStatus.CANCELLED or (
                    record.status is TaskStatus.SKIPPED and record.reason != "condition")
                if reopen:
                    planner.move(key, PhaseEvent(EventKind.RESUME, now))
            planner.settle()
            if self.store.apply(planner.batch()) is None:
                for dispatch in planner.dispatches:
                    self.send(wf, run_id, dispatch)
                return RunHandle(self, run_id, known=True)

    def decide(self, run_id: str, key: str, action: str, actor: str, reason: str = "", value: Any = None) -> RunView:
        """Decide a gate: ``approve`` (continue), ``reject`` (run rejected), ``resume`` (pause/input)."""
        if action not in ("approve", "reject", "resume"):
            raise DefinitionError(f"decide: action must be 'approve', 'reject' or 'resume', got {action!r}")
        require_lossless(value, "run input", "$.value")
        while True:
            snap = self._snapshot(run_id)
            wf = REGISTRY.get(snap.run["wf"], snap.run["ver"])
            gate = wf.task(key)
            if not gate.is_gate:
                raise DefinitionError(f"decide: {key} is a {gate.kind.value}, not a gate")
            if gate.actors and actor not in gate.actors:
                raise DefinitionError(
                    f"decide: actor {actor!r} may not decide gate {key}; allowed: {list(gate.actors)}")
            if action == "resume" and gate.gate_kind == "approval":
                raise DefinitionError(f"decide: gate {key} is an approval gate; use approve or reject")
            record = snap.task(key)
            if record.state is not State.PAUSED:
                raise DefinitionError(
                    f"decide: gate {key} is not waiting for a decision (status {record.status.value})")
            now = clock.now()
            planner = Planner(wf, snap, now, self.settings)
            kind = EventKind.DENY if action == "reject" else EventKind.APPROVE
            planner.move(key, PhaseEvent(kind, now))
            if kind is EventKind.APPROVE:
                planner.data[k.value_field(key)] = dumps(value)
            planner.events.append(Event(type="gate", key=key, phase=action, at=now,
                                        data={"actor": actor, "reason": reason}))
            planner.settle()
            if self.store.apply(planner.batch()) is None:
                for dispatch in planner.dispatches:
                    self.send(wf, run_id, dispatch)
                return self.inspect(run_id)


def _registered(snap: Snapshot) -> bool:
    try:
        REGISTRY.get(snap.run["wf"], snap.run["ver"])
        return True
    except TaskLoopError:
        return False


def _graphless(snap: Snapshot) -> Workflow:
    from taskloop.executor import _stub_workflow

    return _stub_workflow(snap)


def _errors(tasks: dict[str, TaskRecord]) -> list[ErrorInfo]:
    failed = [r for r in tasks.values() if r.status is TaskStatus.FAILED and r.error is not None]
    failed.sort(key=lambda r: r.finished_at or 0.0)
    return [ErrorInfo(key=r.key, type=r.error.type, message=r.error.message, details=r.error.details)
            for r in failed if r.error is not None]


def _task_view(record: TaskRecord, data: dict[str, str]) -> TaskView:
    rounds: list[RoundView] = []
    if record.kind == "loop":
        for n in range(1, record.round + 1):
            output_raw = data.get(k.candidate_field(record.key, n))
            check_raw = data.get(k.check_field(record.key, n))
            phase = "complete" if check_raw is not None else "check" if output_raw is not None else "attempt"
            rounds.append(RoundView(
                round=n, phase=phase,
                output=json.loads(output_raw) if output_raw is not None else None,
                check=json.loads(check_raw) if check_raw is not None else None,
            ))
    value_raw = data.get(k.value_field(record.key))
    error = None
    if record.error is not None:
        error = ErrorInfo(key=record.key, type=record.error.type, message=record.error.message,
                          details=record.error.details)
    return TaskView(
        key=record.key, kind=record.kind, status=record.status.value,
        phase=record.phase.value if record.phase else None, round=record.round,
        attempts=record.attempts, value=json.loads(value_raw) if value_raw is not None else None,
        error=error, cache_hit=record.cache_hit, worker=record.worker,
        started_at=record.started_at, finished_at=record.finished_at, rounds=rounds,
    )


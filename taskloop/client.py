"""The client: start runs (by definition or by name), wait for them, inspect, list, cancel,
resume and decide gates. Reading a run needs only its id, never its definition."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from taskloop import clock, limits, starting
from taskloop import events as ev
from taskloop.app import SETTLE_TASK, START_TASK, PhaseSender, make_app
from taskloop.commit import commit
from taskloop.config import Settings, settings
from taskloop.definitions import NAME_PATTERN, REGISTRY, Workflow, is_text
from taskloop.errors import (
    DefinitionError,
    GateRefused,
    IncompatibleDefinition,
    InvalidInput,
    NotResumable,
    RunNotFound,
    RunTimeout,
    StoreUnavailable,
)
from taskloop.events import Event, Observer, notify
from taskloop.graph import step_of
from taskloop.jsonvalue import dumps, require_lossless, shown, text_problem
from taskloop.models import ErrorInfo, ExecView, RoundView, RunResult, RunSummary, RunView, TaskView, executions
from taskloop.phases import (
    TERMINAL_RUN,
    UNRESUMABLE_ERRORS,
    ErrorRecord,
    RunStatus,
    State,
    TaskKind,
    TaskRecord,
    TaskStatus,
)
from taskloop.scheduler import CANCEL_PREFIX, Planner
from taskloop.store import Applied, Batch, RedisStore, RunMeta, Snapshot
from taskloop.store import keys as k
from taskloop.store.meta import decode_usage

log = logging.getLogger("taskloop.client")
_TERMINAL = {s.value for s in TERMINAL_RUN}
_WAIT_SLICE_S = 5.0
_LIVE = [RunStatus.RUNNING.value, RunStatus.PENDING.value]


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
    """A started run. ``wait()`` blocks on the run's end marker until it ends."""

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
        self.store = RedisStore(base.redis_url, events_maxlen=base.events_maxlen)
        self._app = app
        self._sender: PhaseSender | None = None
        self._observers: list[Observer] = []

    @property
    def app(self) -> Celery:
        if self._app is None:
            self._app = make_app(self.settings)
        return self._app

    @property
    def send(self) -> PhaseSender:
        """The sender of phase messages (a producer from kombu's pool for each send)."""
        if self._sender is None:
            self._sender = PhaseSender(self.app, self.settings.redis_url, keep=False)
        return self._sender

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
        """Start a run. ``workflow`` is a definition, or a name: a workflow this process has not
        imported is recorded ``pending`` and planned by a worker that has it. The same ``run_id``
        with the same input returns the existing run; with another input it raises RunExists."""
        if isinstance(workflow, Workflow):
            started = starting.start_defined(self.store, self.send, workflow, input, run_id, self.settings)
            return RunHandle(self, started.run_id, known=True)
        if not isinstance(workflow, str) or not NAME_PATTERN.match(workflow):
            raise InvalidInput(f"start: workflow must be a workflow or its name ([A-Za-z0-9][A-Za-z0-9._-]*), "
                               f"got {shown(workflow)}")
        if version is not None and not is_text(version):
            raise InvalidInput(f"start: version must be None or a non-empty string, got {shown(version)}")
        if REGISTRY.has(workflow, version):
            defined = REGISTRY.get(workflow, version)
            started = starting.start_defined(self.store, self.send, defined, input, run_id, self.settings)
            return RunHandle(self, started.run_id, known=True)
        started = starting.record_pending(self.store, workflow, version, input, run_id, self.settings)
        if started.pending:
            self.app.send_task(START_TASK, args=[started.run_id], ignore_result=True,
                               shadow=f"{workflow}.start", argsrepr=started.run_id)
        return RunHandle(self, started.run_id, known=True)

    # reading --------------------------------------------------------------------------------
    def find(self, run_id: str) -> str:
        """The run id that ``run_id`` names: itself, or the one run whose id starts with it."""
        k.check_run_id(run_id)
        if self.store.hmget(run_id, [k.F_WORKFLOW])[0] is not None:
            return run_id
        matches = self.store.run_ids_with_prefix(run_id, limit=6)
        if len(matches) == 1:
            return matches[0]
        if matches:
            shown = ", ".join(sorted(matches)[:5])
            raise RunNotFound(run_id, f"the prefix {run_id!r} matches several runs ({shown}, ...); give more of the id")
        raise RunNotFound(run_id)

    def _meta(self, run_id: str) -> RunMeta:
        k.check_run_id(run_id)  # an id no run can have: InvalidInput (it is never sent to Redis)
        snap = self.store.snapshot(run_id, k.META_FIELDS)
        if not snap.exists:
            raise RunNotFound(run_id)
        return snap.meta()

    def status(self, run_id: str) -> str:
        """The run's status now: pending, running, waiting, or how it ended."""
        return self._meta(run_id).status.value

    def wait(self, run_id: str, timeout: float | None = None, on_event: Observer | None = None,
             known: bool = False, on_notice: Callable[[str], None] | None = None) -> RunResult:
        """Block until the run ends and return its result. Without observers it blocks on the run's
        end marker (one wake-up); with observers it reads every event as it is appended.
        ``known``: the run is known to exist (a handle from start), skip looking it up first.

        A Redis outage shorter than ``TASKLOOP_WAIT_OUTAGE_S`` (30 s) is ridden out with backoff
        (``on_notice`` hears about it); the wait keeps its place in the event stream."""
        k.check_run_id(run_id)
        deadline = None if timeout is None else clock.now() + timeout
        notice = on_notice or (lambda message: log.warning("%s", message))
        outage = _Outage(self.settings.wait_outage_s, notice)
        status: str | None = RunStatus.RUNNING.value if known else None
        while status is None:
            try:
                status = self._meta(run_id).stored_status
            except StoreUnavailable as exc:
                outage.failed(exc, deadline)
        outage.recovered()
        observers = [*self._observers, *([on_event] if on_event else [])]
        last = "0-0"
        failures: list[dict[str, str]] = []
        # Observers hear every event of the run, also when it ended before this wait began.
        while status not in _TERMINAL or observers:
            remaining = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, deadline - clock.now())
            if remaining <= 0 and status not in _TERMINAL:
                raise RunTimeout(
                    f"run {run_id} did not finish within {timeout}s (status {status}); it keeps running: "
                    "wait again, or look at it with `taskloop inspect`"
                )
            try:
                if not observers:
                    ended = self.store.block_end(run_id, int(remaining * 1000))
                    events = []
                else:  # an ended run's events are all there: read them without blocking
                    block_ms = 1 if status in _TERMINAL else int(remaining * 1000)
                    events = self.store.block_events(run_id, last, block_ms)
                    ended = any(e.type == ev.RUN_FINISHED for e in events)
                outage.recovered()
                if events:
                    last = events[-1].entry_id or last
                    failures += notify(observers, events)
                if ended:
                    status = self._meta(run_id).stored_status
                    if status in _TERMINAL:
                        break
                    continue  # it ended once, and was resumed since: its later events follow
                if not events:
                    if status in _TERMINAL:
                        break  # read to the end (its last events expired or were trimmed)
                    status = self._meta(run_id).stored_status
            except StoreUnavailable as exc:
                outage.failed(exc, deadline)
        while True:
            try:
                result = self.result(run_id)
                outage.recovered()
                break
            except StoreUnavailable as exc:
                outage.failed(exc, deadline)
        assert result is not None
        if failures:
            result = result.model_copy(update={"observer_errors": [*result.observer_errors, *failures]})
        return result

    def result(self, run_id: str) -> RunResult | None:
        """The result of a finished run, or None while it is still going."""
        meta = self._meta(run_id)
        if not meta.terminal:
            return None
        snap = Snapshot(run_id, self.store.scan_fields(run_id, k.TASK_PREFIX),
                        loader=lambda names: self.store.hmget(run_id, names))
        tasks = _records(snap)
        done = [key for key, rec in tasks.items() if rec.status is TaskStatus.DONE]
        snap.ensure([*(k.value_field(key) for key in done), *k.USAGE_FIELDS, k.stat_field("observer_errors")])
        values = {key: snap.json(k.value_field(key)) for key in done}
        observer_errors: list[dict[str, Any]] = []
        if int(snap.get(k.stat_field("observer_errors")) or 0):
            observer_errors = [e.data or {} for e in self.store.events(run_id) if e.type == ev.OBSERVER_ERROR]
        return RunResult(
            run_id=run_id,
            status=meta.stored_status,
            termination_code=meta.termination.value if meta.termination else None,
            values=values,
            errors=_errors(tasks, meta.error),
            usage=decode_usage(snap.fields, tasks.values()),
            observer_errors=observer_errors,
        )

    def inspect(self, run_id: str) -> RunView:
        """Everything recorded about a run, including every round's output, check and executions."""
        k.check_run_id(run_id)
        fields: dict[str, str | None] = dict(self.store.all_fields(run_id))
        if not fields:
            raise RunNotFound(run_id)
        snap = Snapshot(run_id, fields)
        meta = snap.meta()
        tasks = _records(snap)
        execs = executions(self.store.events(run_id))
        ordered = sorted(tasks.values(), key=lambda r: (r.started_at is None, r.started_at or 0.0, r.key))
        views = {rec.key: _task_view(rec, fields, execs.get(rec.key, [])) for rec in ordered}
        stats = {name.removeprefix("s:"): int(v) for name, v in fields.items() if name.startswith("s:") and v}
        return RunView(
            run_id=run_id,
            workflow=meta.workflow,
            version=meta.version,
            status=meta.status.value,
            termination_code=meta.termination.value if meta.termination else None,
            input=snap.json(k.F_INPUT),
            state=snap.json(k.F_STATE),
            created_at=meta.created,
            finished_at=meta.finished,
            usage=decode_usage(fields, tasks.values()),
            tasks=views,
            stats=stats,
            error=_run_error(meta.error),
            control=meta.control,
        )

    def events(self, run_id: str, after: str | None = None) -> list[Event]:
        """The run's events in order (optionally only those after the event id ``after``)."""
        k.check_run_id(run_id)
        if after is not None and not isinstance(after, str):
            raise InvalidInput(f"events: after must be the id of an event of this run, got {shown(after)}")
        try:
            found = self.store.events(run_id, after)
        except ValueError as exc:
            raise InvalidInput(f"events: after must be the id of an event of this run ({exc})") from None
        if not found and self.store.hmget(run_id, [k.F_WORKFLOW])[0] is None:
            raise RunNotFound(run_id)
        return found

    def runs(self, status: str | None = None, workflow: str | None = None, limit: int = 50) -> list[RunSummary]:
        """Recent runs, newest first, optionally filtered by status and workflow name."""
        if status is not None and status not in {s.value for s in RunStatus}:
            raise InvalidInput(f"runs: status must be one of {sorted(s.value for s in RunStatus)}, got {status!r}")
        found: list[RunSummary] = []
        offset, page = 0, max(limit, 100)
        while len(found) < limit:
            ids = self.store.run_ids(page, offset)
            if not ids:
                break
            offset += len(ids)
            rows = self.store.run_metas(ids)
            gone = [rid for rid, row in zip(ids, rows, strict=True) if row[1] is None]
            self.store.forget_runs(gone)
            for run_id, row in zip(ids, rows, strict=True):
                if row[1] is None:
                    continue
                meta = RunMeta.from_fields(run_id, dict(zip(k.META_FIELDS, row, strict=True)))
                if (status and meta.status.value != status) or (workflow and meta.workflow != workflow):
                    continue
                found.append(RunSummary(
                    run_id=run_id, workflow=meta.workflow, version=meta.version, status=meta.status.value,
                    termination_code=meta.termination.value if meta.termination else None,
                    created_at=meta.created, finished_at=meta.finished,
                ))
                if len(found) == limit:
                    break
        return found

    # control --------------------------------------------------------------------------------
    def cancel(self, run_id: str, reason: str = "cancelled") -> CancelResult:
        """Cancel a run: one small write sets its control flag. Running phases see ctx.signal,
        nothing new starts, queued phases end cancelled as their messages arrive, and the run ends
        ``cancelled`` (termination ``aborted``) once nothing runs."""
        if not is_text(reason):
            raise InvalidInput(f"cancel: reason must be a non-empty string, got {shown(reason)}")
        k.check_run_id(run_id)
        reason = reason[:500]
        control = CANCEL_PREFIX + reason
        batch = Batch(run_id).exists(k.F_WORKFLOW, "run exists").expect(k.F_CONTROL, None, "control")
        batch.one_of(k.F_STATUS, _LIVE, "status")
        batch.set(k.F_CONTROL, control)
        batch.event(Event(type=ev.RUN_CANCEL, at=clock.now(), data={"reason": reason}))
        result = self.store.apply(batch)
        if not isinstance(result, Applied):
            if result.label == "run exists":
                raise RunNotFound(run_id)
            meta = self._meta(run_id)
            if meta.terminal:
                return CancelResult(run_id, False, meta.status.value,
                                    f"run {run_id} already finished ({meta.status.value}); nothing to cancel")
            return CancelResult(run_id, False, meta.status.value, f"run {run_id} is already stopping ({meta.control})")
        meta = self._meta(run_id)
        if meta.stored_status == RunStatus.PENDING.value:
            self.app.send_task(START_TASK, args=[run_id], ignore_result=True)  # ends it cancelled
        elif meta.paused:
            self._settle_gates(run_id, meta)
        return CancelResult(run_id, True, meta.status.value,
                            f"run {run_id} cancelling: running phases were signalled")

    def _settle_gates(self, run_id: str, meta: RunMeta) -> None:
        """End the paused gates of a cancelled run here when this process has the definition;
        else ask a worker (and the reconciler does it too if both fail)."""
        if not REGISTRY.has(meta.workflow, meta.version or None):
            self.app.send_task(SETTLE_TASK, args=[run_id], ignore_result=True)
            return
        workflow = REGISTRY.get(meta.workflow, meta.version or None)

        def plan(view: Snapshot) -> Planner:
            planner = Planner(workflow, view, clock.now(), self.settings)
            planner.cancel_gates()
            planner.settle()
            return planner

        commit(self.store, plan, self.store.snapshot(run_id, [k.F_CONTROL]), self.send)

    def resume(self, run_id: str) -> RunHandle:
        """Replay the interrupted phases of a run that failed on a callback error (or a timeout, or a
        lost worker). Exhausted loops stay exhausted; a changed definition is refused."""
        meta = self._meta(run_id)
        if meta.stored_status != RunStatus.FAILED.value:
            raise NotResumable(f"run {run_id} is {meta.status.value}; only a failed run can be resumed")
        wf = REGISTRY.get(meta.workflow, meta.version)
        if meta.fingerprint != wf.fingerprint:
            raise IncompatibleDefinition(
                f"run {run_id} was started with another definition of workflow {wf.name} v{wf.version} "
                f"(fingerprint {meta.fingerprint}, this process has {wf.fingerprint}); a run resumes only "
                "under the definition it started with: restore it, or start a new run"
            )

        def plan(view: Snapshot) -> Planner:
            if view.get(k.F_STATUS) != RunStatus.FAILED.value:
                raise NotResumable(f"run {run_id} is no longer failed")
            planner = Planner(wf, view, clock.now(), self.settings)
            keys = planner.record_keys()
            view.ensure([k.task_field(key) for key in keys])
            failed = [r for r in (view.record(key) for key in keys) if r and r.status is TaskStatus.FAILED]
            replayable = {r.key for r in failed if r.error is None or r.error.type not in UNRESUMABLE_ERRORS}
            if not replayable:
                why = "; ".join(f"task {r.key}: {r.error.message if r.error else 'failed'}" for r in failed)
                raise NotResumable(
                    f"run {run_id} has nothing to resume ({why}): an exhausted loop stays exhausted and a "
                    "spent budget stays spent; start a new run instead"
                )
            planner.resume(replayable)
            return planner

        commit(self.store, plan, self.store.snapshot(run_id, [k.F_STATUS, k.F_CONTROL]), self.send)
        return RunHandle(self, run_id, known=True)

    def decide(self, run_id: str, key: str, action: str, actor: str, reason: str = "", value: Any = None) -> RunView:
        """Decide a gate: ``approve`` (continue), ``reject`` (run rejected), ``resume`` (pause/input)."""
        if action not in ("approve", "reject", "resume"):
            raise GateRefused(f"decide: action must be 'approve', 'reject' or 'resume', got {action!r}")
        if not isinstance(key, str):
            raise GateRefused(f"decide: key must be the key of a gate (a str), got {shown(key)}")
        for what, text in (("actor", actor), ("reason", reason)):
            if not isinstance(text, str) or text_problem(text):
                raise InvalidInput(f"decide: {what} must be a string, got {shown(text)}")
        require_lossless(value, "gate value", InvalidInput, "$.value")
        value_raw = dumps(value)
        limits.require_size(value_raw, f"the value for gate {key}", self.settings.max_gate_value_bytes,
                            limits.GATE_VALUE_ENV)
        reason, actor = limits.cut(reason, 500), limits.cut(actor, 200)  # recorded in the gate event
        meta = self._meta(run_id)
        wf = REGISTRY.get(meta.workflow, meta.version)
        gate = wf.lookup(key)
        if gate is None or not gate.is_gate:
            what = f"a {gate.kind.value}" if gate else "not a task of this workflow"
            raise GateRefused(f"decide: {key} is {what}, not a gate; gates: {list(wf.gates)}")
        if gate.actors and actor not in gate.actors:
            raise GateRefused(f"decide: actor {actor!r} may not decide gate {key}; allowed: {list(gate.actors)}")
        if action == "resume" and gate.gate_kind == "approval":
            raise GateRefused(f"decide: gate {key} is an approval gate; use approve or reject")

        def plan(view: Snapshot) -> Planner:
            record = view.record(key)
            if record is None or record.state is not State.PAUSED:
                status = record.status.value if record else "missing"
                raise GateRefused(f"decide: gate {key} is not waiting for a decision (status {status})")
            now = clock.now()
            planner = Planner(wf, view, now, self.settings)
            gate_event = Event(type="gate", key=key, phase=action, at=now, data={"actor": actor, "reason": reason})
            planner.decide(key, action != "reject", value_raw, gate_event)
            return planner

        commit(self.store, plan, self.store.snapshot(run_id, [k.task_field(key), k.F_CONTROL]), self.send)
        return self.inspect(run_id)


def _json(raw: str | None) -> Any:
    return json.loads(raw) if raw is not None else None


def _records(snap: Snapshot) -> dict[str, TaskRecord]:
    keys = [k.key_of_task_field(name) for name in snap.fields if name.startswith(k.TASK_PREFIX)]
    found = {key: snap.record(key) for key in keys}
    return {key: rec for key, rec in found.items() if rec is not None}


def _run_error(error: ErrorRecord | None) -> ErrorInfo | None:
    if error is None:
        return None
    return ErrorInfo(key="", type=error.type, message=error.message, details=error.details)


def _errors(tasks: dict[str, TaskRecord], run_error: ErrorRecord | None) -> list[ErrorInfo]:
    failed = [r for r in tasks.values() if r.status is TaskStatus.FAILED and r.error is not None]
    failed.sort(key=lambda r: r.finished_at or 0.0)
    found = [ErrorInfo(key=r.key, type=r.error.type, message=r.error.message, details=r.error.details)
             for r in failed if r.error is not None]
    run = _run_error(run_error)
    return [run, *found] if run is not None else found


def _task_view(record: TaskRecord, data: dict[str, str | None], execs: list[ExecView]) -> TaskView:
    rounds: list[RoundView] = []
    if record.kind is TaskKind.LOOP:
        for n in range(1, record.round + 1):
            output_raw = data.get(k.candidate_field(record.key, n))
            check_raw = data.get(k.check_field(record.key, n))
            phase = "complete" if check_raw is not None else "check" if output_raw is not None else "attempt"
            notes = {p: json.loads(raw) for p in ("attempt", "check")
                     if (raw := data.get(k.notes_field(record.key, n, p))) is not None}
            rounds.append(RoundView(
                round=n, phase=phase,
                output=json.loads(output_raw) if output_raw is not None else None,
                check=json.loads(check_raw) if check_raw is not None else None,
                execs=[e for e in execs if e.round == n], notes=notes,
            ))
    value_raw = data.get(k.value_field(record.key))
    error = None
    if record.error is not None:
        error = ErrorInfo(key=record.key, type=record.error.type, message=record.error.message,
                          details=record.error.details)
    return TaskView(
        key=record.key, kind=record.kind.value, status=record.status.value,
        phase=record.phase.value if record.phase else None, round=record.round,
        attempts=record.attempts, value=json.loads(value_raw) if value_raw is not None else None,
        error=error, cache_hit=record.cache_hit, worker=record.worker,
        started_at=record.started_at, finished_at=record.finished_at, reason=record.reason, rounds=rounds,
        step=step_of(record.key), activation=_json(data.get(k.activation_field(record.key))),
        execs=[] if record.kind is TaskKind.LOOP else execs,
    )


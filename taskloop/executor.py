"""Executes one phase message on a worker: admit, begin, run the callback, record, dispatch.

The steps, each a guarded write that re-plans on conflict:

1. read a snapshot of the run; refuse a message whose (round, phase, token) is not current;
2. on the first execution of an activation, evaluate ``condition`` (attempt 0);
3. BEGIN: the record moves to running, one attempt is admitted against the budget, a lease is
   taken (one write);
4. run the user callback with its context, while the watcher sets ``ctx.signal`` on cancel;
5. record the outcome and everything the scheduler decides with it (one write), then send
   the Celery messages of the phases it dispatched.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from taskloop import clock
from taskloop import events as ev
from taskloop.config import Settings
from taskloop.context import LoopContext, Signal, TaskContext
from taskloop.definitions import REGISTRY, Task, Workflow
from taskloop.errors import Cancelled, IncompatibleDefinition, TaskLoopError, WorkflowNotRegistered
from taskloop.events import Event, notify
from taskloop.jsonvalue import dumps, lossless_problem
from taskloop.options import LoopCheck
from taskloop.phases import ErrorRecord, EventKind, Phase, PhaseEvent, State, TaskRecord
from taskloop.scheduler import Dispatch, Planner
from taskloop.store import Batch, RedisStore, Snapshot
from taskloop.store import keys as k
from taskloop.watcher import Watcher

log = logging.getLogger("taskloop.executor")

Sender = Callable[[Workflow, str, Dispatch], None]
MAX_REPLANS = 50
_QUEUED_OF = {Phase.ATTEMPT: State.QUEUED_ATTEMPT, Phase.CHECK: State.QUEUED_CHECK, Phase.RUN: State.QUEUED_RUN}


@dataclass(frozen=True)
class Outcome:
    """What a callback produced, as the event to apply plus the data to record with it."""

    kind: EventKind
    data: dict[str, str]
    error: ErrorRecord | None = None
    feedback: str | None = None
    cancelled: bool = False


def error_record(exc: BaseException) -> ErrorRecord:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ErrorRecord(type=type(exc).__name__, message=str(exc), details={"traceback": tb})


def invoke(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a sync or async callback and return its result."""
    result = fn(*args)
    if inspect.isawaitable(result):
        async def wait() -> Any:
            return await result
        result = asyncio.run(wait())
    return result


class _Usage:
    def __init__(self, store: RedisStore, run_id: str) -> None:
        self.store = store
        self.run_id = run_id

    def report(self, counts: dict[str, int]) -> None:
        self.store.incr_usage(self.run_id, counts)

    def report_once(self, receipt: str, counts: dict[str, int]) -> bool:
        batch = Batch(self.run_id).expect(k.K_DATA, k.receipt_field(receipt), None, "receipt")
        batch.hset(k.K_DATA, k.receipt_field(receipt), "1")
        for name, amount in counts.items():
            batch.hincr(k.K_RUN, f"u:{name}", amount)
        return self.store.apply(batch) is None


class Executor:
    """Runs phase messages for one worker process."""

    def __init__(self, store: RedisStore, settings: Settings, send: Sender, worker: str) -> None:
        self.store = store
        self.settings = settings
        self.send = send
        self.worker = worker
        self.watcher = Watcher(store, settings.watch_interval_s)

    # entry point ----------------------------------------------------------------------------
    def handle(self, phase: Phase, run_id: str, key: str, round: int, token: int) -> str:
        """Process one message. Returns what happened: committed, skipped, stale, dropped, ..."""
        fields = self._data_fields(phase, key, round)
        for _ in range(MAX_REPLANS):
            snap = self.store.snapshot(run_id, fields)
            if snap is None:
                log.error("run %s not found (never started or expired); dropping %s %s round %s",
                          run_id, phase.value, key, round)
                self.store.incr_stat("dropped_unknown_run")
                return "dropped"
            if key not in snap.raw_tasks:
                log.error("run %s has no task %r; dropping message", run_id, key)
                self.store.incr_stat("dropped_unknown_task")
                return "dropped"
            record = snap.task(key)
            if record.state is not _QUEUED_OF[phase] or record.round != round or record.token != token:
                return self._stale(snap, record, phase, round, token)
            try:
                workflow = self._workflow(snap)
            except TaskLoopError as exc:
                result = self._commit_event(None, snap, key, PhaseEvent(
                    EventKind.FAIL, clock.now(), error=ErrorRecord(type=type(exc).__name__, message=str(exc))))
                if result is not None:
                    return result
                continue
            if snap.control is not None:
                result = self._commit_event(workflow, snap, key, PhaseEvent(EventKind.CANCEL, clock.now()))
                if result is not None:
                    return result
                continue
            task = workflow.task(key)
            if not record.prepared and task.condition is not None:
                result = self._condition(workflow, task, snap)
                if result == "replan":
                    continue
                if result is not None:
                    return result
            begun = self._begin(workflow, task, snap, record)
            if begun == "replan":
                continue
            if isinstance(begun, str):
                return begun
            return self._run(workflow, task, snap, begun)
        raise RuntimeError(f"could not record {phase.value} of {run_id}/{key}: too many conflicts")

    # steps ----------------------------------------------------------------------------------
    def _data_fields(self, phase: Phase, key: str, round: int) -> list[str]:
        if phase is Phase.CHECK:
            return [k.candidate_field(key, round)]
        if phase is Phase.ATTEMPT and round > 1:
            return [k.check_field(key, round - 1)]
        return []

    def _workflow(self, snap: Snapshot) -> Workflow:
        name, version, fingerprint = snap.run["wf"], snap.run["ver"], snap.run.get("fp")
        try:
            workflow = REGISTRY.get(name, version)
        except WorkflowNotRegistered as exc:
            raise WorkflowNotRegistered(f"{exc} [worker {self.worker}]") from None
        if fingerprint and fingerprint != workflow.fingerprint:
            raise IncompatibleDefinition(
                f"run {snap.run_id} was started with another definition of workflow {name} v{version} "
                f"(fingerprint {fingerprint}, this worker has {workflow.fingerprint}); deploy the same "
                "definition to every worker, or give the changed workflow a new version"
            )
        return workflow

    def _stale(self, snap: Snapshot, record: TaskRecord, phase: Phase, round: int, token: int) -> str:
        reason = (f"message for {phase.value} round {round} token {token} does not match the record "
                  f"({record.state.value} round {record.round} token {record.token})")
        log.info("run %s task %s: refused stale delivery: %s", snap.run_id, record.key, reason)
        self.store.incr_stat("stale_deliveries", run_id=snap.run_id)
        batch = Batch(snap.run_id).event(Event(type=ev.STALE, key=record.key, round=round, phase=phase.value,
                                               at=clock.now(), data={"token": token, "reason": reason}))
        self.store.apply(batch)
        return "stale"

    def _commit_event(self, workflow: Workflow | None, snap: Snapshot, key: str, event: PhaseEvent) -> str | None:
        """Apply one event with full settling. None means: the snapshot was stale, read again."""
        if workflow is None:  # the definition is missing: fail this task and stop the run
            workflow = _stub_workflow(snap)
        planner = Planner(workflow, snap, event.at, self.settings)
        planner.move(key, event)
        planner.settle()
        return self._commit(planner, workflow)

    def _commit(self, planner: Planner, workflow: Workflow) -> str | None:
        conflict = self.store.apply(planner.batch())
        if conflict is not None:
            log.debug("run %s: conflict on %s, re-planning", planner.run_id, conflict.label)
            return None
        for dispatch in planner.dispatches:
            self.send(workflow, planner.run_id, dispatch)
        self._observe(workflow, planner.run_id, planner.events)
        return "committed"

    def _observe(self, workflow: Workflow, run_id: str, events: list[Event]) -> None:
        if not workflow.observers:
            return
        stamped = [e.model_copy(update={"run_id": run_id}) for e in events]
        failures = notify(workflow.observers, stamped)
        if failures:
            batch = Batch(run_id)
            for failure in failures:
                batch.event(Event(type=ev.OBSERVER_ERROR, at=clock.now(), data=failure))
            self.store.apply(batch)
            self.store.incr_stat("observer_errors", len(failures), run_id=run_id)

    def _context(self, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord,
                 signal: Signal, attempt: int, phase: Phase | None) -> TaskContext:
        cache: dict[str, Any] = {}

        def load_value(dep: str) -> Any:
            if not cache:
                raws = self.store.data(snap.run_id, [k.value_field(d) for d in task.after])
                cache.update({d: json.loads(raw) if raw is not None else None
                              for d, raw in zip(task.after, raws, strict=True)})
            return cache[dep]

        common: dict[str, Any] = dict(
            run_id=snap.run_id, workflow=workflow.name, key=task.key, input=json.loads(snap.run["input"]),
            attempt=attempt, signal=signal, after=task.after, load_value=load_value,
            usage=_Usage(self.store, snap.run_id),
        )
        if phase is None:  # condition or cache key: evaluated with attempt 0, before any phase
            return TaskContext(idempotency_key=f"{snap.run_id}/{task.key}/condition", **common)
        idempotency_key = f"{snap.run_id}/{task.key}/{record.round}/{phase.value}"
        if task.is_loop:
            return LoopContext(round=record.round, phase=phase.value, idempotency_key=idempotency_key, **common)
        return TaskContext(idempotency_key=idempotency_key, **common)

    def _condition(self, workflow: Workflow, task: Task, snap: Snapshot) -> str | None:
        assert task.condition is not None
        ctx = self._context(workflow, task, snap, snap.task(task.key), Signal(), 0, None)
        try:
            keep = invoke(task.condition, ctx)
        except Exception as exc:
            event = PhaseEvent(EventKind.FAIL, clock.now(), error=error_record(exc))
        else:
            if keep:
                return None
            event = PhaseEvent(EventKind.SKIP, clock.now())
        return self._commit_event(workflow, snap, task.key, event) or "replan"

    def _begin(
        self, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord
    ) -> str | tuple[Snapshot, TaskRecord]:
        now = clock.now()
        planner = Planner(workflow, snap, now, self.settings)
        begun = planner.move(task.key, PhaseEvent(EventKind.BEGIN, now, worker=self.worker,
                                                  timeout_ms=task.timeout_ms))
        consumed = begun.attempts - record.attempts
        planner.usage["attempts"] = consumed
        budget = workflow.budget
        if budget is not None:
            if budget.attempts is not None and consumed:
                planner.caps.append(("u:attempts", budget.attempts, consumed, "budget:attempts"))
            if budget.input_tokens is not None:
                planner.caps.append(("u:input", budget.input_tokens, 1, "budget:input_tokens"))
            if budget.output_tokens is not None:
                planner.caps.append(("u:output", budget.output_tokens, 1, "budget:output_tokens"))
        planner.events.append(Event(type=ev.EXEC, key=task.key, round=begun.round, phase=_phase(begun),
                                    attempt=begun.attempts, at=now,
                                    data={"worker": self.worker, "replay": begun.execs > 1}))
        conflict = self.store.apply(planner.batch())
        if conflict is None:
            return Snapshot(snap.run_id, snap.run, {**snap.raw_tasks, task.key: begun.dump()}, snap.data), begun
        if conflict.label.startswith("budget:"):
            limit = getattr(budget, conflict.label.removeprefix("budget:"))
            error = ErrorRecord(
                type="WorkflowBudgetExceeded",
                message=(f"workflow {workflow.name} spent its budget of {limit} "
                         f"{conflict.label.removeprefix('budget:').replace('_', ' ')} before "
                         f"{task.key} round {record.round} could start; raise the Budget or need fewer rounds"),
                details={"budget": conflict.label.removeprefix("budget:"), "limit": limit},
            )
            failed = self._commit_event(workflow, snap, task.key, PhaseEvent(EventKind.FAIL, now, error=error))
            return failed or "replan"
        return "replan"

    def _run(self, workflow: Workflow, task: Task, snap: Snapshot, begun: tuple[Snapshot, TaskRecord]) -> str:
        snap, record = begun
        phase = record.phase
        assert phase is not None
        signal = Signal()
        ctx = self._context(workflow, task, snap, record, signal, record.attempts, phase)
        lease_s = self.settings.running_lease_s
        with self.watcher.watch(snap.run_id, task.key, snap.raw_tasks[task.key], signal, record.deadline, lease_s):
            outcome = self._call(task, phase, ctx, snap)
        return self._record(workflow, task, snap, record, outcome, signal)

    def _call(self, task: Task, phase: Phase, ctx: TaskContext, snap: Snapshot) -> Outcome:
        key, round = task.key, getattr(ctx, "round", 0)
        try:
            if phase is Phase.CHECK:
                assert task.check is not None
                raw = snap.data[k.candidate_field(key, round)]
                check = LoopCheck.coerce(invoke(task.check, ctx, json.loads(raw) if raw else None))
                check_raw = dumps(check.model_dump())
                if check.done:
                    return Outcome(EventKind.ACCEPT, {k.check_field(key, round): check_raw,
                                                      k.value_field(key): raw or "null"})
                return Outcome(EventKind.REJECT, {k.check_field(key, round): check_raw}, feedback=check.feedback)
            if phase is Phase.ATTEMPT:
                assert task.attempt is not None
                previous = snap.data.get(k.check_field(key, round - 1)) if round > 1 else None
                feedback = json.loads(previous)["feedback"] if previous else None
                result = invoke(task.attempt, ctx, feedback)
                kind, field = EventKind.CANDIDATE, k.candidate_field(key, round)
            else:
                assert task.run is not None
                result = invoke(task.run, ctx)
                kind, field = EventKind.SUCCEED, k.value_field(key)
        except Cancelled as exc:
            return Outcome(EventKind.CANCEL, {}, error=error_record(exc), cancelled=True)
        except Exception as exc:
            return Outcome(EventKind.FAIL, {}, error=error_record(exc))
        problem = lossless_problem(result)
        if problem is not None:
            message = (f"outputs must be lossless JSON values: {problem} (task {key}"
                       f"{f' round {round}' if task.is_loop else ''}); return None, bool, int, finite "
                       "float, str, list or dict with str keys")
            return Outcome(EventKind.FAIL, {}, error=ErrorRecord(type="InvalidOutput", message=message))
        return Outcome(kind, {field: dumps(result)})

    def _record(self, workflow: Workflow, task: Task, snap: Snapshot, begun: TaskRecord,
                outcome: Outcome, signal: Signal) -> str:
        key = task.key
        begun_raw = snap.raw_tasks[key]
        for attempt in range(MAX_REPLANS):
            if attempt:
                fresh = self.store.snapshot(snap.run_id)
                if fresh is None or fresh.raw_tasks.get(key) != begun_raw:
                    return self._superseded(snap, begun)
                snap = fresh
            now = clock.now()
            planner = Planner(workflow, snap, now, self.settings)
            kind = outcome.kind
            if outcome.cancelled and not signal.cancelled:
                kind = EventKind.FAIL  # Cancelled raised by the callback itself, not by a signal
            if snap.control is not None and kind in (EventKind.CANDIDATE, EventKind.REJECT, EventKind.RETRY):
                kind = EventKind.CANCEL  # the run was cancelled or stopped: start nothing new
            planner.data.update(outcome.data)
            planner.move(key, PhaseEvent(kind, now, error=outcome.error, feedback=outcome.feedback))
            planner.settle()
            result = self._commit(planner, workflow)
            if result is not None:
                return result
        raise RuntimeError(f"could not record the outcome of {snap.run_id}/{key}: too many conflicts")

    def _superseded(self, snap: Snapshot, begun: TaskRecord) -> str:
        log.warning("run %s task %s: phase was taken over while it ran (token %s); its outcome is discarded",
                    snap.run_id, begun.key, begun.token)
        self.store.incr_stat("stale_commits", run_id=snap.run_id)
        self.store.apply(Batch(snap.run_id).event(Event(
            type=ev.STALE, key=begun.key, round=begun.round, phase=_phase(begun), at=clock.now(),
            data={"token": begun.token, "reason": "outcome of a superseded execution discarded"})))
        return "stale"


def _phase(record: TaskRecord) -> str | None:
    return record.phase.value if record.phase is not None else None


def _stub_workflow(snap: Snapshot) -> Workflow:
    """A stand-in with the run's task graph when the real definition is not importable here."""
    from taskloop.definitions import Task as _Task
    from taskloop.definitions import TaskKind
    from taskloop.definitions import Workflow as _Workflow

    tasks = tuple(_Task(key=key, kind=TaskKind(rec.kind)) for key, rec in snap.tasks().items())
    by_key = {t.key: t for t in tasks}
    return _Workflow(name=snap.run.get("wf", "?"), version=snap.run.get("ver", "?"), tasks=tasks,
                     by_key=by_key, dependents={}, order=tuple(by_key))

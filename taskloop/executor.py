"""Executes one phase message on a worker: admit, prepare, begin, call, record, dispatch.

Each step is one guarded write that re-plans when a guard fails:

1. read a snapshot of the run; refuse a message whose (round, phase, token) is not current;
2. prepare, on the first execution of an activation: ``condition`` (false: skipped) and the
   cache (hit: done with the cached value, no callback);
3. begin: the record moves to running, one attempt is admitted against the budget, a lease is
   taken; a round whose deadline has already passed fails with TaskTimeout instead;
4. call the user callback while the watcher sets ``ctx.signal`` (cancel, stop, deadline) and,
   past the grace period, records the outcome itself and stops the process;
5. record the outcome (timeouts, retries and cancellation resolved here) together with
   everything the scheduler decides, then send the Celery messages it dispatched.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal as signals
from collections.abc import Callable
from dataclasses import replace

from taskloop import cache as caching
from taskloop import clock
from taskloop import events as ev
from taskloop.callbacks import Outcome, build_context, call_phase, error_record, invoke
from taskloop.config import Settings
from taskloop.context import Signal
from taskloop.definitions import REGISTRY, Task, TaskKind, Workflow
from taskloop.errors import CorruptRecord, IncompatibleDefinition, TaskLoopError, TaskTimeout, WorkflowNotRegistered
from taskloop.events import Event, notify
from taskloop.phases import ErrorRecord, EventKind, Phase, PhaseEvent, Slot, State, TaskRecord, TaskStatus
from taskloop.reconciler import recover, worker_is_dead
from taskloop.scheduler import Dispatch, Planner, budget_caps, ending_reason, exec_event
from taskloop.store import Batch, RedisStore, Snapshot
from taskloop.store import keys as k
from taskloop.watcher import Watcher

log = logging.getLogger("taskloop.executor")

Sender = Callable[[Workflow, str, Dispatch], None]
MAX_REPLANS = 50
_QUEUED_OF = {Phase.ATTEMPT: State.QUEUED_ATTEMPT, Phase.CHECK: State.QUEUED_CHECK, Phase.RUN: State.QUEUED_RUN}
_RUNNING_OF = {Phase.ATTEMPT: State.RUNNING_ATTEMPT, Phase.CHECK: State.RUNNING_CHECK, Phase.RUN: State.RUNNING_RUN}

# Set in Celery prefork pool processes (worker_process_init): only there may a worker stop a
# callback that overran its grace period by ending its own process (the pool replaces it).
hard_stop_allowed = False


class Executor:
    """Runs phase messages for one worker process."""

    def __init__(self, store: RedisStore, settings: Settings, send: Sender, worker: str) -> None:
        self.store = store
        self.settings = settings
        self.send = send
        self.worker = worker.replace('"', "'").replace("\\", "/")  # it is spliced into JSON by begin.lua
        self.watcher = Watcher(store, settings)

    # entry point ----------------------------------------------------------------------------
    def handle(self, phase: Phase, run_id: str, key: str, round: int, token: int) -> str:
        """Process one message. Returns what happened: committed, stale, dropped, ..."""
        fields = self._data_fields(phase, key, round)
        # Usually the scheduler prepared this begin: one call reads the run and begins the phase.
        began, first = self.store.begin(run_id, key, round, phase.value, token, self.worker, clock.now(),
                                        self.settings.running_lease_s, fields)
        if began:
            assert first is not None
            return self._began(first, key)
        for attempt in range(MAX_REPLANS):
            snap = first if attempt == 0 else self.store.snapshot(run_id, fields)
            if snap is None or key not in snap.raw_tasks:
                what = "run" if snap is None else f"task {key!r} of run"
                log.error("%s %s not found (never started, or expired); dropping %s round %s",
                          what, run_id, phase.value, round)
                self.store.incr_stat("dropped_unknown_run")
                return "dropped"
            try:
                snap.tasks()
            except CorruptRecord:
                result = self._fail_corrupt(snap)
                if result is not None:
                    return result
                continue
            record = snap.task(key)
            if record.state is not _QUEUED_OF[phase] or record.round != round or record.token != token:
                if self._execution_lost(snap, record, phase, round, token):
                    result = self._recover(snap, record)
                    if result is not None:
                        return result
                    continue
                return self._stale(snap, record, phase, round, token)
            workflow, task, refusal = self._definition(snap, record)
            if refusal is not None:
                result = self._apply(workflow, snap, key, refusal)
            else:
                result = self._step(workflow, task, snap, record)
            if result is not None:
                return result
        raise RuntimeError(f"could not record {phase.value} of {run_id}/{key}: too many conflicts")

    def _definition(self, snap: Snapshot, record: TaskRecord) -> tuple[Workflow, Task, Outcome | None]:
        """The workflow and task a record runs under, or the failure to record instead (the
        definition is not importable here or changed, or the record contradicts its data)."""
        try:
            workflow = self._workflow(snap)
        except TaskLoopError as exc:
            stub = _stub_workflow(snap)
            error = ErrorRecord(type=type(exc).__name__, message=str(exc))
            return stub, stub.task(record.key), Outcome(EventKind.FAIL, error=error)
        task = workflow.task(record.key)
        problem = _inconsistency(task, record, snap)
        if problem is not None:
            error = ErrorRecord(type="CorruptRecord", message=str(CorruptRecord(snap.run_id, record.key, problem)))
            return workflow, task, Outcome(EventKind.FAIL, error=error)
        if record.deadline is not None and clock.now() >= record.deadline:  # the round ran out while queued
            return workflow, task, _timeout(task, record)
        return workflow, task, None

    def _began(self, snap: Snapshot, key: str) -> str:
        """The phase began in begin.lua: check what it runs on, then run it."""
        record = snap.task(key)
        workflow, task, refusal = self._definition(snap, record)
        if refusal is not None:
            return self._record(workflow, task, snap, record, refusal, Signal())
        return self._run(workflow, task, snap, record)

    def _step(self, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord) -> str | None:
        """One attempt at handling an admitted message; None means: read again and re-plan."""
        if snap.control is not None:
            cancel = Outcome(EventKind.CANCEL, cancelled=True, reason=ending_reason(snap.control))
            return self._apply(workflow, snap, task.key, cancel)
        found: caching.Lookup | None = None
        if not record.prepared:
            prepared = self._prepare(workflow, task, snap)
            if not isinstance(prepared, caching.Lookup):
                return prepared
            found = prepared
        begun = self._begin(workflow, task, snap, record, found)
        if begun is None or isinstance(begun, str):
            return begun
        return self._run(workflow, task, *begun)

    # reading --------------------------------------------------------------------------------
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

    def _execution_lost(self, snap: Snapshot, record: TaskRecord, phase: Phase, round: int, token: int) -> bool:
        """A redelivery of the message whose execution is recorded as running, by a worker that died
        (Celery re-queues the message of a killed pool process) or whose lease expired."""
        if record.state is not _RUNNING_OF[phase] or record.round != round or record.token != token + 1:
            return False
        if worker_is_dead(record.worker, wait=1.0):
            return True
        expiry = self.store.lease_expiry(snap.run_id, record.key)
        return expiry is not None and expiry < clock.now()

    def _recover(self, snap: Snapshot, record: TaskRecord) -> str | None:
        """Do the reconciler's work at once: queue a replay of the lost execution (or give up)."""
        try:
            workflow = self._workflow(snap)
        except TaskLoopError:
            return "stale"  # leave it to a reconciler that has the definition
        planner = Planner(workflow, snap, clock.now(), self.settings)
        recover(planner, record, self.settings.max_executions)
        log.warning("run %s task %s: the execution of %s round %s by %s was lost; %s", snap.run_id, record.key,
                    _phase(record), record.round, record.worker,
                    "giving up" if planner.tasks[record.key].terminal else "replaying it")
        return "recovered" if self._commit(planner, workflow) is not None else None

    def _fail_corrupt(self, snap: Snapshot) -> str | None:
        """Replace every unreadable task record by a failed one, before any callback runs."""
        try:
            workflow = self._workflow(snap)
        except TaskLoopError:
            workflow = None
        stand_ins: dict[str, TaskRecord] = {}
        problems: dict[str, str] = {}
        for key in snap.raw_tasks:
            try:
                snap.task(key)
            except CorruptRecord as exc:
                task = workflow.by_key.get(key) if workflow else None
                kind = task.kind if task else TaskKind.TASK
                # a stand-in from which FAIL is legal; the guard still compares the corrupt bytes
                stand_ins[key] = TaskRecord(key=key, kind=kind.value, status=TaskStatus.ACTIVE,
                                            phase=Phase.ATTEMPT if kind is TaskKind.LOOP else Phase.RUN,
                                            slot=Slot.QUEUED, round=1)
                problems[key] = str(exc)
        patched = Snapshot(snap.run_id, snap.run, snap.raw_tasks, snap.data, {**snap._tasks, **stand_ins})
        workflow = workflow or _stub_workflow(patched)
        now = clock.now()
        planner = Planner(workflow, patched, now, self.settings)
        for key, problem in problems.items():
            log.error("%s", problem)
            planner.move(key, PhaseEvent(EventKind.FAIL, now, error=ErrorRecord(type="CorruptRecord", message=problem)))
        planner.guard_all = True
        planner.settle()
        return self._commit(planner, workflow)

    def _stale(self, snap: Snapshot, record: TaskRecord, phase: Phase, round: int, token: int) -> str:
        reason = (f"message for {phase.value} round {round} token {token} does not match the record "
                  f"({record.state.value} round {record.round} token {record.token})")
        log.info("run %s task %s: refused stale delivery: %s", snap.run_id, record.key, reason)
        self.store.incr_stat("stale_deliveries", run_id=snap.run_id)
        self.store.apply(Batch(snap.run_id).event(Event(
            type=ev.STALE, key=record.key, round=round, phase=phase.value, at=clock.now(),
            data={"token": token, "reason": reason})))
        return "stale"

    # writing --------------------------------------------------------------------------------
    def _apply(self, workflow: Workflow, snap: Snapshot, key: str, outcome: Outcome,
               extra_events: list[Event] | None = None) -> str | None:
        """Record one outcome with full settling. None: the snapshot was stale, read again."""
        now = clock.now()
        planner = Planner(workflow, snap, now, self.settings)
        planner.data.update(outcome.data)
        planner.events.extend(extra_events or ())
        planner.move(key, PhaseEvent(outcome.kind, now, error=outcome.error, feedback=outcome.feedback,
                                     cache_hit=outcome.cache_hit, not_before=outcome.retry_at,
                                     reason=outcome.reason))
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
        failures = notify(workflow.observers, [e.model_copy(update={"run_id": run_id}) for e in events])
        if failures:
            batch = Batch(run_id)
            for failure in failures:
                batch.event(Event(type=ev.OBSERVER_ERROR, at=clock.now(), data=failure))
            self.store.apply(batch)
            self.store.incr_stat("observer_errors", len(failures), run_id=run_id)

    # steps ----------------------------------------------------------------------------------
    def _prepare(self, workflow: Workflow, task: Task, snap: Snapshot) -> str | caching.Lookup | None:
        """Condition and cache, before the first execution of an activation (attempt 0)."""
        ctx = build_context(self.store, workflow, task, snap, snap.task(task.key), Signal(), None)
        if task.condition is not None:
            try:
                keep = invoke(task.condition, ctx)
            except Exception as exc:
                return self._apply(workflow, snap, task.key, Outcome(EventKind.FAIL, error=error_record(exc)))
            if not keep:
                return self._apply(workflow, snap, task.key, Outcome(EventKind.SKIP, reason="condition"))
        if task.cache is None or snap.task(task.key).attempts:  # no cache lookup on a resume
            return caching.Lookup()
        store = caching.store_for(task.cache, self.store)
        found = caching.lookup(task.cache, ctx, workflow.name, task.key, store, clock.now())
        if found.error is not None:
            return self._apply(workflow, snap, task.key, Outcome(EventKind.FAIL, error=found.error), found.events)
        if found.hit:
            assert found.value_raw is not None
            hit = Outcome(EventKind.SUCCEED, {k.value_field(task.key): found.value_raw}, cache_hit=True)
            return self._apply(workflow, snap, task.key, hit, found.events)
        return found

    def _begin(self, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord,
               found: caching.Lookup | None) -> str | tuple[Snapshot, TaskRecord] | None:
        now = clock.now()
        planner = Planner(workflow, snap, now, self.settings)
        begun = planner.move(task.key, PhaseEvent(EventKind.BEGIN, now, worker=self.worker,
                                                  timeout_ms=task.timeout_ms))
        consumed = begun.attempts - record.attempts
        planner.usage["attempts"] = consumed
        planner.caps += budget_caps(workflow, consumed)
        if found is not None:
            planner.events.extend(found.events)
            if found.fingerprint is not None:
                planner.data[k.cache_fingerprint_field(task.key)] = found.fingerprint
        planner.events.append(exec_event(begun, now, self.worker))
        conflict = self.store.apply(planner.batch())
        if conflict is None:
            return Snapshot(snap.run_id, snap.run, {**snap.raw_tasks, task.key: begun.dump()}, snap.data), begun
        if not conflict.label.startswith("budget:"):
            return None
        name = conflict.label.removeprefix("budget:")
        limit = getattr(workflow.budget, name)
        error = ErrorRecord(
            type="WorkflowBudgetExceeded",
            message=(f"workflow {workflow.name} spent its budget of {limit} {name.replace('_', ' ')} before "
                     f"{task.key} {_step_name(task, record)} could start; raise Budget({name}=...) or "
                     "need fewer rounds"),
            details={"budget": name, "limit": limit, "used": int(conflict.current or 0)},
        )
        return self._apply(workflow, snap, task.key, Outcome(EventKind.FAIL, error=error))

    def _run(self, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord) -> str:
        phase = record.phase
        assert phase is not None
        signal = Signal()
        ctx = build_context(self.store, workflow, task, snap, record, signal, phase)

        def overrun(reason: str) -> None:
            """The callback ignored its signal past the grace period: record for it, then stop it."""
            outcome = _timeout(task, record) if reason == "timeout" else Outcome(EventKind.CANCEL, cancelled=True)
            # (a cancel's reason is filled in by _resolve from the run's control)
            result = self._record(workflow, task, snap, record, outcome, signal)
            log.error("run %s task %s: %s %s ignored its %s signal past the grace period; recorded (%s)%s",
                      snap.run_id, task.key, phase.value, _step_name(task, record), reason, result,
                      "; stopping this pool process" if hard_stop_allowed else "")
            if hard_stop_allowed:
                os.kill(os.getpid(), signals.SIGKILL)

        with self.watcher.watch(snap.run_id, task.key, snap.raw_tasks[task.key], signal, record.deadline, overrun):
            outcome = call_phase(task, phase, ctx, snap)
        return self._record(workflow, task, snap, record, outcome, signal)

    def _resolve(self, task: Task, record: TaskRecord, outcome: Outcome, signal: Signal,
                 snap: Snapshot, now: float) -> Outcome:
        """Turn what the callback produced into what is recorded: timeout, cancel, retry."""
        timed_out = signal.reason == "timeout" or (record.deadline is not None and now >= record.deadline)
        if timed_out and not _is_timeout(outcome):
            outcome = _timeout(task, record)
        if outcome.cancelled and not signal.cancelled and snap.control is None:
            outcome = replace(outcome, kind=EventKind.FAIL)  # Cancelled raised by the callback itself
        if snap.control is not None and outcome.kind is not EventKind.FAIL:
            # the run was cancelled or stopped: the phase ends cancelled (its output is kept)
            return replace(outcome, kind=EventKind.CANCEL, reason=ending_reason(snap.control))
        retry = task.retry
        tries_left = record.round < record.limit and snap.control is None
        if outcome.kind is EventKind.FAIL and retry is not None and tries_left:
            error = outcome.exception or TaskLoopError(outcome.error.message if outcome.error else "failed")
            try:
                accepted = retry.accepts is None or bool(retry.accepts(error, record.round))
            except Exception:
                log.exception("retry.accepts of task %s raised; not retrying", task.key)
                accepted = False
            if accepted:
                delay_ms = retry.delay_before(record.round + 1)
                if retry.jitter == "full":
                    delay_ms = int(random.uniform(0, delay_ms))
                return replace(outcome, kind=EventKind.RETRY, retry_at=now + delay_ms / 1000.0)
        return outcome

    def _record(self, workflow: Workflow, task: Task, snap: Snapshot, begun: TaskRecord,
                outcome: Outcome, signal: Signal) -> str:
        key = task.key
        begun_raw = snap.raw_tasks[key]
        extra: list[Event] = []
        for replan in range(MAX_REPLANS):
            if replan:
                fresh = self.store.snapshot(snap.run_id)
                if fresh is None or fresh.raw_tasks.get(key) != begun_raw:
                    return self._superseded(snap, begun)
                snap = fresh
            resolved = self._resolve(task, begun, outcome, signal, snap, clock.now())
            if not extra and task.cache is not None and resolved.kind in (EventKind.ACCEPT, EventKind.SUCCEED):
                extra = self._write_back(task, snap, resolved)
            if self._apply(workflow, snap, key, resolved, extra) is not None:
                return "committed"
        raise RuntimeError(f"could not record the outcome of {snap.run_id}/{key}: too many conflicts")

    def _write_back(self, task: Task, snap: Snapshot, outcome: Outcome) -> list[Event]:
        assert task.cache is not None
        (fingerprint,) = self.store.data(snap.run_id, [k.cache_fingerprint_field(task.key)])
        if fingerprint is None:
            return []
        store = caching.store_for(task.cache, self.store)
        return [caching.write_back(store, task.key, fingerprint, outcome.data[k.value_field(task.key)], clock.now())]

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


def _step_name(task: Task, record: TaskRecord) -> str:
    return f"round {record.round}" if task.is_loop else f"try {record.round}"


def _timeout(task: Task, record: TaskRecord) -> Outcome:
    message = f"task {task.key} timed out: {_step_name(task, record)} ran past timeout_ms={task.timeout_ms}"
    exc = TaskTimeout(task.key, "TaskTimeout", message)
    error = ErrorRecord(type="TaskTimeout", message=message,
                        details={"timeout_ms": task.timeout_ms, "round": record.round})
    return Outcome(EventKind.FAIL, error=error, exception=exc)


def _is_timeout(outcome: Outcome) -> bool:
    return outcome.error is not None and outcome.error.type == "TaskTimeout"


def _inconsistency(task: Task, record: TaskRecord, snap: Snapshot) -> str | None:
    """What is wrong with an (otherwise readable) record and its round data, if anything."""
    if record.kind != task.kind.value:
        return f"the record is a {record.kind} but the definition declares a {task.kind.value}"
    if not 1 <= record.round <= record.limit:
        return f"round {record.round} is outside 1..{record.limit}"
    if task.is_loop and record.limit != task.max_rounds:
        return f"the record allows {record.limit} rounds, the definition {task.max_rounds}"
    if record.phase is Phase.CHECK:
        raw = snap.data.get(k.candidate_field(task.key, record.round))
        if raw is None:
            return f"round {record.round} is in check but has no recorded candidate"
        try:
            json.loads(raw)
        except ValueError:
            return f"the candidate of round {record.round} is not JSON"
    if record.phase is Phase.ATTEMPT and record.round > 1:
        raw = snap.data.get(k.check_field(task.key, record.round - 1))
        try:
            check = json.loads(raw) if raw is not None else None
        except ValueError:
            check = None
        if not (isinstance(check, dict) and check.get("done") is False and isinstance(check.get("feedback"), str)):
            return f"round {record.round} started but round {record.round - 1} has no recorded rejection"
    return None


def _stub_workflow(snap: Snapshot) -> Workflow:
    """A stand-in with the run's tasks when the real definition is not importable here."""
    tasks = tuple(Task(key=key, kind=TaskKind(rec.kind)) for key, rec in snap.tasks().items())
    by_key = {t.key: t for t in tasks}
    return Workflow(name=snap.run.get("wf", "?"), version=snap.run.get("ver", "?"), tasks=tasks,
                    by_key=by_key, dependents={}, order=tuple(by_key))

"""Calling user code: contexts, sync/async invocation, and turning results into outcomes."""

from __future__ import annotations

import asyncio
import inspect
import json
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from taskloop import limits
from taskloop.context import LoopContext, Signal, TaskContext
from taskloop.definitions import Task, Workflow
from taskloop.errors import Cancelled, InvalidOutput, OutputTooLarge
from taskloop.jsonvalue import dumps, lossless_problem
from taskloop.limits import DEFAULT_CAPS, Caps
from taskloop.options import LoopCheck
from taskloop.phases import ErrorRecord, EventKind, Phase, TaskRecord
from taskloop.store import Applied, Batch, RedisStore, Snapshot
from taskloop.store import keys as k
from taskloop.worker.outcomes import Outcome

JSON_FIX = "return None, bool, int, finite float, str, list or dict with str keys"
TRACEBACK_LIMIT = 8_000  # characters of a recorded traceback (its last frames are kept)


def error_record(exc: BaseException, **details: Any) -> ErrorRecord:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(tb) > TRACEBACK_LIMIT:
        tb = "...\n" + tb[-TRACEBACK_LIMIT:]
    return ErrorRecord(type=type(exc).__name__, message=limits.cut(str(exc)), details={"traceback": tb, **details})


def failure(exc: BaseException) -> Outcome:
    return Outcome(EventKind.FAIL, error=error_record(exc), exception=exc)


def invoke(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a sync or async callback and return its result."""
    result = fn(*args)
    if inspect.isawaitable(result):
        async def wait() -> Any:
            return await result
        result = asyncio.run(wait())
    return result


class Usage:
    """ctx.report_usage: counters in the run hash; receipts make a report count once. A receipt
    id longer than its cap (TASKLOOP_MAX_RECEIPT_BYTES) raises OutputTooLarge in the callback."""

    def __init__(self, store: RedisStore, run_id: str, key: str = "",
                 max_receipt_bytes: int = limits.DEFAULT_RECEIPT_BYTES) -> None:
        self.store = store
        self.run_id = run_id
        self.key = key
        self.max_receipt_bytes = max_receipt_bytes

    def report(self, counts: dict[str, int]) -> None:
        self.store.incr_usage(self.run_id, counts)

    def report_once(self, receipt: str, counts: dict[str, int]) -> bool:
        size = limits.oversize(receipt, self.max_receipt_bytes)
        if size is not None:
            message = limits.too_large(f"the usage receipt id reported by task {self.key}", size,
                                       self.max_receipt_bytes, limits.RECEIPT_ENV)
            raise OutputTooLarge(self.key, OutputTooLarge.__name__, message)
        batch = Batch(self.run_id).expect(k.receipt_field(receipt), None, "receipt")
        batch.set(k.receipt_field(receipt), "1")
        for name, amount in counts.items():
            batch.incr(k.usage_field(name), amount)
        return isinstance(self.store.apply(batch), Applied)


def build_context(store: RedisStore, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord,
                  signal: Signal, phase: Phase | None, caps: Caps = DEFAULT_CAPS) -> TaskContext:
    """The context of one phase (or, with ``phase=None``, of a condition or cache key: attempt 0).
    The run input and dependency values are read when the callback first asks for them."""

    def load_value(dep: str) -> Any:
        snap.ensure([k.value_field(d) for d in task.after])
        return snap.json(k.value_field(dep))

    common: dict[str, Any] = dict(
        run_id=snap.run_id, workflow=workflow.name, key=task.key, load_input=lambda: snap.json(k.F_INPUT),
        signal=signal, after=task.after, load_value=load_value, usage=Usage(store, snap.run_id, task.key, caps.receipt),
        load_activation=(lambda: snap.json(k.activation_field(task.key))) if workflow.graph is not None else None,
    )
    if phase is None:
        return TaskContext(attempt=0, idempotency_key=f"{snap.run_id}/{task.key}/prepare", **common)
    idempotency_key = f"{snap.run_id}/{task.key}/{record.round}/{phase.value}"
    common["deadline"] = record.deadline
    if task.is_loop:
        return LoopContext(round=record.round, phase=phase.value, attempt=record.attempts,
                           idempotency_key=idempotency_key,
                           load_previous=lambda: snap.json(k.candidate_field(task.key, record.round - 1)), **common)
    return TaskContext(attempt=record.attempts, idempotency_key=idempotency_key, **common)


def phase_fields(phase: Phase, key: str, round: int) -> list[str]:
    """The data a phase's callback takes as an argument (read together with its record)."""
    if phase is Phase.CHECK:
        return [k.candidate_field(key, round)]
    if phase is Phase.ATTEMPT and round > 1:
        return [k.check_field(key, round - 1)]
    return []


def non_json(problem: str, task: Task, round: int) -> Outcome:
    where = f" round {round}" if task.is_loop else ""
    message = f"outputs must be lossless JSON values: {problem} (task {task.key}{where}); {JSON_FIX}"
    return Outcome(EventKind.FAIL, error=ErrorRecord(type=InvalidOutput.__name__, message=message))


def too_large(task: Task, round: int, what: str, size: int, limit: int, setting: str) -> Outcome:
    """A value over its cap: the phase fails with OutputTooLarge (recorded like InvalidOutput; the
    value itself is never written)."""
    where = f" round {round}" if task.is_loop else ""
    message = limits.too_large(f"the {what} of task {task.key}{where}", size, limit, setting)
    error = ErrorRecord(type=OutputTooLarge.__name__, message=message,
                        details={"size": size, "limit": limit, "setting": setting, "value": what})
    return Outcome(EventKind.FAIL, error=error, exception=OutputTooLarge(task.key, OutputTooLarge.__name__, message))


def call_phase(task: Task, phase: Phase, ctx: TaskContext, snap: Snapshot, caps: Caps = DEFAULT_CAPS) -> Outcome:
    """Run the phase's callback and describe what it produced (never raises for user errors)."""
    key, round = task.key, getattr(ctx, "round", 0)
    try:
        if phase is Phase.CHECK:
            assert task.check is not None
            raw = snap.get(k.candidate_field(key, round))
            check = LoopCheck.coerce(invoke(task.check, ctx, json.loads(raw) if raw else None))
            check_raw = dumps(check.model_dump())
            size = limits.oversize(check_raw, caps.feedback)
            if size is not None:
                return too_large(task, round, "check result (its feedback)", size, caps.feedback, limits.FEEDBACK_ENV)
            if check.done:
                accepted = Outcome(EventKind.ACCEPT, {k.check_field(key, round): check_raw,
                                                      k.value_field(key): raw or "null"})
                return with_notes(accepted, ctx, task, phase, caps)
            rejected = Outcome(EventKind.REJECT, {k.check_field(key, round): check_raw}, feedback=check.feedback)
            return with_notes(rejected, ctx, task, phase, caps)
        if phase is Phase.ATTEMPT:
            assert task.attempt is not None
            previous = snap.get(k.check_field(key, round - 1)) if round > 1 else None
            feedback = json.loads(previous)["feedback"] if previous else None
            result = invoke(task.attempt, ctx, feedback)
            kind, field_name = EventKind.CANDIDATE, k.candidate_field(key, round)
        else:
            assert task.run is not None
            result = invoke(task.run, ctx)
            kind, field_name = EventKind.SUCCEED, k.value_field(key)
    except Cancelled as exc:
        return Outcome(EventKind.CANCEL, error=error_record(exc), exception=exc, cancelled=True)
    except OutputTooLarge as exc:  # a usage receipt over its cap (Usage.report_once)
        return Outcome(EventKind.FAIL, error=ErrorRecord(type=OutputTooLarge.__name__, message=limits.cut(exc.message)),
                       exception=exc)
    except Exception as exc:
        return failure(exc)
    problem = lossless_problem(result)
    if problem is not None:
        return non_json(problem, task, round)
    raw_result = dumps(result)
    size = limits.oversize(raw_result, caps.output)
    if size is not None:
        what = "candidate" if phase is Phase.ATTEMPT else "output"
        return too_large(task, round, what, size, caps.output, limits.OUTPUT_ENV)
    return with_notes(Outcome(kind, {field_name: raw_result}), ctx, task, phase, caps)


def with_notes(outcome: Outcome, ctx: TaskContext, task: Task, phase: Phase, caps: Caps = DEFAULT_CAPS) -> Outcome:
    """What a callback noted about its phase (``ctx.notes``: a model's verdict, ...) is recorded with it
    (notes over TASKLOOP_MAX_OUTPUT_BYTES are replaced by a note saying so: they never fail a phase)."""
    if not ctx.notes or lossless_problem(ctx.notes) is not None:
        return outcome
    field = k.notes_field(task.key, getattr(ctx, "round", 0) or 1, phase.value)
    raw = dumps(ctx.notes)
    size = limits.oversize(raw, caps.output)
    if size is not None:
        raw = dumps({"dropped": f"notes of {size} bytes, over {limits.OUTPUT_ENV}={caps.output}"})
    return replace(outcome, data={**outcome.data, field: raw})

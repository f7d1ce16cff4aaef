"""Calling user code: contexts, sync/async invocation, and turning results into outcomes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import os
import threading
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from taskloop.base import limits, text
from taskloop.base.errors import Cancelled, InvalidCheckResult, InvalidOutput, OutputTooLarge
from taskloop.base.jsonvalue import dumps
from taskloop.base.limits import DEFAULT_CAPS, Caps
from taskloop.core import checks, scores
from taskloop.core import fields as fld
from taskloop.core.batch import Batch
from taskloop.core.checks import StoredCheck
from taskloop.core.outcomes import Outcome
from taskloop.core.phases import EventKind
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase
from taskloop.define.context import LoopContext, Signal, StreamSink, TaskContext
from taskloop.define.options import LoopCheck
from taskloop.define.tasks import Task
from taskloop.define.workflow import Workflow
from taskloop.runtime.judge import judge
from taskloop.runtime.writes import write
from taskloop.store.redis_store import Applied, RedisStore

JSON_FIX = "return None, bool, int, finite float, str, list or dict with str keys"
TRACEBACK_LIMIT = 8_000  # characters of a recorded traceback (its last frames are kept)


def error_record(exc: BaseException, **details: Any) -> ErrorRecord:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if len(tb) > TRACEBACK_LIMIT:
        tb = "...\n" + tb[-TRACEBACK_LIMIT:]
    return ErrorRecord(type=type(exc).__name__, message=text.cut(str(exc)), details={"traceback": tb, **details})


def failure(exc: BaseException) -> Outcome:
    return Outcome(EventKind.FAIL, error=error_record(exc), exception=exc)


def invoke(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a sync or async callback and return its result. An ``async def`` called here (a sync
    pool's thread or greenlet, or the asyncio pool's threads: a condition, a cache key) is awaited on
    the process's one event loop (``event_loop``), never on a loop of its own."""
    result = fn(*args)
    if inspect.isawaitable(result):
        async def wait() -> Any:
            return await result
        future = asyncio.run_coroutine_threadsafe(wait(), event_loop())
        signal = getattr(args[0], "signal", None) if args else None
        if isinstance(signal, Signal):  # a timeout or a cancel cancels its task, as on the asyncio pool
            def cancel(reason: str) -> None:
                future.cancel()
            signal.on_set(cancel)
        try:
            result = future.result()
        except concurrent.futures.CancelledError:
            if isinstance(signal, Signal):
                signal.raise_if_cancelled()
            raise
    return result


_loop: asyncio.AbstractEventLoop | None = None
_loop_pid: int | None = None
_loop_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop for async callbacks: the asyncio pool's (``use_event_loop``), or one
    started on a thread of its own the first time a sync pool meets an ``async def`` (a prefork
    pool process makes its own after the fork)."""
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid() or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="taskloop-event-loop", daemon=True).start()
            _loop, _loop_pid = loop, os.getpid()
        return _loop


def use_event_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Make ``loop`` (running on a thread of its own) this process's loop for async callbacks."""
    global _loop, _loop_pid
    with _loop_lock:
        _loop, _loop_pid = loop, os.getpid()


class Usage:
    """ctx.report_usage: counters in the run hash; receipts make a report count once. A receipt
    id longer than its cap (TASKLOOP_MAX_RECEIPT_BYTES) raises OutputTooLarge in the callback."""

    def __init__(self, store: RedisStore, run_id: str, key: str = "",
                 max_receipt_bytes: int = limits.DEFAULT_RECEIPT_BYTES, round: int = 0,
                 on_tokens: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.on_tokens = on_tokens  # counts the tokens in the phase's token rate limits
        self.run_id = run_id
        self.key = key
        self.max_receipt_bytes = max_receipt_bytes
        self.round = round  # also counted per task and round (what a fork carries over with the round)
        self.reported: dict[str, int] = {}  # what this phase reported (the hooks' PhaseEnded.usage)

    def _fields(self, name: str) -> list[str]:
        per_round = [fld.task_usage_field(self.key, self.round, name)] if self.key and self.round else []
        return [fld.usage_field(name), *per_round]

    def report(self, counts: dict[str, int]) -> None:
        self.store.incr_fields(self.run_id, {field: amount for name, amount in counts.items() if amount
                                             for field in self._fields(name)})
        self._tokens(counts)

    def _tokens(self, counts: dict[str, int]) -> None:
        for name, amount in counts.items():
            self.reported[name] = self.reported.get(name, 0) + amount
        if self.on_tokens is not None:
            self.on_tokens(counts.get("input", 0) + counts.get("output", 0))

    def report_once(self, receipt: str, counts: dict[str, int]) -> bool:
        size = limits.oversize(receipt, self.max_receipt_bytes)
        if size is not None:
            message = limits.too_large(f"the usage receipt id reported by task {self.key}", size,
                                       self.max_receipt_bytes, limits.RECEIPT_ENV)
            raise OutputTooLarge(self.key, OutputTooLarge.__name__, message)
        batch = Batch(self.run_id).expect(fld.receipt_field(receipt), None, "receipt")
        batch.set(fld.receipt_field(receipt), "1")
        for name, amount in counts.items():
            for field in self._fields(name):
                batch.incr(field, amount)
        counted = isinstance(write(self.store, batch), Applied)
        if counted:
            self._tokens(counts)
        return counted


def build_context(store: RedisStore, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord,
                  signal: Signal, phase: Phase | None, caps: Caps = DEFAULT_CAPS,
                  on_tokens: Callable[[int], None] | None = None, stream: StreamSink | None = None,
                  usage: Usage | None = None) -> TaskContext:
    """The context of one phase (or, with ``phase=None``, of a condition or cache key: attempt 0).
    The run input and dependency values are read when the callback first asks for them; the model
    that until_llm, tl.llm_check and tl.llm_score ask is the runtime's (runtime/judge.py).
    ``on_tokens``: told the tokens each usage report adds (the phase's token rate limits);
    ``stream``: where ``ctx.stream`` puts the phase's live text (streaming.py); ``usage``: where its
    ``ctx.report_usage`` counts (made here when None)."""

    def load_value(dep: str) -> Any:
        snap.ensure([fld.value_field(d) for d in task.after])
        return snap.json(fld.value_field(dep))

    common: dict[str, Any] = dict(
        run_id=snap.run_id, workflow=workflow.name, key=task.key, load_input=lambda: snap.json(fld.F_INPUT),
        signal=signal, after=task.after, load_value=load_value,
        usage=usage or Usage(store, snap.run_id, task.key, caps.receipt, record.round if phase is not None else 0,
                             on_tokens),
        load_activation=(lambda: snap.json(fld.activation_field(task.key))) if workflow.graph is not None else None,
        judge=judge, stream=stream,
    )
    if phase is None:
        return TaskContext(attempt=0, idempotency_key=f"{snap.run_id}/{task.key}/prepare", **common)
    idempotency_key = f"{snap.run_id}/{task.key}/{record.round}/{phase.value}"
    common["deadline"] = record.deadline
    if task.is_loop:
        return LoopContext(round=record.round, phase=phase.value, attempt=record.attempts,
                           idempotency_key=idempotency_key,
                           load_previous=lambda: snap.json(fld.candidate_field(task.key, record.round - 1)), **common)
    return TaskContext(attempt=record.attempts, idempotency_key=idempotency_key, **common)


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
    try:
        fn, args = phase_arguments(task, phase, ctx, snap)
        result = invoke(fn, *args)
    except Exception as exc:
        return raised(exc, task, ctx)
    return produced(result, task, phase, ctx, snap, caps)


async def acall_phase(task: Task, phase: Phase, ctx: TaskContext, snap: Snapshot,
                      caps: Caps = DEFAULT_CAPS) -> Outcome:
    """``call_phase`` for an ``async def`` callback, awaited on the running event loop (the asyncio
    pool's). A cancel of the awaiting task (a timeout, a cancelled run) propagates as
    ``asyncio.CancelledError`` once the callback lets it."""
    try:
        fn, args = phase_arguments(task, phase, ctx, snap)
        result = await fn(*args)
    except Exception as exc:
        return raised(exc, task, ctx)
    return produced(result, task, phase, ctx, snap, caps)


def phase_arguments(task: Task, phase: Phase, ctx: TaskContext,
                    snap: Snapshot) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The phase's callback and what it is called with: the context, and for an attempt the feedback
    it gets, for a check the candidate."""
    key, round = task.key, getattr(ctx, "round", 0)
    if phase is Phase.CHECK:
        assert task.check is not None
        raw = snap.get(fld.candidate_field(key, round))
        return task.check, (ctx, json.loads(raw) if raw else None)
    if phase is Phase.ATTEMPT:
        assert task.attempt is not None
        return task.attempt, (ctx, checks.attempt_feedback(key, round, snap.get))
    assert task.run is not None
    return task.run, (ctx,)


def raised(exc: Exception, task: Task, ctx: TaskContext) -> Outcome:
    """What a callback that raised comes to."""
    if isinstance(exc, InvalidCheckResult):  # a check that built a wrong LoopCheck: say which round
        return _invalid_check(exc, task, getattr(ctx, "round", 0))
    if isinstance(exc, Cancelled):
        return Outcome(EventKind.CANCEL, error=error_record(exc), exception=exc, cancelled=True)
    if isinstance(exc, OutputTooLarge):  # a usage receipt over its cap (Usage.report_once)
        return Outcome(EventKind.FAIL, error=ErrorRecord(type=OutputTooLarge.__name__, message=text.cut(exc.message)),
                       exception=exc)
    return failure(exc)


def _invalid_check(exc: InvalidCheckResult, task: Task, round: int) -> Outcome:
    """A check that returned (or built) something other than a LoopCheck: the failure names its round."""
    try:
        raise InvalidCheckResult(f"{exc} (task {task.key} round {round})") from exc
    except InvalidCheckResult as named:
        return failure(named)


def produced(result: Any, task: Task, phase: Phase, ctx: TaskContext, snap: Snapshot,
             caps: Caps = DEFAULT_CAPS) -> Outcome:
    """What a callback that returned ``result`` comes to: a check's verdict, a candidate, a value."""
    key, round = task.key, getattr(ctx, "round", 0)
    if phase is Phase.CHECK:
        raw = snap.get(fld.candidate_field(key, round))
        try:
            check = LoopCheck.coerce(result)
        except InvalidCheckResult as exc:
            return _invalid_check(exc, task, round)
        stored = StoredCheck.of(check).encode(caps.feedback)  # a LoopCheck is lossless JSON
        if stored.raw is None:
            return too_large(task, round, "check result (its feedback)", stored.size or 0, caps.feedback,
                             limits.FEEDBACK_ENV)
        check_raw = stored.raw
        if check.done:
            accepted = Outcome(EventKind.ACCEPT, {fld.check_field(key, round): check_raw,
                                                  fld.value_field(key): raw or "null"}, score=check.score)
            return with_notes(accepted, ctx, task, phase, caps)
        data = {fld.check_field(key, round): check_raw}
        record = snap.record(key)
        if task.on_exhausted == "best" and record is not None and \
                scores.keeps(scores.before(record.scores, round), check.score):
            data[fld.value_field(key)] = raw or "null"  # the best so far: the value if the loop runs out
        rejected = Outcome(EventKind.REJECT, data, feedback=check.feedback, score=check.score)
        return with_notes(rejected, ctx, task, phase, caps)
    if phase is Phase.ATTEMPT:
        kind, field_name = EventKind.CANDIDATE, fld.candidate_field(key, round)
    else:
        kind, field_name = EventKind.SUCCEED, fld.value_field(key)
    stored = limits.store_form(result, caps.output)
    if stored.problem is not None:
        return non_json(stored.problem, task, round)
    if stored.raw is None:
        what = "candidate" if phase is Phase.ATTEMPT else "output"
        return too_large(task, round, what, stored.size or 0, caps.output, limits.OUTPUT_ENV)
    return with_notes(Outcome(kind, {field_name: stored.raw}), ctx, task, phase, caps)


def with_notes(outcome: Outcome, ctx: TaskContext, task: Task, phase: Phase, caps: Caps = DEFAULT_CAPS) -> Outcome:
    """What a callback noted about its phase (``ctx.notes``: a model's verdict, ...) is recorded with it
    (notes over TASKLOOP_MAX_OUTPUT_BYTES are replaced by a note saying so: they never fail a phase)."""
    stored = limits.store_form(ctx.notes, caps.output)
    if not ctx.notes or stored.problem is not None:
        return outcome
    field = fld.notes_field(task.key, getattr(ctx, "round", 0) or 1, phase.value)
    raw = stored.raw or dumps({"dropped": f"notes of {stored.size} bytes, over {limits.OUTPUT_ENV}={caps.output}"})
    return replace(outcome, data={**outcome.data, field: raw})

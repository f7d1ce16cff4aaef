"""A phase ready to run (``Call``), and running it: the callback is called while the process's
watcher watches the phase (its deadline, its run's cancel, its lease), then its outcome is recorded
(recording.py).

Every path of the executor that lets a phase run ends in a ``Call``, so that the callback is called
in one place whatever the pool: a sync pool (prefork, threads, gevent) runs it in the thread or
greenlet that took the message (``run``); the asyncio pool awaits an ``async def`` callback on its
event loop, and runs a sync one on its thread pool (worker/pools/asyncio_pool.py). The watcher's
``overrun`` hook records the outcome of a callback that ignored its signal past the grace period;
in a prefork pool process it then ends the process (the pool forks a replacement), elsewhere the
callback runs on and its late outcome is refused (docs/controls.md, *What each pool can stop*).
"""

from __future__ import annotations

import inspect
import logging
import os
import signal as signals
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from taskloop.base import clock
from taskloop.base.limits import Caps
from taskloop.core import outcomes
from taskloop.core.outcomes import Outcome
from taskloop.core.phases import EventKind
from taskloop.core.records import TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Phase
from taskloop.define.context import Signal, TaskContext
from taskloop.define.tasks import Task
from taskloop.define.workflow import Workflow
from taskloop.ops.hooks import Hooks, PhaseBegan, PhaseEnded
from taskloop.runtime.instruments import hooks
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution.callbacks import Usage, acall_phase, build_context, call_phase
from taskloop.worker.execution.deferred import Deferred
from taskloop.worker.execution.handled import Handled
from taskloop.worker.execution.recording import Recorder
from taskloop.worker.execution.streaming import PhaseStream, phase_stream
from taskloop.worker.limits import limiter

log = logging.getLogger("taskloop.executor")

# Set in Celery prefork pool processes (worker_process_init): only there may a worker stop a
# callback that overran its grace period by ending its own process (the pool replaces it).
hard_stop_allowed = False


@dataclass
class Call:
    """A phase that may run now: what its callback gets, what the watcher guards, what it holds."""

    workflow: Workflow
    task: Task
    snap: Snapshot
    record: TaskRecord  # the running record it runs as (for a deferred phase, the one its outcome begins)
    signal: Signal
    ctx: TaskContext
    holding: limiter.Holding | None = None
    deferred: Deferred | None = None
    renew: Callable[[float], None] | None = None  # renews its limit slots with its lease
    on_end: list[Callable[[], None]] = field(default_factory=list)  # run once it is recorded (the executor's)
    stream: PhaseStream | None = None  # its live text (ctx.stream): written before its outcome is recorded
    usage: Usage | None = None  # what its ctx.report_usage counted (told to the hooks when it ends)
    traceparent: str | None = None  # the W3C trace context its message carried (told to the hooks)

    @property
    def phase(self) -> Phase:
        assert self.record.phase is not None
        return self.record.phase

    @property
    def callback(self) -> Callable[..., Any]:
        fn = {Phase.ATTEMPT: self.task.attempt, Phase.CHECK: self.task.check}.get(self.phase, self.task.run)
        assert fn is not None
        return fn

    @property
    def is_async(self) -> bool:
        """Whether its callback is an ``async def`` (awaited on the asyncio pool's loop)."""
        return inspect.iscoroutinefunction(self.callback)

    def end(self) -> None:
        """The phase is over here: run the hooks once, and drop what would keep it in a reference
        cycle (its signal's listeners)."""
        hooks, self.on_end = self.on_end, []
        self.signal.forget_listeners()
        if self.stream is not None:
            self.stream.end()  # (already ended when its outcome was recorded here)
        for fn in hooks:
            fn()


def make_call(store: RedisStore, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord, caps: Caps,
              holding: limiter.Holding | None = None, deferred: Deferred | None = None) -> Call:
    """The call of a phase that runs as ``record`` (its context, its signal, what it holds)."""
    phase = record.phase
    assert phase is not None
    signal = Signal()
    held = holding.held if holding is not None else None
    tokens = limiter.token_counter(store, held) if held is not None else None
    stream = phase_stream(store.url, snap.run_id, task.key, record.round, phase.value)
    usage = Usage(store, snap.run_id, task.key, caps.receipt, record.round, tokens)
    ctx = build_context(store, workflow, task, snap, record, signal, phase, caps, tokens, stream, usage)
    renew = limiter.slot_renewer(store, held) if held is not None else None
    return Call(workflow, task, snap, record, signal, ctx, holding, deferred, renew, stream=stream, usage=usage)


def overrun(call: Call, recorder: Recorder, reason: str) -> Handled:
    """The callback ignored its signal past the grace period: record for it (the watcher's hook),
    and in a prefork pool process stop the process."""
    task, record = call.task, call.record
    outcome = outcomes.timeout(task, record) if reason == "timeout" else Outcome(EventKind.CANCEL, cancelled=True)
    if call.stream is not None:
        call.stream.end()  # what it streamed so far is written soon; the watcher's thread does not wait
    copy = Snapshot(call.snap.run_id, dict(call.snap.fields),
                    loader=lambda names: recorder.store.hmget(call.snap.run_id, names))
    handled = recorder.record(call.workflow, task, copy, record, outcome, call.signal, deferred=call.deferred)
    log.error("run %s task %s: %s %s ignored its %s signal past the grace period; recorded (%s)%s",
              call.snap.run_id, task.key, call.phase.value, outcomes.step_name(task, record), reason,
              handled.result.value, "; stopping this pool process" if hard_stop_allowed else "")
    if hard_stop_allowed:
        recorder.release(call.holding)  # the process ends here: nothing after this runs
        os.kill(os.getpid(), signals.SIGKILL)
    return handled


def finish(call: Call, recorder: Recorder, outcome: Outcome) -> Handled:
    """Write the rest of its live text, record what the callback produced, then give back what the
    phase holds (once)."""
    try:
        end_stream(call)
        return recorder.record(call.workflow, call.task, call.snap, call.record, outcome, call.signal, call.holding,
                               call.deferred)
    finally:
        recorder.release(call.holding)
        call.end()


def end_stream(call: Call) -> None:
    """The phase's live text is over: the rest is written before its outcome is recorded (the
    wait is bounded: streaming.END_WAIT_S)."""
    if call.stream is not None:
        call.stream.end_and_wait()


def call_sync(call: Call, caps: Caps) -> Outcome:
    """Call the callback here (a sync pool's thread or greenlet, or the asyncio pool's thread pool),
    between the hooks' ``phase_began`` and ``phase_ended`` (in this thread: what a hook makes
    current, the callback sees)."""
    told = hooks()
    began = _began(call, told)
    try:
        outcome = call_phase(call.task, call.phase, call.ctx, call.snap, caps)
    except BaseException as exc:
        _ended(call, told, began, None, exc)
        raise
    _ended(call, told, began, outcome)
    return outcome


async def call_async(call: Call, caps: Caps) -> Outcome:
    """``call_sync`` for an ``async def`` callback, awaited on the running event loop (a task of its
    own on the asyncio pool's loop: the hooks are told inside it)."""
    told = hooks()
    began = _began(call, told)
    try:
        outcome = await acall_phase(call.task, call.phase, call.ctx, call.snap, caps)
    except BaseException as exc:
        _ended(call, told, began, None, exc)
        raise
    _ended(call, told, began, outcome)
    return outcome


def _began(call: Call, told: Hooks) -> PhaseBegan | None:
    if not (told.wants("phase_began") or told.wants("phase_ended")):
        return None
    record = call.record
    began = PhaseBegan(call.snap.run_id, call.workflow.name, call.workflow.version, call.task.key, record.round,
                       call.phase.value, record.attempts, record.worker, clock.now(), call.traceparent)
    told.phase_began(began)
    return began


def _ended(call: Call, told: Hooks, began: PhaseBegan | None, outcome: Outcome | None,
           exc: BaseException | None = None) -> None:
    """What the callback came to, told to the hooks (``exc``: it was interrupted: a cancel of its
    task, the process ending)."""
    if began is None:
        return
    usage = dict(call.usage.reported) if call.usage is not None else {}
    if outcome is None:
        told.phase_ended(PhaseEnded(began, "interrupted", clock.now(), exception=exc, usage=usage))
        return
    told.phase_ended(PhaseEnded(began, outcome.kind.value, clock.now(), outcome.error, outcome.exception,
                                outcome.score, usage))

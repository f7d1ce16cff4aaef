"""What a phase's execution comes to, and how it is recorded: pure (no I/O, no clock of its own).

A callback produces an `Outcome` (callbacks.py). Before it is recorded, `resolve` turns it into
what the run's rules say it is:

- past the round's deadline (or with a ``timeout`` signal) it is a TaskTimeout failure;
- ``Cancelled`` raised by the callback without a signal is an ordinary failure;
- once the run is cancelled or stopped, anything but a failure ends the phase cancelled;
- a failure of a plain task with tries left becomes a retry when ``retry.accepts`` agrees, due
  after the policy's delay (with full jitter: a uniform draw below it).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field, replace

from taskloop.base.errors import TaskLoopError, TaskTimeout, WorkflowBudgetExceeded
from taskloop.core.phases import EventKind, PhaseEvent
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.rules import ending_reason
from taskloop.core.states import Phase
from taskloop.define.tasks import Task
from taskloop.define.workflow import Workflow

log = logging.getLogger("taskloop.outcomes")


@dataclass(frozen=True)
class Outcome:
    """What a callback produced: the event to apply plus the data to record with it."""

    kind: EventKind
    data: dict[str, str] = field(default_factory=dict)
    error: ErrorRecord | None = None
    exception: BaseException | None = None
    feedback: str | None = None
    cancelled: bool = False
    retry_at: float | None = None  # RETRY: when the next try is due (epoch seconds)
    cache_hit: bool = False  # SUCCEED restored from the cache
    reason: str | None = None  # SKIP / CANCEL: why
    score: float | None = None  # ACCEPT / REJECT: the check's score


def step_name(task: Task, record: TaskRecord) -> str:
    return f"round {record.round}" if task.is_loop else f"try {record.round}"


def timeout(task: Task, record: TaskRecord) -> Outcome:
    message = f"task {task.key} timed out: {step_name(task, record)} ran past timeout_ms={task.timeout_ms}"
    exc = TaskTimeout(task.key, TaskTimeout.__name__, message)
    error = ErrorRecord(type=TaskTimeout.__name__, message=message,
                        details={"timeout_ms": task.timeout_ms, "round": record.round})
    return Outcome(EventKind.FAIL, error=error, exception=exc)


def is_timeout(outcome: Outcome) -> bool:
    return outcome.error is not None and outcome.error.of(TaskTimeout)


def cancel(control: str) -> Outcome:
    """A phase that ends because its run is cancelled or stopped."""
    return Outcome(EventKind.CANCEL, cancelled=True, reason=ending_reason(control))


def resolve(task: Task, record: TaskRecord, outcome: Outcome, signal_reason: str | None, control: str | None,
            now: float, rng: random.Random | None = None) -> Outcome:
    """Turn what the callback produced into what is recorded: timeout, cancel, retry."""
    if (signal_reason == "timeout" or record.overdue(now)) and not is_timeout(outcome):
        outcome = timeout(task, record)
    if outcome.cancelled and signal_reason is None and control is None:
        outcome = replace(outcome, kind=EventKind.FAIL)  # Cancelled raised by the callback itself
    if control is not None and outcome.kind is not EventKind.FAIL:
        # the run was cancelled or stopped: the phase ends cancelled (its output is kept)
        return replace(outcome, kind=EventKind.CANCEL, reason=ending_reason(control))
    retry = task.retry
    if record.phase is Phase.CHECK:  # a flow loop's judgement is tried again in its round
        tries_left = record.tries + 1 < (retry.attempts if retry else 0)
    else:
        tries_left = record.phase is Phase.RUN and record.round < record.limit
    if outcome.kind is not EventKind.FAIL or retry is None or not tries_left or control is not None:
        return outcome
    error = outcome.exception or TaskLoopError(outcome.error.message if outcome.error else "failed")
    try:
        attempt = record.tries + 1 if record.phase is Phase.CHECK else record.round
        accepted = retry.accepts is None or bool(retry.accepts(error, attempt))
    except Exception:
        log.exception("retry.accepts of task %s raised; not retrying", task.key)
        accepted = False
    if not accepted:
        return outcome
    delay_ms = retry.delay_before((record.tries if record.phase is Phase.CHECK else record.round) + 1)
    if retry.jitter == "full":
        delay_ms = int((rng or random).uniform(0, delay_ms))
    return replace(outcome, kind=EventKind.RETRY, retry_at=now + delay_ms / 1000.0)


def budget_spent(workflow: Workflow, task: Task, record: TaskRecord, name: str, used: int) -> Outcome:
    """The failure of a phase that a spent budget (``name``: attempts, input_tokens, ...) refused."""
    limit = getattr(workflow.budget, name)
    error = ErrorRecord(
        type=WorkflowBudgetExceeded.__name__,
        message=(f"workflow {workflow.name} spent its budget of {limit} {name.replace('_', ' ')} before "
                 f"{task.key} {step_name(task, record)} could start; raise Budget({name}=...) or "
                 "need fewer rounds"),
        details={"budget": name, "limit": limit, "used": used},
    )
    return Outcome(EventKind.FAIL, error=error)


def phase_event(outcome: Outcome, now: float, task: Task) -> PhaseEvent:
    """The state machine's event for an outcome of ``task`` (with the task's plateau and best-of)."""
    plateau = (task.plateau.rounds, task.plateau.min_gain) if task.plateau is not None else None
    return PhaseEvent(outcome.kind, now, error=outcome.error, feedback=outcome.feedback, cache_hit=outcome.cache_hit,
                      not_before=outcome.retry_at, reason=outcome.reason, score=outcome.score, plateau=plateau,
                      keep_best=task.on_exhausted == "best")

"""The names of where a task and a run stand (pure): task statuses, phases, slots, the states
of the phase machine (taskloop/core/phases.py), run statuses and terminations."""

from __future__ import annotations

from enum import Enum


class TaskStatus(str, Enum):
    WAITING = "waiting"
    ACTIVE = "active"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"
    PAUSED = "paused"
    REJECTED = "rejected"


TERMINAL_TASK = frozenset(
    {TaskStatus.DONE, TaskStatus.FAILED, TaskStatus.SKIPPED, TaskStatus.CANCELLED, TaskStatus.REJECTED}
)


class Phase(str, Enum):
    """Loop phases (attempt, check, complete) plus ``run`` for a plain task's attempt."""

    ATTEMPT = "attempt"
    CHECK = "check"
    COMPLETE = "complete"
    RUN = "run"


class Slot(str, Enum):
    """Where the current phase of an active task is: its message is queued, or a worker runs it."""

    QUEUED = "queued"
    RUNNING = "running"


class RunStatus(str, Enum):
    PENDING = "pending"  # started by name, not planned by a worker yet
    RUNNING = "running"
    WAITING = "waiting"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


TERMINAL_RUN = frozenset({RunStatus.DONE, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.REJECTED})


class Termination(str, Enum):
    FAILED = "failed"
    TIMEOUT = "timeout"
    ABORTED = "aborted"
    LIMIT = "limit"
    REJECTED = "rejected"


class State(str, Enum):
    WAITING = "waiting"
    QUEUED_ATTEMPT = "queued_attempt"
    RUNNING_ATTEMPT = "running_attempt"
    QUEUED_CHECK = "queued_check"
    RUNNING_CHECK = "running_check"
    QUEUED_RUN = "queued_run"
    RUNNING_RUN = "running_run"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


_ACTIVE_STATES = {
    (Phase.ATTEMPT, Slot.QUEUED): State.QUEUED_ATTEMPT,
    (Phase.ATTEMPT, Slot.RUNNING): State.RUNNING_ATTEMPT,
    (Phase.CHECK, Slot.QUEUED): State.QUEUED_CHECK,
    (Phase.CHECK, Slot.RUNNING): State.RUNNING_CHECK,
    (Phase.RUN, Slot.QUEUED): State.QUEUED_RUN,
    (Phase.RUN, Slot.RUNNING): State.RUNNING_RUN,
}
QUEUED_STATES = frozenset({State.QUEUED_ATTEMPT, State.QUEUED_CHECK, State.QUEUED_RUN})


def active_state(phase: Phase, slot: Slot) -> State:
    """The state of an active task whose current phase is ``phase``, queued or running."""
    return _ACTIVE_STATES[(phase, slot)]

RUNNING_STATES = frozenset({State.RUNNING_ATTEMPT, State.RUNNING_CHECK, State.RUNNING_RUN})

"""What handling one phase message came to (the executor's reply, which tasks.py turns into the
reply Celery records)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from taskloop.core.phases import EventKind
from taskloop.core.records import ErrorRecord
from taskloop.core.states import TaskStatus
from taskloop.runtime.commit import Committed


class Result(str, Enum):
    """What handling one phase message came to."""

    COMMITTED = "committed"  # the phase ran (or was settled) and its outcome is recorded
    STALE = "stale"  # refused: the message's round, phase or token is no longer current
    SUPERSEDED = "superseded"  # ran, but another execution took the phase over; outcome discarded
    RECOVERED = "recovered"  # the message re-delivered a lost execution: it was queued again
    THROTTLED = "throttled"  # a fleet limit holds the phase back: it waits (recorded), its message is done
    DROPPED = "dropped"  # the run or the task does not exist (never started, or expired)


@dataclass(frozen=True)
class Handled:
    """The result of one message, and for a committed phase the event it recorded."""

    result: Result
    outcome: EventKind | None = None
    error: ErrorRecord | None = None
    reason: str | None = None


def handled_of(committed: Committed, key: str) -> Handled:
    record = committed.planner.tasks[key]
    last = committed.planner.changed.get(key)
    kind = None
    if last is not None and last.error is not None and last.status is TaskStatus.FAILED:
        kind = EventKind.FAIL
    return Handled(Result.COMMITTED, outcome=kind, error=record.error if kind else None)

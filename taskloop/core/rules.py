"""The rules of a run as a whole (pure): how its control flag reads, what termination a failure
gives, and how a run whose tasks are all terminal ends."""

from __future__ import annotations

from taskloop.base.errors import LoopTaskExhausted, termination_of
from taskloop.core import fields as fld
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.states import TERMINAL_RUN, RunStatus, Termination

# What decides the final status of a run besides its control flag (read and guarded together).
OUTCOME_FIELDS = (fld.F_TERMINATION, fld.F_REJECTED, fld.F_STATUS)
# What a write that may end the run reads: those, and the run's creation time (its place in the
# run lists that the end moves it between; never changes, so not guarded).
ENDING_FIELDS = (*OUTCOME_FIELDS, fld.F_CREATED)
TERMINAL_STATUSES = frozenset(s.value for s in TERMINAL_RUN)

CANCEL_PREFIX = "cancel:"
STOP_PREFIX = "stop:"

def termination_for(error: ErrorRecord | None) -> Termination:
    """A failure's termination: the class attribute of its error (TaskTimeout: timeout, ...)."""
    return Termination(termination_of(error.type if error else None))


def ending_reason(control: str) -> str:
    """What a task ended by a run control records as its reason: ``cancelled`` or ``stopped``."""
    return "stopped" if control.startswith(STOP_PREFIX) else "cancelled"


def control_reason(control: str | None) -> str | None:
    """The signal reason that running phases see for a run control value."""
    if control is None:
        return None
    if control.startswith(STOP_PREFIX):
        return "stopped"
    return control.removeprefix(CANCEL_PREFIX) or "cancelled"


def final_status(control: str | None, termination: Termination | None,
                 rejected: bool) -> tuple[RunStatus, Termination | None]:
    """How a run whose tasks are all terminal ends: the one rule for its status and termination."""
    if control is not None and control.startswith(CANCEL_PREFIX):
        return RunStatus.CANCELLED, Termination.ABORTED
    if rejected:
        return RunStatus.REJECTED, Termination.REJECTED
    if termination is not None:
        return RunStatus.FAILED, termination
    if control is not None:  # stopped without a failed task (cannot normally happen)
        return RunStatus.FAILED, Termination.FAILED
    return RunStatus.DONE, None


def exhausted(record: TaskRecord) -> bool:
    return record.error is not None and record.error.of(LoopTaskExhausted)

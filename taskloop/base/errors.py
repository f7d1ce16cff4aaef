"""One error hierarchy for taskloop, grouped by layer.

Every message says what went wrong *and* what to do about it.
"""

from __future__ import annotations

from typing import Any, ClassVar


class TaskLoopError(Exception):
    """Base class of every error taskloop raises on purpose.

    ``termination``: the run termination a task (or run) that failed with this error gets;
    ``resumable``: whether ``client.resume`` may replay what failed with it."""

    termination: ClassVar[str] = "failed"
    resumable: ClassVar[bool] = True


# --- declaration layer -------------------------------------------------------------------------


class DefinitionError(TaskLoopError, ValueError):
    """A task, loop task, gate, workflow or option was declared wrongly (raised at definition time),
    or a callback used the context in a way its declaration does not allow."""


class IncompatibleDefinition(TaskLoopError):
    """A run was started or resumed under a definition that differs from the one it pinned."""


class WorkflowNotRegistered(TaskLoopError, LookupError):
    """No workflow with this name (and version) was imported in this process."""


# --- input / output values ---------------------------------------------------------------------


class InvalidInput(TaskLoopError, ValueError):
    """Run input (or a run id) that taskloop cannot store losslessly."""


class InvalidOutput(TaskLoopError, ValueError):
    """A callback returned a value that is not lossless JSON; the task fails before `check` runs."""


class InvalidCheckResult(TaskLoopError, ValueError):
    """A loop task's `check` returned something other than LoopCheck(done=...)."""


# --- runtime / store ---------------------------------------------------------------------------


class RunNotFound(TaskLoopError, LookupError):
    """No run with this id exists (never started, or expired after its retention period)."""

    def __init__(self, run_id: str, message: str | None = None) -> None:
        self.run_id = run_id
        super().__init__(message or (
            f"run {run_id!r} not found: check the id with `taskloop runs`; finished runs expire "
            "after their retention period (TASKLOOP_RETENTION_S, default 7 days)"
        ))


class RunExists(TaskLoopError):
    """`start` was given a run id that already belongs to another run (another workflow, or the
    same workflow with another input)."""


class CommitConflict(TaskLoopError):
    """A guarded write kept conflicting with concurrent writers and was given up (the caller may
    try again later; nothing was written). ``conflict`` says which guard failed last."""

    def __init__(self, message: str, conflict: Any = None) -> None:
        super().__init__(message)
        self.conflict = conflict


class GateRefused(TaskLoopError, ValueError):
    """``client.decide`` was refused at run time: not a gate, not waiting, actor not allowed, or an
    action the gate does not take."""


class StoreUnavailable(TaskLoopError, ConnectionError):
    """Redis could not be reached (or answered with an error) while taskloop needed it."""


class StoreAccessDenied(TaskLoopError, PermissionError):
    """Redis was reached but refused taskloop: wrong password, unknown or disabled ACL user, or a
    command or key the ACL user may not use (NOPERM). Not transient: retrying does not help, so it
    is not a StoreUnavailable (wait() fails at once instead of riding it out)."""


class ConnectionConfigError(TaskLoopError, ValueError):
    """A Redis or broker URL (or a TASKLOOP_TLS_* / TASKLOOP_SENTINEL_* setting) that taskloop
    cannot use: unknown scheme or option, a Cluster URL as the broker, a Sentinel URL without a
    master name ..."""


class IllegalTransition(TaskLoopError):
    """The phase state machine refused an event in the record's current state."""


class CorruptRecord(TaskLoopError):
    """A record in Redis cannot be read or contradicts the others; nothing runs on top of it."""

    def __init__(self, run_id: str, key: str, problem: str) -> None:
        self.run_id = run_id
        self.key = key
        super().__init__(
            f"run {run_id}: the record of task {key} is corrupt or inconsistent ({problem}); taskloop "
            "refuses to run callbacks on it. Inspect it with `taskloop inspect`, then start a new run"
        )


class NotResumable(TaskLoopError):
    """``client.resume`` found nothing it may replay (the run is not failed, or only failed in ways
    that a replay cannot change, such as an exhausted loop)."""


class NotForkable(TaskLoopError):
    """Only a finished run (done, failed, cancelled, rejected) can be forked."""


class ActionTimeout(TaskLoopError, TimeoutError):
    """An action asked of a worker by run id (``client.decide``, ``resume`` or ``fork`` in a process
    without the workflow's code: runtime/acting.py) got no verdict in time; the message says
    whether a worker took it, and what to check."""


class Cancelled(TaskLoopError):
    """Raised inside a callback by `ctx.signal.raise_if_cancelled()` once its phase is cancelled."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"phase cancelled: {reason}")


class RunTimeout(TaskLoopError, TimeoutError):
    """`RunHandle.wait(timeout=...)` gave up before the run finished (the run keeps going)."""


# --- task outcomes (raised by RunResult.raise_for_status) --------------------------------------


class TaskFailed(TaskLoopError):
    """A task of the run failed; `type` and `message` are those of the original error."""

    def __init__(self, key: str, type: str, message: str, traceback: str | None = None) -> None:
        self.key = key
        self.type = type
        self.message = message
        self.traceback = traceback
        super().__init__(f"task {key} failed: {type}: {message}")


class LoopTaskExhausted(TaskFailed):
    """A loop task's check rejected the candidate in every one of its `max_rounds` rounds, or
    (``reason`` "plateau") its best score stopped improving (``Plateau``) before that."""

    resumable = False  # an exhausted loop stays exhausted

    def __init__(self, key: str, max_rounds: int, feedback: str | None, reason: str = "rounds",
                 round: int | None = None) -> None:
        self.max_rounds = max_rounds
        self.feedback = feedback
        self.reason = reason
        message = self.message_for(key, max_rounds, reason, round)
        super().__init__(key, type(self).__name__, message)
        self.args = (message,)

    @staticmethod
    def message_for(key: str, max_rounds: int, reason: str = "rounds", round: int | None = None) -> str:
        if reason == "plateau":
            return f"Loop task {key} stopped improving (plateau) in round {round} of {max_rounds}"
        return f"Loop task {key} exhausted its {max_rounds} rounds"

    def __str__(self) -> str:
        return self.message


class TaskTimeout(TaskFailed):
    """A phase ran past the task's `timeout_ms`."""

    termination = "timeout"


class WorkflowBudgetExceeded(TaskFailed):
    """The workflow's Budget was spent before the next round or attempt could be admitted."""

    termination = "limit"
    resumable = False  # a spent budget stays spent


class PhaseAbandoned(TaskFailed):
    """Every execution of a phase was lost (its worker died, hung or lost its lease) until the
    redelivery cap (TASKLOOP_MAX_EXECUTIONS) was reached."""


class InvalidCacheKey(TaskFailed):
    """A task's ``Cache.key(ctx)`` returned something that is not lossless JSON."""


class OutputTooLarge(TaskFailed):
    """A callback produced a value larger than the configured cap (see docs/security.md)."""


class RunRejected(TaskLoopError):
    """A gate of the run was rejected."""


class GraphRunFailed(TaskLoopError):
    """A graph run was ended by its own rules: the transition handler raised or returned something
    invalid, a state or an output broke its schema, or a transition was not declared."""


class GraphLimitReached(TaskLoopError):
    """A graph run asked for more activations than its ``max_transitions``."""

    termination = "limit"


class LoopIterationError(TaskLoopError):
    """The body of a flow loop raised: ``loop iteration N: <the error>``."""


class LLMNotConfigured(TaskLoopError):
    """``until_llm`` / ``llm_check`` ran without TASKLOOP_LLM_BASE_URL and TASKLOOP_LLM_MODEL."""


class LLMCallFailed(TaskLoopError):
    """The chat-completions call failed: connection error, timeout, HTTP error status or a malformed reply.
    ``retryable`` is true for connection errors, timeouts, 429 and 5xx (for a Retry policy's ``accepts``)."""

    def __init__(self, message: str, *, url: str = "", status: int | None = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.url, self.status, self.retryable = url, status, retryable


# --- internal: what the runtime raises to itself ---------------------------------------------------


class Superseded(TaskLoopError):
    """The phase record changed while its callback ran: another execution owns it now."""


class LimitRefused(TaskLoopError):
    """A write that begins a phase was refused by one of its fleet limits (nothing of it was
    written; the phase joined that limit's wait queue). ``admission``: what the limit said."""

    def __init__(self, message: str, admission: object) -> None:
        super().__init__(message)
        self.admission = admission


class OutboxUnsupported(TaskLoopError):
    """The broker transport produced a command the outbox cannot run inside a script (the messages
    are then sent after each write instead)."""


class PoolRefused(TaskLoopError, ValueError):
    """A worker was asked to run phases on a pool taskloop cannot run them correctly on (``-P
    eventlet``, an unknown pool class): refused at start, never accepted and left hanging."""


class UIRefused(TaskLoopError):
    """``taskloop ui`` will not start as asked (the message says why and what to do); the CLI
    prints it as one line."""


class ActionRefused(TaskLoopError):
    """The UI refuses an action before it reaches the client (read-only, cross-site, no token, a
    body that is not JSON): answered with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# --- the one table: a recorded error's type name -> its class ---------------------------------------

RECORDED: dict[str, type[TaskLoopError]] = {cls.__name__: cls for cls in (
    LoopTaskExhausted, TaskTimeout, WorkflowBudgetExceeded, PhaseAbandoned, InvalidCacheKey, OutputTooLarge,
    InvalidOutput, InvalidCheckResult, CorruptRecord, LoopIterationError, LLMNotConfigured, LLMCallFailed,
    WorkflowNotRegistered, IncompatibleDefinition, GraphRunFailed, GraphLimitReached,
)}


# the errors a worker's verdict on an action asked by run id is raised as in the caller (runtime/acting.py)
ACTION_ERRORS: dict[str, type[TaskLoopError]] = {cls.__name__: cls for cls in (
    InvalidInput, IncompatibleDefinition, WorkflowNotRegistered, NotResumable, NotForkable, GateRefused, RunExists,
    CommitConflict, StoreUnavailable, StoreAccessDenied,
)}


def action_error(type_name: str, message: str) -> TaskLoopError:
    """The exception a worker's refusal of an action stands for: its own class with the worker's
    message (RunNotFound too); any other type as TaskLoopError naming it."""
    if type_name == RunNotFound.__name__:
        return RunNotFound(message.partition("'")[2].partition("'")[0], message)
    cls = ACTION_ERRORS.get(type_name)
    if cls is None:
        return TaskLoopError(f"{type_name}: {message}" if type_name != TaskLoopError.__name__ else message)
    return cls(message)


def recorded(type_name: str | None) -> type[TaskLoopError] | None:
    """The taskloop class of a recorded error type (None: a user's own exception, or nothing)."""
    return RECORDED.get(type_name or "")


def is_recorded(type_name: str | None, cls: type[TaskLoopError]) -> bool:
    """Whether a recorded error type is ``cls`` (compares through the table, never raw strings)."""
    return recorded(type_name) is cls


def termination_of(type_name: str | None) -> str:
    """The termination a failure of this recorded type gives its run."""
    found = recorded(type_name)
    return found.termination if found is not None else TaskLoopError.termination


def resumable(type_name: str | None) -> bool:
    found = recorded(type_name)
    return found.resumable if found is not None else True


def error_from_info(key: str, type: str, message: str, details: dict[str, Any] | None) -> TaskLoopError:
    """Rebuild the typed exception for a recorded error (``raise_for_status``): a task's (``key``)
    as its TaskFailed class, or TaskFailed with the original type name; the run's own (key
    empty) as its class, e.g. WorkflowNotRegistered or GraphRunFailed."""
    details = details or {}
    cls = recorded(type)
    if cls is LoopTaskExhausted:
        return LoopTaskExhausted(key, int(details.get("max_rounds", 0)), details.get("feedback"),
                                 str(details.get("reason") or "rounds"), details.get("round"))
    if cls is not None and issubclass(cls, TaskFailed):
        return cls(key or "?", type, message, details.get("traceback"))
    if not key:
        if cls is not None and cls is not CorruptRecord:
            return cls(message)
        return TaskLoopError(message)
    return TaskFailed(key, type, message, details.get("traceback"))

"""The pure phase state machine of one task: statuses, phases, the transition table. No I/O.

A task record is an immutable value. ``advance(record, event)`` returns a new record whose
fencing ``token`` is one higher, or raises `IllegalTransition` and leaves the old record as it
was. The Redis store writes the new record only if the stored one is still the old one
(compare-and-set), so a stale or duplicated delivery can never commit twice.

States (``TaskRecord.state``) combine the task status with, for active tasks, the phase and
whether its Celery message is queued or running::

    WAITING --ACTIVATE--> QUEUED_ATTEMPT --BEGIN--> RUNNING_ATTEMPT --CANDIDATE--> QUEUED_CHECK
    QUEUED_CHECK --BEGIN--> RUNNING_CHECK --ACCEPT--> DONE
                                          --REJECT--> QUEUED_ATTEMPT (round + 1) | FAILED (exhausted)
    WAITING --ACTIVATE--> QUEUED_RUN --BEGIN--> RUNNING_RUN --SUCCEED--> DONE | --RETRY--> QUEUED_RUN
    RUNNING_CHECK --RETRY--> QUEUED_CHECK (a flow loop's stop judgement, same round)
    WAITING --ACTIVATE--> PAUSED (gate) --APPROVE--> DONE | --DENY--> REJECTED

A waiting task counts the dependencies it still waits for (``waiting_on``); DEP_DONE lowers it,
and ACTIVATE is legal only once it is zero. The two time rules of a phase are here too: when a
round runs out (``TaskRecord.overdue``) and how long a running phase's lease lasts
(``lease_until``); begin.lua repeats the second by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from taskloop.errors import IllegalTransition, LoopTaskExhausted, WorkflowBudgetExceeded
from taskloop.jsonvalue import utf8_safe, utf8_safe_json


class TaskKind(str, Enum):
    TASK = "task"
    LOOP = "loop"
    GATE = "gate"


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


class ErrorRecord(BaseModel):
    """A recorded task error: the original type name and message, plus typed details."""

    model_config = ConfigDict(frozen=True)
    type: str
    message: str
    details: dict[str, Any] | None = None

    @field_validator("type", "message", "details", mode="before")
    @classmethod
    def _storable(cls, value: Any) -> Any:
        """An exception's message (and traceback) may hold lone surrogates, which UTF-8 cannot
        encode: they are escaped, or the outcome could never be recorded."""
        if isinstance(value, dict):
            return utf8_safe_json(value)
        return utf8_safe(value) if isinstance(value, str) else value


class TaskRecord(BaseModel):
    """The durable record of one task in one run (JSON in Redis, compared byte for byte)."""

    model_config = ConfigDict(frozen=True, use_enum_values=False)

    key: str
    kind: TaskKind
    limit: int = 1  # loop: max_rounds; plain task: tries allowed by its retry policy
    status: TaskStatus = TaskStatus.WAITING
    phase: Phase | None = None
    slot: Slot | None = None
    round: int = 0  # loop: 1-based round; plain task: 1-based try; 0 before activation
    token: int = 0  # fencing token: +1 on every transition
    attempts: int = 0  # attempts consumed: one per round/try, plus one per replay
    execs: int = 0  # executions of the current phase (1 = first, more = replays)
    tries: int = 0  # retries of the current check (a flow loop's stop judgement)
    lost: int = 0  # executions of the current phase lost to a dead worker or an expired lease
    deadline: float | None = None  # epoch seconds; set when the round (or try) starts
    not_before: float | None = None  # retry backoff: the message is due at this time
    waiting_on: int = 0  # dependencies that are not done yet (WAITING only)
    worker: str | None = None
    began_at: float | None = None  # when the current execution began
    queued_at: float | None = None  # when the current phase's message was (last) sent
    cache_hit: bool = False
    prepared: bool = False  # condition (and cache) consulted for this activation
    started_at: float | None = None
    finished_at: float | None = None
    error: ErrorRecord | None = None
    reason: str | None = None  # why a task was skipped or cancelled (condition, dependency, stopped, ...)

    @property
    def state(self) -> State:
        if self.status is TaskStatus.ACTIVE:
            assert self.phase is not None and self.slot is not None
            return active_state(self.phase, self.slot)
        return State(self.status.value)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_TASK

    def overdue(self, now: float) -> bool:
        """The deadline rule: the round (or try) has run out of time."""
        return self.deadline is not None and now >= self.deadline

    def dump(self) -> str:
        return self.model_dump_json(exclude_defaults=True)

    @classmethod
    def load(cls, raw: str | bytes) -> TaskRecord:
        return cls.model_validate_json(raw)


def round_deadline(began_at: float, timeout_ms: int) -> float:
    """The deadline rule: a round (or try) must end ``timeout_ms`` after it began; a check keeps its
    round's deadline. (begin.lua evaluates the same rule under the same name.)"""
    return began_at + timeout_ms / 1000.0


def lease_until(now: float, deadline: float | None, running_lease_s: float, grace_s: float) -> float:
    """The lease rule: a running phase is reclaimed ``running_lease_s`` after its last renewal,
    and never before its hard limit (deadline + grace) has passed by a second.
    (begin.lua evaluates the same rule under the same name.)"""
    until = now + running_lease_s
    if deadline is not None:
        until = max(until, deadline + grace_s + 1.0)
    return until


class EventKind(str, Enum):
    DEP_DONE = "dep_done"  # one more dependency finished done
    ACTIVATE = "activate"  # dependencies done: queue round 1 (or pause a gate)
    SKIP = "skip"  # condition false, or a dependency did not finish done
    BEGIN = "begin"  # a worker starts executing the queued phase
    CANDIDATE = "candidate"  # attempt returned a (lossless JSON) candidate
    ACCEPT = "accept"  # check accepted the candidate
    REJECT = "reject"  # check rejected the candidate with feedback
    SUCCEED = "succeed"  # plain task returned, or a cache hit restored the value
    FAIL = "fail"  # callback error, invalid output, timeout, budget, ...
    RETRY = "retry"  # plain task (or a flow loop's check) failed with tries left under its retry policy
    CANCEL = "cancel"  # the run was cancelled or stopped
    EXPIRE = "expire"  # a running phase's lease expired: queue it again (a replay)
    HAND_BACK = "hand_back"  # a worker shutting down gives a running phase back: queue it again at once
    REDISPATCH = "redispatch"  # a queued phase's message is presumed lost: send a new one
    APPROVE = "approve"  # gate approved (or resumed with a value)
    DENY = "deny"  # gate rejected
    RESUME = "resume"  # explicit resume of a task that failed on a callback error


@dataclass(frozen=True)
class PhaseEvent:
    kind: EventKind
    at: float
    worker: str | None = None
    timeout_ms: int | None = None
    error: ErrorRecord | None = None
    feedback: str | None = None
    cache_hit: bool = False
    not_before: float | None = None
    reason: str | None = None
    waiting_on: int = 0  # RESUME back to waiting: the dependencies not done


S = State
E = EventKind

# The transition table: (state, event) -> the states the event may lead to. Any pair that is
# not listed is illegal. Terminal states accept nothing except FAILED + RESUME.
TABLE: dict[tuple[State, EventKind], frozenset[State]] = {
    (S.WAITING, E.DEP_DONE): frozenset({S.WAITING}),
    (S.WAITING, E.ACTIVATE): frozenset({S.QUEUED_ATTEMPT, S.QUEUED_RUN, S.PAUSED}),
    (S.WAITING, E.SKIP): frozenset({S.SKIPPED}),
    (S.WAITING, E.CANCEL): frozenset({S.CANCELLED}),
    (S.PAUSED, E.APPROVE): frozenset({S.DONE}),
    (S.PAUSED, E.DENY): frozenset({S.REJECTED}),
    (S.PAUSED, E.CANCEL): frozenset({S.CANCELLED}),
    (S.FAILED, E.RESUME): frozenset({S.QUEUED_ATTEMPT, S.QUEUED_CHECK, S.QUEUED_RUN}),
    (S.CANCELLED, E.RESUME): frozenset({S.WAITING, S.QUEUED_ATTEMPT, S.QUEUED_CHECK, S.QUEUED_RUN}),
    (S.SKIPPED, E.RESUME): frozenset({S.WAITING}),
}
for _queued, _running in (
    (S.QUEUED_ATTEMPT, S.RUNNING_ATTEMPT),
    (S.QUEUED_CHECK, S.RUNNING_CHECK),
    (S.QUEUED_RUN, S.RUNNING_RUN),
):
    TABLE[(_queued, E.BEGIN)] = frozenset({_running})
    TABLE[(_queued, E.REDISPATCH)] = frozenset({_queued})
    TABLE[(_queued, E.FAIL)] = frozenset({S.FAILED})
    TABLE[(_queued, E.CANCEL)] = frozenset({S.CANCELLED})
    TABLE[(_running, E.EXPIRE)] = frozenset({_queued})
    TABLE[(_running, E.HAND_BACK)] = frozenset({_queued})
    TABLE[(_running, E.FAIL)] = frozenset({S.FAILED})
    TABLE[(_running, E.CANCEL)] = frozenset({S.CANCELLED})
# Before the first execution of an activation: condition false -> skipped; cache hit -> done.
TABLE[(S.QUEUED_ATTEMPT, E.SKIP)] = frozenset({S.SKIPPED})
TABLE[(S.QUEUED_RUN, E.SKIP)] = frozenset({S.SKIPPED})
TABLE[(S.QUEUED_ATTEMPT, E.SUCCEED)] = frozenset({S.DONE})
TABLE[(S.QUEUED_RUN, E.SUCCEED)] = frozenset({S.DONE})
# Outcomes of a running phase.
TABLE[(S.RUNNING_ATTEMPT, E.CANDIDATE)] = frozenset({S.QUEUED_CHECK})
TABLE[(S.RUNNING_CHECK, E.ACCEPT)] = frozenset({S.DONE})
TABLE[(S.RUNNING_CHECK, E.REJECT)] = frozenset({S.QUEUED_ATTEMPT, S.FAILED})
TABLE[(S.RUNNING_RUN, E.SUCCEED)] = frozenset({S.DONE})
TABLE[(S.RUNNING_RUN, E.RETRY)] = frozenset({S.QUEUED_RUN})
TABLE[(S.RUNNING_CHECK, E.RETRY)] = frozenset({S.QUEUED_CHECK})
del _queued, _running


def exhausted_error(key: str, max_rounds: int, feedback: str | None) -> ErrorRecord:
    return ErrorRecord(
        type=LoopTaskExhausted.__name__,
        message=LoopTaskExhausted.message_for(key, max_rounds),
        details={"max_rounds": max_rounds, "feedback": feedback},
    )


def _queue(phase: Phase, round: int, **extra: Any) -> dict[str, Any]:
    return {"status": TaskStatus.ACTIVE, "phase": phase, "slot": Slot.QUEUED, "round": round,
            "execs": 0, "lost": 0, "tries": 0, "worker": None, "began_at": None, **extra}


def _dep_done(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    if r.waiting_on < 1:
        raise IllegalTransition(f"task {r.key} waits for no dependency")
    return {"waiting_on": r.waiting_on - 1}


def _activate(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    if r.waiting_on:
        raise IllegalTransition(f"task {r.key} still waits for {r.waiting_on} dependencies")
    if r.kind is TaskKind.GATE:
        return {"status": TaskStatus.PAUSED, "started_at": e.at}
    phase = Phase.ATTEMPT if r.kind is TaskKind.LOOP else Phase.RUN
    return _queue(phase, 1, started_at=e.at)


def _begin(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    # The first execution of a check belongs to its round's attempt; everything else
    # (a new round, a plain try, any replay) consumes one attempt.
    consumes = r.execs > 0 or r.phase is not Phase.CHECK
    deadline = r.deadline
    if deadline is None and e.timeout_ms is not None:
        deadline = round_deadline(e.at, e.timeout_ms)
    return {"slot": Slot.RUNNING, "execs": r.execs + 1, "attempts": r.attempts + int(consumes),
            "worker": e.worker, "began_at": e.at, "deadline": deadline, "not_before": None, "prepared": True}


def _finish(status: TaskStatus, phase: Phase | None = None) -> Callable[[TaskRecord, PhaseEvent], dict[str, Any]]:
    def apply(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
        changes: dict[str, Any] = {"status": status, "slot": None, "finished_at": e.at}
        if phase is not None:
            changes["phase"] = phase
        if e.error is not None:
            changes["error"] = e.error
        if e.reason is not None:
            changes["reason"] = e.reason
        return changes
    return apply


def _succeed(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    fresh = r.execs == 0 and r.attempts == 0 and not r.prepared
    if (r.slot is Slot.QUEUED) is not (e.cache_hit and fresh):
        raise IllegalTransition(
            f"task {r.key}: a cache hit (and only a cache hit) finishes a queued phase, and only before "
            "its first execution"
        )
    changes = _finish(TaskStatus.DONE, Phase.COMPLETE if r.kind is TaskKind.LOOP else None)(r, e)
    if e.cache_hit:
        changes.update(cache_hit=True, round=0, attempts=0, phase=None, started_at=e.at)
    return changes


def _skip(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    if r.slot is Slot.QUEUED and (r.execs or r.attempts or r.prepared):
        raise IllegalTransition(f"task {r.key}: a queued phase is skipped only by its condition, before it first runs")
    return {**_finish(TaskStatus.SKIPPED)(r, e), "phase": None}


def _reject(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    if r.round >= r.limit:
        error = exhausted_error(r.key, r.limit, e.feedback)
        return {"status": TaskStatus.FAILED, "phase": Phase.COMPLETE, "slot": None,
                "finished_at": e.at, "error": error}
    return _queue(Phase.ATTEMPT, r.round + 1, deadline=None)


def _retry(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    """A plain task's next try is its next round; a check is tried again in the same round (within
    the round's deadline), counting its tries."""
    if r.phase is Phase.CHECK:
        return _queue(Phase.CHECK, r.round, deadline=r.deadline, not_before=e.not_before, tries=r.tries + 1)
    return _queue(Phase.RUN, r.round + 1, deadline=None, not_before=e.not_before)


UNRESUMABLE_ERRORS = frozenset({LoopTaskExhausted.__name__, WorkflowBudgetExceeded.__name__})


def _resume(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    """Replay the interrupted phase (keeping its round and execution count), or wait again."""
    if r.error is not None and r.error.type == LoopTaskExhausted.__name__:
        raise IllegalTransition(f"task {r.key} exhausted its {r.limit} rounds; an exhausted loop stays exhausted")
    if r.error is not None and r.error.type in UNRESUMABLE_ERRORS:
        raise IllegalTransition(f"task {r.key} failed with {r.error.type}, which a resume cannot undo")
    if r.status is TaskStatus.SKIPPED and r.reason == "condition":
        raise IllegalTransition(f"task {r.key} was skipped by its condition; that is its outcome")
    reset = {"error": None, "finished_at": None, "reason": None, "prepared": False, "deadline": None}
    if r.status is TaskStatus.SKIPPED or (r.status is TaskStatus.CANCELLED and r.phase is None):
        # e.waiting_on: how many of its dependencies are not done (the resume counts them)
        return {"status": TaskStatus.WAITING, "slot": None, "waiting_on": e.waiting_on, **reset}
    if r.phase not in (Phase.ATTEMPT, Phase.CHECK, Phase.RUN):
        raise IllegalTransition(f"task {r.key} has no interrupted phase to resume (phase {r.phase})")
    # execs is kept: the replayed phase consumes one attempt when it begins.
    return {**_queue(r.phase, r.round, **reset), "execs": r.execs}


_APPLY: dict[EventKind, Callable[[TaskRecord, PhaseEvent], dict[str, Any]]] = {
    E.DEP_DONE: _dep_done,
    E.ACTIVATE: _activate,
    E.SKIP: _skip,
    E.BEGIN: _begin,
    E.CANDIDATE: lambda r, e: _queue(Phase.CHECK, r.round, deadline=r.deadline),
    E.ACCEPT: _finish(TaskStatus.DONE, Phase.COMPLETE),
    E.REJECT: _reject,
    E.SUCCEED: _succeed,
    E.FAIL: _finish(TaskStatus.FAILED),
    E.RETRY: _retry,
    E.CANCEL: _finish(TaskStatus.CANCELLED),
    E.EXPIRE: lambda r, e: {"slot": Slot.QUEUED, "worker": None, "began_at": None, "lost": r.lost + 1},
    # A handed-back execution was not lost (lost is not counted) but it did run: execs is kept,
    # and the replay consumes an attempt when it begins, like any replay.
    E.HAND_BACK: lambda r, e: {"slot": Slot.QUEUED, "worker": None, "began_at": None},
    E.REDISPATCH: lambda r, e: {},
    E.APPROVE: _finish(TaskStatus.DONE),
    E.DENY: _finish(TaskStatus.REJECTED),
    E.RESUME: _resume,
}


def advance(record: TaskRecord, event: PhaseEvent) -> TaskRecord:
    """Apply ``event`` to ``record``: the new record (token + 1), or IllegalTransition."""
    allowed = TABLE.get((record.state, event.kind))
    if allowed is None:
        raise IllegalTransition(
            f"task {record.key}: event {event.kind.value!r} is not allowed in state {record.state.value!r}"
        )
    changes = _APPLY[event.kind](record, event)
    if (changes.get("slot", record.slot) is Slot.QUEUED and record.slot is not Slot.QUEUED) or \
            event.kind is EventKind.REDISPATCH:
        changes["queued_at"] = event.at  # a message is (re)sent now: how long it waits starts here
    new = record.model_copy(update={**changes, "token": record.token + 1})
    if new.state not in allowed:  # pragma: no cover - guards the table against the functions
        raise IllegalTransition(f"task {record.key}: {event.kind.value} led to {new.state.value}")
    return new

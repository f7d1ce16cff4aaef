"""The pure phase state machine of one task: its events, the transition table, `advance`. No I/O.

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
    WAITING --FORK--> QUEUED_ATTEMPT (a fork's loop: the round after those it copied)

A waiting task counts the dependencies it still waits for (``waiting_on``); DEP_DONE lowers it,
and ACTIVATE is legal only once it is zero. The records it moves are records.py's `TaskRecord`;
the time rules of a phase (when a round runs out, how long a lease lasts) are in leases.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from taskloop.base.errors import IllegalTransition, LoopTaskExhausted
from taskloop.core import scores
from taskloop.core.leases import round_deadline
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.states import Phase, Slot, State, TaskStatus
from taskloop.define.tasks import TaskKind


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
    FORK = "fork"  # a fork's task starts its next round from the rounds it copied (or a plain try afresh)


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
    score: float | None = None  # ACCEPT / REJECT: the check's score
    plateau: tuple[int, float] | None = None  # REJECT: the task's Plateau (rounds, min_gain)
    keep_best: bool = False  # REJECT: on_exhausted="best" (an exhausted loop ends done with its best round)


S = State
E = EventKind

# The transition table: (state, event) -> the states the event may lead to. Any pair that is
# not listed is illegal. Terminal states accept nothing except FAILED + RESUME.
TABLE: dict[tuple[State, EventKind], frozenset[State]] = {
    (S.WAITING, E.DEP_DONE): frozenset({S.WAITING}),
    (S.WAITING, E.ACTIVATE): frozenset({S.QUEUED_ATTEMPT, S.QUEUED_RUN, S.PAUSED}),
    (S.WAITING, E.SKIP): frozenset({S.SKIPPED}),
    (S.WAITING, E.CANCEL): frozenset({S.CANCELLED}),
    (S.WAITING, E.FORK): frozenset({S.QUEUED_ATTEMPT, S.QUEUED_RUN, S.PAUSED}),
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
TABLE[(S.RUNNING_CHECK, E.REJECT)] = frozenset({S.QUEUED_ATTEMPT, S.FAILED, S.DONE})  # DONE: a best-of loop
TABLE[(S.RUNNING_RUN, E.SUCCEED)] = frozenset({S.DONE})
TABLE[(S.RUNNING_RUN, E.RETRY)] = frozenset({S.QUEUED_RUN})
TABLE[(S.RUNNING_CHECK, E.RETRY)] = frozenset({S.QUEUED_CHECK})
del _queued, _running


def exhausted_error(key: str, max_rounds: int, feedback: str | None, reason: str = "rounds",
                    round: int | None = None) -> ErrorRecord:
    details: dict[str, Any] = {"max_rounds": max_rounds, "feedback": feedback}
    if reason != "rounds":
        details.update(reason=reason, round=round)
    return ErrorRecord(type=LoopTaskExhausted.__name__,
                       message=LoopTaskExhausted.message_for(key, max_rounds, reason, round), details=details)


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


def _fork(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    """A fork's task (core/fork.py): a loop's record holds the rounds it copied (``round`` the last
    of them, its attempts and scores), and it queues the next one; its condition was true in the
    run it was forked from, so it is not asked again. A plain task or a gate starts afresh."""
    if r.started_at is not None:
        raise IllegalTransition(f"task {r.key} already started: only a fork's new record forks")
    if r.kind is not TaskKind.LOOP:
        return _activate(r, e)
    if r.waiting_on:
        raise IllegalTransition(f"task {r.key} still waits for {r.waiting_on} dependencies")
    if r.round >= r.limit:
        raise IllegalTransition(f"task {r.key} copied {r.round} rounds of its {r.limit}: none is left to run")
    return _queue(Phase.ATTEMPT, r.round + 1, started_at=e.at, prepared=True, deadline=None)


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
    """The next round; or, out of rounds or on a plateau (core/scores.py), an exhaustion: failed
    with LoopTaskExhausted, or for a best-of loop done with its best round's candidate."""
    found = scores.with_score(r.scores, r.round, e.score)
    scored = {"scores": found} if found is not None else {}
    reason = "rounds" if r.round >= r.limit else \
        "plateau" if e.plateau is not None and scores.plateaued(found or (), *e.plateau) else None
    if reason is None:
        return _queue(Phase.ATTEMPT, r.round + 1, deadline=None, **scored)
    ended = {"phase": Phase.COMPLETE, "slot": None, "finished_at": e.at, **scored}
    if e.keep_best:
        kept = scores.best_round(found or [None] * r.round)
        return {"status": TaskStatus.DONE, "exhausted": reason, "kept_round": kept, **ended}
    return {"status": TaskStatus.FAILED, "error": exhausted_error(r.key, r.limit, e.feedback, reason, r.round), **ended}


def _accept(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    found = scores.with_score(r.scores, r.round, e.score)
    return {**_finish(TaskStatus.DONE, Phase.COMPLETE)(r, e), **({"scores": found} if found is not None else {})}


def _retry(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    """A plain task's next try is its next round; a check is tried again in the same round (within
    the round's deadline), counting its tries."""
    if r.phase is Phase.CHECK:
        return _queue(Phase.CHECK, r.round, deadline=r.deadline, not_before=e.not_before, tries=r.tries + 1)
    return _queue(Phase.RUN, r.round + 1, deadline=None, not_before=e.not_before)




def _resume(r: TaskRecord, e: PhaseEvent) -> dict[str, Any]:
    """Replay the interrupted phase (keeping its round and execution count), or wait again."""
    if r.error is not None and r.error.of(LoopTaskExhausted):
        raise IllegalTransition(f"task {r.key} exhausted its {r.limit} rounds; an exhausted loop stays exhausted")
    if r.error is not None and not r.error.resumable:
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
    E.ACCEPT: _accept,
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
    E.FORK: _fork,
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

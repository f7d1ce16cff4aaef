"""The events a task's transition tells (pure): what a run's history says when one record moves
through the phase machine (the event types: events.py).

A check's verdict ends its round (``phase`` ``complete``, with the feedback shortened); a lost or
handed-back execution says so; a check tried again in the same round says so (``retry``); a task
that enters a phase or a round says which (``phase``); a task whose status changed otherwise says
its new status, with the error, the reason, a cache hit or the round an exhausted best-of loop
kept (``task``). The planner (planner.py) adds them to its plan, the first with what ran.
"""

from __future__ import annotations

from typing import Any

from taskloop.base.errors import LoopTaskExhausted
from taskloop.base.text import cut
from taskloop.core import events as ev
from taskloop.core.events import Event
from taskloop.core.phases import EventKind, PhaseEvent
from taskloop.core.records import TaskRecord
from taskloop.core.states import Phase, State, TaskStatus

EVENT_TEXT_LIMIT = 300  # characters of a feedback quoted in an event (the whole one is in the round data)


def transition_events(old: TaskRecord, new: TaskRecord, event: PhaseEvent, now: float) -> list[Event]:
    """The events of ``event`` moving a task from ``old`` to ``new``, at ``now``."""
    key = new.key
    emitted: list[Event] = []
    if old.state is State.RUNNING_CHECK and event.kind in (EventKind.ACCEPT, EventKind.REJECT):
        feedback = None if event.feedback is None else cut(event.feedback, EVENT_TEXT_LIMIT)
        verdict: dict[str, Any] = {"done": event.kind is EventKind.ACCEPT, "feedback": feedback}
        if event.score is not None:
            verdict["score"] = event.score
        emitted.append(Event(type=ev.PHASE, key=key, round=old.round, phase=Phase.COMPLETE.value, at=now,
                             data=verdict))
    if event.kind in (EventKind.EXPIRE, EventKind.HAND_BACK):
        kind = ev.LOST if event.kind is EventKind.EXPIRE else ev.HANDED_BACK
        emitted.append(Event(type=kind, key=key, round=new.round, phase=_value(new.phase), at=now))
    if event.kind is EventKind.RETRY and new.phase is Phase.CHECK:  # same round and phase: say so
        emitted.append(Event(type=ev.RETRY, key=key, round=new.round, phase=_value(new.phase), at=now,
                             data={"try": new.tries + 1, "due": new.not_before,
                                   "error": event.error.message if event.error else None}))
    if new.status is TaskStatus.ACTIVE and (new.phase, new.round) != (old.phase, old.round):
        emitted.append(Event(type=ev.PHASE, key=key, round=new.round, phase=_value(new.phase), at=now))
    entered_phase = bool(emitted) and emitted[-1].type == ev.PHASE
    if new.status is not old.status and not (new.status is TaskStatus.ACTIVE and entered_phase):
        data: dict[str, Any] = {"status": new.status.value}
        if new.error is not None and new.error is not old.error:
            data.update(error=new.error.type, message=new.error.message)
            if new.error.of(LoopTaskExhausted):
                data["exhausted"] = (new.error.details or {}).get("reason") or "rounds"
        if new.reason is not None and new.reason is not old.reason:
            data["reason"] = new.reason
        if new.cache_hit:
            data["cache_hit"] = True
        if new.exhausted is not None:  # a best-of loop ran out: done with the round it kept
            data.update(exhausted=new.exhausted, kept_round=new.kept_round)
        emitted.append(Event(type=ev.TASK, key=key, round=new.round or None,
                             phase=_value(new.phase), at=now, data=data))
    return emitted


def _value(phase: Phase | None) -> str | None:
    return phase.value if phase is not None else None

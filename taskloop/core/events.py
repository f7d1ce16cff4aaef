"""Run events: the ordered history of a run (a Redis stream), and the observer hooks.

Every committed transition appends its events in the same atomic write, so the history and
the records can never disagree. Event types:

``run.pending``, ``run.started``, ``run.cancel``, ``run.finished``, ``run.resumed``
    run-level (``data``: the workflow a run by name asks for; status, termination; the cancel's
    reason; the tasks a resume replays)
``phase``
    a loop task entered (round, phase): ``attempt``, ``check`` or ``complete``; a plain task
    entered ``run`` for a try. Each (task, round, phase) appears exactly once. A ``complete``
    carries the check's verdict (``data``: done, feedback — shortened to 300 characters).
``lost``
    an execution of the phase was lost (its worker died, hung or lost its lease); the phase is
    queued again as a replay (``data.exec`` says which execution)
``handed_back``
    a worker that was shutting down gave a running phase back (its grace period ran out): the
    phase is queued again at once, for another worker (``data.exec`` says which execution)
``retry``
    a flow loop's stop judgement failed and is tried again in the same round (``data``: the try,
    when it is due, the error)
``task``
    a task changed status (``data``: status, error type/message when it failed, reason when it
    was skipped or cancelled)

The first event a phase's outcome writes carries ``data.exec``: the worker that ran it, when it
began, how long it took and how many executions it needed; a lost execution carries
``data.exec.lost`` (a handed-back one ``data.exec.handed_back``).
``transition``
    a graph workflow's handler was applied after the action ``key`` ended (``data``: the steps
    it activates next, the new state)
``cache``
    cache lookups (``phase``: ``hit``, ``miss``, ``stored``, ``failed``)
``observer.error``
    a workflow observer raised (``data``: observer, error)
``throttled``
    a queued phase waits for a fleet limit (``data``: the limit, the phase and round, the key
    value of a concurrency limit, when it may start); written once per limit it waits on. The
    wait it came to is ``data.exec.wait`` of the phase's outcome.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict

log = logging.getLogger("taskloop.core.events")

RUN_PENDING = "run.pending"
RUN_STARTED = "run.started"
RUN_CANCEL = "run.cancel"
RUN_FINISHED = "run.finished"
RUN_RESUMED = "run.resumed"
PHASE = "phase"
TASK = "task"
LOST = "lost"
HANDED_BACK = "handed_back"
RETRY = "retry"
TRANSITION = "transition"
CACHE = "cache"
OBSERVER_ERROR = "observer.error"
TASK_THROTTLED = "throttled"

# Short names in the stream: events are stored once per write, all the events of one write in
# one stream entry (field "e", a JSON list; the events that ended the run, written by the write's
# finishing part, in field "z"), so that a write costs one XADD.
_SHORT = (("type", "t"), ("key", "k"), ("round", "r"), ("phase", "p"), ("attempt", "a"), ("at", "at"),
          ("data", "d"))


class Event(BaseModel):
    """One entry of a run's history. Run-level and cache events leave unused fields None.

    ``id`` is ``<stream entry id>:<index in the entry>``, e.g. ``"1764460000000-0:1"``."""

    model_config = ConfigDict(frozen=True)
    id: str | None = None
    run_id: str | None = None
    type: str
    key: str | None = None
    round: int | None = None
    phase: str | None = None
    attempt: int | None = None
    at: float
    data: dict[str, Any] | None = None

    def compact(self) -> dict[str, Any]:
        return {short: getattr(self, name) for name, short in _SHORT if getattr(self, name) is not None}

    @classmethod
    def from_compact(cls, run_id: str, event_id: str, found: dict[str, Any]) -> Event:
        values: dict[str, Any] = {name: found[short] for name, short in _SHORT if short in found}
        return cls(id=event_id, run_id=run_id, **values)

    @property
    def entry_id(self) -> str | None:
        """The stream entry this event was stored in."""
        return self.id.rpartition(":")[0] if self.id else None


ENTRY_PARTS = ("e", "z")  # a stream entry's fields: a write's events, then those that ended the run


def entry_fields(events: list[Event], part: str = "e") -> list[str]:
    """The field of one stream entry that holds the events of a write (``part`` "z": of its
    finishing part, applied only if the write ends the run)."""
    return [part, json.dumps([e.compact() for e in events], separators=(",", ":"), ensure_ascii=False)]


def from_entry(run_id: str, entry_id: str, fields: dict[str, str]) -> list[Event]:
    found = [item for part in ENTRY_PARTS if part in fields for item in json.loads(fields[part])]
    return [Event.from_compact(run_id, f"{entry_id}:{i}", item) for i, item in enumerate(found)]


def split_id(event_id: str) -> tuple[str, int]:
    """An event id's stream entry and index (ValueError when it is not an event id)."""
    entry, _, index = event_id.rpartition(":")
    if not entry or not index.isdigit():
        raise ValueError(f"{event_id!r} is not an event id (expected <stream id>:<index>)")
    return entry, int(index)


Observer = Callable[[Event], Any]


def notify(observers: Iterable[Observer], events: Iterable[Event]) -> list[dict[str, str]]:
    """Call each observer with each event. A failing observer is logged and reported, never raised."""
    failures: list[dict[str, str]] = []
    for event in events:
        for observer in observers:
            try:
                observer(event)
            except Exception as exc:  # an observer must never break a loop
                name = getattr(observer, "__qualname__", repr(observer))
                log.warning("observer %s failed on %s: %r", name, event.type, exc)
                failures.append({"observer": name, "event": event.type, "error": f"{type(exc).__name__}: {exc}"})
    return failures

"""Run events: the ordered history of a run (a Redis stream), and the observer hooks.

Every committed transition appends its events in the same atomic write, so the history and
the records can never disagree. Event types:

``run.pending``, ``run.started``, ``run.cancel``, ``run.finished``, ``run.resumed``
    run-level (``data``: the workflow a run by name asks for; status, termination; the cancel's
    reason; the tasks a resume replays)
``phase``
    a loop task entered (round, phase): ``attempt``, ``check`` or ``complete``; a plain task
    entered ``run`` for a try. Each (task, round, phase) appears exactly once.
``lost``
    an execution of the phase was lost (its worker died, hung or lost its lease); the phase is
    queued again as a replay (``data.exec`` says which execution)
``task``
    a task changed status (``data``: status, error type/message when it failed, reason when it
    was skipped or cancelled)

The first event a phase's outcome writes carries ``data.exec``: the worker that ran it, when it
began, how long it took and how many executions it needed; a lost execution carries
``data.exec.lost``.
``cache``
    cache lookups (``phase``: ``hit``, ``miss``, ``stored``, ``failed``)
``observer.error``
    a workflow observer raised (``data``: observer, error)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict

log = logging.getLogger("taskloop.events")

RUN_PENDING = "run.pending"
RUN_STARTED = "run.started"
RUN_CANCEL = "run.cancel"
RUN_FINISHED = "run.finished"
RUN_RESUMED = "run.resumed"
PHASE = "phase"
TASK = "task"
LOST = "lost"
CACHE = "cache"
OBSERVER_ERROR = "observer.error"

# Stream field names (short, they are stored once per event).
_FIELDS = (("type", "t"), ("key", "k"), ("round", "r"), ("phase", "p"), ("attempt", "a"), ("at", "at"))


class Event(BaseModel):
    """One entry of a run's history. Run-level and cache events leave unused fields None."""

    model_config = ConfigDict(frozen=True)
    id: str | None = None  # the stream id, e.g. "1764460000000-0"; None before it is stored
    run_id: str | None = None
    type: str
    key: str | None = None
    round: int | None = None
    phase: str | None = None
    attempt: int | None = None
    at: float
    data: dict[str, Any] | None = None

    def to_fields(self) -> list[str]:
        out: list[str] = []
        for name, short in _FIELDS:
            value = getattr(self, name)
            if value is not None:
                out += [short, str(value)]
        if self.data:
            out += ["d", json.dumps(self.data, separators=(",", ":"))]
        return out

    @classmethod
    def from_stream(cls, run_id: str, entry_id: str, fields: dict[str, str]) -> Event:
        data = fields.get("d")
        return cls(
            id=entry_id,
            run_id=run_id,
            type=fields["t"],
            key=fields.get("k"),
            round=int(fields["r"]) if "r" in fields else None,
            phase=fields.get("p"),
            attempt=int(fields["a"]) if "a" in fields else None,
            at=float(fields["at"]),
            data=json.loads(data) if data else None,
        )


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

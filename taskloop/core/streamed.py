"""A phase's live text (SPEC §13), pure: what ``ctx.stream`` sends, as one entry of its run's live
stream (``Piece``), and what readers get back (``StreamChunk``, numbered into segments).

A process writes the text its phases streamed a few times a second, coalesced: one entry holds
whatever one phase streamed since the last write (taskloop/worker/execution/streaming.py). An
entry names its task, round and phase, and the execution that streamed it (an id made for each
execution of a phase). Readers number the executions of one (task, round, phase) in the order
their first entries appear: segment 1 is the first, and 2, 3, ... are later executions of the same
phase (a replay after a crash, a retry, a resume), so that a reader shows where the text started
again. Entries carry the text dropped just before them (the store was unreachable) and whether
the phase reached its cap (``TASKLOOP_STREAM_MAX_BYTES``: nothing more of it is streamed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Short field names in a stream entry.
F_TASK, F_ROUND, F_PHASE, F_EXECUTION, F_TEXT, F_DROPPED, F_CAPPED = "k", "r", "p", "e", "x", "d", "c"


@dataclass(frozen=True)
class StreamChunk:
    """Text a phase streamed (``ctx.stream``), as ``client.stream(run_id)`` yields it, in order.

    ``segment``: 1 for the first execution of this task, round and phase, 2 and on for a later one
    (a replay after a crash, a retry, a resume) that streams again from its start. ``dropped``:
    bytes of text lost just before this chunk (the store was unreachable when they were due).
    ``capped``: the phase reached ``TASKLOOP_STREAM_MAX_BYTES``; the rest of its text is only in
    its recorded output. ``id``: the stream entry (``<ms>-<seq>``), to read on after it."""

    task: str
    round: int
    phase: str
    text: str
    segment: int = 1
    dropped: int = 0
    capped: bool = False
    id: str = ""

    @property
    def replay(self) -> bool:
        """A later execution of its phase than the first (segment 2 and on)."""
        return self.segment > 1

    def as_json(self) -> dict[str, Any]:
        return {"task": self.task, "round": self.round, "phase": self.phase, "text": self.text,
                "segment": self.segment, "dropped": self.dropped, "capped": self.capped, "id": self.id}


@dataclass(frozen=True)
class Piece:
    """One entry to append to a run's live stream: what one execution of a phase streamed since
    its last entry."""

    run_id: str
    task: str
    round: int
    phase: str
    execution: str
    text: str
    dropped: int = 0
    capped: bool = False

    def fields(self) -> dict[str, str | int]:
        found: dict[str, str | int] = {F_TASK: self.task, F_ROUND: self.round, F_PHASE: self.phase,
                                       F_EXECUTION: self.execution, F_TEXT: self.text}
        if self.dropped:
            found[F_DROPPED] = self.dropped
        if self.capped:
            found[F_CAPPED] = 1
        return found


class Segments:
    """Numbers the executions of each (task, round, phase) in the order a reader meets them."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, int, str], list[str]] = {}

    def number(self, task: str, round: int, phase: str, execution: str) -> int:
        executions = self._seen.setdefault((task, round, phase), [])
        if execution not in executions:
            executions.append(execution)
        return executions.index(execution) + 1

    def chunk(self, entry_id: str, fields: dict[str, str]) -> StreamChunk | None:
        """The chunk of one stream entry (None: not an entry of ours)."""
        try:
            task, phase, execution = fields[F_TASK], fields[F_PHASE], fields[F_EXECUTION]
            round = int(fields[F_ROUND])
            dropped = int(fields.get(F_DROPPED) or 0)
        except (KeyError, ValueError):
            return None
        return StreamChunk(task=task, round=round, phase=phase, text=fields.get(F_TEXT, ""),
                           segment=self.number(task, round, phase, execution), dropped=dropped,
                           capped=fields.get(F_CAPPED) == "1", id=entry_id)

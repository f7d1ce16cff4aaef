"""Following a run's live text (SPEC §13): ``client.stream(run_id)``, ``RunHandle.stream()``,
``taskloop watch`` and the run UI's ``/api/runs/<id>/stream`` read it here.

``follow`` yields the run's chunks from the start of its live text (store/streams.py), numbered
into segments (core/streamed.py), then blocks for more: one ``XREAD BLOCK`` on the run's live
text and its events together, which wakes for a chunk and for the event that ends the run. Once
the run has ended (its status says so, read again whenever an event says it finished or a wait
runs out), what is left of its live text is read, and the iteration ends. A run that has ended
already yields what is left of its live text (kept ``TASKLOOP_STREAM_GRACE_S`` past its last
phase) and ends at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from taskloop.base import names
from taskloop.base.errors import InvalidInput, RunNotFound
from taskloop.base.text import shown
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.states import RunStatus
from taskloop.core.streamed import Segments, StreamChunk
from taskloop.store.redis_store import RedisStore
from taskloop.store.streams import Entry

BLOCK_S = 5.0  # one parked read (an idle follower costs a read this often)
# The first read of the run's events starts this far back (the client's clock): an event that ends
# the run while the follower starts is not missed (and one from before it is checked against the
# run's status).
EVENTS_LOOKBACK_S = 60.0


def _terminal(store: RedisStore, run_id: str) -> bool:
    snap = store.snapshot(run_id, fld.META_FIELDS)
    if not snap.exists:
        raise RunNotFound(run_id)
    return snap.meta().terminal


def _order(entry_id: object) -> tuple[int, int] | None:
    """A stream entry id as the stream orders them (None: not an entry id)."""
    if not isinstance(entry_id, str) or len(entry_id) > 41:
        return None
    millis, _, seq = entry_id.partition("-")
    return (int(millis), int(seq)) if millis.isdigit() and seq.isdigit() else None


def check_task(store: RedisStore, run_id: str, task: object) -> str | None:
    """``task`` as a filter of the run's live text: None, or the key of one of its tasks."""
    if task is None:
        return None
    if not isinstance(task, str) or not task:
        raise InvalidInput(f"stream: task must be None or the key of a task of the run, got {shown(task)}")
    status, record = store.hmget(run_id, [fld.F_STATUS, fld.task_field(task)])
    if record is None and status not in (None, RunStatus.PENDING.value):  # a pending run has no tasks yet
        found = sorted(field.removeprefix(fld.TASK_PREFIX) for field in store.scan_fields(run_id, fld.TASK_PREFIX))
        raise InvalidInput(f"stream: task {task!r} is not a task of run {run_id}; its tasks: {', '.join(found)}")
    return task


def follow(store: RedisStore, run_id: str, task: str | None = None, after: str | None = None,
           block_s: float = BLOCK_S) -> Iterator[StreamChunk]:
    """The run's live text as chunks, in order, until the run ends (only ``task``'s with a task;
    only the chunks after entry ``after`` with one, numbered as if read from the start). The run,
    the task and ``after`` are checked now (RunNotFound, InvalidInput), before the first chunk."""
    return (chunk for chunk in follow_idle(store, run_id, task, after, block_s) if chunk is not None)


def follow_idle(store: RedisStore, run_id: str, task: str | None = None, after: str | None = None,
                block_s: float = BLOCK_S) -> Iterator[StreamChunk | None]:
    """``follow``, and None each time ``block_s`` passed with nothing new (what a server-sent event
    stream turns into a keep-alive)."""
    names.check_run_id(run_id)
    bound = _order(after) if after is not None else (0, 0)
    if bound is None:
        raise InvalidInput(f"stream: after must be the id of a chunk (a stream entry id such as 1764460000000-0), "
                           f"got {shown(after)}")
    ended = _terminal(store, run_id)
    return _follow(store, run_id, check_task(store, run_id, task), bound, ended, block_s)


def _follow(store: RedisStore, run_id: str, task: str | None, bound: tuple[int, int], ended: bool,
            block_s: float) -> Iterator[StreamChunk | None]:
    segments = Segments()
    last = "0-0"

    def chunks(entries: Iterable[Entry]) -> Iterator[StreamChunk]:
        nonlocal last
        for entry_id, found in entries:
            last = entry_id
            chunk = segments.chunk(entry_id, found)
            if chunk is not None and (task is None or chunk.task == task) and (_order(entry_id) or (0, 0)) > bound:
                yield chunk

    if ended:
        yield from chunks(store.stream_entries(run_id))
        return
    events_after = f"{max(int((time.time() - EVENTS_LOOKBACK_S) * 1000), 0)}-0"
    while True:
        entries, events = store.block_stream(run_id, last, events_after, int(block_s * 1000))
        yield from chunks(entries)
        if events:
            events_after = events[-1].entry_id or events_after
        if (not entries and not events) or any(e.type == ev.RUN_FINISHED for e in events):
            if _terminal(store, run_id):
                yield from chunks(store.stream_entries(run_id, last))
                return
        if not entries and not events:
            yield None

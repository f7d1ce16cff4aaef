"""``ctx.stream``: a phase's live text (SPEC §13), buffered in the process and written by one
thread, the process's ``Flusher``.

A callback's ``ctx.stream(text)`` appends to its phase's buffer (``PhaseStream``) and returns: no
Redis call, so it costs an async callback on the asyncio pool's loop nothing but a lock, and a
sync one in any pool no round trip. The flusher writes what every phase of the process buffered
in one pipeline (store/streams.py ``StreamWriter``): ``TASKLOOP_STREAM_FLUSH_S`` (0.2 s) after
the text that woke it, so that the tokens of that interval, of every phase, cost one call; at
once when a phase holds ``FLUSH_BYTES`` or reached its cap; and at the phase's end, which waits
for it (``end``, at most ``END_WAIT_S``) before its outcome is recorded, so that a reader has all
of a phase's text by the time the phase is over. A phase that never streams costs nothing.

The flusher also keeps the run's stream from expiring while a phase that streamed still runs
(its expiry is ``TASKLOOP_STREAM_GRACE_S`` after the last write: one ``PEXPIRE`` a third of
the grace apart at most), so a run's live text lasts until its last streaming phase has ended,
plus the grace.

Nothing here fails a phase. A write the store does not take (unreachable, timed out) is dropped:
counted (``taskloop_stream_dropped_chunks`` / ``_bytes``, reason ``unavailable``), logged once
per outage, and marked in the phase's next entry (``dropped``: the bytes lost just before it).
Past ``TASKLOOP_STREAM_MAX_BYTES`` (UTF-8) of one execution of a phase, the rest is dropped
(reason ``capped``) and the entry that reached the cap says so (``capped``); text streamed after
the phase's outcome was recorded (a callback that overran its signal) is dropped (``ended``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from taskloop.base.config import Settings, settings
from taskloop.core.streamed import Piece
from taskloop.ops.hooks import ChunkStreamed, StreamDropped, StreamWritten
from taskloop.runtime.instruments import hooks
from taskloop.store.streams import StreamWriter

log = logging.getLogger("taskloop.streaming")

FLUSH_BYTES = 64 * 1024  # a phase holding this much unwritten text is written at once
END_WAIT_S = 5.0  # how long a phase's end waits for its last text to be written (then it goes on)
KEEPALIVE_MAX_S = 60.0


def utf8_size(text: str) -> tuple[str, int]:
    """``text`` as Redis can store it (a lone surrogate becomes "?") and its size in UTF-8."""
    try:
        return text, len(text.encode("utf-8"))
    except UnicodeEncodeError:
        fixed = text.encode("utf-8", "replace").decode("utf-8")
        return fixed, len(fixed.encode("utf-8"))


def cut_utf8(text: str, room: int) -> str:
    """The longest start of ``text`` whose UTF-8 fits in ``room`` bytes (no character is split)."""
    return text.encode("utf-8")[:room].decode("utf-8", "ignore")


@dataclass(frozen=True)
class Taken:
    """What the flusher took from a phase's buffer for one write."""

    piece: Piece
    chunks: int  # how many ctx.stream texts it holds
    size: int  # its text's bytes


class PhaseStream:
    """The live text of one execution of a phase: ``ctx.stream`` appends here (``__call__``)."""

    def __init__(self, flusher: Callable[[], Flusher], run_id: str, task: str, round: int, phase: str,
                 max_bytes: int) -> None:
        self.flusher = flusher  # the process's (made when a phase first streams)
        self.run_id, self.task, self.round, self.phase = run_id, task, round, phase
        self.execution = secrets.token_hex(6)  # tells this execution's entries from a replay's
        self.max_bytes = max_bytes
        self.used = 0  # bytes taken toward the cap
        self.written = False  # an entry of it reached Redis (the flusher keeps its run's stream alive)
        self.closed = False
        self._parts: list[str] = []
        self._pending = 0  # bytes in _parts
        self._dropped = 0  # bytes lost to the store since the last entry that was written
        self._capped = False
        self._cap_marked = False
        self._lock = threading.Lock()

    def __call__(self, text: str) -> None:
        text, size = utf8_size(text)
        kept, kept_size, urgent = "", 0, False
        with self._lock:
            if self.closed:
                reason = "ended"
            elif self._capped:
                reason = "capped"
            else:
                room = self.max_bytes - self.used
                kept, kept_size = (text, size) if size <= room else utf8_size(cut_utf8(text, room))
                self._capped = kept_size < size
                reason = "capped" if self._capped else ""
                if kept:
                    self._parts.append(kept)
                    self._pending += kept_size
                    self.used += kept_size
                urgent = self._pending >= FLUSH_BYTES or self._capped
        if reason:
            hooks().stream_dropped(StreamDropped(reason, 1, size - kept_size))
        if kept or urgent:
            self.flusher().wake(self, urgent)
        told = hooks()
        if told.wants("chunk_streamed"):
            told.chunk_streamed(ChunkStreamed(self.run_id, self.task, self.round, self.phase, size))

    def take(self) -> Taken | None:
        """What to write now (None: nothing)."""
        with self._lock:
            mark = self._capped and not self._cap_marked
            if not self._parts and not self._dropped and not mark:
                return None
            text, chunks, size = "".join(self._parts), len(self._parts), self._pending
            piece = Piece(self.run_id, self.task, self.round, self.phase, self.execution, text, self._dropped, mark)
            self._parts, self._pending, self._dropped, self._cap_marked = [], 0, 0, self._cap_marked or mark
            return Taken(piece, chunks, size)

    def lost(self, taken: Taken) -> None:
        """The write of ``taken`` failed: its text is dropped (counted, and marked in the next entry)."""
        with self._lock:
            self._dropped += taken.piece.dropped + taken.size
            if taken.piece.capped:
                self._cap_marked = False
        hooks().stream_dropped(StreamDropped("unavailable", taken.chunks, taken.size))

    def end(self) -> concurrent.futures.Future[None] | None:
        """The phase is over: nothing more is taken, and what is left is written now. Returns the
        write to wait for (None: there is nothing to write)."""
        with self._lock:
            if self.closed:
                return None
            self.closed = True
            if not self.written and not self._parts and not self._dropped and not self._capped:
                return None
        return self.flusher().ending(self)

    def end_and_wait(self) -> None:
        """``end``, and wait for the write (at most END_WAIT_S: the outcome is not held up longer)."""
        pending = self.end()
        if pending is None:
            return
        try:
            pending.result(END_WAIT_S)
        except concurrent.futures.TimeoutError:
            self._late()

    async def end_awaited(self) -> None:
        """``end_and_wait`` on an event loop (the asyncio pool's): the write is awaited, not waited for."""
        pending = self.end()
        if pending is None:
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(pending), END_WAIT_S)
        except TimeoutError:
            self._late()

    def _late(self) -> None:
        log.warning("run %s task %s: the end of %s round %s's live text was not written within %.0f s; its outcome "
                    "is recorded without waiting longer", self.run_id, self.task, self.phase, self.round, END_WAIT_S)


class Flusher:
    """The thread that writes the live text of every phase of one process."""

    def __init__(self, writer: StreamWriter, flush_s: float, grace_s: float) -> None:
        self.writer = writer
        self.flush_s = flush_s
        self.keepalive_s = max(min(grace_s / 3, KEEPALIVE_MAX_S), flush_s)
        self._streams: set[PhaseStream] = set()  # phases with text to write, or that wrote and still run
        self._ending: list[tuple[PhaseStream, concurrent.futures.Future[None]]] = []
        self._touched: dict[str, float] = {}  # run id -> when its stream's expiry was last set
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._urgent = threading.Event()
        self._down = False  # the last write failed (logged once per outage)
        threading.Thread(target=self._run, name="taskloop-stream", daemon=True).start()

    def wake(self, stream: PhaseStream, urgent: bool = False) -> None:
        with self._lock:
            self._streams.add(stream)
        if urgent:
            self._urgent.set()
        self._wake.set()

    def ending(self, stream: PhaseStream) -> concurrent.futures.Future[None]:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._streams.add(stream)
            self._ending.append((stream, done))
        self._urgent.set()
        self._wake.set()
        return done

    def _run(self) -> None:
        while True:
            self._wake.wait(self.keepalive_s)
            self._wake.clear()
            self._urgent.wait(self.flush_s)  # let the tokens of the next moments come too
            self._urgent.clear()
            try:
                self.flush()
            except Exception:  # the thread must outlive anything: a phase never waits on it for long
                log.exception("writing live text failed")

    def flush(self) -> None:
        """One write: what every phase holds, and the expiry of the streams that need it."""
        with self._lock:
            ending, self._ending = self._ending, []
            streams = list(self._streams | {stream for stream, _ in ending})
        taken = [(stream, found) for stream in streams if (found := stream.take()) is not None]
        now = time.monotonic()
        runs = {s.run_id for s in streams if s.written and not s.closed}
        touched = {run_id for run_id in runs if now - self._touched.get(run_id, 0.0) >= self.keepalive_s}
        touched |= {s.run_id for s, _ in ending if s.written}
        if taken or touched:
            self._write(taken, touched, now)
        with self._lock:
            self._streams.difference_update(stream for stream, _ in ending)
            live = {s.run_id for s in self._streams}
            self._touched = {run_id: at for run_id, at in self._touched.items() if run_id in live}
        for _, done in ending:
            done.set_result(None)

    def _write(self, taken: list[tuple[PhaseStream, Taken]], touched: set[str], now: float) -> None:
        try:
            self.writer.write([found.piece for _, found in taken], touched)
        except Exception as exc:
            for stream, found in taken:
                stream.lost(found)
            if not self._down:
                log.warning("live text of %d phase(s) dropped: the store did not take it (%s); the phases go on, "
                            "and the text they stream is dropped until it does", len(taken), exc)
            self._down = True
            return
        hooks().stream_written(StreamWritten(len(taken)))
        if self._down:
            log.warning("live text is written again")
            self._down = False
        for stream, _ in taken:
            stream.written = True
        for run_id in {*touched, *(found.piece.run_id for _, found in taken)}:
            self._touched[run_id] = now


_flusher: Flusher | None = None
_flusher_of: tuple[int, str] | None = None
_flusher_lock = threading.Lock()


def flusher(url: str, config: Settings | None = None) -> Flusher:
    """This process's flusher for the store at ``url`` (made on first use: a prefork pool process
    makes its own after the fork)."""
    global _flusher, _flusher_of
    with _flusher_lock:
        if _flusher is None or _flusher_of != (os.getpid(), url):
            config = config or settings()
            _flusher = Flusher(StreamWriter(url, config.stream_grace_s), config.stream_flush_s, config.stream_grace_s)
            _flusher_of = (os.getpid(), url)
        return _flusher


def phase_stream(url: str, run_id: str, task: str, round: int, phase: str,
                 config: Settings | None = None) -> PhaseStream:
    """The live text of one execution of a phase (nothing is written until it streams)."""
    config = config or settings()
    return PhaseStream(lambda: flusher(url, config), run_id, task, round, phase, config.stream_max_bytes)

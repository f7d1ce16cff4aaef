"""Live pages: a server-sent event stream per open run page, fed by a blocking read of the run's
event stream (XREAD BLOCK on the run's own stream, so an idle run costs nothing but a parked
read); and the run's live text (``ctx.stream``) as server-sent events (``text_stream``), which
the page's script (static/ui.js) puts under each round.

Each event that a write adds wakes the stream, which renders the run's body again and sends it
as one SSE message (``event: run``) that htmx swaps into the page. Writes that come close
together are sent as one message: a stream renders ``COALESCE_S`` after the write that woke it,
and at most once per ``MIN_INTERVAL_S``, so a page updates within about a second of an event and
a busy run costs the UI at most one render per open page and interval. A comment line every
``BLOCK_S`` seconds keeps proxies from closing the connection.

The number of open streams is capped (``--max-streams``): a page over the cap gets one message
saying so and a ``retry`` hint, and its browser tries again later. A closed tab ends its
stream at once (Starlette cancels it on disconnect); the read it had parked returns within
``BLOCK_S`` seconds and frees its thread.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import anyio.to_thread

from taskloop.base.errors import TaskLoopError
from taskloop.core.events import Event
from taskloop.core.streamed import StreamChunk
from taskloop.store.redis_store import RedisStore

BLOCK_S = 5.0  # one parked read; also the keep-alive interval
COALESCE_S = 0.25
MIN_INTERVAL_S = 1.0
FULL_RETRY_MS = 10_000
_ENDED = object()  # what reading the live text returns once the run has ended


class Streams:
    """The open streams of one UI process, capped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.served = 0  # streams opened since start (the fleet page shows both)
        # a parked read holds a thread until it returns: room for the cap, and for reads that a
        # closed tab left parked for up to BLOCK_S
        self.threads = anyio.CapacityLimiter(max(2 * limit, 4))

    def full(self) -> bool:
        return self.open >= self.limit


def message(event: str, data: str) -> str:
    """One SSE message: every line of ``data`` as a ``data:`` line."""
    lines = "".join(f"data: {line}\n" for line in data.split("\n"))
    return f"event: {event}\n{lines}\n"


async def _counted(streams: Streams, body: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream of ``body``'s messages that takes a place among the UI's open streams for as long as
    it runs, or, when the UI serves its cap already, one message saying so."""
    if streams.full():
        yield f"retry: {FULL_RETRY_MS}\n" + message(
            "full", f"Live updates are paused: this UI serves {streams.limit} live pages at most. "
                    "This page tries again in a few seconds.")
        return
    streams.open += 1
    streams.served += 1
    try:
        yield "retry: 2000\n: open\n\n"
        async for part in body:
            yield part
    finally:
        streams.open -= 1


def text_stream(streams: Streams, chunks: Iterator[StreamChunk | None],
                ended: Callable[[], dict[str, object]]) -> AsyncIterator[str]:
    """A run's live text as server-sent events: ``event: chunk`` per chunk (its entry id as the
    event's id, so that a browser that reconnects goes on after it: ``Last-Event-ID``), a comment
    when a read found nothing new, and ``event: end`` with the run's status once it has ended (the
    page then closes the stream). Each read of ``chunks`` runs on a thread (it blocks in Redis)."""
    async def body() -> AsyncIterator[str]:
        while True:
            try:
                chunk = await anyio.to_thread.run_sync(next, chunks, _ENDED, limiter=streams.threads)
            except TaskLoopError as exc:  # the store went away: say so; the browser tries again
                yield message("error", json.dumps({"type": type(exc).__name__, "message": str(exc)}))
                return
            if chunk is _ENDED:
                break
            if chunk is None:
                yield ": idle\n\n"
                continue
            assert isinstance(chunk, StreamChunk)
            yield f"id: {chunk.id}\n" + message("chunk", json.dumps(chunk.as_json()))
        yield message("end", json.dumps(await anyio.to_thread.run_sync(ended, limiter=streams.threads)))
    return _counted(streams, body())


def run_stream(streams: Streams, store: RedisStore, run_id: str, after: str,
               render: Callable[[], str]) -> AsyncIterator[str]:
    """The stream of one open run page: the run's body, again after each write to it. ``after``
    is the last stream entry the page was rendered with."""
    async def body() -> AsyncIterator[str]:
        last = after
        rendered = 0.0
        while True:
            found: list[Event] = await anyio.to_thread.run_sync(
                store.block_events, run_id, last, int(BLOCK_S * 1000), limiter=streams.threads)
            if not found:
                yield ": idle\n\n"
                continue
            loop = asyncio.get_running_loop()
            # let the writes that follow at once come too, and keep to one render per interval
            await asyncio.sleep(max(COALESCE_S, rendered + MIN_INTERVAL_S - loop.time()))
            last = found[-1].entry_id or last
            more: list[Event] = await anyio.to_thread.run_sync(
                store.block_events, run_id, last, 1, limiter=streams.threads)
            if more:
                last = more[-1].entry_id or last
            html = await anyio.to_thread.run_sync(render, limiter=streams.threads)
            rendered = loop.time()
            yield message("run", html)
    return _counted(streams, body())

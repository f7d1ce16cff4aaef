"""A run's live text in Redis (SPEC §13): one stream per run, ``tl:{R}:stream`` (store/keys.py),
an entry per coalesced piece of a phase's text (core/streamed.py).

Writing (``StreamWriter``): a worker process writes the pieces of all the phases it runs in one
pipeline, on a client of its own that does not retry and gives up after ``WRITE_TIMEOUT_S``, so
that an unreachable store costs the phases a dropped piece, never a wait (the flusher of
taskloop/worker/execution/streaming.py counts the drop). Every write sets the expiry of the
streams it touches to ``TASKLOOP_STREAM_GRACE_S`` from now; as every write uses the same
period, the last write decides, and a stream lasts that long past the last phase that wrote to it
(its end, or the flusher's keep-alive of a phase still running).

Reading (``Streams``, mixed into RedisStore): the entries after one (``XRANGE``), and a blocking
read of the run's live text and its events together (``XREAD BLOCK`` on both streams, one slot),
which wakes for a piece of text and for the event that ends the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from taskloop.connections import clients
from taskloop.core.events import Event, from_entry
from taskloop.core.streamed import Piece
from taskloop.store import keys as k
from taskloop.store.calls import wrap

WRITE_TIMEOUT_S = 2.0  # a write of live text that takes longer is dropped (the phase goes on)
STREAM_MAXLEN = 100_000  # entries kept per run (XADD MAXLEN ~): a phase's cap bounds its bytes
READ_COUNT = 1000  # entries per read

Entry = tuple[str, dict[str, str]]


class StreamWriter:
    """Appends pieces of live text for one process, on a client of its own (made on first use)."""

    def __init__(self, url: str, grace_s: float) -> None:
        self.url = url
        self.ttl_ms = max(int(grace_s * 1000), 1)
        self._client: Any = None

    @wrap
    def write(self, pieces: Sequence[Piece], touched: Iterable[str] = ()) -> None:
        """Append ``pieces`` (in order) and set the expiry of their runs' streams and of the runs
        in ``touched`` (phases that ended, or still run: kept alive), in one round trip."""
        if self._client is None:
            self._client = clients.store_client(self.url, retries=0, socket_timeout=WRITE_TIMEOUT_S,
                                                health_check=False)
        pipe = self._client.pipeline(transaction=False)
        for piece in pieces:
            pipe.xadd(k.RunKeys.of(piece.run_id).stream, piece.fields(),
                      maxlen=STREAM_MAXLEN, approximate=True)
        for run_id in dict.fromkeys([*(p.run_id for p in pieces), *touched]):
            pipe.pexpire(k.RunKeys.of(run_id).stream, self.ttl_ms)
        try:
            pipe.execute()
        except BaseException:
            clients.disconnect(self._client)  # a reply that comes late must not be read by the next write
            raise

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class Streams:
    """Reads of a run's live text, for RedisStore (its client and blocking reads)."""

    client: Any

    @wrap
    def stream_entries(self, run_id: str, after: str = "0-0") -> list[Entry]:
        """The run's live-text entries after entry ``after`` ("0-0": all of them), in order."""
        key = k.RunKeys.of(run_id).stream
        found: list[Entry] = []
        while True:
            entries = self.client.xrange(key, f"({after}" if after != "0-0" else "-", "+", count=READ_COUNT)
            found += [(entry_id, dict(fields)) for entry_id, fields in entries]
            if len(entries) < READ_COUNT:
                return found
            after = entries[-1][0]

    @wrap
    def block_stream(self, run_id: str, after: str, events_after: str,
                     block_ms: int) -> tuple[list[Entry], list[Event]]:
        """Wait up to ``block_ms`` for live-text entries after ``after`` or events after
        ``events_after`` ("$": from now on), and return both (nothing: the wait ran out)."""
        keys = k.RunKeys.of(run_id)
        reply: Any = self._block(block_ms / 1000.0,  # type: ignore[attr-defined]
                                 lambda c: c.xread({keys.stream: after, keys.events: events_after},
                                                   count=READ_COUNT, block=max(block_ms, 1)), [])
        entries: list[Entry] = []
        events: list[Event] = []
        for name, found in reply or []:
            if name == keys.stream:
                entries = [(entry_id, dict(fields)) for entry_id, fields in found]
            else:
                events = [e for entry_id, fields in found for e in from_entry(run_id, entry_id, fields)]
        return entries, events

"""A run page's model reads the run's fields and its events in two calls; a live page then follows
the run's stream from the last event it showed. A write that lands between the two reads must
reach the page: either the fields already show it, or its event comes after the page's last one.
Real redis-server; the write is a real cancel, made from inside the first read."""

from __future__ import annotations

import time
from typing import Any

from taskloop.runtime import views
from taskloop.store.redis_store import RedisStore
from tests.integration import control_flows as cf


class _WriteAfterFirstRead:
    """The store, with a real write made right after the page's first read of the run."""

    def __init__(self, store: RedisStore, write: Any) -> None:
        self._store = store
        self._write = write
        self.order: list[str] = []

    def _then_write(self, name: str, value: Any) -> Any:
        self.order.append(name)
        if len(self.order) == 1:
            self._write()
        return value

    def events(self, run_id: str, after: str | None = None) -> Any:
        return self._then_write("events", self._store.events(run_id, after))

    def all_fields(self, run_id: str) -> Any:
        return self._then_write("fields", self._store.all_fields(run_id))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_write_between_the_pages_reads_is_in_its_fields_or_after_its_last_event(client) -> None:
    # Given a run held in its attempt (no worker takes it here: its phase stays queued)
    run_id = f"view-race-{time.time_ns()}"
    client.start(cf.cancellable, input={"hold": "attempt"}, run_id=run_id)
    store = _WriteAfterFirstRead(client.store, lambda: client.cancel(run_id, reason="between the reads"))

    # When the page's model is read while a cancel lands after its first read
    run, events = views.run_view_and_events(store, run_id)  # type: ignore[arg-type]

    # Then the page shows the cancel, or the cancel's event is after the last event the page follows from
    last = next((e.entry_id for e in reversed(events) if e.entry_id), "0-0")
    later = client.store.block_events(run_id, last, 1)  # what the live page reads next
    cancel_events = [e for e in client.store.events(run_id) if e.type == "run.cancel"]
    assert len(cancel_events) == 1
    assert "run.cancel" in [e.type for e in later], "the live page must still receive the write it missed"
    assert run.control is not None and run.control.endswith("between the reads")
    assert store.order == ["events", "fields"]

"""Waiting for a run: ``client.wait`` blocks on the run's end marker (one wake-up), or reads its
events as they are appended when observers listen, and rides out a Redis outage."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from taskloop.base import clock, names
from taskloop.base.config import Settings
from taskloop.base.errors import RunTimeout, StoreUnavailable
from taskloop.core import events as ev
from taskloop.core.events import Event, Observer, notify
from taskloop.core.snapshot import RunMeta
from taskloop.core.states import TERMINAL_RUN
from taskloop.runtime import views
from taskloop.runtime.models import RunResult
from taskloop.store.redis_store import RedisStore

log = logging.getLogger("taskloop.client")
_TERMINAL = {s.value for s in TERMINAL_RUN}
_WAIT_SLICE_S = 5.0


class WaitingClient(Protocol):
    """What waiting needs of the client (runtime/client.py's TaskLoop): its store and settings, its
    observers, and a run's meta fields (its result is built on the last read of them)."""

    store: RedisStore
    settings: Settings
    _observers: list[Observer]

    def _meta(self, run_id: str) -> RunMeta: ...


class Outage:
    """How a waiting client rides out a Redis outage: back off, say so, and give up only after
    ``limit`` seconds without an answer (then StoreUnavailable)."""

    def __init__(self, limit: float, notice: Callable[[str], None]) -> None:
        self.limit = limit
        self.notice = notice
        self.since: float | None = None
        self.delay = 0.1

    def failed(self, exc: StoreUnavailable, deadline: float | None) -> None:
        now = clock.now()
        if self.since is None:
            self.since = now
            self.notice(f"Redis unreachable, retrying for up to {self.limit:g}s ({exc})")
        if now - self.since >= self.limit:
            raise exc
        if deadline is not None and now >= deadline:
            raise RunTimeout(f"gave up waiting: Redis has been unreachable for {now - self.since:.1f}s "
                             "and the wait's timeout passed") from exc
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 2.0)

    def recovered(self) -> None:
        if self.since is not None:
            self.notice(f"Redis reachable again after {clock.now() - self.since:.1f}s")
        self.since = None
        self.delay = 0.1


def wait(client: WaitingClient, run_id: str, timeout: float | None = None, on_event: Observer | None = None,
         on_notice: Callable[[str], None] | None = None) -> RunResult:
    """Block until the run ends and return its result. Without observers it blocks on the run's
    end marker (one wake-up); with observers it reads every event as it is appended.
    The run's status is read first, also for a run just started: a run that has ended may be
    compacted already, and a compacted run has no end marker to block on (store/compacted.py).

    A Redis outage shorter than ``TASKLOOP_WAIT_OUTAGE_S`` (30 s) is ridden out with backoff
    (``on_notice`` hears about it); the wait keeps its place in the event stream."""
    names.check_run_id(run_id)
    deadline = None if timeout is None else clock.now() + timeout
    notice = on_notice or (lambda message: log.warning("%s", message))
    outage = Outage(client.settings.wait_outage_s, notice)
    status: str | None = None
    meta: RunMeta | None = None  # the last read of the run's meta fields (the result is built on it)
    result: RunResult | None = None  # read with the meta once the end marker woke the wait
    while status is None:
        try:
            meta = client._meta(run_id)
            status = meta.stored_status
        except StoreUnavailable as exc:
            outage.failed(exc, deadline)
    outage.recovered()
    observers = [*client._observers, *([on_event] if on_event else [])]
    last = "0-0"
    failures: list[dict[str, str]] = []
    # The first block pipelines the result's read behind it: a run that ends within it (most short
    # runs) costs no round trip after the wake. Later blocks wait alone, so a long run's wait does
    # not scan its records at every slice.
    first = True
    # Observers hear every event of the run, also when it ended before this wait began.
    while status not in _TERMINAL or observers:
        remaining = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, deadline - clock.now())
        if remaining <= 0 and status not in _TERMINAL:
            raise RunTimeout(
                f"run {run_id} did not finish within {timeout}s (status {status}); it keeps running: "
                "wait again, or look at it with `taskloop inspect`"
            )
        try:
            woken: tuple[RunMeta, RunResult | None] | None = None  # the run ended: its meta and result
            events: list[Event] = []
            if not observers:
                if first:  # the result's read rides on the wake (views.woken_result)
                    first = False
                    woken = views.woken_result(client.store, run_id, int(remaining * 1000))
                elif client.store.block_end(run_id, int(remaining * 1000)):
                    woken = views.meta_and_result(client.store, run_id)  # one read (both at once)
            else:  # an ended run's events are all there: read them without blocking
                block_ms = 1 if status in _TERMINAL else int(remaining * 1000)
                events = client.store.block_events(run_id, last, block_ms)
            outage.recovered()
            if events:
                last = events[-1].entry_id or last
                failures += notify(observers, events)
                if any(e.type == ev.RUN_FINISHED for e in events):
                    woken = views.meta_and_result(client.store, run_id)
            if woken is not None:
                meta, result = woken
                status = meta.stored_status
                if status in _TERMINAL:
                    break
                continue  # it ended once, and was resumed since: its later events follow
            if not events:
                if status in _TERMINAL:
                    break  # read to the end (its last events expired or were trimmed)
                meta = client._meta(run_id)
                status = meta.stored_status
        except StoreUnavailable as exc:
            outage.failed(exc, deadline)
    while result is None:
        try:
            assert meta is not None
            result = views.run_result(client.store, run_id, meta)  # on the status just read: no second read
            outage.recovered()
            break
        except StoreUnavailable as exc:
            outage.failed(exc, deadline)
    assert result is not None
    if failures:
        result = result.model_copy(update={"observer_errors": [*result.observer_errors, *failures]})
    return result


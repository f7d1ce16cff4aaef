"""One background thread per worker process that watches every phase the process is running,
whatever their number: its Redis calls are per interval, not per phase.

Every ``TASKLOOP_WATCH_INTERVAL_S`` (0.2 s), for all the phases it watches, it

- sets ``ctx.signal`` with reason ``timeout`` when a round's deadline passes (no Redis: it wakes
  at the deadline);
- reads the **controls feed** once (store/running.py: one ``XREAD`` of the runs whose control flag
  was set, a cancel or a stop) and, only for those of its runs that appear there, their flags
  (one pipelined read), setting the signal with the run's reason;
- writes, in one round trip, the begins of the phases that have run ``MARK_S`` before their begin
  was written (worker/execution/deferred.py): from then on each holds a running lease; a begin
  that is refused sets the signal (the run's reason, or ``superseded``);
- renews, in one call (renew.lua), the leases of the phases whose last renewal is a third of a
  lease old, each guarded by its record: a phase that was taken over learns it (reason
  ``superseded``), and the run's control flag comes back with it, so a cancel the feed did not
  carry (a crash between a cancel's write and its announcement) is seen within a third of a lease;
- calls a phase's ``overrun`` hook once when its callback ignored its signal for longer than the
  grace period (``TASKLOOP_TIMEOUT_GRACE_S`` after a deadline, ``TASKLOOP_CANCEL_GRACE_S`` after
  a cancel or stop): the executor records the outcome (worker/execution/running.py).

When Redis cannot be reached the watcher says so and goes on with what needs no Redis (deadlines,
overruns); once the feed answers again it reads the control flag of every run it watches once,
since announcements may have been trimmed meanwhile. Idle (no phase running), it makes no call.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import StoreAccessDenied, StoreUnavailable
from taskloop.core.leases import lease_until
from taskloop.core.rules import control_reason
from taskloop.define.context import Signal
from taskloop.runtime.commit import renew
from taskloop.store.redis_store import RedisStore
from taskloop.store.running import CONTROLS_LOOKBACK_S, Renewal
from taskloop.worker.execution.deferred import MARK_S, Deferred, mark_all
from taskloop.worker.execution.running import Call

log = logging.getLogger("taskloop.watcher")


@dataclass
class _Watch:
    run_id: str
    key: str
    token: int  # the fencing token of the record its execution began: its renewals' guard
    signal: Signal
    deadline: float | None
    overrun: Callable[[str], object]
    overran: bool = False
    renew: Callable[[float], None] | None = None  # renews what else the phase holds until then (limit slots)
    deferred: Deferred | None = None  # its begin is not written yet: written after MARK_S (deferred.py)
    id: int = 0  # its key in the watcher's tables and heap
    gone: bool = False  # its callback returned: its entries in the heaps are dropped when they come up

    @property
    def leased(self) -> bool:
        """Whether it holds a running lease (begun before it ran, or marked since)."""
        return self.deferred is None or self.deferred.marked is not None


# what a heap entry is due for
DEADLINE, MARK, RENEW, OVERRUN = "deadline", "mark", "renew", "overrun"


class Watcher:
    """The process's watcher thread and what it watches. Each phase has its due times in one heap
    (its deadline, its mark, its next renewal, the end of its grace), so that a tick costs what is
    due, not the number of phases in flight."""

    def __init__(self, store: RedisStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self._watches: dict[int, _Watch] = {}
        self._by_run: dict[str, set[int]] = {}
        self._due: list[tuple[float, int, str]] = []  # (when, watch id, what): a heap
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._feed: str | None = None  # the feed entry read up to (None: not following it)
        self._feed_lost = False  # a read of the feed failed: read every watched run's flag once it answers
        self._no_feed = False  # the store refuses the feed (an ACL without it): read every run's flag instead
        self._recent: dict[str, float] = {}  # runs announced lately -> when the feed showed them
        self._check: set[int] = set()  # watches whose run was announced around the time they started
        self._polled_at = 0.0

    @property
    def watching(self) -> int:
        return len(self._watches)

    @contextmanager
    def watch(self, call: Call, overrun: Callable[[str], object]) -> Iterator[None]:
        """Watch a phase while its callback runs: its deadline, its run's cancel, its lease."""
        watch_id = next(self._ids)
        deadline = call.record.deadline
        run_id = call.snap.run_id
        with self._lock:
            now = clock.now()
            watch = _Watch(run_id, call.task.key, call.record.token, call.signal, deadline, overrun,
                           renew=call.renew, deferred=call.deferred, id=watch_id)
            self._watches[watch_id] = watch
            if run_id in self._recent:
                self._check.add(watch_id)
            self._by_run.setdefault(run_id, set()).add(watch_id)
            if deadline is not None:
                heapq.heappush(self._due, (deadline, watch_id, DEADLINE))
            if call.deferred is not None:
                heapq.heappush(self._due, (call.deferred.started + MARK_S, watch_id, MARK))
            else:
                heapq.heappush(self._due, (now + self.settings.running_lease_s / 3, watch_id, RENEW))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="taskloop-watcher", daemon=True)
                self._thread.start()
        call.signal.on_set(lambda reason: self._signalled(watch))
        if deadline is not None or call.deferred is not None:
            self._wake.set()  # re-plan the next wake-up with this due time in view
        try:
            yield
        finally:
            with self._lock:
                watch.gone = True
                del self._watches[watch_id]
                runs = self._by_run.get(run_id)
                if runs is not None:
                    runs.discard(watch_id)
                    if not runs:
                        del self._by_run[run_id]

    def supersede(self, run_id: str, key: str) -> int:
        """Set the signal (reason ``superseded``) of the phases of ``run_id``'s task ``key`` that run
        here: what a shared pool does for a phase handed back at shutdown, whose process runs on."""
        with self._lock:
            found = [self._watches[i] for i in self._by_run.get(run_id, ()) if self._watches[i].key == key]
        for watch in found:
            watch.signal.set("superseded")
        return len(found)

    def _signalled(self, watch: _Watch) -> None:
        """A phase's signal was set: its grace period ends the overrun's wait (none for superseded)."""
        if watch.signal.reason == "superseded" or watch.signal.set_at is None:
            return
        grace = self.settings.timeout_grace_s if watch.signal.reason == "timeout" else self.settings.cancel_grace_s
        with self._lock:
            heapq.heappush(self._due, (watch.signal.set_at + grace, watch.id, OVERRUN))
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self._next_wait())
            self._wake.clear()
            with self._lock:
                idle = not self._watches
                if idle:  # what is left in the heap is of phases that ended: none of it is due
                    self._due.clear()
            if idle:
                self._feed = None  # idle: stop following the feed (a restart reads CONTROLS_LOOKBACK_S back)
                self._recent.clear()
                continue
            self.tick()

    def _next_wait(self) -> float:
        wait = self.settings.watch_interval_s
        with self._lock:
            while self._due and self._due[0][1] not in self._watches:  # of a phase that ended
                heapq.heappop(self._due)
            if self._due:
                wait = min(wait, max(self._due[0][0] - clock.now(), 0.0))
        return wait

    def _take_due(self, now: float) -> dict[str, list[_Watch]]:
        """The watches due now, by what for (their entries leave the heap)."""
        found: dict[str, list[_Watch]] = {DEADLINE: [], MARK: [], RENEW: [], OVERRUN: []}
        with self._lock:
            while self._due and self._due[0][0] <= now:
                _, watch_id, what = heapq.heappop(self._due)
                watch = self._watches.get(watch_id)
                if watch is not None and not watch.gone:
                    found[what].append(watch)
        return found

    def _again(self, when: float, watch: _Watch, what: str) -> None:
        """Due again at ``when`` (under the lock)."""
        if not watch.gone:
            heapq.heappush(self._due, (when, watch.id, what))

    def tick(self) -> None:
        """One look at what is due (each part goes on when another fails)."""
        now = clock.now()
        due = self._take_due(now)
        for watch in due[DEADLINE]:
            watch.signal.set("timeout")
        parts: list[tuple[Callable[[list[_Watch], float], None], list[_Watch]]] = [
            (self._controls, []), (self._marks, due[MARK]), (self._renewals, due[RENEW])]
        for part, watched in parts:
            try:
                part(watched, now)
            except StoreUnavailable as exc:
                log.warning("watcher cannot reach Redis: %s", exc)
                self._retry(watched, now)
            except Exception:  # the watcher must survive anything
                log.exception("watcher failed (%s)", part.__name__)
                self._retry(watched, now)
        for watch in due[OVERRUN]:
            try:
                self._overrun(watch)
            except Exception:
                log.exception("watcher failed on %s/%s", watch.run_id, watch.key)

    def _retry(self, watches: list[_Watch], now: float) -> None:
        """Marks and renewals that failed are due again at the next interval."""
        with self._lock:
            for watch in watches:
                what = MARK if watch.deferred is not None and not watch.deferred.settled else RENEW
                self._again(now + self.settings.watch_interval_s, watch, what)

    # cancels --------------------------------------------------------------------------------
    def _controls(self, _: list[_Watch], now: float) -> None:
        """Once per interval: the runs the feed announced (or, after a gap, every watched run), then
        their flags."""
        if now - self._polled_at < self.settings.watch_interval_s:
            return
        self._polled_at = now
        with self._lock:
            check = {self._watches[i].run_id for i in self._check if i in self._watches}
            self._check.clear()
        everything = False
        if self._no_feed:
            everything = True
        else:
            try:
                self._feed, announced = self.store.controls_after(self._feed)
            except StoreAccessDenied as exc:
                log.warning("the store refuses the controls feed (%s); each watched run's control flag is read "
                            "every interval instead", exc)
                self._no_feed = everything = True
            except StoreUnavailable:
                self._feed_lost = True
                raise
            else:
                if self._feed_lost:  # announcements may have been trimmed while the feed was away
                    everything = True
                    self._feed_lost = False
                for run_id in announced:
                    self._recent[run_id] = now
                check.update(announced)
                for run_id, seen in list(self._recent.items()):
                    if now - seen > CONTROLS_LOOKBACK_S:
                        del self._recent[run_id]
        with self._lock:
            if everything:
                check = set(self._by_run)
            watched = {run_id: [self._watches[i] for i in self._by_run.get(run_id, ()) if i in self._watches]
                       for run_id in check}
        check = {run_id for run_id, found in watched.items() if found}
        if not check:
            return
        flags = self.store.controls_of(sorted(check))
        for run_id, flag in flags.items():
            reason = control_reason(flag)
            for watch in watched.get(run_id, ()):
                if reason is not None:
                    watch.signal.set(reason)

    # begins and leases ----------------------------------------------------------------------
    def _marks(self, due: list[_Watch], now: float) -> None:
        """The begins of the phases that ran MARK_S before theirs was written, in one round trip."""
        due = [watch for watch in due if watch.deferred is not None and not watch.deferred.settled]
        if not due:
            return
        mark_all(self.store, [watch.deferred for watch in due if watch.deferred is not None])
        refused: list[tuple[_Watch, str]] = []
        with self._lock:
            for watch in due:
                deferred = watch.deferred
                assert deferred is not None
                if deferred.marked is not None:
                    watch.token = deferred.marked.token(watch.key)
                    self._again(now + self.settings.running_lease_s / 3, watch, RENEW)
                elif deferred.refused is not None:
                    refused.append((watch, deferred.refused))
                elif not deferred.settled:
                    self._again(now + self.settings.watch_interval_s, watch, MARK)
        # Signals are set outside the lock: setting one calls its listeners, and the watcher's own
        # (_signalled, which schedules the overrun) takes the lock.
        for watch, reason in refused:
            watch.signal.set(reason)

    def _renewals(self, due: list[_Watch], now: float) -> None:
        """The leases a third of a lease old, renewed in one call."""
        lease = self.settings.running_lease_s
        due = [watch for watch in due if watch.leased and watch.signal.reason != "superseded"]
        if not due:
            return
        untils = [lease_until(now, watch.deadline, lease, self.settings.timeout_grace_s) for watch in due]
        found = renew(self.store, [Renewal(w.run_id, w.key, w.token, until) for w, until in zip(due, untils,
                                                                                              strict=True)])
        with self._lock:
            for watch in due:
                self._again(now + lease / 3, watch, RENEW)
        for watch, until, renewed in zip(due, untils, found, strict=True):
            if not renewed.renewed:
                watch.signal.set("superseded")
                continue
            reason = control_reason(renewed.control)
            if reason is not None:
                watch.signal.set(reason)
            if watch.renew is not None:
                try:
                    watch.renew(until)
                except StoreUnavailable as exc:
                    log.warning("watcher could not renew the slots of %s/%s: %s", watch.run_id, watch.key, exc)

    def _overrun(self, watch: _Watch) -> None:
        if watch.overran or not watch.signal.cancelled or watch.signal.reason == "superseded":
            return
        watch.overran = True
        watch.overrun(watch.signal.reason or "cancelled")

"""One background thread per worker process that watches the phases it is running.

For each running phase it:

- sets ``ctx.signal`` with reason ``timeout`` when the round's deadline passes, and with the
  run's reason when the run is cancelled or stopped (polling the run's control field every
  ``TASKLOOP_WATCH_INTERVAL_S``);
- renews the phase's lease, guarded by the phase record: a worker whose phase was taken over
  learns it (its signal is set with reason ``superseded``);
- writes the begin of a phase that runs before its begin is written (worker/execution/deferred.py) once it
  has run ``MARK_S``: from then on the phase holds a running lease, renewed as above; a begin that
  is refused sets the signal (the run's reason, or ``superseded``);
- calls the phase's ``overrun`` hook once when the callback ignored its signal for longer
  than the grace period (``TASKLOOP_TIMEOUT_GRACE_S`` after a deadline,
  ``TASKLOOP_CANCEL_GRACE_S`` after a cancel or stop): the executor records the outcome and
  stops the process.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import StoreUnavailable
from taskloop.core import fields as fld
from taskloop.core.batch import Batch
from taskloop.core.phases import lease_until
from taskloop.core.rules import control_reason
from taskloop.define.context import Signal
from taskloop.runtime.commit import write
from taskloop.store.redis_store import Conflict, RedisStore
from taskloop.worker.execution.deferred import MARK_S, Deferred

log = logging.getLogger("taskloop.watcher")


@dataclass
class _Watch:
    run_id: str
    key: str
    raw_record: str
    signal: Signal
    deadline: float | None
    overrun: Callable[[str], None]
    renewed_at: float
    polled_at: float = 0.0
    overran: bool = False
    renew: Callable[[float], None] | None = None  # renews what else the phase holds until then (limit slots)
    deferred: Deferred | None = None  # its begin is not written yet: written after MARK_S (deferred.py)


class Watcher:
    def __init__(self, store: RedisStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self._watches: dict[int, _Watch] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watch(self, run_id: str, key: str, raw_record: str, signal: Signal, deadline: float | None,
              overrun: Callable[[str], None], renew: Callable[[float], None] | None = None,
              deferred: Deferred | None = None) -> Iterator[None]:
        watch_id = next(self._ids)
        with self._lock:
            now = clock.now()
            self._watches[watch_id] = _Watch(run_id, key, raw_record, signal, deadline, overrun, now, polled_at=now,
                                             renew=renew, deferred=deferred)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="taskloop-watcher", daemon=True)
                self._thread.start()
        if deadline is not None:
            self._wake.set()  # re-plan the next wake-up with this deadline in view
        try:
            yield
        finally:
            with self._lock:
                del self._watches[watch_id]

    def _loop(self) -> None:
        while True:
            self._wake.wait(self._next_wait())
            self._wake.clear()
            with self._lock:
                watches = list(self._watches.values())
            for watch in watches:
                try:
                    self._check(watch)
                except StoreUnavailable as exc:
                    log.warning("watcher cannot reach Redis: %s", exc)
                except Exception:  # the watcher must survive anything
                    log.exception("watcher failed on %s/%s", watch.run_id, watch.key)

    def _next_wait(self) -> float:
        wait = self.settings.watch_interval_s
        now = clock.now()
        with self._lock:
            for watch in self._watches.values():
                if watch.deadline is not None and not watch.signal.cancelled:
                    wait = min(wait, max(watch.deadline - now, 0.0))
                if watch.deferred is not None and not watch.deferred.settled \
                        and now < watch.deferred.started + MARK_S:  # after that, every interval (a retry)
                    wait = min(wait, watch.deferred.started + MARK_S - now)
        return wait

    def _mark(self, watch: _Watch, now: float) -> bool:
        """Write the begin of a deferred phase that has run MARK_S; whether the phase holds its
        running lease now (its renewals are then due as for any running phase)."""
        deferred = watch.deferred
        if deferred is None:
            return True
        if not deferred.settled and now - deferred.started >= MARK_S:
            mark = deferred.mark()
            if mark is not None:
                watch.raw_record = mark.raw(watch.key)
                watch.renewed_at = now
            elif deferred.refused is not None:
                watch.signal.set(deferred.refused)
        return deferred.marked is not None

    def _check(self, watch: _Watch) -> None:
        now = clock.now()
        if watch.deadline is not None and now >= watch.deadline:
            watch.signal.set("timeout")
        if now - watch.polled_at >= self.settings.watch_interval_s:
            watch.polled_at = now
            (control,) = self.store.hmget(watch.run_id, [fld.F_CONTROL])
            reason = control_reason(control)
            if reason is not None:
                watch.signal.set(reason)
        lease = self.settings.running_lease_s
        if self._mark(watch, now) and now - watch.renewed_at >= lease / 3:
            until = lease_until(now, watch.deadline, lease, self.settings.timeout_grace_s)
            batch = Batch(watch.run_id).expect(fld.task_field(watch.key), watch.raw_record).lease(watch.key, until)
            if isinstance(write(self.store, batch), Conflict):
                watch.signal.set("superseded")
            elif watch.renew is not None:
                watch.renew(until)
            watch.renewed_at = now
        if watch.overran or not watch.signal.cancelled or watch.signal.reason == "superseded":
            return
        grace = self.settings.timeout_grace_s if watch.signal.reason == "timeout" else self.settings.cancel_grace_s
        assert watch.signal.set_at is not None
        if now >= watch.signal.set_at + grace:
            watch.overran = True
            watch.overrun(watch.signal.reason or "cancelled")

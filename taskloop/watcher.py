"""One background thread per worker process that watches the phases it is running.

For each running phase it sets ``ctx.signal`` when the run is cancelled or stopped (polling the
run's control field every ``TASKLOOP_WATCH_INTERVAL_S``) or when the round's deadline passes,
and it renews the phase's lease (guarded by the phase record, so a worker whose phase was taken
over learns it: its signal is set with reason ``superseded``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from taskloop import clock
from taskloop.context import Signal
from taskloop.errors import StoreUnavailable
from taskloop.scheduler import control_reason
from taskloop.store import Batch, RedisStore

log = logging.getLogger("taskloop.watcher")


@dataclass
class _Watch:
    run_id: str
    key: str
    raw_record: str
    signal: Signal
    deadline: float | None
    lease_s: float
    renewed_at: float


class Watcher:
    def __init__(self, store: RedisStore, interval: float) -> None:
        self.store = store
        self.interval = interval
        self._watches: dict[int, _Watch] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watch(
        self, run_id: str, key: str, raw_record: str, signal: Signal, deadline: float | None, lease_s: float
    ) -> Iterator[None]:
        watch_id = next(self._ids)
        with self._lock:
            self._watches[watch_id] = _Watch(run_id, key, raw_record, signal, deadline, lease_s, clock.now())
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="taskloop-watcher", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                del self._watches[watch_id]

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval)
            with self._lock:
                watches = list(self._watches.values())
            for watch in watches:
                try:
                    self._check(watch)
                except StoreUnavailable as exc:
                    log.warning("watcher cannot reach Redis: %s", exc)
                except Exception:  # the watcher must survive anything
                    log.exception("watcher failed on %s/%s", watch.run_id, watch.key)

    def _check(self, watch: _Watch) -> None:
        now = clock.now()
        if watch.deadline is not None and now >= watch.deadline:
            watch.signal.set("timeout")
        (control,) = self.store.run_fields(watch.run_id, "ctl")
        reason = control_reason(control)
        if reason is not None:
            watch.signal.set(reason)
        if now - watch.renewed_at >= watch.lease_s / 3:
            lease = max(watch.lease_s, (watch.deadline or now) - now + watch.lease_s)
            batch = Batch(watch.run_id).expect_task(watch.key, watch.raw_record).lease(watch.key, now + lease)
            if self.store.apply(batch) is not None:
                watch.signal.set("superseded")
            watch.renewed_at = now

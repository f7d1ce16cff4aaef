"""The watcher's schedule (taskloop/worker/liveness/watcher.py): what is due of a phase that ended
is dropped, so an idle watcher sleeps its interval instead of spinning; a refused begin signals its
phase without hanging the watcher."""

from __future__ import annotations

import heapq
import threading
from types import SimpleNamespace

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.define.context import Signal
from taskloop.worker.execution import deferred as deferred_module
from taskloop.worker.liveness import watcher as watcher_module
from taskloop.worker.liveness.watcher import DEADLINE, RENEW, Watcher

SETTINGS = Settings(redis_url="redis://127.0.0.1:1/0", broker_url="redis://127.0.0.1:1/0")


def test_due_times_of_phases_that_ended_do_not_wake_the_watcher() -> None:
    watcher = Watcher(store=None, settings=SETTINGS)  # type: ignore[arg-type]  # no Redis call is made
    past = clock.now() - 5.0
    heapq.heappush(watcher._due, (past, 1, DEADLINE))  # a phase that ended, whose deadline had passed
    heapq.heappush(watcher._due, (past, 2, RENEW))
    assert watcher._next_wait() == SETTINGS.watch_interval_s
    assert watcher._due == []


def test_a_watcher_with_nothing_to_watch_supersedes_nothing() -> None:
    watcher = Watcher(store=None, settings=SETTINGS)  # type: ignore[arg-type]
    assert watcher.supersede("run", "key") == 0


class _Feed:
    """The store's controls feed, with nothing announced (the only Redis calls a mark's tick makes
    besides the mark, which the test replaces)."""

    def controls_after(self, entry: str | None) -> tuple[str, list[str]]:
        return entry or "0-0", []


def test_a_begin_refused_by_a_cancel_signals_the_phase_and_the_watcher_goes_on(monkeypatch) -> None:
    """A cancel that lands after the feed's last read and before the phase's deferred begin is
    written refuses the begin: the watcher sets the phase's signal with the run's reason, and it
    must do so without holding its lock, since the signal's listener (the overrun's schedule) takes
    it. It once did not, and the watcher and the phase's own thread both hung (the cancel never
    ended the run)."""
    def refuse(store, deferreds):
        for one in deferreds:
            one.refused = "cancelled"

    monkeypatch.setattr(watcher_module, "mark_all", refuse)
    watcher = Watcher(store=_Feed(), settings=SETTINGS)  # type: ignore[arg-type]
    started = clock.now() - 2 * deferred_module.MARK_S  # its mark is due at once
    deferred = deferred_module.Deferred(None, "run", "task", None, 1, 7, "w", started, "")  # type: ignore[arg-type]
    signal = Signal()
    call = SimpleNamespace(record=SimpleNamespace(deadline=None, token=7), snap=SimpleNamespace(run_id="run"),
                           task=SimpleNamespace(key="task"), signal=signal, renew=None, deferred=deferred)
    ended = []

    def phase() -> None:
        with watcher.watch(call, overrun=lambda reason: None):  # type: ignore[arg-type]
            assert signal.wait(5.0)
        ended.append(True)

    thread = threading.Thread(target=phase, daemon=True)
    thread.start()
    thread.join(10.0)
    assert ended == [True], "the phase's thread hung leaving the watch (the watcher holds its lock)"
    assert signal.reason == "cancelled"
    assert watcher._lock.acquire(timeout=5.0), "the watcher's thread hung holding its lock"
    watcher._lock.release()

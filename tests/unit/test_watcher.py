"""The watcher's schedule (taskloop/worker/liveness/watcher.py): what is due of a phase that ended
is dropped, so an idle watcher sleeps its interval instead of spinning."""

from __future__ import annotations

import heapq

from taskloop.base import clock
from taskloop.base.config import Settings
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

"""Worker presence: every worker's main process writes a heartbeat to the store every
``HEARTBEAT_S`` seconds (``tl:workers``: its node name, Celery main-process pid, pool size, the
queues it consumes, how many phases it runs now and the ids of every message it holds), and
removes it when it shuts down. A worker that falls silent while the others go on is taken for
gone: the reconciler gives the messages it held back to the queue (worker/orphans.py).

``taskloop status``, the fleet exporter and the UI's fleet page read the workers from there
(runtime/fleet.py) instead of asking them over Celery's remote control. Reading needs no more
than the read-only ``monitor`` user: broadcasting on the pidbox, which ``inspect`` needs, is
the very right that also lets its holder send ``shutdown`` to every worker (docs/security.md,
F5). A worker killed without a word drops out of the view ``ONLINE_WITHIN_S`` after its last
heartbeat, and out of the hash after ``FORGET_AFTER_S``."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery.worker import state as worker_state

from taskloop.base import clock
from taskloop.runtime.fleet import HEARTBEAT_S, ONLINE_WITHIN_S, RunningPhase, WorkerInfo, gone_workers
from taskloop.store.redis_store import RedisStore
from taskloop.worker.outage import phases_of

log = logging.getLogger("taskloop.presence")


def held_ids() -> list[str]:
    """The ids of the task messages this worker holds: prefetched, waiting for a countdown, or
    running (Celery's worker state, kept by the main process)."""
    for _ in range(10):  # the main thread may change these sets while this thread reads them
        try:
            held = [*worker_state.reserved_requests, *worker_state.active_requests, *worker_state.scheduled_requests]
        except RuntimeError:
            continue
        return sorted({request.id for request in held if isinstance(getattr(request, "id", None), str)})
    raise RuntimeError("the worker's requests kept changing while the heartbeat read them")


class Seen:
    """Since when this worker's heartbeats have seen each phase running (its pool's active
    requests): the first heartbeat that listed it."""

    def __init__(self) -> None:
        self._since: dict[tuple[str, str, int], float] = {}

    def running(self, at: float) -> list[RunningPhase]:
        for _ in range(10):  # the main thread may change the set while this thread reads it
            try:
                active = list(worker_state.active_requests)
            except RuntimeError:
                continue
            break
        else:
            active = []
        pids = {(p.run_id, p.key, p.token): getattr(r, "worker_pid", None)
                for r in active for p in phases_of([r])}
        now = {found: self._since.get(found, at) for found in pids}
        self._since = now
        return [RunningPhase(run_id=run_id, key=key, token=token, since=since,
                             pid=pid if isinstance(pid := pids[(run_id, key, token)], int) else None)
                for (run_id, key, token), since in sorted(now.items())]


def describe(consumer: Any, node: str, seen: Seen | None = None) -> WorkerInfo:
    """This worker as its heartbeat tells it (read from Celery's consumer and worker state). The
    time is taken before the messages held are read: every message taken before it is among them."""
    at = clock.now()
    pool = getattr(consumer, "pool", None)
    processes = getattr(pool, "num_processes", None) or getattr(pool, "limit", None) or 0
    task_consumer = getattr(consumer, "task_consumer", None)
    queues = sorted({queue.name for queue in getattr(task_consumer, "queues", None) or []})
    return WorkerInfo(node=node, processes=int(processes), pid=os.getpid(), queues=queues,
                      active=len(worker_state.active_requests), at=at, held=held_ids(),
                      running=(seen or Seen()).running(at))


class Presence:
    """The heartbeat thread of a worker's main process (started by ``worker_ready``)."""

    def __init__(self, store: RedisStore, consumer: Any, node: str, every_s: float = HEARTBEAT_S) -> None:
        self.store = store
        self.consumer = consumer
        self.node = node
        self.every_s = every_s
        self.seen = Seen()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="taskloop-presence", daemon=True)

    def start(self) -> None:
        self.beat(prune=True)
        self._thread.start()

    def beat(self, prune: bool = False) -> None:
        """One heartbeat; never raises (a Redis outage only makes this worker look gone for a while)."""
        try:
            self.store.note_worker(self.node, describe(self.consumer, self.node, self.seen).model_dump_json())
            if prune:
                self.store.forget_workers(*gone_workers(self.store.workers_seen(), clock.now()))
        except Exception as exc:
            log.warning("heartbeat of %s not written: %s", self.node, exc)

    def stop(self) -> None:
        """On shutdown: no more heartbeats, and the entry goes (the worker is no longer online)."""
        self._stop.set()
        try:
            self.store.forget_workers(self.node)
        except Exception as exc:
            log.warning("heartbeat of %s not removed (it ages out in %.0f s): %s", self.node, ONLINE_WITHIN_S, exc)

    def _loop(self) -> None:
        beats = 0
        while not self._stop.wait(self.every_s):
            beats += 1
            self.beat(prune=beats % 60 == 0)  # about every 5 minutes, drop workers long gone

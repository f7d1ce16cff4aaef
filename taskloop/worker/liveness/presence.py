"""Worker presence: every worker's main process writes a heartbeat to the store every
``HEARTBEAT_S`` seconds (``tl:workers``: its node name, Celery main-process pid, pool size, the
queues it consumes, how many phases it runs now and every message it holds, with what each of
taskloop's names and since when its pool runs it), and removes it when it shuts down. A worker
that falls silent while the others go on is taken for gone: the reconciler sends again what it
held (worker/recovery/orphans.py).

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
from taskloop.runtime.celery_app import DISPATCH_TASK, SETTLE_TASK, START_TASK
from taskloop.runtime.fleet import HEARTBEAT_S, ONLINE_WITHIN_S, Held, WorkerInfo, encode_held, gone_workers
from taskloop.store.redis_store import RedisStore
from taskloop.worker.recovery.outage import PHASE_TASKS

log = logging.getLogger("taskloop.presence")


def _requests() -> tuple[list[Any], list[Any]]:
    """The requests this worker holds (running ones second), read from Celery's worker state."""
    for _ in range(10):  # the main thread may change these sets while this thread reads them
        try:
            return ([*worker_state.reserved_requests, *worker_state.scheduled_requests],
                    list(worker_state.active_requests))
        except RuntimeError:
            continue
    raise RuntimeError("the worker's requests kept changing while the heartbeat read them")


def held_message(request: Any, since: float | None) -> Held | None:
    """What a held request of one of taskloop's tasks names (None: not one, or malformed)."""
    task, args = getattr(request, "type", None), tuple(getattr(request, "args", None) or ())
    pid = getattr(request, "worker_pid", None) if since is not None else None
    pid = pid if isinstance(pid, int) else None
    if task in PHASE_TASKS and len(args) == 4 and isinstance(args[0], str) and isinstance(args[1], str) \
            and type(args[3]) is int:
        return Held(task=task, run_id=args[0], key=args[1], token=args[3], since=since, pid=pid)
    if task == DISPATCH_TASK and len(args) == 2 and isinstance(args[0], str) and isinstance(args[1], list):
        return Held(task=task, run_id=args[0], keys=[str(key) for key in args[1]], since=since, pid=pid)
    if task in (START_TASK, SETTLE_TASK) and len(args) == 1 and isinstance(args[0], str):
        return Held(task=task, run_id=args[0], since=since, pid=pid)
    return None


class Seen:
    """What this worker holds, for its heartbeats, and since when each running message has been
    seen running (the first heartbeat that saw it in the pool)."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}

    def messages(self, at: float) -> list[Held]:
        waiting, running = _requests()
        since = {request.id: self._since.get(request.id, at) for request in running
                 if isinstance(getattr(request, "id", None), str)}
        self._since = since
        found = [held_message(r, None) for r in waiting if getattr(r, "id", None) not in since]
        found += [held_message(r, since.get(getattr(r, "id", None), at)) for r in running]
        return [held for held in found if held is not None]


def describe(consumer: Any, node: str, seen: Seen | None = None) -> WorkerInfo:
    """This worker as its heartbeat tells it (read from Celery's consumer and worker state), with
    the messages it holds. The time is taken before the messages held are read: every message
    taken before it is among them."""
    at = clock.now()
    pool = getattr(consumer, "pool", None)
    processes = getattr(pool, "num_processes", None) or getattr(pool, "limit", None) or 0
    task_consumer = getattr(consumer, "task_consumer", None)
    queues = sorted({queue.name for queue in getattr(task_consumer, "queues", None) or []})
    messages = (seen or Seen()).messages(at)
    return WorkerInfo(node=node, processes=int(processes), pid=os.getpid(), queues=queues,
                      active=len(worker_state.active_requests), at=at, messages=messages)


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
            info = describe(self.consumer, self.node, self.seen)
            self.store.note_worker(self.node, info.model_dump_json(), encode_held(info.messages))
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

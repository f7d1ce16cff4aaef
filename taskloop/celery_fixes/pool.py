"""Celery's prefork pool, as a subclass with one fix: what taskloop's worker names as its
``worker_pool`` (``taskloop worker``, and ``celery -A taskloop worker``). Checked against
celery 5.7.0 and billiard 4.3.2; the upstream report is in docs/upstream.md.

**Two pool processes that die together stopped the worker at the next reconnect** (found by
the chaos soak, tests/faults/soak.py)::

    CRITICAL/MainProcess Unrecoverable error: ValueError('file descriptor is None')

Both exit sentinels (fds N1, N2) are readable in one poll. The handler of N1
(``AsynPool._event_process_exit``) untracks process 1 and calls ``maintain_pool``, which reaps
*both* dead processes and forks two replacements whose sentinels are duplicated onto the freed
numbers N1 and N2. The loop then delivers the stale event of N2 to what is registered under N2
now: the exit handler of a replacement that is alive. It is untracked (``_sentinel_poll =
None``) while it stays in the pool and runs tasks. At the next reconnect
``register_with_event_loop`` re-registers every pool process; kombu's ``fileno(None)`` raises
ValueError, which Celery's ``iterate_file_descriptors_safely`` does not catch, and the worker
stops.

Fixed at both ends: ``_event_process_exit`` ignores the event when the process is alive
(``exitcode is None``: a sentinel becomes readable only when its process has exited, so such an
event is stale), and ``_track_child_process`` tracks again a live process whose sentinel was
dropped (a fresh duplicate of its sentinel) instead of registering None.

``probe()`` says whether Celery's own pool still untracks a live process on a stale event.
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any

from celery.concurrency import prefork
from celery.concurrency.asynpool import AsynPool as CeleryAsynPool

log = logging.getLogger("taskloop.pool")


def _alive(proc: Any) -> bool:
    try:
        return proc.exitcode is None
    except (OSError, ValueError, AssertionError):  # closed or never started: not alive
        return False


class AsynPool(CeleryAsynPool):  # type: ignore[misc]  # Celery is untyped
    def _event_process_exit(self, hub: Any, proc: Any) -> Any:
        if _alive(proc):
            log.debug("ignored a stale exit event for live pool process %s", getattr(proc, "pid", "?"))
            return None
        return super()._event_process_exit(hub, proc)

    def _track_child_process(self, proc: Any, hub: Any) -> Any:
        if getattr(proc, "_sentinel_poll", 0) is None:  # untracked earlier
            if not _alive(proc):
                return None  # dead: maintain_pool reaps it
            del proc._sentinel_poll  # alive: track it again with a fresh duplicate of its sentinel
        return super()._track_child_process(proc, hub)


class TaskPool(prefork.TaskPool):  # type: ignore[misc]
    """Celery's prefork TaskPool on the fixed AsynPool."""

    Pool = AsynPool


POOL = f"{__name__}:TaskPool"


def untracks_a_live_process(pool_class: Any = CeleryAsynPool) -> bool:
    """Whether ``pool_class._event_process_exit`` untracks a process that is still alive (the cause)."""
    read, write = os.pipe()
    removed: list[int] = []
    proc = types.SimpleNamespace(exitcode=None, pid=0, _sentinel_poll=os.dup(read))
    pool = types.SimpleNamespace(maintain_pool=lambda: None)
    pool._untrack_child_process = lambda p, hub: CeleryAsynPool._untrack_child_process(pool, p, hub)
    try:
        pool_class._event_process_exit(pool, types.SimpleNamespace(remove=removed.append), proc)
        return proc._sentinel_poll is None
    except Exception:
        return False  # it cannot be tried this way any more: look at Celery's code
    finally:
        if proc._sentinel_poll is not None:
            os.close(proc._sentinel_poll)
        os.close(read)
        os.close(write)


def probe() -> dict[str, bool]:
    return {"a stale exit event untracks a live pool process": untracks_a_live_process()}

"""A local fix for a Celery prefork-pool crash that ends a worker at a broker reconnect.

Seen with celery 5.7.0, kombu 5.7.0 and billiard 4.3.2 (found by the chaos soak,
tests/faults/soak.py): after two pool processes die in the same event-loop poll, the next broker
reconnect stops the worker::

    CRITICAL/MainProcess Unrecoverable error: ValueError('file descriptor is None')

Cause. Both exit sentinels (fds N1, N2) are readable in one poll. The handler of N1
(``AsynPool._event_process_exit``) untracks process 1 and calls ``maintain_pool``, which reaps
*both* dead processes and forks two replacements whose sentinels are duplicated onto the freed
numbers N1 and N2. The loop then delivers the stale event of N2 to what is registered under N2
now: the exit handler of a replacement that is alive. It is untracked (``_sentinel_poll = None``)
while it stays in the pool and runs tasks. At the next reconnect ``register_with_event_loop``
re-registers every pool process; kombu's ``fileno(None)`` raises ValueError, which Celery's
``iterate_file_descriptors_safely`` does not catch, and the worker stops.

Fix, at both ends:

- ``_event_process_exit`` ignores the event when the process is alive (``exitcode is None``):
  a sentinel becomes readable only when its process has exited, so such an event is stale;
- ``_track_child_process`` re-tracks a live process whose sentinel was dropped (a fresh
  duplicate of its sentinel) instead of registering None.

``install()`` patches ``celery.concurrency.asynpool.AsynPool`` once; worker start-up calls it
(taskloop/worker/app.py). ``TASKLOOP_POOL_FIX=0`` leaves Celery as it is (for the test that
shows the crash).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

log = logging.getLogger("taskloop.pool_fix")

_MARK = "_taskloop_stale_exit_event_fix"


def installed() -> bool:
    from celery.concurrency.asynpool import AsynPool

    return bool(getattr(AsynPool._event_process_exit, _MARK, False))


def _alive(proc: Any) -> bool:
    try:
        return proc.exitcode is None
    except (OSError, ValueError, AssertionError):  # closed or never started: not alive
        return False


def install() -> bool:
    """Patch Celery's AsynPool (once). Returns whether the fix is in place."""
    if os.environ.get("TASKLOOP_POOL_FIX", "1") == "0":
        return False
    from celery.concurrency.asynpool import AsynPool

    if installed():
        return True
    exit_event = AsynPool.__dict__.get("_event_process_exit")
    track = AsynPool.__dict__.get("_track_child_process")
    if exit_event is None or track is None:  # another Celery: nothing to patch
        log.debug("celery's AsynPool has no _event_process_exit/_track_child_process; no fix needed")
        return False

    @functools.wraps(exit_event)
    def _event_process_exit(self: Any, hub: Any, proc: Any) -> Any:
        if _alive(proc):
            log.debug("ignored a stale exit event for live pool process %s", getattr(proc, "pid", "?"))
            return None
        return exit_event(self, hub, proc)

    @functools.wraps(track)
    def _track_child_process(self: Any, proc: Any, hub: Any) -> Any:
        if getattr(proc, "_sentinel_poll", 0) is None:  # untracked earlier
            if not _alive(proc):
                return None  # dead: maintain_pool reaps it
            del proc._sentinel_poll  # alive: track it again with a fresh duplicate of its sentinel
        return track(self, proc, hub)

    setattr(_event_process_exit, _MARK, True)
    AsynPool._event_process_exit = _event_process_exit
    AsynPool._track_child_process = _track_child_process
    log.debug("applied taskloop's fix for stale pool-process exit events")
    return True

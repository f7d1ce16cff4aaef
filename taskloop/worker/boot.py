"""The first lines of the Celery worker process that ``taskloop worker``'s supervisor starts
(``python -P .../boot.py <the Celery worker's options>``), before anything else is imported:

1. It asks Linux to send it SIGTERM when its supervisor dies (``PR_SET_PDEATHSIG``): a supervisor
   that is SIGKILLed takes its worker with it, through the worker's warm shutdown (its phases are
   handed back within ``TASKLOOP_SHUTDOWN_GRACE_S``), instead of leaving it running unsupervised.
   Should the supervisor be gone already, it exits at once.
2. On ``-P gevent`` it lets Celery monkey-patch the standard library (``celery.maybe_patch_concurrency``,
   what ``celery worker`` itself does first), so that sockets, threads and sleeps are gevent's in
   every module the worker imports afterwards. A worker patched late hangs on its first phase.
3. It runs ``python -m taskloop.worker``, with the directory it was started in first on the path, as
   ``-m`` puts it.

Run by path with ``-P`` (its own folder is not put on the path, where ``celery.py`` would hide the
``celery`` package), it imports only the standard library and ``celery``'s package module, which is
built to be imported before the patching. Elsewhere than Linux step 1 is skipped.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1
SUPERVISOR_ENV = "TASKLOOP_SUPERVISOR_PID"


def die_with_supervisor(supervisor: int) -> None:
    """SIGTERM to this process when its parent (the supervisor) dies; exit now if it is dead already."""
    if not sys.platform.startswith("linux") or supervisor <= 0:
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != supervisor:  # it died before the call above
        sys.stderr.write("taskloop worker: its supervisor is gone; not starting\n")
        os._exit(1)


def main(argv: list[str]) -> None:
    die_with_supervisor(int(os.environ.pop(SUPERVISOR_ENV, "0") or 0))
    import celery

    celery.maybe_patch_concurrency(["worker", *argv])
    sys.path.insert(0, os.getcwd())
    import runpy

    sys.argv = ["taskloop.worker", *argv]
    runpy.run_module("taskloop.worker", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])

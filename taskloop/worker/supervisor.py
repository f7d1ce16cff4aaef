"""The worker supervisor: ``taskloop worker`` runs the Celery worker as a child process and, if it
dies unexpectedly, starts it again with backoff — a second line of defence. The first is that the
worker does not die (see taskloop/celery_fixes/); the supervisor logs and counts every restart, so that a
restart is never silent.

Signals are passed on: SIGTERM and SIGINT ask the worker for a warm shutdown (it finishes or
hands back its phases, then exits), SIGQUIT for a cold one; the supervisor then exits with the
worker's code and does not restart it.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("taskloop.supervisor")

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_AFTER_S = 60.0  # a worker that ran this long before dying restarts with the backoff reset
EXIT_BAD_IMPORT = 78  # EX_CONFIG: the worker could not import a workflow module (not restarted)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)


class Supervisor:
    """Keeps one Celery worker process running."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None,
                 on_restart: Callable[[int], None] | None = None) -> None:
        self.argv = [sys.executable, "-m", "taskloop.worker", *argv]
        self.env = env
        self.on_restart = on_restart or (lambda code: None)
        self.child: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stopping = threading.Event()

    def _forward(self, signum: int, frame: object) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            self._stopping.set()
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    def run(self) -> int:
        """Run the worker until it is asked to stop; returns its exit code."""
        for signum in FORWARDED:
            signal.signal(signum, self._forward)
        backoff = BACKOFF_START_S
        while True:
            started = time.monotonic()
            self.child = subprocess.Popen(self.argv, env=self.env)
            code = self.child.wait()
            if self._stopping.is_set() or code == 0:
                return code
            if code == EXIT_BAD_IMPORT:
                log.error("the Celery worker could not import a workflow module (above); not restarting it")
                return code
            self.restarts += 1
            if time.monotonic() - started >= HEALTHY_AFTER_S:
                backoff = BACKOFF_START_S
            log.error("the Celery worker (pid %s) exited unexpectedly with code %s; restart %s in %.0f s",
                      self.child.pid, code, self.restarts, backoff)
            self.on_restart(code)
            from taskloop.ops import metrics  # prometheus-client, loaded by a supervisor only when needed

            metrics.restarted()
            if self._stopping.wait(backoff):
                return code
            backoff = min(backoff * 2, BACKOFF_MAX_S)


def cannot_import(name: str, exc: BaseException) -> str:
    """What ``taskloop`` says of a workflow module it cannot import (the CLI and the worker alike)."""
    return (f"cannot import workflow module {name!r}: {exc}; run from the directory that contains it or add that "
            "directory to PYTHONPATH")


def exit_code(code: int) -> int:
    """A child's code as the supervisor's own (a signal -N becomes 128 + N, as shells do)."""
    return 128 - code if code < 0 else code


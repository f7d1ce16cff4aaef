"""The worker supervisor: ``taskloop worker`` runs the Celery worker as a child process and, if it
dies unexpectedly, starts it again with backoff — a second line of defence. The first is that the
worker does not die (see taskloop/celery_fixes/); the supervisor logs and counts every restart, so that a
restart is never silent.

Signals are passed on: SIGTERM and SIGINT ask the worker for a warm shutdown (it finishes or
hands back its phases, then exits), SIGQUIT for a cold one; the supervisor then exits with the
worker's code and does not restart it.

``taskloop worker`` checks its options, then replaces itself (``exec``, the same pid) with
``python -m taskloop.worker.supervisor``: a process that imports only this module (and, with
``--metrics-port``, prometheus-client to serve the worker's metrics), about 15 MB where the command
line's own process, with click, rich and taskloop's CLI, held 36 MB.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
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



def command(argv: Sequence[str], loglevel: str, logfile: str | None, metrics: tuple[str, int] | None) -> list[str]:
    """What ``taskloop worker`` execs: this module's ``main`` with the Celery worker's options."""
    line = [sys.executable, "-m", "taskloop.worker.supervisor", "--loglevel", loglevel]
    line += ["--logfile", logfile] if logfile else []
    line += ["--metrics", f"{metrics[0]}:{metrics[1]}"] if metrics else []
    return [*line, "--", *argv]


def main(args: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m taskloop.worker.supervisor")
    parser.add_argument("--loglevel", default="INFO")
    parser.add_argument("--logfile", default=None)
    parser.add_argument("--metrics", default=None, help="HOST:PORT: serve the worker's metrics (multiprocess mode)")
    parser.add_argument("worker", nargs=argparse.REMAINDER, help="-- then the Celery worker's options")
    options = parser.parse_args(args)
    worker = options.worker[1:] if options.worker[:1] == ["--"] else options.worker
    logging.basicConfig(level=options.loglevel.upper(), filename=options.logfile,
                        format="[%(asctime)s: %(levelname)s/Supervisor] %(message)s")
    if options.metrics:
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:  # made by `taskloop worker` for this worker's processes: gone when the supervisor is
            atexit.register(shutil.rmtree, directory, True)
        host, _, port = options.metrics.rpartition(":")
        serve_metrics(host, int(port))
    code = exit_code(Supervisor(worker).run())
    sys.exit(code)


def serve_metrics(host: str, port: int) -> None:
    """The worker's Prometheus metrics, summed over its processes (prometheus-client's multiprocess mode)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%s/metrics", host, port)


if __name__ == "__main__":
    main()

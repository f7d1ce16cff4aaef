"""The worker supervisor: ``taskloop worker`` runs the Celery worker as a child process and, if it
dies unexpectedly, starts it again with backoff — a second line of defence. The first is that the
worker does not die (see taskloop/celery_fixes/); the supervisor logs and counts every restart, so that a
restart is never silent.

Signals are passed on: SIGTERM and SIGINT ask the worker for a warm shutdown (it finishes or
hands back its phases, then exits), SIGQUIT for a cold one; the supervisor then exits with the
worker's code and does not restart it.

``taskloop worker`` checks its options, then replaces itself (``exec``, the same pid) with this
file run bare: ``python -S -P .../supervisor.py``. Without ``site`` (no site-packages, no ``.pth``
files) and importing only ``os``, ``sys``, ``signal`` and ``time`` — its own option reading and log
lines, ``os.posix_spawn`` rather than ``subprocess`` — it holds about 10 MB, where the command line's
own process, with click, rich and taskloop's CLI, held 36 MB. With ``--metrics`` (or
``TASKLOOP_METRICS=1``) it runs as ``python -m taskloop.worker.supervisor`` instead: it serves the
worker's metrics with prometheus-client and counts its restarts there.

Nothing here may import taskloop or a third-party package at module level: run bare, they cannot
be found.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
HEALTHY_AFTER_S = 60.0  # a worker that ran this long before dying restarts with the backoff reset
EXIT_BAD_IMPORT = 78  # EX_CONFIG: a workflow module does not import, or the pool is refused (not restarted)
SUPERVISOR_ENV = "TASKLOOP_SUPERVISOR_PID"  # the worker's parent-death check (boot.py)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "WARN": 30, "ERROR": 40, "CRITICAL": 50, "FATAL": 50}
USAGE = ("usage: supervisor.py [--loglevel LEVEL] [--logfile PATH] [--metrics HOST:PORT] "
         "-- <the Celery worker's options>")


class Log:
    """The supervisor's log lines, in the format of Celery's own (``[time: LEVEL/Supervisor] ...``),
    on stderr or appended to the worker's log file. ``logging`` is not imported: it alone costs
    the bare process a fifth of its memory."""

    def __init__(self, level: str = "INFO", path: str | None = None) -> None:
        self.threshold = LEVELS.get(level.upper(), 20)
        self.path = path

    def write(self, level: str, message: str) -> None:
        if LEVELS[level] < self.threshold:
            return
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"
        line = f"[{stamp}: {level}/Supervisor] {message}\n"
        if self.path is None:
            sys.stderr.write(line)
            sys.stderr.flush()
            return
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(line)

    def info(self, message: str) -> None:
        self.write("INFO", message)

    def error(self, message: str) -> None:
        self.write("ERROR", message)


class Supervisor:
    """Keeps one Celery worker process running."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None,
                 on_restart: Callable[[int], None] | None = None, log: Log | None = None) -> None:
        # boot.py: dies with this process, and monkey-patches first on -P gevent (see its docstring)
        self.argv = [sys.executable, "-P", os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.py"),
                     *argv]
        self.env = env
        self.on_restart = on_restart or (lambda code: None)
        self.log = log or Log()
        self.child: int | None = None  # the Celery worker's pid while it runs
        self.restarts = 0
        self.stopping = False

    def _forward(self, signum: int, frame: object) -> None:
        if signum in STOPPING:
            self.stopping = True
        if self.child is not None:
            try:
                os.kill(self.child, signum)
            except ProcessLookupError:  # it has just exited; its status is not read yet
                pass

    def _spawn(self) -> int:
        """Start the worker. The forwarded signals are blocked until its pid is known, so none
        arrives in between and is lost; the child starts with none blocked."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        env = {**(os.environ if self.env is None else self.env), SUPERVISOR_ENV: str(os.getpid())}
        try:
            self.child = os.posix_spawn(self.argv[0], self.argv, env, setsigmask=blocked - set(FORWARDED))
            return self.child
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _reap(self, pid: int) -> int:
        """Wait for the worker to exit; its code, as Popen's (-N for a signal). It is waited for
        without being reaped (WNOWAIT: its pid stays its own), then forgotten with the signals
        blocked and only then reaped, so that no signal is passed to a pid the system may have given
        another process."""
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # a forwarded signal interrupts it, then it waits again
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        try:
            self.child = None
            _, status = os.waitpid(pid, 0)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return os.waitstatus_to_exitcode(status)

    def _wait(self, seconds: float) -> bool:
        """Sleep for the backoff; True if a stop was asked meanwhile."""
        until = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < until:
            time.sleep(min(0.1, max(until - time.monotonic(), 0.0)))
        return self.stopping

    def run(self) -> int:
        """Run the worker until it is asked to stop; returns its exit code."""
        for signum in FORWARDED:
            signal.signal(signum, self._forward)
        backoff = BACKOFF_START_S
        while True:
            started = time.monotonic()
            pid = self._spawn()
            code = self._reap(pid)
            if self.stopping or code == 0:
                return code
            if code == EXIT_BAD_IMPORT:
                self.log.error("the Celery worker could not start as configured (above); not restarting it")
                return code
            self.restarts += 1
            if time.monotonic() - started >= HEALTHY_AFTER_S:
                backoff = BACKOFF_START_S
            self.log.error(f"the Celery worker (pid {pid}) exited unexpectedly with code {code}; "
                           f"restart {self.restarts} in {backoff:.0f} s")
            self.on_restart(code)
            if self._wait(backoff):
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
    """What ``taskloop worker`` execs: this file run bare, or with metrics this module with site-packages."""
    if metrics_on(metrics):
        line = [sys.executable, "-m", "taskloop.worker.supervisor"]
    else:
        line = [sys.executable, "-S", "-P", os.path.abspath(__file__)]
    line += ["--loglevel", loglevel]
    line += ["--logfile", logfile] if logfile else []
    line += ["--metrics", f"{metrics[0]}:{metrics[1]}"] if metrics else []
    return [*line, "--", *argv]


def metrics_on(served: object) -> bool:
    """The supervisor needs prometheus-client (site-packages): it serves the metrics, or counts its
    restarts in them (``TASKLOOP_METRICS=1``)."""
    return bool(served) or os.environ.get("TASKLOOP_METRICS") == "1"


class Options:
    """The supervisor's own options (argparse is not imported, for the same reason as logging)."""

    def __init__(self, args: Sequence[str]) -> None:
        self.loglevel, self.logfile, self.metrics = "INFO", None, None
        self.worker: list[str] = []
        rest = list(args)
        while rest:
            name = rest.pop(0)
            if name == "--":
                self.worker = rest
                return
            if name not in ("--loglevel", "--logfile", "--metrics") or not rest:
                raise SystemExit(f"{USAGE}\nerror: unexpected {name!r}" + ("" if rest else " (a value is missing)"))
            value = rest.pop(0)
            if name == "--loglevel":
                if value.upper() not in LEVELS:
                    raise SystemExit(f"{USAGE}\nerror: --loglevel {value!r}: use one of DEBUG, INFO, WARNING, ERROR")
                self.loglevel = value
            elif name == "--logfile":
                self.logfile = value
            else:
                self.metrics = value


def main(args: Sequence[str] | None = None) -> None:
    options = Options(sys.argv[1:] if args is None else args)
    log = Log(options.loglevel, options.logfile)
    on_restart: Callable[[int], None] | None = None
    if metrics_on(options.metrics):
        on_restart = _count_restart
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:  # made by `taskloop worker` for this worker's processes: gone when the supervisor is
            import atexit
            import shutil

            atexit.register(shutil.rmtree, directory, True)
    if options.metrics:
        host, _, port = options.metrics.rpartition(":")
        serve_metrics(host, int(port))
        log.info(f"metrics on http://{host}:{port}/metrics")
    sys.exit(exit_code(Supervisor(options.worker, on_restart=on_restart, log=log).run()))


def _count_restart(code: int) -> None:
    from taskloop.ops import metrics  # prometheus-client, loaded by a supervisor only with metrics on

    metrics.restarted()


def serve_metrics(host: str, port: int) -> None:
    """The worker's Prometheus metrics, summed over its processes (prometheus-client's multiprocess mode)."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    start_http_server(port, addr=host, registry=registry)


if __name__ == "__main__":
    main()

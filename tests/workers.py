"""The one harness that starts worker processes for the tests: `WorkerProcess`, a real `taskloop
worker` (its supervisor, the Celery worker under it, and the pool) against a test's Redis. The
session workers (tests/conftest.py), the fault and soak clusters, the connection tests' workers
(their own store and broker URLs) and the fuzzed-message worker all start theirs here."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from taskloop.ops.embedded import spawn_worker, wait_until_ready
from taskloop.worker.recovery.executions import process_gone

REPO = Path(__file__).resolve().parent.parent


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    return not process_gone(pid)


def kill_left(pids: list[int]) -> None:
    """Kill what a killed supervisor left running: a Celery worker still in its warm shutdown (and
    its pool), which would go on trying the test's stopped Redis."""
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):  # it may have exited meanwhile
                os.kill(pid, signal.SIGKILL)


class WorkerProcess:
    """One `taskloop worker`. It behaves like its supervisor's Popen (pid, poll, terminate, kill,
    wait), and knows its Celery process and pool."""

    def __init__(self, store_url: str, imports: list[str] | tuple[str, ...], logfile: Path, *, name: str = "w1",
                 concurrency: int = 2, broker_url: str | None = None, env: dict[str, str] | None = None,
                 queues: str | None = None, pool: str | None = None, loglevel: str = "INFO",
                 args: list[str] | None = None) -> None:
        self.name = name
        self.logfile = Path(logfile)
        self.concurrency = concurrency
        extra = {"PYTHONPATH": str(REPO), **(env or {})}
        if broker_url is not None:
            extra["TASKLOOP_BROKER_URL"] = broker_url
        self.process = spawn_worker(store_url, list(imports), concurrency=concurrency, name=f"{name}@%h",
                                    loglevel=loglevel, logfile=str(self.logfile), extra_env=extra, queues=queues,
                                    extra_args=[*(["--pool", pool] if pool else []), *(args or [])])

    def ready(self, timeout: float = 30.0) -> WorkerProcess:
        """Wait until it logs that it is ready, and until its Celery process is there."""
        wait_until_ready(self.process, self.logfile, timeout)
        deadline = time.monotonic() + timeout
        while self.celery_pid() is None:
            assert self.process.poll() is None and time.monotonic() < deadline, f"worker {self.name} did not start"
            time.sleep(0.05)
        return self

    # the supervisor's process ---------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def poll(self) -> int | None:
        return self.process.poll()

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()

    def send_signal(self, signal: int) -> None:
        self.process.send_signal(signal)

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def alive(self) -> bool:
        return self.process.poll() is None

    # the Celery worker and its pool ---------------------------------------------------------
    def celery_pid(self) -> int | None:
        """The Celery worker process (the supervisor's child), or None when there is none."""
        found = [pid for pid in children_of(self.process.pid) if alive(pid)]
        return found[0] if found else None

    def processes(self) -> list[int]:
        """The supervisor, the Celery worker and its pool processes, alive now."""
        found = [self.process.pid]
        for child in children_of(self.process.pid):
            found += [child, *children_of(child)]
        return sorted(pid for pid in found if alive(pid))

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def stop(self, timeout: float = 20.0) -> None:
        family = self.processes()  # the supervisor's children die with it only when it stops them
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        kill_left(family)

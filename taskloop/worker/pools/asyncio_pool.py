"""The asyncio pool (``taskloop worker -P asyncio``, Celery's ``worker_pool``
``taskloop.worker.pools.asyncio_pool:TaskPool``): thousands of phases in flight, their ``async def``
callbacks on one event loop, in one pool process. The threads pool (``-P threads``, ``ThreadsPool``)
is the same with a thread for each of ``-c`` sync callbacks in that process.

Like Celery's prefork pool, it splits the work between two processes: the worker's main process
runs Celery's consumer (it takes the messages, acknowledges them, sends the events, writes the
log lines and the heartbeats); the pool process (loop_process.py) runs the phases, all of them, on
its event loop. In one process the two would share one interpreter lock, and each of the loop's
round trips to Redis would hand it to the consumer and wait to get it back: measured on this
machine kind, that cost a third of the throughput (docs/benchmarks.md, *Loops that wait on models*).

The main process sends the pool process each phase message Celery gives it (frames.py), at most
``-c`` at a time (the rest wait here, which Celery counts as reserved, not active), and hands
Celery each reply as it comes back: ``on_success`` acknowledges the message and announces the
outcome, as Celery's tracer would. It reads the replies in Celery's own event loop (the consumer's
hub), so the consumer and the replies share one thread.

A pool process that dies is a pool process lost, as in a prefork pool: each phase it ran fails
with ``WorkerLostError``, which replays it at once (worker/recovery/pool_loss.py), Celery puts its
message back, and a new pool process starts. What is not a phase (``taskloop.start``,
``taskloop.dispatch``, ``taskloop.settle``, ``taskloop.reconcile``) runs here, on a few threads, as
on ``-P threads``. Celery's ``task_prerun`` and ``task_postrun`` signals are not sent for phases.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from billiard.einfo import ExceptionInfo
from billiard.exceptions import WorkerLostError
from celery.concurrency.base import BasePool, apply_target
from celery.exceptions import Reject
from pydantic import ValidationError

from taskloop.base.config import settings
from taskloop.core import reads
from taskloop.worker.execution import messages, process, replies
from taskloop.worker.pools.frames import PhaseFrame, Reader, ReplyFrame, StopFrame, pack
from taskloop.worker.pools.loop_process import LOOP_ENV

log = logging.getLogger("taskloop.pool")
trace_log = logging.getLogger("celery.app.trace")  # where Celery's tracer logs what each task came to

PHASES = ("taskloop.attempt", "taskloop.check", "taskloop.run")
OTHER_THREADS = 4  # the tasks that are not phases
STOP_WAIT_S = 10.0  # after the stop frame, how long the pool process gets to end before it is killed


def ahead(concurrency: int) -> int:
    """The phases sent to the pool process beyond the ``-c`` it runs at once."""
    return max(8, concurrency // 10)


@dataclass
class Pending:
    """A phase message given to the pool, until its reply."""

    request: Any
    callback: Callable[..., Any]
    accept: Callable[..., Any] | None
    started: float = 0.0


class Placed:
    """What ``apply_async`` returns for a phase (Celery keeps a weak reference to it)."""

    __slots__ = ("__weakref__",)

    def terminate(self, signal: Any = None) -> None:
        """A revoke that terminates: a phase stops by its run's cancel, not by Celery's."""


class ApplyResult:
    """What ``apply_async`` returns for another task (as Celery's threads pool does)."""

    def __init__(self, future: Future[Any]) -> None:
        self.f = future
        self.get = future.result

    def wait(self, timeout: float | None = None) -> None:
        wait([self.f], timeout)


class LoopChild:
    """The pool process and the main process's end of its socket."""

    def __init__(self, concurrency: int, kind: str = "asyncio", sync_threads: int | None = None) -> None:
        mine, theirs = socket.socketpair()
        for sock in (mine, theirs):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        root = logging.getLogger()
        logfile = next((h.baseFilename for h in root.handlers if isinstance(h, logging.FileHandler)), None)
        options = {"path": sys.path, "parent": os.getpid(), "logfile": logfile, "level": root.level,
                   "concurrency": concurrency, "kind": kind, "sync_threads": sync_threads}
        env = {**os.environ, LOOP_ENV: json.dumps(options)}
        self.process = subprocess.Popen([sys.executable, "-m", "taskloop.worker.pools.loop_process",
                                         str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.sock = mine
        self.reader = Reader()

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def send(self, frame: Any) -> bool:
        """Send a frame (False: the pool process is gone)."""
        try:
            self.sock.sendall(pack(frame))
            return True
        except OSError:
            return False

    def receive(self) -> list[bytes] | None:
        """The frames that arrived (None: the pool process is gone)."""
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return []
        except OSError:
            return None
        if not data:
            return None
        try:
            return self.reader.feed(data)
        except ValueError:
            return None

    def close(self, wait_s: float) -> None:
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            log.warning("the asyncio pool process %s did not end within %.0f s; killing it", self.pid, wait_s)
            self.process.kill()
            self.process.wait()
        self.sock.close()


class TaskPool(BasePool):  # type: ignore[misc]  # Celery is untyped
    """Phases in one pool process, on its event loop; everything else on threads here."""

    body_can_be_buffer = True
    signal_safe = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.concurrency = int(self.limit or 1)
        self.others = ThreadPoolExecutor(max_workers=OTHER_THREADS, thread_name_prefix="taskloop-other")
        self.child: LoopChild | None = None
        self.pending: dict[str, Pending] = {}
        self.waiting: collections.deque[Pending] = collections.deque()
        self._hub: Any = None
        self._lock = threading.RLock()  # Celery's consumer thread, and the reply reader when there is no hub
        self._reader: threading.Thread | None = None
        self._stopping = False

    # Celery's pool interface ----------------------------------------------------------------
    KIND = "asyncio"

    def sync_threads(self) -> int | None:
        """How many threads run the pool process's sync callbacks (None: ``TASKLOOP_SYNC_THREADS``)."""
        return None

    def _child(self) -> LoopChild:
        return LoopChild(self.concurrency, self.KIND, self.sync_threads())

    def on_start(self) -> None:
        process.POOL.kind, process.POOL.concurrency = self.KIND, self.concurrency
        self.child = self._child()

    def register_with_event_loop(self, hub: Any) -> None:
        """Read the pool process's replies in Celery's own event loop (the consumer's thread)."""
        self._hub = hub
        if self.child is not None:
            hub.add_reader(self.child.sock.fileno(), self._readable)

    def on_apply(self, target: Callable[..., Any], args: tuple[Any, ...] | None = None,
                 kwargs: dict[str, Any] | None = None, callback: Callable[..., Any] | None = None,
                 accept_callback: Callable[..., Any] | None = None, **_: Any) -> ApplyResult | Placed:
        request = getattr(callback, "__self__", None)
        if isinstance(request, replies.PhaseRequest) and request.type in PHASES and callback is not None:
            with self._lock:
                self.waiting.append(Pending(request, callback, accept_callback))
                self._dispatch()
            if self._hub is None:
                self._read_on_a_thread()
            return Placed()
        return ApplyResult(self.others.submit(apply_target, target, args, kwargs, callback, accept_callback))

    def on_stop(self) -> None:
        """The worker stops: the phases in flight end (a warm shutdown hands back those still running
        after its grace period, worker/liveness/shutdown.py, and then their replies no longer
        matter), then the pool process is told to stop."""
        self._stopping = True
        deadline = time.monotonic() + settings().shutdown_grace_s + STOP_WAIT_S
        while self.pending and time.monotonic() < deadline and self.child is not None:
            ready, _, _ = select.select([self.child.sock], [], [], 0.2)
            if ready:
                self._readable()
        child, self.child = self.child, None
        if child is not None:
            if self._hub is not None:
                self._hub.remove_reader(child.sock.fileno())
            child.send(StopFrame())
            child.close(STOP_WAIT_S)
        self._fail_pending("the worker stopped")
        self.others.shutdown(wait=False, cancel_futures=True)

    def on_terminate(self) -> None:
        child, self.child = self.child, None
        if child is not None:
            child.process.kill()
            child.close(STOP_WAIT_S)

    def terminate_job(self, pid: int, signal: Any = None) -> None:
        """A phase handed back at shutdown (or revoked) keeps running in the pool process, which runs
        all the others too: its late outcome is refused (its token is no longer the record's)."""

    def _get_info(self) -> dict[str, Any]:
        info: dict[str, Any] = super()._get_info()
        info.update({"max-concurrency": self.concurrency, "running": len(self.pending),
                     "waiting": len(self.waiting), "processes": [self.child.pid] if self.child else []})
        return info

    @property
    def num_processes(self) -> int:
        return self.concurrency

    # to and from the pool process -----------------------------------------------------------
    def _dispatch(self) -> None:
        """Send the waiting phases while fewer than ``-c`` run, and a few more: the pool process
        starts one of those the moment a phase of its ``-c`` ends, without waiting for this
        process to hear of it (``AHEAD``)."""
        child = self.child
        while self.waiting and len(self.pending) < self.concurrency + ahead(self.concurrency) and child is not None:
            item = self.waiting.popleft()
            request = item.request
            headers = request.request_dict
            info = request.delivery_info or {}
            frame = PhaseFrame(id=request.id, task=request.type, args=list(request.args or ()),
                               kwargs=dict(request.kwargs or {}), name=request.name, hostname=request.hostname,
                               carry=headers.get(reads.CARRY_HEADER), queued_at=headers.get(reads.QUEUED_AT_HEADER),
                               redelivered=bool(headers.get("redelivered") or info.get("redelivered")),
                               traceparent=messages.traceparent_of(headers))
            item.started = time.monotonic()
            self.pending[request.id] = item
            if item.accept is not None:
                item.accept(child.pid, item.started)
            if not child.send(frame):
                self._lost(child)
                return

    def _readable(self) -> None:
        with self._lock:
            child = self.child
            if child is None:
                return
            bodies = child.receive()
            if bodies is None:
                self._lost(child)
                return
            for body in bodies:
                try:
                    reply = ReplyFrame.model_validate_json(body)
                except ValidationError:
                    log.error("the asyncio pool process %s sent what is not a reply; taking it for lost", child.pid)
                    self._lost(child)
                    return
                item = self.pending.pop(reply.id, None)
                if item is not None:
                    self._done(item, reply)
            self._dispatch()

    def _done(self, item: Pending, reply: ReplyFrame) -> None:
        request, runtime = item.request, time.monotonic() - item.started
        if reply.reply is not None:
            trace_log.info("Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s",
                           {"name": request.name, "id": request.id, "runtime": round(runtime, 6),
                            "return_value": repr(reply.reply)})
            item.callback((False, reply.reply, runtime))
            return
        try:  # the failure Celery's tracer would have handed over
            if reply.requeue is not None:
                raise Reject(reply.requeue, requeue=True)
            raise RuntimeError(f"taskloop failed in the asyncio pool process: {reply.error}")
        except (Reject, RuntimeError):
            einfo = ExceptionInfo(internal=True)
        if reply.error is not None:
            trace_log.error("Task %s[%s] raised unexpected: %s", request.name, request.id, reply.error)
        item.callback((True, einfo, runtime))

    def _lost(self, child: LoopChild) -> None:
        """The pool process died (or spoke nonsense): its phases are lost, as a prefork pool process's
        are (WorkerLostError replays each at once: PhaseRequest.on_failure), and a new one starts."""
        if self._hub is not None:
            self._hub.remove_reader(child.sock.fileno())
        code = child.process.poll()
        if code is None:
            child.process.kill()
        child.close(STOP_WAIT_S)
        self.child = None
        log.error("the asyncio pool process %s exited (code %s) running %d phase(s); they are replayed",
                  child.pid, child.process.returncode, len(self.pending))
        self._fail_pending(f"the asyncio pool process {child.pid} exited with code {child.process.returncode}")
        if not self._stopping:
            self.child = self._child()
            if self._hub is not None:
                self._hub.add_reader(self.child.sock.fileno(), self._readable)
            self._dispatch()

    def _fail_pending(self, why: str) -> None:
        lost, self.pending = list(self.pending.values()), {}
        for item in lost:
            try:
                raise WorkerLostError(why)
            except WorkerLostError:
                einfo = ExceptionInfo(internal=True)
            try:
                item.callback((True, einfo, time.monotonic() - item.started))
            except Exception:
                log.exception("could not fail the lost phase %s", item.request.id)

    def _read_on_a_thread(self) -> None:
        """Without Celery's event loop (a worker that runs none), the replies are read on a thread."""
        if self._reader is not None:
            return
        self._reader = threading.Thread(target=self._read_loop, name="taskloop-replies", daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        while not self._stopping:
            child = self.child
            if child is None:
                time.sleep(0.1)
                continue
            ready, _, _ = select.select([child.sock], [], [], 0.5)
            if ready:
                self._readable()


class ThreadsPool(TaskPool):
    """``-P threads``: the same two processes, with a thread for each of ``-c`` sync callbacks in the
    pool process (an ``async def`` one still runs on its loop). Only the callback runs on its
    thread; the step's round trips are the loop's, and Celery's consumer has the main process's
    interpreter lock to itself."""

    KIND = "threads"

    def sync_threads(self) -> int | None:
        return self.concurrency

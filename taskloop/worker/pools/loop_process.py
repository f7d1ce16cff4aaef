"""The pool process of the asyncio and threads pools (``python -m taskloop.worker.pools.loop_process
FD``, started by asyncio_pool.py): thousands of phases in flight on one event loop.

It reads phase messages from the worker's main process (frames.py) and, for each, on its loop:
prepares the phase (worker/execution/executor.py: the read or the begin, the full path), awaits an
``async def`` callback as a task of its own, watched by the process's watcher, whose signal (a
deadline, a cancelled run) cancels the task: the callback sees ``asyncio.CancelledError``; runs a
sync callback on a thread pool instead (``TASKLOOP_SYNC_THREADS`` threads; ``-c`` on the threads
pool), and only the callback; records the outcome; and sends
back the reply. The loop makes the round trips of a step itself: this process has no Celery
consumer to share its interpreter lock with, so a round trip costs the loop its latency and
nothing more.

A main process that dies takes this one with it (Linux's parent-death signal); told to stop, it
takes nothing more and exits once its phases have ended (the main process hands back, after the
warm shutdown's grace period, those still running: worker/liveness/shutdown.py). A callback that
ignores its signal past the grace period is recorded for by the watcher and left to run: its late
outcome is refused; this process is never ended for one phase, since it runs all of them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

LOOP_ENV = "TASKLOOP_LOOP_PROCESS"  # JSON: the main process's path, log file and level, concurrency
log = logging.getLogger("taskloop.pool")


def _setup() -> dict[str, Any]:
    """Before taskloop is imported: the main process's path, death with it, its logging."""
    options: dict[str, Any] = json.loads(os.environ.pop(LOOP_ENV))
    sys.path[:0] = [entry for entry in options["path"] if entry not in sys.path]
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != options["parent"]:
            os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C goes to the main process, which stops this one
    handler: logging.Handler
    if options.get("logfile"):
        from logging.handlers import WatchedFileHandler

        handler = WatchedFileHandler(options["logfile"], encoding="utf-8")
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s: %(levelname)s/LoopProcess-%(process)d] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(options.get("level") or logging.INFO)
    return options


class LoopProcess:
    """This process's loop, its phases and its side of the socket."""

    def __init__(self, sock: socket.socket, concurrency: int, sync_threads: int, kind: str = "asyncio") -> None:
        from taskloop.worker.app import app
        from taskloop.worker.pools.frames import Reader

        self.app = app
        self.sock = sock
        self.loop = asyncio.new_event_loop()
        self.reader = Reader()
        self.sync = ThreadPoolExecutor(max_workers=max(1, sync_threads), thread_name_prefix="taskloop-sync")
        self.out = bytearray()
        self.flushing = False
        self.running = 0
        self.stopping = False
        self.concurrency = concurrency
        self.kind = kind  # the pool's name: asyncio, or threads (the same process, a thread per phase)
        self.places: asyncio.Semaphore | None = None  # -c phases run at once; the main process sends a few more
        self._aio: Any = None
        self._aio_store: Any = None

    def run(self) -> None:
        from taskloop.worker import pools
        from taskloop.worker.execution import callbacks, process

        pools.tune_collector()
        process.POOL.kind, process.POOL.concurrency = self.kind, self.concurrency
        callbacks.use_event_loop(self.loop)
        asyncio.set_event_loop(self.loop)
        self.places = asyncio.Semaphore(self.concurrency)
        self.sock.setblocking(False)
        self.loop.add_reader(self.sock.fileno(), self._readable)
        self.loop.run_forever()
        self.sync.shutdown(wait=False, cancel_futures=True)

    # the socket -----------------------------------------------------------------------------
    def _readable(self) -> None:
        from pydantic import ValidationError

        from taskloop.worker.pools.frames import PhaseFrame, StopFrame

        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the main process is gone: nothing can be replied any more
            os._exit(0)
        for body in self.reader.feed(data):
            try:
                frame = PhaseFrame.model_validate_json(body)
            except ValidationError:
                StopFrame.model_validate_json(body)
                self._stop()
                continue
            self.running += 1
            self.loop.create_task(self._phase(frame))

    def _send(self, frame: Any) -> None:
        from taskloop.worker.pools.frames import pack

        self.out += pack(frame)
        if not self.flushing:
            self.flushing = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """The replies of this turn of the loop, in one write (blocking: the main process reads them
        as they come, and a reply must not be lost to a full buffer)."""
        self.flushing = False
        out, self.out = bytes(self.out), bytearray()
        self.sock.setblocking(True)
        try:
            self.sock.sendall(out)
        except OSError:
            os._exit(0)  # the main process is gone
        finally:
            self.sock.setblocking(False)

    def _stop(self) -> None:
        self.stopping = True
        self.loop.remove_reader(self.sock.fileno())
        if not self.running:
            self.loop.stop()

    # one phase ------------------------------------------------------------------------------
    async def _phase(self, frame: Any) -> None:
        from taskloop.worker.pools.frames import ReplyFrame

        assert self.places is not None
        try:
            async with self.places:
                reply = ReplyFrame(id=frame.id, **await self._handle(frame))
        except BaseException as exc:  # a bug of taskloop's: said to Celery as the task's failure
            log.exception("phase %s of %s failed in the pool process", frame.id, frame.name)
            reply = ReplyFrame(id=frame.id, error="".join(traceback.format_exception(exc)))
        self.running -= 1
        self._send(reply)
        if self.stopping and not self.running:
            self.loop.call_soon(self.loop.stop)

    async def _handle(self, frame: Any) -> dict[str, str]:
        from celery.exceptions import Reject

        from taskloop.core.states import Phase
        from taskloop.worker.execution import messages, process

        phase = Phase(frame.task.rpartition(".")[2])
        carried = None
        if frame.carry is not None:
            carried = messages.Carried(values=frame.carry, queued_at=frame.queued_at, redelivered=frame.redelivered)
        try:
            prepared = await self._prepare(phase, frame, carried)
        except Reject as exc:
            return {"requeue": str(exc.reason)}
        if isinstance(prepared, str):
            return {"reply": prepared}
        worker, call = prepared
        call.traceparent = frame.traceparent
        return {"reply": process.reply_of(await self._call_phase(worker, call))}

    def _scripts(self, worker: Any) -> Any:
        """This loop's Redis connection for the process's store (None: a Sentinel or a Cluster)."""
        from taskloop.store.aio import AsyncScripts

        if worker.store is not self._aio_store:
            self._aio_store, self._aio = worker.store, AsyncScripts.of(worker.store)
        return self._aio

    async def _prepare(self, phase: Any, frame: Any, carried: Any) -> Any:
        """The step before the callback: a message begun first with nothing else to present has its
        begin awaited on this loop (executor.begin_first); any other step is made here, its round
        trips waited out (process.prepare)."""
        from celery.exceptions import Reject

        from taskloop.base.errors import StoreUnavailable
        from taskloop.worker.execution import messages, process
        from taskloop.worker.execution.handled import Handled

        message = messages.read(messages.PhaseMessage, frame.task, tuple(frame.args), dict(frame.kwargs),
                                ("run_id", "key", "round", "token"))
        if isinstance(message, str):
            return message
        worker = process.executor(self.app, frame.hostname or "worker")
        aio = self._scripts(worker)
        begin = worker.begin_first(phase, message.run_id, message.key, message.round, message.token, frame.name) \
            if aio is not None else None
        if begin is None:
            return process.prepare(self.app, phase, frame.hostname, tuple(frame.args), dict(frame.kwargs),
                                   frame.name, carried)
        refused = worker.claim(phase, message.run_id, message.key, message.round, message.token)
        if refused is not None:
            return process.reply_of(refused)
        taken = (message.run_id, message.key, message.token)
        try:
            reply = await aio.begin(begin)
        except StoreUnavailable as exc:  # nothing ran: the message goes back to the queue (as process.prepare)
            worker.release(taken)
            log.warning("run %s task %s: the store is unreachable before %s round %s began; the message goes back "
                        "to the queue (%s)", message.run_id, message.key, phase.value, message.round, exc)
            raise Reject(f"store unreachable: {exc}", requeue=True) from None
        step = worker.settle(taken, frame.name, lambda: worker.after_begin(begin, reply, frame.name))
        return process.reply_of(step) if isinstance(step, Handled) else (worker, step)

    async def _call_phase(self, worker: Any, call: Any) -> Any:
        """Run the callback, watched, then record its outcome, its write awaited on this loop when it
        is one script call. An ``async def`` callback is a task of its own on this loop (the
        watcher's signal cancels it); a sync one runs on the thread pool (the signal is its
        ``ctx.signal``), and only it: its step's round trips are this loop's, as an async one's."""
        from taskloop.core.outcomes import Outcome
        from taskloop.core.phases import EventKind
        from taskloop.worker.execution import running

        try:
            inner: asyncio.Future[Any]
            if call.is_async:
                missing = [name for name in _context_fields(call) if name not in call.snap.fields]
                if missing:  # read now, not lazily inside the callback, where it would hold up the loop
                    call.snap.ensure(missing)
                task = self.loop.create_task(running.call_async(call, worker.caps))

                def cancel(reason: str) -> None:
                    self.loop.call_soon_threadsafe(task.cancel)

                call.signal.on_set(cancel)
                inner = task
            else:
                inner = self.loop.run_in_executor(self.sync, running.call_sync, call, worker.caps)
            with worker.watcher.watch(call, lambda reason: running.overrun(call, worker.recorder, reason)):
                await asyncio.wait([inner])
            outcome = Outcome(EventKind.CANCEL, cancelled=True, reason=call.signal.reason) if inner.cancelled() \
                else inner.result()
            if call.stream is not None:  # the rest of its live text is written before its outcome
                await call.stream.end_awaited()
            recorder = worker.recorder
            recording = recorder.recording(call.workflow, call.task, call.snap, call.record, outcome, call.signal,
                                           call.holding, call.deferred)
            aio = self._scripts(worker)
            handled = await recorder.awrite(aio, recording) if aio is not None else None
            return handled if handled is not None else recorder.write(recording)
        finally:
            worker.recorder.release(call.holding)
            call.end()


def _context_fields(call: Any) -> list[str]:
    """What an async callback's context may read (core/reads.py ``context_fields``)."""
    from taskloop.core import reads

    return reads.context_fields(call.task.key, call.task.after, call.task.is_loop, call.record.round)


def main(argv: list[str]) -> None:
    options = _setup()
    from taskloop.base.config import settings
    from taskloop.worker.__main__ import import_workflows

    import_workflows()
    sock = socket.socket(fileno=int(argv[0]))
    sync_threads = int(options.get("sync_threads") or settings().sync_threads)
    LoopProcess(sock, int(options["concurrency"]), sync_threads, options.get("kind") or "asyncio").run()


if __name__ == "__main__":
    main(sys.argv[1:])

"""Flows for tests/integration/test_hooks.py: a loop whose rounds report usage and stream, sync and
``async def``, and a task that fails; with ``TL_HOOKS=1`` the worker adds two hooks at import
(``tl.add_hook``): ``Broken``, which raises at every point, then ``Told``, which notes what each
point told in the test's Redis (``test:<run>:told``)."""

from __future__ import annotations

import json
import os
from typing import Any

import redis

import taskloop as tl
from taskloop.ops import hooks as h

_client: redis.Redis | None = None
_client_pid: int | None = None


def _note(run_id: str, found: dict[str, Any]) -> None:
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        _client, _client_pid = redis.Redis.from_url(os.environ["TASKLOOP_REDIS_URL"]), os.getpid()
    _client.rpush(f"test:{run_id}:told", json.dumps({**found, "pid": os.getpid()}))


class Broken(tl.Hook):
    """An exporter that is down: every point raises."""

    def _down(self, *_: Any) -> None:
        raise RuntimeError("exporter down")

    committed = run_started = run_ended = phase_began = phase_ended = chunk_streamed = _down
    stream_written = stream_dropped = limit_throttled = limit_waited = delivery_refused = reconciled = _down


class Told(tl.Hook):
    def phase_began(self, phase: h.PhaseBegan) -> None:
        _note(phase.run_id, {"point": "phase_began", "task": phase.task, "round": phase.round, "phase": phase.phase,
                             "attempt": phase.attempt, "worker": phase.worker, "workflow": phase.workflow,
                             "version": phase.version})

    def phase_ended(self, phase: h.PhaseEnded) -> None:
        began = phase.began
        _note(began.run_id, {"point": "phase_ended", "task": began.task, "round": began.round, "phase": began.phase,
                             "outcome": phase.outcome, "score": phase.score, "usage": phase.usage,
                             "error": phase.error.type if phase.error else None,
                             "exception": type(phase.exception).__name__ if phase.exception else None,
                             "took": phase.at - began.at})

    def chunk_streamed(self, chunk: h.ChunkStreamed) -> None:
        _note(chunk.run_id, {"point": "chunk_streamed", "task": chunk.task, "round": chunk.round, "size": chunk.size})

    def run_ended(self, run: h.RunEnded) -> None:
        _note(run.run_id, {"point": "run_ended", "status": run.status, "termination": run.termination})


if os.environ.get("TL_HOOKS") == "1":
    tl.add_hook(Broken())
    tl.add_hook(Told())


def write(ctx: tl.LoopContext, feedback: str | None) -> int:
    ctx.report_usage(input=10, output=5)
    ctx.stream(f"draft {ctx.round}")
    return ctx.round


async def awrite(ctx: tl.LoopContext, feedback: str | None) -> int:
    ctx.report_usage(input=10, output=5)
    return ctx.round


def review(ctx: tl.LoopContext, draft: int) -> tl.LoopCheck:
    return tl.LoopCheck(done=draft >= 2, feedback="longer", score=draft / 2)


def boom(ctx: tl.TaskContext) -> None:
    raise ValueError("no luck")


hooked = tl.define_workflow("hooked", version="1", tasks=[
    tl.define_loop_task("draft", attempt=write, check=review, max_rounds=3)])
hooked_async = tl.define_workflow("hooked-async", version="1", tasks=[
    tl.define_loop_task("draft", attempt=awrite, check=review, max_rounds=3)])
hooked_fails = tl.define_workflow("hooked-fails", version="1", tasks=[tl.define_task("boom", run=boom)])

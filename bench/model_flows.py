"""The benchmark's loops that wait like a model call (bench/models.py): 3 rounds, accepted in round
3, each attempt and each check waiting ``phase_s`` seconds, as a sync callback (``time.sleep``:
gevent's, under a gevent pool) and as an ``async def`` one (``asyncio.sleep``). The phase time is
part of the workflow's name, so no phase reads its run's input to learn it."""

from __future__ import annotations

import asyncio
import time

import taskloop as tl
from bench.flows import _finished

PHASE_TIMES = (0.05, 0.5, 2.0, 20.0)  # 0.05: the warm-up that touches every slot of a pool


def name(kind: str, phase_s: float) -> str:
    return f"model-{kind}-{int(phase_s * 1000)}ms"


def _sync(phase_s: float) -> tl.Workflow:
    def attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
        time.sleep(phase_s)
        return ctx.round

    def check(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
        time.sleep(phase_s)
        return tl.LoopCheck(done=True) if candidate >= 3 else tl.LoopCheck(done=False, feedback="again")

    return tl.define_workflow(name("sync", phase_s), version="1", observers=[_finished], tasks=[
        tl.define_loop_task("loop", max_rounds=3, attempt=attempt, check=check)])


def _async(phase_s: float) -> tl.Workflow:
    async def attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
        await asyncio.sleep(phase_s)
        return ctx.round

    async def check(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
        await asyncio.sleep(phase_s)
        return tl.LoopCheck(done=True) if candidate >= 3 else tl.LoopCheck(done=False, feedback="again")

    return tl.define_workflow(name("async", phase_s), version="1", observers=[_finished], tasks=[
        tl.define_loop_task("loop", max_rounds=3, attempt=attempt, check=check)])


WORKFLOWS = {name(kind, s): make(s) for s in PHASE_TIMES for kind, make in (("sync", _sync), ("async", _async))}

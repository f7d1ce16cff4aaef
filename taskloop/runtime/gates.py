"""Ending the paused gates of a cancelled run: no message will come for them, so whoever sees the
cancel first ends them (the client that cancelled, a worker asked by ``taskloop.settle``, or the
reconciler). One guarded write, the same from all three."""

from __future__ import annotations

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.core import fields as fld
from taskloop.core.planner import Planner
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import State
from taskloop.define.workflow import Workflow
from taskloop.runtime.commit import MAX_ATTEMPTS, Sender, commit
from taskloop.store.redis_store import RedisStore


def settle_gates(store: RedisStore, settings: Settings, send: Sender, workflow: Workflow, run_id: str,
                 attempts: int = MAX_ATTEMPTS) -> int:
    """End the run's paused gates (cancelled, or skipped for a stopped run) and what follows from
    that: how many gates this write cancelled. CommitConflict if the write kept conflicting."""
    snap = store.snapshot(run_id, [fld.F_CONTROL, *(fld.task_field(g) for g in workflow.gates)])

    def plan(view: Snapshot) -> Planner:
        planner = Planner(workflow, view, clock.now(), settings)
        planner.cancel_gates()
        planner.settle()
        return planner

    committed = commit(store, plan, snap, send, attempts=attempts)
    return sum(1 for key in committed.planner.changed if committed.planner.tasks[key].state is State.CANCELLED)

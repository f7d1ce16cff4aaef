"""The one commit path: every write of a run's records goes through this module.

- ``commit``: plan, apply the plan as one guarded write, plan again on a conflict (a bounded
  number of times), then send the messages the plan dispatched and tell the hooks. The
  client (start, resume, decide, gate cancellation), the executor (begin and outcomes), recovery,
  the outage sweep and the reconciler.
- ``begin``: the begin the scheduler prepared for a queued phase (begin.lua), which writes the
  running record and its lease, or only reads, for the executor to decide.
- ``commit_once``: the first attempt of ``commit`` with its write awaited on an event loop (the
  asyncio pool's), or None for the caller to commit on the sync path.
- ``begin_many``, ``renew``: the watcher's calls for all of a process's running phases at once: the
  begins of phases that run before their begin is written, and their lease renewals.

A guarded batch that needs no plan is ``write`` (runtime/writes.py). After a write, the process's
hooks hear of it (runtime/instruments.py: metrics, tracing, the workflow's observers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from taskloop.base.errors import CommitConflict, LimitRefused, StoreUnavailable
from taskloop.core.batch import Batch
from taskloop.core.begin import Dispatch
from taskloop.core.events import Event
from taskloop.core.limits import LimitOp
from taskloop.core.planner import Planner
from taskloop.core.snapshot import Snapshot
from taskloop.define.workflow import Workflow
from taskloop.ops.hooks import Committed as Written
from taskloop.runtime import instruments
from taskloop.store.aio import AsyncScripts
from taskloop.store.limit_store import Admission
from taskloop.store.redis_store import Applied, BeginReply, Conflict, RedisStore
from taskloop.store.running import Begin, Renewal, Renewed

log = logging.getLogger("taskloop.runtime.commit")

MAX_ATTEMPTS = 50

Sender = Callable[[Workflow, str, list[Dispatch]], None]
Plan = Callable[[Snapshot], Planner]


class Dispatcher(Protocol):
    """A sender that can also hand over the Redis commands that publish its messages, to run inside
    the write (taskloop/runtime/outbox.py); None means it sends after the write instead."""

    def __call__(self, workflow: Workflow, run_id: str, dispatches: list[Dispatch]) -> None: ...

    def fold(self, workflow: Workflow, run_id: str,
             dispatches: list[Dispatch]) -> list[tuple[str, tuple[Any, ...]]] | None: ...


@dataclass(frozen=True)
class Committed:
    """A plan that was written: what it decided, and whether it ended the run."""

    planner: Planner
    finished: bool
    picked: tuple[str, ...] = ()  # the waiters a slot released with the write lets start (to send again)

    @property
    def events(self) -> list[Event]:
        return [*self.planner.events, *(self.planner.final_events if self.finished else ())]


def begin(store: RedisStore, run_id: str, key: str, round: int, phase: str, token: int, worker: str,
          now: float, fields: Sequence[str], limits: LimitOp | None = None) -> BeginReply:
    """Begin a prepared phase in one call (taking its room under ``limits``), or read ``fields``
    for the caller (store.begin)."""
    return store.begin(run_id, key, round, phase, token, worker, now, fields, limits)


def begin_many(store: RedisStore, begins: Sequence[Begin]) -> list[BeginReply]:
    """Begin several prepared phases (no limits) in one round trip (store.begin_many: the watcher's
    marks of the phases that run before their begin is written)."""
    return store.begin_many(begins)


def renew(store: RedisStore, renewals: Sequence[Renewal]) -> list[Renewed]:
    """Renew the leases of running phases, each guarded by its record, in one call (store.renew_leases)."""
    return store.renew_leases(renewals)


def never(conflict: Conflict) -> bool:
    return False


def commit(store: RedisStore, plan: Plan, snapshot: Snapshot, send: Sender,
           retry: Callable[[Conflict], bool] | None = None, attempts: int = MAX_ATTEMPTS,
           limits: LimitOp | None = None) -> Committed:
    """Plan over ``snapshot`` and write the plan; on a conflict, read again what the plan read and
    plan again (unless ``retry`` says that conflict is final). Raises CommitConflict when the
    conflicts do not stop. ``plan`` may raise to give up (nothing is written then). ``limits``: a
    limits operation made with the write: ``wake`` (the phase's slots released when its outcome is
    written), or ``acquire`` (the room of the phase the write begins; raises LimitRefused, nothing
    written, when a limit refuses it)."""
    conflict: Conflict | None = None
    for _ in range(attempts):
        planner = plan(snapshot)
        batch = planner.batch()
        batch.limits = limits
        folded = _fold(send, planner, batch)
        result = store.apply(batch)
        if isinstance(result, Admission):
            raise LimitRefused(f"run {snapshot.run_id}: waits for limit {result.limit}", result)
        if isinstance(result, Applied):
            committed = Committed(planner, result.finished, result.picked)
            _after(store, committed, None if folded else send)
            return committed
        conflict = result
        log.debug("run %s: conflict on %s, planning again", snapshot.run_id, conflict.label)
        if retry is not None and not retry(conflict):
            break
        refresh(store, snapshot)
    assert conflict is not None
    raise CommitConflict(
        f"run {snapshot.run_id}: gave up writing after repeated conflicts (last on {conflict.label}); "
        "another writer keeps changing the same records. Nothing was written by this attempt; try again",
        conflict,
    )


async def commit_once(store: RedisStore, aio: AsyncScripts, plan: Plan, snapshot: Snapshot, send: Sender,
                      limits: LimitOp | None = None) -> Committed | None:
    """``commit``'s first attempt, its write awaited on an event loop (store/aio.py): the Committed,
    or None when the write is not one script call (a Cluster, a cancel, a run's first or last
    listing) or was refused (a conflict, a limit): the caller then commits on the sync path, which
    plans again. ``plan`` may raise to give up, as for ``commit``."""
    planner = plan(snapshot)
    batch = planner.batch()
    batch.limits = limits
    folded = _fold(send, planner, batch)
    result = await aio.apply(batch)
    if not isinstance(result, Applied):
        return None
    committed = Committed(planner, result.finished, result.picked)
    _after(store, committed, None if folded else send)
    return committed


def through_outage(store: RedisStore, plan: Plan, snapshot: Snapshot, send: Sender, limit_s: float,
                   limits: LimitOp | None = None) -> Committed:
    """``commit``, trying again while Redis is unreachable, for up to ``limit_s`` seconds: what a
    worker does with the outcome of a phase that ended during an outage (recorded as soon as Redis
    is back, instead of replayed after its lease). The plan is made again on every try."""
    deadline = time.monotonic() + limit_s
    delay = 0.1
    while True:
        try:
            return commit(store, plan, snapshot, send, limits=limits)
        except StoreUnavailable as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("run %s: Redis unreachable while recording a phase (%s); trying again for up to %.0f s",
                        snapshot.run_id, exc, deadline - time.monotonic())
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def refresh(store: RedisStore, snapshot: Snapshot) -> None:
    """Read again, in one call, every field the snapshot has read."""
    names = list(snapshot.fields)
    snapshot.forget(names)
    snapshot.ensure(names)


def _fold(send: Sender, planner: Planner, batch: Batch) -> bool:
    """Put the messages of the plan into its write, when the sender can (see outbox.py)."""
    fold = getattr(send, "fold", None)
    if not planner.dispatches or fold is None:
        return False
    commands = fold(planner.workflow, planner.run_id, planner.dispatches)
    if commands is None:
        return False
    for name, args in commands:
        batch.push(name, *args)
    return True


def _after(store: RedisStore, committed: Committed, send: Sender | None) -> None:
    planner = committed.planner
    if planner.dispatches and send is not None:
        send(planner.workflow, planner.run_id, planner.dispatches)
    instruments.hooks().committed(Written(store, planner.workflow, planner.run_id, committed.events,
                                          committed.finished))

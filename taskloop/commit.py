"""The one commit path: plan, apply the plan as one guarded write, plan again on a conflict (a
bounded number of times), then send the messages the plan dispatched and tell the observers.

Every writer of run state goes through `commit`: the client (start, resume, decide, gate
cancellation), the executor (begin and outcomes), recovery and the reconciler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from taskloop import clock, metrics
from taskloop import events as ev
from taskloop.definitions import Workflow
from taskloop.errors import CommitConflict
from taskloop.events import Event, notify
from taskloop.scheduler import Dispatch, Planner
from taskloop.store import Applied, Batch, Conflict, RedisStore, Snapshot
from taskloop.store import keys as k

log = logging.getLogger("taskloop.commit")

MAX_ATTEMPTS = 50

Sender = Callable[[Workflow, str, list[Dispatch]], None]
Plan = Callable[[Snapshot], Planner]


class Dispatcher(Protocol):
    """A sender that can also hand over the Redis commands that publish its messages, to run inside
    the write (taskloop/outbox.py); None means it sends after the write instead."""

    def __call__(self, workflow: Workflow, run_id: str, dispatches: list[Dispatch]) -> None: ...

    def fold(self, workflow: Workflow, run_id: str,
             dispatches: list[Dispatch]) -> list[tuple[str, tuple[Any, ...]]] | None: ...


@dataclass(frozen=True)
class Committed:
    """A plan that was written: what it decided, and whether it ended the run."""

    planner: Planner
    finished: bool

    @property
    def events(self) -> list[Event]:
        return [*self.planner.events, *(self.planner.final_events if self.finished else ())]


def never(conflict: Conflict) -> bool:
    return False


def commit(store: RedisStore, plan: Plan, snapshot: Snapshot, send: Sender,
           retry: Callable[[Conflict], bool] | None = None, attempts: int = MAX_ATTEMPTS) -> Committed:
    """Plan over ``snapshot`` and write the plan; on a conflict, read again what the plan read and
    plan again (unless ``retry`` says that conflict is final). Raises CommitConflict when the
    conflicts do not stop. ``plan`` may raise to give up (nothing is written then)."""
    conflict: Conflict | None = None
    for _ in range(attempts):
        planner = plan(snapshot)
        batch = planner.batch()
        folded = _fold(send, planner, batch)
        result = store.apply(batch)
        if isinstance(result, Applied):
            committed = Committed(planner, result.finished)
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
    metrics.observe_events(planner.workflow.name, committed.events)
    observe(store, planner.workflow, planner.run_id, committed.events)


def observe(store: RedisStore, workflow: Workflow, run_id: str, events: list[Event]) -> None:
    """Call the workflow's observers; a failing observer is recorded in the run, never raised."""
    if not workflow.observers or not events:
        return
    failures = notify(workflow.observers, [e.model_copy(update={"run_id": run_id}) for e in events])
    if failures:
        batch = Batch(run_id).exists(k.F_WORKFLOW, "run exists")
        for failure in failures:
            batch.event(Event(type=ev.OBSERVER_ERROR, at=clock.now(), data=failure))
        batch.incr(k.stat_field("observer_errors"), len(failures))
        store.apply(batch)

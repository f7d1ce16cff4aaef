"""Refused deliveries: a message that no longer matches its record, and an outcome whose phase was
taken over while it ran. Each is a counter (fleet-wide and in the run), a log line and a metric,
never an event."""

from __future__ import annotations

import logging

from taskloop.core import fields as fld
from taskloop.core.batch import Batch
from taskloop.core.records import TaskRecord
from taskloop.core.states import Phase
from taskloop.ops.hooks import Refused
from taskloop.runtime.instruments import hooks
from taskloop.runtime.writes import write
from taskloop.store.redis_store import RedisStore
from taskloop.worker.execution.handled import Handled, Result

log = logging.getLogger("taskloop.executor")


def stale(store: RedisStore, run_id: str, record: TaskRecord, phase: Phase, round: int, token: int) -> Handled:
    """A message whose round, phase or token is no longer the record's."""
    reason = (f"message for {phase.value} round {round} token {token} does not match the record "
              f"({record.state.value} round {record.round} token {record.token})")
    log.info("run %r task %r: refused stale delivery: %s", run_id, record.key, reason)
    count(store, run_id, "stale_deliveries")
    hooks().delivery_refused(Refused("stale"))
    return Handled(Result.STALE, reason=reason)


def superseded(store: RedisStore, run_id: str, begun: TaskRecord) -> Handled:
    """An execution whose phase another one took over: its outcome is discarded."""
    log.warning("run %r task %r: phase was taken over while it ran (token %s); its outcome is discarded",
                run_id, begun.key, begun.token)
    count(store, run_id, "stale_commits")
    hooks().delivery_refused(Refused("superseded"))
    return Handled(Result.SUPERSEDED, reason="outcome of a superseded execution discarded")


def count(store: RedisStore, run_id: str, name: str) -> None:
    """A refused delivery is a counter, never an event; it never re-creates an expired run."""
    store.incr_stat(name)
    batch = Batch(run_id).exists(fld.F_WORKFLOW, "run exists").expect(fld.F_COMPACT, None, "not compacted")
    write(store, batch.incr(fld.stat_field(name), 1))

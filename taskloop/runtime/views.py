"""Reading runs: what ``client.result``, ``client.inspect`` and ``client.runs`` return, built from
a run's records (only its id is needed, never its definition)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from taskloop.base import names
from taskloop.base.errors import InvalidInput, RunNotFound
from taskloop.base.names import step_of
from taskloop.base.text import shown
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.checks import StoredCheck, decode_given
from taskloop.core.events import Event
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.snapshot import RunMeta, Snapshot, decode_usage
from taskloop.core.states import RunStatus, Slot, TaskStatus
from taskloop.define.tasks import TaskKind
from taskloop.runtime.models import (
    ErrorInfo,
    ExecView,
    LoopProgress,
    RoundView,
    RunPage,
    RunResult,
    RunSummary,
    RunView,
    TaskView,
    ThrottleView,
    executions,
)
from taskloop.store.redis_store import RedisStore

# what a result reads besides the task records and values: the usage counters and the observer errors' count
_RESULT_ALSO = (*fld.USAGE_FIELDS, fld.stat_field("observer_errors"))
_META_AND_RESULT = (*fld.META_FIELDS, *_RESULT_ALSO)


def run_result(store: RedisStore, run_id: str, meta: RunMeta) -> RunResult | None:
    """The result of a finished run, or None while it is still going."""
    if not meta.terminal:
        return None
    return _result(store, _ended_snapshot(store, run_id, _RESULT_ALSO), meta)


def meta_and_result(store: RedisStore, run_id: str) -> tuple[RunMeta, RunResult | None]:
    """A run's meta, and its result if it ended, in one round trip: its meta fields and, in the
    same pipeline, a scan of the fields a result reads of each task."""
    names.check_run_id(run_id)  # an id no run can have: InvalidInput (it is never sent to Redis)
    return _meta_and_result(store, _ended_snapshot(store, run_id, _META_AND_RESULT))


def woken_result(store: RedisStore, run_id: str, block_ms: int) -> tuple[RunMeta, RunResult | None] | None:
    """Wait up to ``block_ms`` for the run's end marker; once it wakes, what ``meta_and_result``
    reads, in the round trip of the wake itself (store.block_end_scan: wait()'s first block).
    None: nothing woke it."""
    found = store.block_end_scan(run_id, block_ms, fld.RESULT_SCAN, _META_AND_RESULT)
    return None if found is None else _meta_and_result(store, _scanned_snapshot(store, run_id, found))


def _meta_and_result(store: RedisStore, snap: Snapshot) -> tuple[RunMeta, RunResult | None]:
    if not snap.exists:
        raise RunNotFound(snap.run_id)
    meta = snap.meta()
    return meta, _result(store, snap, meta) if meta.terminal else None


def _ended_snapshot(store: RedisStore, run_id: str, also: Sequence[str]) -> Snapshot:
    """The ``also`` fields and every field of fld.RESULT_SCAN (each task's record, value and
    execution), read at once; a field of that pattern the scan did not find is absent."""
    return _scanned_snapshot(store, run_id, store.scan_with(run_id, fld.RESULT_SCAN, also))


def _scanned_snapshot(store: RedisStore, run_id: str, found: dict[str, str | None]) -> Snapshot:
    """A snapshot of what a scan of fld.RESULT_SCAN found (a field of that pattern it did not find
    is absent)."""
    keys = [fld.key_of_task_field(name) for name in found if name.startswith(fld.TASK_PREFIX)]
    absent = {name: None for key in keys for name in (*fld.record_fields(key), fld.value_field(key))
              if name not in found}
    return Snapshot(run_id, {**absent, **found}, loader=lambda names: store.hmget(run_id, names))


def _result(store: RedisStore, snap: Snapshot, meta: RunMeta) -> RunResult:
    """The result of a run that ended, on a snapshot holding its task records (a scan)."""
    tasks = _records(snap, lambda key: [fld.value_field(key)])  # every task's value (a task not done has none)
    done = [key for key, rec in tasks.items() if rec.status is TaskStatus.DONE]
    values = {key: snap.json(fld.value_field(key)) for key in done}
    observer_errors: list[dict[str, Any]] = []
    if int(snap.get(fld.stat_field("observer_errors")) or 0):
        observer_errors = [e.data or {} for e in store.events(snap.run_id) if e.type == ev.OBSERVER_ERROR]
    return RunResult(
        run_id=snap.run_id,
        status=meta.stored_status,
        termination_code=meta.termination.value if meta.termination else None,
        values=values,
        errors=_errors(tasks, meta.error),
        usage=decode_usage(snap.fields, tasks.values()),
        observer_errors=observer_errors,
    )


def run_view(store: RedisStore, run_id: str) -> RunView:
    """Everything recorded about a run, including every round's output, check and executions."""
    return run_view_and_events(store, run_id)[0]


def run_view_and_events(store: RedisStore, run_id: str,
                        known: list[Event] | None = None) -> tuple[RunView, list[Event]]:
    """``run_view``, and the events it was built from (the UI shows both; one read of each).
    ``known``: the events a caller read before (a live page): only the later ones are read, and
    the list is extended with them."""
    names.check_run_id(run_id)
    # the events first, then the fields: a write landing between the two reads is then in the fields
    # and after the last event read, so a live page that follows from that event renders it again
    # (read the other way round, the page would show the older fields with the newer event as its
    # last, and wait for a later write that may never come)
    if known is None:
        events = store.events(run_id)
    else:
        known += store.events(run_id, after=known[-1].id) if known and known[-1].id else store.events(run_id)
        events = known
    fields: dict[str, str | None] = dict(store.all_fields(run_id))
    if not fields:
        raise RunNotFound(run_id)
    snap = Snapshot(run_id, fields)
    meta = snap.meta()
    tasks = _records(snap)
    execs = executions(events)
    ordered = sorted(tasks.values(), key=lambda r: (r.started_at is None, r.started_at or 0.0, r.key))
    copied = _json(fields.get(fld.F_COPIED))
    views = {rec.key: _task_view(rec, fields, execs.get(rec.key, []), copied) for rec in ordered}
    stats = {name.removeprefix("s:"): int(v) for name, v in fields.items() if name.startswith("s:") and v}
    return RunView(
        run_id=run_id,
        workflow=meta.workflow,
        version=meta.version,
        fingerprint=meta.fingerprint or None,
        status=meta.status.value,
        termination_code=meta.termination.value if meta.termination else None,
        input=snap.json(fld.F_INPUT),
        state=snap.json(fld.F_STATE),
        created_at=meta.created,
        finished_at=meta.finished,
        usage=decode_usage(fields, tasks.values()),
        tasks=views,
        stats=stats,
        error=_run_error(meta.error),
        control=meta.control,
        forked_from=_json(fields.get(fld.F_FORKED_FROM)),
        copied=copied,
    ), events


def run_summaries(store: RedisStore, status: str | None = None, workflow: str | None = None,
                  limit: int = 50) -> list[RunSummary]:
    """Recent runs, newest first, optionally filtered by status and workflow name: up to ``limit``
    of them, any number, read a page of at most MAX_PAGE at a time (``run_page``). A run started
    while it pages shifts the pages: one seen on the page before is not listed twice."""
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise InvalidInput(f"runs: limit must be an integer from 1, got {shown(limit)}")
    found: list[RunSummary] = []
    seen: set[str] = set()
    offset = 0
    while len(found) < limit:
        size = min(limit - len(found), MAX_PAGE)
        page = run_page(store, status, workflow, offset, size)
        found += [r for r in page.runs if r.run_id not in seen]
        seen.update(r.run_id for r in page.runs)
        if not page.more:
            break
        offset += size
    return found[:limit]


def run_page(store: RedisStore, status: str | None = None, workflow: str | None = None, offset: int = 0,
             limit: int = 50, prefix: str | None = None) -> RunPage:
    """One page of runs, newest first: ``limit`` runs from ``offset`` of the run list of ``status``
    and ``workflow`` (both optional). The lists are sorted sets in Redis (store/keys.py
    ``run_list``): a page costs one range read and one read of its runs, whatever the number of
    runs (a status across workflows: one range read per workflow, merged). ``waiting`` is derived
    from the records (a running run whose only work left is paused gates): it pages through the
    running list and keeps the waiting ones, so its pages may be short. ``prefix`` looks up run
    ids that start with it instead (at most ``limit`` of them)."""
    statuses = {s.value for s in RunStatus}
    if status is not None and status not in statuses:
        raise InvalidInput(f"runs: status must be one of {sorted(statuses)}, got {shown(status)}")
    if workflow is not None and not names.is_name(workflow):
        raise InvalidInput(f"runs: workflow must be a workflow name: {names.NAME_RULE}; got {shown(workflow)}")
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"runs: limit must be an integer from 1 to {MAX_PAGE}, got {shown(limit)}")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise InvalidInput(f"runs: offset must be an integer >= 0, got {shown(offset)}")
    if prefix is not None:
        if not isinstance(prefix, str) or not names.is_run_id(prefix):
            raise InvalidInput(f"runs: prefix must be the start of a run id ({names.RUN_ID_RULE}), got {shown(prefix)}")
        ids, total = sorted(store.run_ids_with_prefix(prefix, limit=limit)), None
    else:
        stored = RunStatus.RUNNING.value if status == RunStatus.WAITING.value else status
        ids, count = store.list_page(stored, workflow, offset, limit)
        total = count if status != RunStatus.WAITING.value else None
    found: list[RunSummary] = []
    for run_id, row in zip(ids, store.run_metas(ids), strict=True):
        if row[1] is None:  # expired since it was listed (the reconciler trims the lists)
            continue
        meta = RunMeta.from_fields(run_id, dict(zip(fld.META_FIELDS, row, strict=True)))
        if (status and meta.status.value != status) or (workflow and meta.workflow != workflow):
            continue  # a waiting filter, or a prefix search with filters
        found.append(RunSummary(
            run_id=run_id, workflow=meta.workflow, version=meta.version, status=meta.status.value,
            termination_code=meta.termination.value if meta.termination else None,
            created_at=meta.created, finished_at=meta.finished,
        ))
    return RunPage(runs=found, total=total, offset=offset, limit=limit,
                   more=(total is not None and offset + limit < total) or (total is None and len(ids) == limit))


MAX_PAGE = 500  # runs in one page


def loop_progress(store: RedisStore, run_ids: list[str]) -> dict[str, list[LoopProgress]]:
    """Where each loop task of each run stands (its round, of how many), for lists of runs: one
    pipelined read of the records of every run (``store.task_records``), the first ``per_run``
    tasks of a large run."""
    found: dict[str, list[LoopProgress]] = {}
    for run_id, raws in zip(run_ids, store.task_records(run_ids), strict=True):
        loops: list[LoopProgress] = []
        for raw in raws:
            try:
                record = TaskRecord.load(raw)
            except ValueError:
                continue
            if record.kind is TaskKind.LOOP and record.round:
                loops.append(LoopProgress(key=record.key, round=record.round, max_rounds=record.limit,
                                          status=record.status.value))
        found[run_id] = sorted(loops, key=lambda loop: loop.key)
    return found


def _json(raw: str | None) -> Any:
    return json.loads(raw) if raw is not None else None


def _records(snap: Snapshot, per_task: Callable[[str], Sequence[str]] = lambda key: (),
             also: Sequence[str] = ()) -> dict[str, TaskRecord]:
    """The task records the snapshot's scan found, every execution read in one read, with
    ``per_task``'s fields of each task and the ``also`` fields."""
    keys = [fld.key_of_task_field(name) for name in snap.fields if name.startswith(fld.TASK_PREFIX)]
    snap.ensure([*(field for key in keys for field in (*fld.record_fields(key), *per_task(key))), *also])
    found = {key: snap.record(key) for key in keys}
    return {key: rec for key, rec in found.items() if rec is not None}


def _run_error(error: ErrorRecord | None) -> ErrorInfo | None:
    if error is None:
        return None
    return ErrorInfo(key="", type=error.type, message=error.message, details=error.details)


def _errors(tasks: dict[str, TaskRecord], run_error: ErrorRecord | None) -> list[ErrorInfo]:
    failed = [r for r in tasks.values() if r.status is TaskStatus.FAILED and r.error is not None]
    failed.sort(key=lambda r: r.finished_at or 0.0)
    found = [ErrorInfo(key=r.key, type=r.error.type, message=r.error.message, details=r.error.details)
             for r in failed if r.error is not None]
    run = _run_error(run_error)
    return [run, *found] if run is not None else found


def _task_view(record: TaskRecord, data: dict[str, str | None], execs: list[ExecView],
               copied: dict[str, Any] | None = None) -> TaskView:
    rounds: list[RoundView] = []
    copied_rounds = int(((copied or {}).get("rounds") or {}).get(record.key) or 0)
    if record.kind is TaskKind.LOOP:
        for n in range(1, record.round + 1):
            output_raw = data.get(fld.candidate_field(record.key, n))
            check_raw = data.get(fld.check_field(record.key, n))
            phase = "complete" if check_raw is not None else "check" if output_raw is not None else "attempt"
            notes = {p: json.loads(raw) for p in ("attempt", "check")
                     if (raw := data.get(fld.notes_field(record.key, n, p))) is not None}
            given = data.get(fld.feedback_field(record.key, n))
            rounds.append(RoundView(
                round=n, phase=phase,
                output=json.loads(output_raw) if output_raw is not None else None,
                check=StoredCheck.decode(check_raw).form() if check_raw is not None else None,
                execs=[e for e in execs if e.round == n], notes=notes,
                copied=n <= copied_rounds, feedback_given=decode_given(given) if given is not None else None,
            ))
    value_raw = data.get(fld.value_field(record.key))
    error = None
    if record.error is not None:
        error = ErrorInfo(key=record.key, type=record.error.type, message=record.error.message,
                          details=record.error.details)
    return TaskView(
        key=record.key, kind=record.kind.value, status=record.status.value,
        phase=record.phase.value if record.phase else None, round=record.round,
        attempts=record.attempts,
        value=json.loads(value_raw) if value_raw is not None and record.status is TaskStatus.DONE else None,
        error=error, cache_hit=record.cache_hit, worker=record.worker,
        started_at=record.started_at, finished_at=record.finished_at, reason=record.reason, rounds=rounds,
        step=step_of(record.key), activation=_json(data.get(fld.activation_field(record.key))),
        execs=[] if record.kind is TaskKind.LOOP else execs,
        exhausted=record.exhausted, kept_round=record.kept_round,
        copied=record.key in ((copied or {}).get("tasks") or ()),
        throttled=_throttled(data.get(fld.throttle_field(record.key))) if record.slot is Slot.QUEUED else None,
    )


def _throttled(note: str | None) -> ThrottleView | None:
    if note is None:
        return None
    try:
        found = json.loads(note)
        return ThrottleView(limit=found["limit"], value=found.get("value") or "", since=found["since"],
                            retry_at=found.get("retry_at"))
    except (ValueError, KeyError, TypeError):
        return None

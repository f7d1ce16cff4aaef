"""Queueing and beginning a phase (pure): the message a queued phase gets (``Dispatch``), what its
begin writes when the scheduler can prepare it for begin.lua, what it is admitted against (the
budget), and the record a task starts from."""

from __future__ import annotations

import json
from dataclasses import dataclass

from taskloop.base.config import Settings
from taskloop.core import fields as fld
from taskloop.core.limits import limits_tag, unkeyed_specs
from taskloop.core.phases import EventKind, PhaseEvent, advance
from taskloop.core.records import TaskRecord
from taskloop.core.states import Phase
from taskloop.define.tasks import Task, TaskKind
from taskloop.define.workflow import Workflow


@dataclass(frozen=True)
class Dispatch:
    """A Celery message to send once the plan is committed."""

    key: str
    phase: Phase
    round: int
    token: int
    countdown: float | None = None


@dataclass(frozen=True)
class Cap:
    """A budget admission check of a begin: run field + ``add`` must stay within ``limit``."""

    field: str
    limit: int
    add: int
    label: str


def counts_attempts(workflow: Workflow) -> bool:
    """Only a budget on attempts needs a run-wide attempt counter (to admit against); the usage
    reported to callers sums the records' own counts."""
    return workflow.budget is not None and workflow.budget.attempts is not None


def budget_caps(workflow: Workflow, consumed: int) -> list[Cap]:
    budget = workflow.budget
    caps: list[Cap] = []
    if budget is None:
        return caps
    if budget.attempts is not None and consumed:
        caps.append(Cap(fld.usage_field("attempts"), budget.attempts, consumed, "budget:attempts"))
    if budget.input_tokens is not None:
        caps.append(Cap(fld.usage_field("input"), budget.input_tokens, 1, "budget:input_tokens"))
    if budget.output_tokens is not None:
        caps.append(Cap(fld.usage_field("output"), budget.output_tokens, 1, "budget:output_tokens"))
    return caps


def needs_preparation(task: Task, record: TaskRecord) -> bool:
    """Before the first execution of an activation, the worker evaluates the condition and the cache."""
    return not record.prepared and (task.condition is not None or task.cache is not None)


def prepared_begin(workflow: Workflow, record: TaskRecord, settings: Settings) -> str | None:
    """What beginning this queued phase will write, for begin.lua (None: the worker decides).

    The running record (its JSON, ``rec``) comes from the state machine; begin.lua writes it as it
    is, and the execution (the worker's name, the begin time and, for a new round with a timeout,
    the deadline) in its own fields, then takes the lease. A phase under fleet limits that need no
    key from the worker (``lim``) takes its room in the same call, or joins a wait queue."""
    task = workflow.lookup(record.key)
    if task is None or needs_preparation(task, record):
        return None  # the worker decides
    limits = task.limits_of(record.phase.value) if record.phase else ()
    specs = unkeyed_specs(limits)
    if specs is None:
        return None  # a concurrency key: the worker computes it and takes the room first (worker/limits/limiter.py)
    begun = advance(record, PhaseEvent(EventKind.BEGIN, 0.0, worker="-"))
    consumed = begun.attempts - record.attempts
    return json.dumps({
        "tok": record.token, "rnd": record.round, "ph": _value(record.phase),
        "rec": begun.dump(), "cons": consumed if counts_attempts(workflow) else 0,
        "caps": [[cap.field, cap.limit, cap.add] for cap in budget_caps(workflow, consumed)],
        "dl": record.deadline, "tmo": task.timeout_ms / 1000.0 if task.timeout_ms and record.deadline is None else None,
        "lease": settings.running_lease_s, "grace": settings.timeout_grace_s,
        "rd": outcome_fields(workflow, record.key, record.phase),
        **({"lim": limits_tag(specs, workflow.name, task.queue or "")} if specs else {}),
    }, separators=(",", ":"), ensure_ascii=False)


PREFETCH_DEPENDENTS = 64  # beyond this many, an outcome reads its dependents when it needs them


def outcome_fields(workflow: Workflow, key: str, phase: Phase | None) -> list[str]:
    """What the outcome of a phase that may end its task will read besides OUTCOME_FIELDS (which
    the executor asks begin.lua for with the record): the dependents' records (with their execution
    fields), returned with the begin."""
    if phase is Phase.ATTEMPT:
        return []
    dependents = workflow.dependents.get(key, ())
    if len(dependents) > PREFETCH_DEPENDENTS:
        return []
    return [field for d in dependents for field in fld.record_fields(d)]


def initial_record(task: Task) -> TaskRecord:
    """The record of a task in a new run: waiting for its dependencies."""
    if task.kind is TaskKind.LOOP:
        limit = task.max_rounds or 1
    elif task.retry is not None:
        limit = task.retry.attempts
    else:
        limit = 1
    return TaskRecord(key=task.key, kind=task.kind, limit=limit, waiting_on=len(task.after))


def _value(phase: Phase | None) -> str | None:
    return phase.value if phase is not None else None

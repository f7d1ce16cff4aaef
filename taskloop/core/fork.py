"""Forking a finished run from a round (SPEC §9), pure: the plan of the new run's first write,
built from every field of the original (it is never changed).

A workflow of tasks (a DAG):

- Tasks that are not downstream of the forked task and ended ``done`` (or ``skipped`` by their
  condition) are copied as they ended, with their data: they never run again. The others (downstream
  of it, or ended otherwise, e.g. cancelled by the original's failure) start afresh.
- The forked task keeps rounds 1..k-1 as recorded (candidates, checks, notes, scores, token usage)
  and starts round k with ``attempt(ctx, feedback)``: the feedback given, else the one recorded
  for round k-1. A plain task (or a gate) starts afresh, as round 1.

A graph workflow forks at an action (an activation, e.g. ``review@2``): the new run starts from
the business state recorded when that action's batch of activations was made; the actions of
earlier batches that ended done or failed are copied (the handler saw their outcomes); the
action forked from and the other actions of its batch are activated again with their inputs
(the forked one keeping its copied rounds, as above); nothing of the later batches is kept.

What is copied counts: attempts (one per copied round, and the copied tasks' own) and tokens
(those reported in copied rounds and by copied tasks) are the new run's usage from the start,
so its budget bounds the whole logical run, as ``max_rounds`` bounds its logical rounds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from taskloop.base.config import Settings, min_lease_s
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core import scores
from taskloop.core.batch import Index
from taskloop.core.begin import counts_attempts, initial_record
from taskloop.core.events import Event
from taskloop.core.phases import EventKind, PhaseEvent
from taskloop.core.planner import Planner
from taskloop.core.records import TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import RunStatus, State, TaskStatus
from taskloop.define.tasks import Task
from taskloop.define.workflow import Workflow

Fields = Mapping[str, str | None]


def stored_record(fields: Fields, key: str) -> TaskRecord | None:
    raw = fields.get(fld.task_field(key))
    if raw is None:
        return None
    return TaskRecord.load(raw, *(fields.get(f) for f in fld.record_fields(key)[1:]))


def downstream(workflow: Workflow, key: str) -> set[str]:
    """Every task that depends on ``key``, directly or not."""
    found: set[str] = set()
    todo = [key]
    while todo:
        for dependent in workflow.dependents.get(todo.pop(), ()):
            if dependent not in found:
                found.add(dependent)
                todo.append(dependent)
    return found


def kept_as_is(record: TaskRecord | None) -> bool:
    """An outcome a fork keeps: done, or skipped by its own condition."""
    return record is not None and (record.status is TaskStatus.DONE or (
        record.status is TaskStatus.SKIPPED and record.reason == "condition"))


def plan_fork(workflow: Workflow, original_id: str, fields: Fields, new_id: str, key: str, round: int,
              feedback_raw: str | None, now: float, settings: Settings, actor: str | None = None) -> Planner:
    """The first write of a fork of a DAG run (``fields``: all of the original's)."""
    planner = _new_run(workflow, original_id, fields, new_id, key, round, now, settings, actor)
    originals = {k: stored_record(fields, k) for k in workflow.order}
    below = downstream(workflow, key)
    kept = [k for k in workflow.order if k != key and k not in below and kept_as_is(originals[k])]
    data: dict[str, str] = {}
    for k in kept:
        record = originals[k]
        assert record is not None
        planner.tasks[k] = planner.changed[k] = record
        data.update(_data_of(fields, k, None))
    forked = _forked_record(workflow.by_key[key], originals[key], key, round, fields, data, feedback_raw)
    planner.tasks[key] = planner.changed[key] = forked
    fresh = [k for k in workflow.order if k != key and k not in kept]
    done = {k for k in kept if originals[k].status is TaskStatus.DONE}  # type: ignore[union-attr]
    for k in fresh:
        task = workflow.by_key[k]
        planner.tasks[k] = planner.changed[k] = initial_record(task).model_copy(
            update={"waiting_on": sum(1 for dep in task.after if dep not in done)})
    planner.counters[fld.F_OPEN] = len(fresh) + 1
    if workflow.gates:
        planner.run_updates[fld.F_GATES] = json.dumps(list(workflow.gates))
    _carry_usage(planner, workflow, [planner.tasks[k] for k in kept], forked, fields, kept, key, round, data)
    planner.data.update(data)
    planner.move(key, PhaseEvent(EventKind.FORK, now))
    skipped = {k for k in kept if k not in done}
    for k in fresh:
        task = workflow.by_key[k]
        if any(dep in skipped for dep in task.after):  # a copied skip skips what depends on it
            if planner.tasks[k].state is State.WAITING:
                planner.move(k, PhaseEvent(EventKind.SKIP, now, reason="dependency"))
        elif planner.tasks[k].waiting_on == 0:
            planner.activate(k)
    planner.settle()
    return planner


def _new_run(workflow: Workflow, original_id: str, fields: Fields, new_id: str, key: str, round: int, now: float,
             settings: Settings, actor: str | None) -> Planner:
    planner = Planner(workflow, Snapshot(new_id), now, settings)
    planner.new_run = True
    planner.mark_outcome_read()
    forked_from = {"run_id": original_id, "task": key, "round": round}
    planner.run_updates.update({
        fld.F_FORMAT: fld.FORMAT, fld.F_WORKFLOW: workflow.name, fld.F_VERSION: workflow.version,
        fld.F_FINGERPRINT: workflow.fingerprint, fld.F_STATUS: RunStatus.RUNNING.value,
        fld.F_INPUT: fields.get(fld.F_INPUT) or "null", fld.F_INPUT_DIGEST: fields.get(fld.F_INPUT_DIGEST) or "",
        fld.F_CREATED: repr(now), fld.F_FORKED_FROM: json.dumps(forked_from),
    })
    planner.listing = (RunStatus.RUNNING.value, None, now, True)
    planner.indexes.append((Index.LIVE, new_id, now + min_lease_s(settings)))
    planner.events += [
        Event(type=ev.RUN_STARTED, at=now, data={"workflow": workflow.name, "version": workflow.version,
                                                 "forked_from": forked_from, **({"actor": actor} if actor else {})}),
    ]
    planner.stats[fld.started_stat(workflow.name)] = 1
    return planner


def _data_of(fields: Fields, key: str, before_round: int | None) -> dict[str, str]:
    """The data fields of task ``key`` (only its rounds before ``before_round``, and no per-task
    field, when given)."""
    found: dict[str, str] = {}
    for name, value in fields.items():
        if value is None:
            continue
        belongs, n = fld.data_of_task(name, key)
        if not belongs:
            continue
        if before_round is not None and (n is None or n >= before_round):
            continue
        found[name] = value
    return found


def _forked_record(task: Task, original: TaskRecord | None, key: str, round: int, fields: Fields,
                   data: dict[str, str], feedback_raw: str | None) -> TaskRecord:
    """The forked task's new record: a loop's copied rounds (round = the last copied), or a fresh
    record; its copied data go into ``data``."""
    fresh = initial_record(task).model_copy(update={"waiting_on": 0})
    if not task.is_loop:
        return fresh
    copied = round - 1
    data.update(_data_of(fields, key, round))
    if feedback_raw is not None:
        data[fld.feedback_field(key, round)] = feedback_raw
    kept_scores = scores.before(original.scores, round) if original is not None and original.scores else None
    if kept_scores is not None and not any(s is not None for s in kept_scores):
        kept_scores = None
    if task.on_exhausted == "best" and copied:  # the best of the copied rounds, should the fork run out
        best = fld.candidate_field(key, scores.best_round(kept_scores or [None] * copied))
        if fields.get(best) is not None:
            data[fld.value_field(key)] = fields[best] or "null"
    return fresh.model_copy(update={"round": copied, "attempts": copied, "scores": kept_scores})


def _carry_usage(planner: Planner, workflow: Workflow, kept: list[TaskRecord], forked: TaskRecord, fields: Fields,
                 kept_keys: list[str], key: str, round: int, data: Mapping[str, str]) -> None:
    """The copied rounds' and tasks' usage becomes the new run's, and is recorded as copied."""
    attempts = sum(r.attempts for r in kept) + forked.attempts
    tokens: dict[str, int] = {}
    for name, value in data.items():
        kind, _, rest = name.partition(":")
        if kind == "ut" and value.lstrip("-").isdigit():
            counter = rest.rsplit(":", 1)[1]
            tokens[counter] = tokens.get(counter, 0) + int(value)
    if counts_attempts(workflow) and attempts:
        planner.usage["attempts"] = attempts
    for name, amount in tokens.items():
        planner.usage[name] = planner.usage.get(name, 0) + amount
    copied: dict[str, Any] = {"tasks": kept_keys, "rounds": {key: round - 1} if forked.kind.value == "loop" else {},
                              "usage": {"attempts": attempts, "tokens": tokens}}
    planner.run_updates[fld.F_COPIED] = json.dumps(copied, separators=(",", ":"))


def plan_graph_fork(workflow: Workflow, original_id: str, fields: Fields, new_id: str, key: str, round: int,
                    feedback_raw: str | None, now: float, settings: Settings, actor: str | None = None) -> Planner:
    """The first write of a fork of a graph run at action ``key`` (see the module docstring)."""
    graph = workflow.graph
    assert graph is not None
    planner = _new_run(workflow, original_id, fields, new_id, key, round, now, settings, actor)
    batch = int(fields.get(fld.activation_batch_field(key)) or 0)
    actions = {name[len(fld.TASK_PREFIX):] for name in fields if name.startswith(fld.TASK_PREFIX)}
    batch_of = {a: int(fields.get(fld.activation_batch_field(a)) or 0) for a in actions}
    data: dict[str, str] = {}
    kept: list[str] = []
    for action in sorted(actions):
        record = stored_record(fields, action)
        if batch_of[action] < batch and record is not None and record.status in (TaskStatus.DONE, TaskStatus.FAILED):
            planner.tasks[action] = planner.changed[action] = record
            data.update(_data_of(fields, action, None))
            kept.append(action)
    again = sorted(a for a in actions if batch_of[a] == batch)
    forked = _forked_record(workflow.task(key), stored_record(fields, key), key, round, fields, data, feedback_raw)
    for action in again:
        data[fld.activation_field(action)] = fields.get(fld.activation_field(action)) or "null"
        data[fld.activation_batch_field(action)] = str(batch)
        planner.tasks[action] = planner.changed[action] = forked if action == key else initial_record(
            workflow.task(action)).model_copy(update={"waiting_on": 0})
    for n in range(batch + 1):
        state = fields.get(fld.batch_state_field(n))
        if state is not None:
            data[fld.batch_state_field(n)] = state
    planner.run_updates[fld.F_STATE] = fields.get(fld.batch_state_field(batch)) or "null"
    planner.run_updates[fld.F_ACTIVATIONS] = str(batch + len(again))
    for step in graph.order:
        numbers = [int(a.rsplit("@", 1)[1]) for a in [*kept, *again] if a.rsplit("@", 1)[0] == step]
        if numbers:
            planner.run_updates[fld.activation_count_field(step)] = str(max(numbers))
    gates = [a for a in [*kept, *again] if workflow.task(a).is_gate]
    if gates:
        planner.run_updates[fld.F_GATES] = json.dumps(gates)
    planner.counters[fld.F_OPEN] = len(again)
    _carry_usage(planner, workflow, [planner.tasks[a] for a in kept], forked, fields, kept, key, round, data)
    planner.data.update(data)
    for action in again:
        planner.move(action, PhaseEvent(EventKind.FORK, now))
    return planner


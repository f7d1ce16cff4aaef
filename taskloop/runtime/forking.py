"""``client.fork``: a new run from a finished one's round (SPEC §9). The checks, then one write of
the new run's records through the one commit path (the plan is core/fork.py's); the original is
only read."""

from __future__ import annotations

from typing import Any

from taskloop.base import clock, limits, names
from taskloop.base.config import Settings
from taskloop.base.errors import (
    CommitConflict,
    IncompatibleDefinition,
    InvalidInput,
    NotForkable,
    RunExists,
    RunNotFound,
)
from taskloop.base.jsonvalue import text_problem
from taskloop.base.text import shown
from taskloop.core import fields as fld
from taskloop.core import fork as forks
from taskloop.core.checks import encode_given
from taskloop.core.planner import Planner
from taskloop.core.snapshot import Snapshot
from taskloop.define.workflow import REGISTRY, Workflow
from taskloop.ops.hooks import RunStarting
from taskloop.runtime import shapes
from taskloop.runtime.commit import Sender, commit, never
from taskloop.runtime.instruments import hooks
from taskloop.runtime.starting import new_run_id, traced
from taskloop.store.redis_store import RedisStore


def fork(store: RedisStore, send: Sender, settings: Settings, run_id: str, task: Any, round: Any,
         feedback: Any = None, new_id: str | None = None, actor: str | None = None) -> str:
    """Start a fork of run ``run_id`` at ``round`` of ``task``; the new run's id."""
    names.check_run_id(run_id)
    fields: dict[str, str | None] = dict(store.all_fields(run_id))
    if not fields:
        raise RunNotFound(run_id)
    meta = Snapshot(run_id, fields).meta()
    if not meta.terminal:
        raise NotForkable(f"run {run_id} is {meta.status.value}; only a finished run (done, failed, cancelled, "
                          "rejected) can be forked: wait for it to end, or cancel it first")
    workflow = REGISTRY.get(meta.workflow, meta.version or None)
    if meta.fingerprint != workflow.fingerprint:
        raise IncompatibleDefinition(
            f"run {run_id} was started with another definition of workflow {workflow.name} v{workflow.version} "
            f"(fingerprint {meta.fingerprint}, this process has {workflow.fingerprint}); a fork replays rounds under "
            "the definition they were recorded with: restore it, or start a new run")
    _check_task_and_round(workflow, fields, run_id, task, round)
    feedback_raw = check_feedback(feedback, settings)
    new = new_run_id(new_id)
    shapes.publish(store, workflow, settings)
    planning = forks.plan_graph_fork if workflow.graph is not None else forks.plan_fork
    context = hooks().run_context(RunStarting(new, workflow.name, workflow.version))

    def plan(view: Snapshot) -> Planner:
        return traced(planning(workflow, run_id, fields, new, task, round, feedback_raw, clock.now(), settings,
                               actor), context)

    try:
        commit(store, plan, Snapshot(new), send, retry=never)
    except CommitConflict:
        raise RunExists(f"run {new} already exists: give fork another run_id (or None for a new one)") from None
    return new


def check_shape(task: Any, round: Any) -> None:
    """What a fork's task and round must be without the definition (InvalidInput)."""
    if not isinstance(task, str) or not names.is_task_key(task):
        raise InvalidInput(f"fork: task must be the key of a task of the run (a str), got {shown(task)}")
    if type(round) is not int or round < 1:
        raise InvalidInput(f"fork: round must be a round number (1, 2, ...), got {shown(round)}")


def _check_task_and_round(workflow: Workflow, fields: dict[str, str | None], run_id: str, task: Any,
                          round: Any) -> None:
    check_shape(task, round)
    if workflow.graph is not None:
        if names.step_of(task) is None or fields.get(fld.task_field(task)) is None:
            actions = sorted(n[len(fld.TASK_PREFIX):] for n in fields if n.startswith(fld.TASK_PREFIX))
            raise InvalidInput(f"fork: {task} is not an action of run {run_id} (a graph run forks at an action: "
                               f"one of {actions})")
        if fields.get(fld.activation_batch_field(task)) is None:
            raise NotForkable(f"run {run_id} was recorded before graph runs could be forked (its actions have no "
                              "batch): start a new run")
    elif task not in workflow.by_key:
        raise InvalidInput(f"fork: task {task} is not a task of workflow {workflow.name} v{workflow.version}; its "
                           f"tasks are {list(workflow.order)}")
    record = forks.stored_record(fields, task)
    defined = workflow.task(task)
    reached = (record.round if defined.is_loop else int(record.started_at is not None)) if record else 0
    if not defined.is_loop and round != 1:
        raise InvalidInput(f"fork: task {task} is not a loop: a plain task or a gate forks at round 1")
    if not reached:
        raise InvalidInput(f"fork: task {task} never ran in run {run_id}, so it has no round to fork at; fork at a "
                           "task that ran")
    if round > reached:
        raise InvalidInput(f"fork: round {round} of task {task} was never reached (run {run_id} reached round "
                           f"{reached}); fork at a round from 1 to {reached}")


def check_feedback(feedback: Any, settings: Settings) -> str | None:
    """A fork's feedback as stored (InvalidInput: not text, or over TASKLOOP_MAX_FEEDBACK_BYTES)."""
    if feedback is None:
        return None
    if not isinstance(feedback, str):
        raise InvalidInput(f"fork: feedback must be None or a string, got {shown(feedback)}")
    problem = text_problem(feedback)
    if problem is not None:
        raise InvalidInput(f"fork: the feedback {problem}; give UTF-8 text")
    raw = encode_given(feedback)
    size = limits.oversize(raw, settings.max_feedback_bytes)
    if size is not None:
        raise InvalidInput(limits.too_large("the fork's feedback", size, settings.max_feedback_bytes,
                                            limits.FEEDBACK_ENV))
    return raw

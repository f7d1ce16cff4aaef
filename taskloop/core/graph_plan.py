"""The topology of a graph workflow (taskloop/define/graph.py): a new run starts with its initial
state and the entry's first activation; when an action ends, the transition handler is applied,
its state validated and stored, its next activations checked against the declared transitions
and ``max_transitions``, then queued. A failure of the handler, an invalid state or output, or an
undeclared transition fails the run and keeps the last valid state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from taskloop.base import limits, text
from taskloop.base.errors import (
    GraphLimitReached,
    GraphRunFailed,
    OutputTooLarge,
    TaskLoopError,
    WorkflowBudgetExceeded,
)
from taskloop.base.jsonvalue import dumps
from taskloop.base.names import action_key, step_of
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.begin import initial_record
from taskloop.core.events import Event
from taskloop.core.phases import EventKind, PhaseEvent
from taskloop.core.plan import Plan
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.states import TaskStatus, Termination
from taskloop.define.graph_spec import OUTCOME_EVENT, Activation, GraphSpec, Transition, schema_problem

EVENT_STATE_LIMIT = 4_096  # characters of a state quoted in a transition event (a larger one: its size)
OUTCOME_OF = {TaskStatus.DONE: "succeeded", TaskStatus.FAILED: "failed"}


@dataclass(frozen=True)
class Outcome:
    status: str  # "succeeded" | "failed"
    output: Any = None
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class GraphEvent:
    """What the handler is told: an action of ``step`` ended with ``outcome``."""

    kind: str
    step: str
    action: str
    activation: Any
    outcome: Outcome


@dataclass(frozen=True)
class ActionView:
    """One action of a graph run, as the handler sees it."""

    key: str
    step: str
    input: Any
    status: str
    output: Any = None


@dataclass
class GraphRun:
    """The run, as the handler sees it: its business ``state``, its (unchanging) ``input``, and its
    ``actions`` (read when the handler asks for them)."""

    run_id: str
    state: Any
    input: Any
    _plan: Plan = field(repr=False)

    @property
    def actions(self) -> list[ActionView]:
        return list_actions(self._plan)


def start(plan: Plan, graph: GraphSpec) -> None:
    """A new graph run: its initial state, and the entry's first activation."""
    plan.run_updates[fld.F_STATE] = dumps(graph.initial_state)
    _activate(plan, graph, [Activation(graph.entry, None)])


def action_keys(plan: Plan) -> list[str]:
    """The run's actions so far, by step (entry first) and activation."""
    graph = plan.workflow.graph
    assert graph is not None
    snap = plan.snapshot
    snap.ensure(fld.activation_count_field(step) for step in graph.order)
    return [action_key(step, n) for step in graph.order
            for n in range(1, int(snap.get(fld.activation_count_field(step)) or 0) + 1)]


def list_actions(plan: Plan) -> list[ActionView]:
    snap = plan.snapshot
    keys = action_keys(plan)
    snap.ensure([*(f for key in keys for f in fld.record_fields(key)), *(fld.value_field(key) for key in keys),
                 *(fld.activation_field(key) for key in keys)])
    found = []
    for key in keys:
        record = plan.tasks.get(key) or snap.record(key)
        if record is None:
            continue
        output = _value(plan, key) if record.status is TaskStatus.DONE else None
        found.append(ActionView(key, step_of(key) or "", snap.json(fld.activation_field(key)), record.status.value,
                                output))
    return found


def _value(plan: Plan, key: str) -> Any:
    """An action's value: written by this plan (the action whose outcome it records), or stored."""
    raw = plan.data.get(fld.value_field(key)) or plan.snapshot.get(fld.value_field(key))
    return json.loads(raw) if raw is not None else None


def after_action(plan: Plan, record: TaskRecord) -> None:
    """An action ended: apply the transition handler, validate, and activate what it asks for."""
    graph = plan.workflow.graph
    assert graph is not None
    step = step_of(record.key) or ""
    if record.status is TaskStatus.REJECTED or plan.control is not None:
        return  # a rejected gate rejects the run; a stopped or cancelled run starts nothing new
    if record.status not in OUTCOME_OF:
        return
    output = None
    if record.status is TaskStatus.DONE:
        output = _value(plan, record.key)
        problem = schema_problem(graph.steps[step].output_schema, output)
        if problem is not None:
            fail(plan, f"the output of {record.key} does not match the output_schema of step {step}: {problem}")
            return
    error = {"type": record.error.type, "message": record.error.message} if record.error else None
    state = json.loads(plan.guard(fld.F_STATE) or "null")
    event = GraphEvent(OUTCOME_EVENT, step, record.key, plan.snapshot.json(fld.activation_field(record.key)),
                       Outcome(OUTCOME_OF[record.status], output, error))
    run = GraphRun(plan.run_id, state, plan.snapshot.json(fld.F_INPUT), plan)
    handler = graph.handler
    try:
        transition = handler.apply(run, event)
    except Exception as exc:
        fail(plan, f"transition handler {handler.id} v{handler.version} raised {type(exc).__name__}: {exc} "
                      f"(on the outcome of {record.key})")
        return
    if not isinstance(transition, Transition):
        fail(plan, f"transition handler {handler.id} v{handler.version} must return tl.Transition(state, next), "
                      f"got {transition!r}")
        return
    cap = plan.settings.max_output_bytes
    state = limits.store_form(transition.state, cap)
    problem = state.problem or schema_problem(graph.state_schema, transition.state)
    if problem is not None:
        fail(plan, f"transition handler {handler.id} v{handler.version} returned an invalid state after "
                      f"{record.key}: {problem}; the last valid state is kept")
        return
    if state.raw is None:
        fail(plan, limits.too_large(f"the state that transition handler {handler.id} v{handler.version} returned "
                                       f"after {record.key}", state.size or 0, cap, limits.OUTPUT_ENV)
             + "; the last valid state is kept", OutputTooLarge)
        return
    state_raw = state.raw
    wanted: list[Activation] = []
    inputs: list[str] = []
    for item in transition.next:
        target = Activation(item) if isinstance(item, str) else item
        if not isinstance(target, Activation) or target.step not in graph.steps:
            fail(plan, f"transition handler {handler.id} v{handler.version} asked for {item!r} after {record.key}, "
                          f"which is not a step; steps are {sorted(graph.steps)}")
            return
        if not graph.allows(step, target.step):
            fail(plan, f"transition {step} -> {target.step} is not declared (handler {handler.id} "
                          f"v{handler.version}, after {record.key}); add ({step!r}, {target.step!r}) to transitions=")
            return
        given = limits.store_form(target.input, cap)
        if given.problem is not None:
            fail(plan, f"the input of the activation of {target.step} after {record.key} is not lossless JSON: "
                          f"{given.problem}")
            return
        if given.raw is None:
            fail(plan, limits.too_large(f"the input of the activation of {target.step} after {record.key}",
                                           given.size or 0, cap, limits.OUTPUT_ENV), OutputTooLarge)
            return
        wanted.append(target)
        inputs.append(given.raw)
    plan.run_updates[fld.F_STATE] = state_raw
    # the event quotes a small state; a large one is in the run's state field (not copied per transition)
    shown = transition.state if len(state_raw) <= EVENT_STATE_LIMIT else {"omitted": True, "characters": len(state_raw)}
    plan.events.append(Event(type=ev.TRANSITION, key=record.key, at=plan.now,
                                data={"next": [t.step for t in wanted], "state": shown}))
    if wanted:
        _activate(plan, graph, wanted, inputs)
    elif record.status is TaskStatus.FAILED:
        plan.note_failure(record)  # a failure the handler did not answer with a next step fails the run


def _activate(plan: Plan, graph: GraphSpec, targets: list[Activation], inputs: list[str] | None = None) -> None:
    """Queue ``targets`` (``inputs``: their inputs as stored JSON, when already serialised)."""
    since = int(plan.guard(fld.F_ACTIVATIONS) or 0)
    if since + len(targets) > graph.max_transitions:
        message = (f"run {plan.run_id} asked for activation {since + len(targets)} but max_transitions is "
                   f"{graph.max_transitions}; it ends with termination limit (its state is what the handler "
                   "last wrote, which says nothing of approval)")
        fail(plan, message, GraphLimitReached)
        return
    plan.run_updates[fld.F_ACTIVATIONS] = str(since + len(targets))
    # for forks: the state this batch starts from, and each action's batch
    plan.data[fld.batch_state_field(since)] = plan.run_updates.get(fld.F_STATE) or plan.guard(fld.F_STATE) or "null"
    counts: dict[str, int] = {}
    gates: list[str] = []
    for n, target in enumerate(targets):
        if target.step not in counts:
            counts[target.step] = int(plan.guard(fld.activation_count_field(target.step)) or 0)
        counts[target.step] += 1
        key = action_key(target.step, counts[target.step])
        plan.tasks[key] = plan.changed[key] = _new_record(plan, key)
        plan.counters[fld.F_OPEN] += 1
        plan.data[fld.activation_field(key)] = inputs[n] if inputs is not None else dumps(target.input)
        plan.data[fld.activation_batch_field(key)] = str(since)
        if graph.steps[target.step].task.is_gate:
            gates.append(key)
        plan.move(key, PhaseEvent(EventKind.ACTIVATE, plan.now))
    for step_name, count in counts.items():
        plan.run_updates[fld.activation_count_field(step_name)] = str(count)
    if gates:
        known = json.loads(plan.guard(fld.F_GATES) or "[]")
        plan.run_updates[fld.F_GATES] = json.dumps([*known, *gates])


def _new_record(plan: Plan, key: str) -> TaskRecord:
    return initial_record(plan.workflow.task(key))


def fail(plan: Plan, message: str, error: type[TaskLoopError] = GraphRunFailed) -> None:
    """End the run by its rules: recorded as the run's error (its termination is the error's: limit
    for GraphLimitReached), nothing new starts, actions still running end cancelled; the state
    keeps its last valid value."""
    plan.fail_run(ErrorRecord(type=error.__name__, message=text.cut(message)), Termination(error.termination))


class Graph:
    """The topology of a graph workflow (see the module docstring)."""

    def start(self, plan: Plan) -> None:
        assert plan.workflow.graph is not None
        start(plan, plan.workflow.graph)

    def record_keys(self, plan: Plan) -> list[str]:
        return action_keys(plan)

    def settle(self, plan: Plan, record: TaskRecord) -> None:
        if record.status is TaskStatus.FAILED and record.error is not None and record.error.of(WorkflowBudgetExceeded):
            plan.note_failure(record)  # a spent budget fails the run whatever the handler says
            return
        after_action(plan, record)


GRAPH = Graph()

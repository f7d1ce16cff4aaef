"""Planning a graph workflow's run (the scheduler's part for taskloop/graph.py): the entry
activation, and what happens when an action ends — the transition handler applied, its state
validated and stored, its next activations checked against the declared transitions and
``max_transitions``, then queued. A failure of the handler, an invalid state or output, or an
undeclared transition fails the run and keeps the last valid state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from taskloop import events as ev
from taskloop import limits
from taskloop.errors import OutputTooLarge, TaskLoopError
from taskloop.events import Event
from taskloop.graph import OUTCOME_EVENT, Activation, GraphSpec, Transition, action_key, schema_problem, step_of
from taskloop.jsonvalue import dumps, lossless_problem
from taskloop.phases import ErrorRecord, EventKind, PhaseEvent, TaskRecord, TaskStatus, Termination
from taskloop.store import keys as k

if TYPE_CHECKING:
    from taskloop.scheduler import Planner


class GraphRunFailed(TaskLoopError):
    """A graph run was ended by its own rules: the transition handler raised or returned something
    invalid, a state or an output broke its schema, or a transition was not declared."""


class GraphLimitReached(TaskLoopError):
    """A graph run asked for more activations than its ``max_transitions``."""


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
    _planner: Planner = field(repr=False)

    @property
    def actions(self) -> list[ActionView]:
        return list_actions(self._planner)


def start(planner: Planner, graph: GraphSpec) -> None:
    """A new graph run: its initial state, and the entry's first activation."""
    planner.run_updates[k.F_STATE] = dumps(graph.initial_state)
    _activate(planner, graph, [Activation(graph.entry, None)])


def action_keys(planner: Planner) -> list[str]:
    """The run's actions so far, by step (entry first) and activation."""
    graph = planner.workflow.graph
    assert graph is not None
    snap = planner.snapshot
    snap.ensure(k.activation_count_field(step) for step in graph.order)
    return [action_key(step, n) for step in graph.order
            for n in range(1, int(snap.get(k.activation_count_field(step)) or 0) + 1)]


def list_actions(planner: Planner) -> list[ActionView]:
    snap = planner.snapshot
    keys = action_keys(planner)
    snap.ensure([*(k.task_field(key) for key in keys), *(k.value_field(key) for key in keys),
                 *(k.activation_field(key) for key in keys)])
    found = []
    for key in keys:
        record = planner.tasks.get(key) or snap.record(key)
        if record is None:
            continue
        output = snap.json(k.value_field(key)) if record.status is TaskStatus.DONE else None
        found.append(ActionView(key, step_of(key) or "", snap.json(k.activation_field(key)), record.status.value,
                                output))
    return found


def after_action(planner: Planner, record: TaskRecord) -> None:
    """An action ended: apply the transition handler, validate, and activate what it asks for."""
    graph = planner.workflow.graph
    assert graph is not None
    step = step_of(record.key) or ""
    if record.status is TaskStatus.REJECTED or planner.control is not None:
        return  # a rejected gate rejects the run; a stopped or cancelled run starts nothing new
    if record.status not in OUTCOME_OF:
        return
    output = None
    if record.status is TaskStatus.DONE:
        raw = planner.data.get(k.value_field(record.key)) or planner.snapshot.get(k.value_field(record.key))
        output = json.loads(raw) if raw is not None else None
        problem = schema_problem(graph.steps[step].output_schema, output)
        if problem is not None:
            fail(planner, f"the output of {record.key} does not match the output_schema of step {step}: {problem}")
            return
    error = {"type": record.error.type, "message": record.error.message} if record.error else None
    state = json.loads(planner.guard(k.F_STATE) or "null")
    event = GraphEvent(OUTCOME_EVENT, step, record.key, planner.snapshot.json(k.activation_field(record.key)),
                       Outcome(OUTCOME_OF[record.status], output, error))
    run = GraphRun(planner.run_id, state, planner.snapshot.json(k.F_INPUT), planner)
    handler = graph.handler
    try:
        transition = handler.apply(run, event)
    except Exception as exc:
        fail(planner, f"transition handler {handler.id} v{handler.version} raised {type(exc).__name__}: {exc} "
                      f"(on the outcome of {record.key})")
        return
    if not isinstance(transition, Transition):
        fail(planner, f"transition handler {handler.id} v{handler.version} must return tl.Transition(state, next), "
                      f"got {transition!r}")
        return
    problem = lossless_problem(transition.state, "$") or schema_problem(graph.state_schema, transition.state)
    if problem is not None:
        fail(planner, f"transition handler {handler.id} v{handler.version} returned an invalid state after "
                      f"{record.key}: {problem}; the last valid state is kept")
        return
    cap = planner.settings.max_output_bytes
    state_raw = dumps(transition.state)
    size = limits.oversize(state_raw, cap)
    if size is not None:
        fail(planner, limits.too_large(f"the state that transition handler {handler.id} v{handler.version} returned "
                                       f"after {record.key}", size, cap, limits.OUTPUT_ENV)
             + "; the last valid state is kept", OutputTooLarge)
        return
    wanted: list[Activation] = []
    inputs: list[str] = []
    for item in transition.next:
        target = Activation(item) if isinstance(item, str) else item
        if not isinstance(target, Activation) or target.step not in graph.steps:
            fail(planner, f"transition handler {handler.id} v{handler.version} asked for {item!r} after {record.key}, "
                          f"which is not a step; steps are {sorted(graph.steps)}")
            return
        if not graph.allows(step, target.step):
            fail(planner, f"transition {step} -> {target.step} is not declared (handler {handler.id} "
                          f"v{handler.version}, after {record.key}); add ({step!r}, {target.step!r}) to transitions=")
            return
        problem = lossless_problem(target.input, "$")
        if problem is not None:
            fail(planner, f"the input of the activation of {target.step} after {record.key} is not lossless JSON: "
                          f"{problem}")
            return
        input_raw = dumps(target.input)
        size = limits.oversize(input_raw, cap)
        if size is not None:
            fail(planner, limits.too_large(f"the input of the activation of {target.step} after {record.key}", size,
                                           cap, limits.OUTPUT_ENV), OutputTooLarge)
            return
        wanted.append(target)
        inputs.append(input_raw)
    planner.run_updates[k.F_STATE] = state_raw
    # the event quotes a small state; a large one is in the run's state field (not copied per transition)
    shown = transition.state if len(state_raw) <= EVENT_STATE_LIMIT else {"omitted": True, "characters": len(state_raw)}
    planner.events.append(Event(type=ev.TRANSITION, key=record.key, at=planner.now,
                                data={"next": [t.step for t in wanted], "state": shown}))
    if wanted:
        _activate(planner, graph, wanted, inputs)
    elif record.status is TaskStatus.FAILED:
        planner.note_failure(record)  # a failure the handler did not answer with a next step fails the run


def _activate(planner: Planner, graph: GraphSpec, targets: list[Activation], inputs: list[str] | None = None) -> None:
    """Queue ``targets`` (``inputs``: their inputs as stored JSON, when already serialised)."""
    since = int(planner.guard(k.F_ACTIVATIONS) or 0)
    if since + len(targets) > graph.max_transitions:
        message = (f"run {planner.run_id} asked for activation {since + len(targets)} but max_transitions is "
                   f"{graph.max_transitions}; it ends with termination limit (its state is what the handler "
                   "last wrote, which says nothing of approval)")
        fail(planner, message, GraphLimitReached, Termination.LIMIT)
        return
    planner.run_updates[k.F_ACTIVATIONS] = str(since + len(targets))
    counts: dict[str, int] = {}
    gates: list[str] = []
    for n, target in enumerate(targets):
        if target.step not in counts:
            counts[target.step] = int(planner.guard(k.activation_count_field(target.step)) or 0)
        counts[target.step] += 1
        key = action_key(target.step, counts[target.step])
        planner.tasks[key] = planner.changed[key] = _new_record(planner, key)
        planner.counters[k.F_OPEN] += 1
        planner.data[k.activation_field(key)] = inputs[n] if inputs is not None else dumps(target.input)
        if graph.steps[target.step].task.is_gate:
            gates.append(key)
        planner.move(key, PhaseEvent(EventKind.ACTIVATE, planner.now))
    for step_name, count in counts.items():
        planner.run_updates[k.activation_count_field(step_name)] = str(count)
    if gates:
        known = json.loads(planner.guard(k.F_GATES) or "[]")
        planner.run_updates[k.F_GATES] = json.dumps([*known, *gates])


def _new_record(planner: Planner, key: str) -> TaskRecord:
    from taskloop.scheduler import initial_record

    return initial_record(planner.workflow.task(key))


def fail(planner: Planner, message: str, error: type[TaskLoopError] = GraphRunFailed,
         termination: Termination = Termination.FAILED) -> None:
    """End the run by its rules: recorded as the run's error, nothing new starts, actions still
    running end cancelled; the state keeps its last valid value."""
    planner.fail_run(ErrorRecord(type=error.__name__, message=limits.cut(message)), termination)

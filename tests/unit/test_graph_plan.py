"""The topology of a graph workflow (taskloop/core/graph_plan.py), driven through a Planner over a
run held in memory: the entry's activation, the handler's next steps and their inputs, and the
ways a graph run fails by its own rules (undeclared transition, invalid state, max_transitions).
Pure: no Redis."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import taskloop as tl
from taskloop.base.config import Settings
from taskloop.base.jsonvalue import dumps
from taskloop.core import fields as fld
from taskloop.core.batch import Batch, Writes
from taskloop.core.events import Event
from taskloop.core.phases import EventKind, PhaseEvent
from taskloop.core.planner import Planner
from taskloop.core.records import ErrorRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import State
from taskloop.define.workflow import REGISTRY, Workflow

SETTINGS = Settings(redis_url="redis://unused:1/0")
NOW = 1000.0
RUN = "g1"
WORKER = "node@host/1"
Handler = Callable[[Any, Any], tl.Transition]


class MemoryRun:
    """A run hash in memory, written the way cas.lua writes it (guards first, then the writes,
    then the finishing part once the open-task counter reaches 0)."""

    def __init__(self, workflow: Workflow) -> None:
        self.workflow = workflow
        self.fields: dict[str, str] = {}
        self.events: list[Event] = []

    def snapshot(self, *names: str) -> Snapshot:
        snap = Snapshot(RUN, loader=lambda wanted: [self.fields.get(name) for name in wanted])
        snap.ensure(names)
        return snap

    def apply(self, batch: Batch) -> bool:
        if not all(self._holds(guard) for guard in batch.guards):
            return False
        self._write(batch)
        if batch.open_delta:
            self.fields[fld.F_OPEN] = str(int(self.fields.get(fld.F_OPEN) or 0) + batch.open_delta)
            if self.fields[fld.F_OPEN] == "0":
                self._write(batch.final)
        return True

    def _holds(self, guard: list[Any]) -> bool:
        op, current = guard[0], self.fields.get(guard[1])
        if op == "eq":
            return bool(current == guard[2])
        if op == "nx":
            return current is None
        if op == "ex":
            return current is not None
        if op == "in":
            return bool(current in guard[2])
        assert op == "cap"
        return bool(int(current or 0) + guard[3] <= guard[2])

    def _write(self, writes: Writes) -> None:
        self.fields.update(writes.hset)
        for name in writes.hdel:
            self.fields.pop(name, None)
        for name, amount in writes.hincr.items():
            self.fields[name] = str(int(self.fields.get(name) or 0) + amount)
        self.events += writes.events

    # the steps of a run ------------------------------------------------------------------------
    def start(self, input: Any = None) -> Planner:
        planner = Planner.start_run(self.workflow, RUN, dumps(input), "digest", NOW, SETTINGS)
        assert self.apply(planner.batch())
        return planner

    def begin(self, key: str) -> None:
        planner = Planner(self.workflow, self.snapshot(*fld.record_fields(key), fld.F_CONTROL), NOW, SETTINGS)
        planner.admit(key, WORKER, None)
        assert self.apply(planner.batch())

    def succeed(self, key: str, output: Any) -> Planner:
        """The action ``key`` (begun) returned ``output``: the plan, written."""
        self.begin(key)
        planner = Planner(self.workflow, self.snapshot(*fld.record_fields(key), fld.F_CONTROL), NOW, SETTINGS)
        planner.outcome(key, PhaseEvent(EventKind.SUCCEED, NOW), {fld.value_field(key): dumps(output)})
        assert self.apply(planner.batch())
        return planner

    def fail(self, key: str, error: ErrorRecord) -> Planner:
        self.begin(key)
        planner = Planner(self.workflow, self.snapshot(*fld.record_fields(key), fld.F_CONTROL), NOW, SETTINGS)
        planner.outcome(key, PhaseEvent(EventKind.FAIL, NOW, error=error))
        assert self.apply(planner.batch())
        return planner

    def json(self, name: str) -> Any:
        raw = self.fields.get(name)
        return None if raw is None else json.loads(raw)

    def error(self) -> ErrorRecord | None:
        raw = self.fields.get(fld.F_ERROR)
        return None if raw is None else ErrorRecord.model_validate_json(raw)


Define = Callable[..., Workflow]


@pytest.fixture()
def define() -> Iterator[Define]:
    """define_graph_workflow under a name of its own; unregistered after the test."""
    made: list[Workflow] = []

    def build(handler: Handler, **options: Any) -> Workflow:
        options.setdefault("entry", "write")
        options.setdefault("steps", {"write": tl.step(lambda ctx: "draft"), "review": tl.step(lambda ctx: "ok")})
        options.setdefault("transitions", [("write", "review"), ("review", "review")])
        options.setdefault("initial_state", {"seen": 0})
        wf = tl.define_graph_workflow(f"graph-plan-{uuid.uuid4().hex[:12]}", version="1",
                                      handler=tl.TransitionHandler("policy", "1", handler), **options)
        made.append(wf)
        return wf

    yield build
    for wf in made:
        REGISTRY.unregister(wf.name, wf.version)


def _nothing(run: Any, event: Any) -> tl.Transition:
    return tl.Transition(run.state, [])


def test_a_new_run_sets_the_initial_state_and_activates_the_entry(define: Define) -> None:
    run = MemoryRun(define(_nothing))
    planner = run.start({"topic": "graphs"})
    assert {key: record.state for key, record in planner.tasks.items()} == {"write@1": State.QUEUED_RUN}
    assert [(d.key, d.phase.value, d.round) for d in planner.dispatches] == [("write@1", "run", 1)]
    assert run.json(fld.F_STATE) == {"seen": 0}
    assert run.fields[fld.F_ACTIVATIONS] == "1"
    assert run.fields[fld.activation_count_field("write")] == "1"
    assert fld.activation_count_field("review") not in run.fields  # no review yet
    assert run.fields[fld.activation_field("write@1")] == "null"  # the entry's activation has no input
    assert run.fields[fld.F_OPEN] == "1" and run.fields[fld.F_STATUS] == "running"
    assert [e.type for e in run.events] == ["run.started", "phase"]


def test_the_handler_sees_the_outcome_and_its_next_steps_are_activated_with_their_inputs(define: Define) -> None:
    # Given a handler that asks for two reviews after the draft
    seen: list[tuple[Any, ...]] = []

    def fan_out(run: Any, event: Any) -> tl.Transition:
        seen.append((event.kind, event.step, event.action, event.activation, event.outcome.status,
                     event.outcome.output, run.state, run.input, run.run_id))
        state = {"seen": run.state["seen"] + 1}
        if event.step == "write":
            return tl.Transition(state, [tl.Activation("review", {"part": 1}), tl.Activation("review", {"part": 2})])
        return tl.Transition(state, [])

    run = MemoryRun(define(fan_out))
    run.start({"topic": "graphs"})
    # When the draft succeeds
    planner = run.succeed("write@1", {"text": "draft"})
    # Then the handler was told what happened, on the run's state and input
    assert seen == [("action-outcome", "write", "write@1", None, "succeeded", {"text": "draft"}, {"seen": 0},
                     {"topic": "graphs"}, RUN)]
    # and both reviews are queued, numbered per step, each with its own input
    assert {key: record.state for key, record in planner.tasks.items()} == {
        "write@1": State.DONE, "review@1": State.QUEUED_RUN, "review@2": State.QUEUED_RUN}
    assert sorted(d.key for d in planner.dispatches) == ["review@1", "review@2"]
    assert run.json(fld.activation_field("review@1")) == {"part": 1}
    assert run.json(fld.activation_field("review@2")) == {"part": 2}
    assert run.json(fld.F_STATE) == {"seen": 1}
    assert (run.fields[fld.F_ACTIVATIONS], run.fields[fld.activation_count_field("review")]) == ("3", "2")
    assert run.fields[fld.F_OPEN] == "2"
    transition = next(e for e in planner.events if e.type == "transition")
    assert transition.key == "write@1" and transition.data == {"next": ["review", "review"], "state": {"seen": 1}}
    # and the write guards the graph fields it rewrote from what it read
    guarded = {guard[1] for guard in planner.batch().guards}
    assert {fld.F_STATE, fld.F_ACTIVATIONS, fld.activation_count_field("review")} <= guarded


def test_a_step_sees_its_activation_and_a_run_with_nothing_next_ends_done(define: Define) -> None:
    actions: list[list[tuple[str, str, Any, str, Any]]] = []

    def once_more(run: Any, event: Any) -> tl.Transition:
        actions.append([(a.key, a.step, a.input, a.status, a.output) for a in run.actions])
        if event.step == "write":
            return tl.Transition({"seen": 1}, [tl.Activation("review", {"round": 1})])
        return tl.Transition({"seen": 2}, [])

    run = MemoryRun(define(once_more))
    run.start()
    run.succeed("write@1", "draft")
    planner = run.succeed("review@1", "fine")
    assert actions[0][0] == ("write@1", "write", None, "done", "draft")  # the action that just ended, with its value
    assert actions[-1][0] == ("write@1", "write", None, "done", "draft")  # an earlier action: as stored
    assert actions[-1][1][:4] == ("review@1", "review", {"round": 1}, "done")  # its activation's input
    assert planner.dispatches == []
    assert run.fields[fld.F_STATUS] == "done" and run.fields[fld.F_OPEN] == "0"
    assert run.json(fld.F_STATE) == {"seen": 2}
    assert run.error() is None


def test_run_actions_show_the_output_of_the_action_that_just_ended(define: Define) -> None:
    listed: list[Any] = []

    def look(run: Any, event: Any) -> tl.Transition:
        listed.append({a.key: (a.status, a.output) for a in run.actions})
        assert event.outcome.output == "draft"  # the event itself has it
        return tl.Transition(run.state, [])

    run = MemoryRun(define(look))
    run.start()
    run.succeed("write@1", "draft")
    assert listed == [{"write@1": ("done", "draft")}]


def _failed_run(run: MemoryRun, planner: Planner, error_type: str, termination: str, control: str) -> ErrorRecord:
    """The run failed by its rules: the error is recorded, nothing was dispatched, the run ended."""
    assert planner.dispatches == []
    assert planner.run_updates[fld.F_TERMINATION] == termination and planner.run_updates[fld.F_CONTROL] == control
    error = run.error()
    assert error is not None and error.type == error_type
    assert run.fields[fld.F_STATUS] == "failed" and run.fields[fld.F_TERMINATION] == termination
    assert run.fields[fld.F_OPEN] == "0"
    return error


def test_an_undeclared_transition_fails_the_run_and_keeps_the_last_valid_state(define: Define) -> None:
    def to_publish(run: Any, event: Any) -> tl.Transition:
        return tl.Transition({"seen": 99}, ["review"])

    # write -> review is not declared
    run = MemoryRun(define(to_publish, transitions=[("review", "review")]))
    run.start()
    planner = run.succeed("write@1", "draft")
    error = _failed_run(run, planner, "GraphRunFailed", "failed", "stop:failed")
    assert "transition write -> review is not declared" in error.message
    assert "add ('write', 'review') to transitions=" in error.message
    assert run.json(fld.F_STATE) == {"seen": 0}  # not the handler's {"seen": 99}
    assert fld.F_STATE not in planner.run_updates
    assert fld.activation_count_field("review") not in run.fields
    assert not any(e.type == "transition" for e in planner.events)


def test_a_next_step_that_does_not_exist_fails_the_run(define: Define) -> None:
    run = MemoryRun(define(lambda run, event: tl.Transition(run.state, ["publish"])))
    run.start()
    error = _failed_run(run, run.succeed("write@1", "draft"), "GraphRunFailed", "failed", "stop:failed")
    assert "asked for 'publish'" in error.message and "which is not a step" in error.message


def test_an_invalid_state_fails_the_run_and_keeps_the_last_valid_state(define: Define) -> None:
    schema = {"type": "object", "required": ["seen"], "properties": {"seen": {"type": "integer", "minimum": 0}}}

    def goes_negative(run: Any, event: Any) -> tl.Transition:
        return tl.Transition({"seen": -1}, ["review"])

    run = MemoryRun(define(goes_negative, state_schema=schema))
    run.start()
    planner = run.succeed("write@1", "draft")
    error = _failed_run(run, planner, "GraphRunFailed", "failed", "stop:failed")
    assert "returned an invalid state after write@1" in error.message
    assert "the last valid state is kept" in error.message
    assert run.json(fld.F_STATE) == {"seen": 0}
    assert "review@1" not in planner.tasks


def test_a_state_that_is_not_lossless_json_fails_the_run(define: Define) -> None:
    run = MemoryRun(define(lambda run, event: tl.Transition({"when": {1, 2}}, [])))
    run.start()
    error = _failed_run(run, run.succeed("write@1", "draft"), "GraphRunFailed", "failed", "stop:failed")
    assert "$.when is a set" in error.message
    assert run.json(fld.F_STATE) == {"seen": 0}


def test_max_transitions_ends_the_run_with_graph_limit_reached(define: Define) -> None:
    # Given a handler that always asks for one more review, and room for three activations
    def again(run: Any, event: Any) -> tl.Transition:
        return tl.Transition({"seen": run.state["seen"] + 1}, ["review"])

    run = MemoryRun(define(again, max_transitions=3))
    run.start()
    run.succeed("write@1", "draft")  # activation 2: review@1
    run.succeed("review@1", "ok")  # activation 3: review@2
    assert run.fields[fld.F_ACTIVATIONS] == "3" and run.fields[fld.F_STATUS] == "running"
    # When the third action ends and the handler asks for a fourth activation
    planner = run.succeed("review@2", "ok")
    # Then the run ends with termination limit, and review@3 never exists
    error = _failed_run(run, planner, "GraphLimitReached", "limit", "stop:limit")
    assert "asked for activation 4 but max_transitions is 3" in error.message
    assert run.fields[fld.F_ACTIVATIONS] == "3"
    assert "review@3" not in planner.tasks and fld.task_field("review@3") not in run.fields
    # the state is the last one the handler wrote (a valid state, which says nothing of approval)
    assert run.json(fld.F_STATE) == {"seen": 3}


def test_a_handler_that_raises_or_returns_no_transition_fails_the_run(define: Define) -> None:
    def raises(run: Any, event: Any) -> tl.Transition:
        raise KeyError("oops")

    run = MemoryRun(define(raises))
    run.start()
    error = _failed_run(run, run.succeed("write@1", "draft"), "GraphRunFailed", "failed", "stop:failed")
    assert "transition handler policy v1 raised KeyError" in error.message and "(on the outcome of write@1)" in \
        error.message

    run = MemoryRun(define(lambda run, event: {"seen": 1}))
    run.start()
    error = _failed_run(run, run.succeed("write@1", "draft"), "GraphRunFailed", "failed", "stop:failed")
    assert "must return tl.Transition(state, next)" in error.message
    assert run.json(fld.F_STATE) == {"seen": 0}


def test_an_output_that_does_not_match_its_step_schema_fails_the_run(define: Define) -> None:
    called: list[str] = []

    def policy(run: Any, event: Any) -> tl.Transition:
        called.append(event.action)
        return tl.Transition(run.state, [])

    schema = {"type": "object", "required": ["text"]}
    run = MemoryRun(define(policy, steps={"write": tl.step(lambda ctx: {}, output_schema=schema),
                                          "review": tl.step(lambda ctx: "ok")}))
    run.start()
    error = _failed_run(run, run.succeed("write@1", {"len": 3}), "GraphRunFailed", "failed", "stop:failed")
    assert "the output of write@1 does not match the output_schema of step write" in error.message
    assert called == []  # the handler never saw the invalid output


def test_a_failed_action_the_handler_does_not_answer_fails_the_run(define: Define) -> None:
    run = MemoryRun(define(_nothing))
    run.start()
    planner = run.fail("write@1", ErrorRecord(type="ValueError", message="no draft"))
    assert planner.run_updates[fld.F_TERMINATION] == "failed"
    assert fld.F_CONTROL not in planner.run_updates  # a graph does not stop on an error by itself
    assert run.fields[fld.F_STATUS] == "failed" and run.error() is None  # the error is the task's
    assert any(e.type == "transition" for e in planner.events)  # the handler was applied


def test_a_failed_action_the_handler_answers_lets_the_run_go_on(define: Define) -> None:
    outcomes: list[tuple[str, Any]] = []

    def retry_by_review(run: Any, event: Any) -> tl.Transition:
        outcomes.append((event.outcome.status, event.outcome.error))
        return tl.Transition(run.state, ["review"] if event.outcome.status == "failed" else [])

    run = MemoryRun(define(retry_by_review))
    run.start()
    planner = run.fail("write@1", ErrorRecord(type="ValueError", message="no draft"))
    assert outcomes == [("failed", {"type": "ValueError", "message": "no draft"})]
    assert planner.tasks["review@1"].state is State.QUEUED_RUN
    assert fld.F_TERMINATION not in planner.run_updates and run.fields[fld.F_STATUS] == "running"


def test_a_stopped_run_starts_nothing_new(define: Define) -> None:
    called: list[str] = []

    def policy(run: Any, event: Any) -> tl.Transition:
        called.append(event.action)
        return tl.Transition(run.state, ["review"])

    run = MemoryRun(define(policy))
    run.start()
    run.begin("write@1")
    run.fields[fld.F_CONTROL] = "stop:failed"  # another task failed meanwhile
    planner = Planner(run.workflow, run.snapshot(*fld.record_fields("write@1"), fld.F_CONTROL), NOW, SETTINGS)
    planner.outcome("write@1", PhaseEvent(EventKind.SUCCEED, NOW), {fld.value_field("write@1"): '"draft"'})
    assert called == [] and planner.dispatches == []
    assert set(planner.tasks) == {"write@1"}


def test_an_activated_gate_is_listed_among_the_run_gates(define: Define) -> None:
    steps = {"write": tl.step(lambda ctx: "draft"), "approve": tl.step(gate="approval", prompt="Publish?")}
    run = MemoryRun(define(lambda run, event: tl.Transition(run.state, ["approve"]), steps=steps,
                           transitions=[("write", "approve")]))
    run.start()
    planner = run.succeed("write@1", "draft")
    assert planner.tasks["approve@1"].state is State.PAUSED and planner.dispatches == []
    assert run.json(fld.F_GATES) == ["approve@1"]
    assert run.fields[fld.F_PAUSED] == "1"

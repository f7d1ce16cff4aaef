"""The plan of a fork (taskloop/core/fork.py), pure: what it copies, what starts afresh, what it
queues, and what it counts, from the fields of a finished run held in memory."""

from __future__ import annotations

import json

import taskloop as tl
from taskloop.base.config import Settings
from taskloop.core import fields as fld
from taskloop.core.begin import initial_record
from taskloop.core.fork import downstream, plan_fork
from taskloop.core.phases import EventKind, PhaseEvent, advance
from taskloop.core.states import Phase, State, TaskStatus

SETTINGS = Settings(redis_url="redis://unused:1/0")
NOW = 2000.0


def _wf() -> tl.Workflow:
    loop = dict(attempt=lambda c, f: 1, check=lambda c, x: tl.LoopCheck(done=True))
    return tl.define_workflow("fork-plan", version="1", budget=tl.Budget(attempts=99), tasks=[
        tl.define_task("a", run=lambda c: 1),
        tl.define_task("b", run=lambda c: 2),
        tl.define_loop_task("loop", max_rounds=4, after=["a"], **loop),
        tl.define_task("c", run=lambda c: 3, after=["loop", "b"]),
        tl.define_task("d", run=lambda c: 4, after=["b"]),
    ])


def _finished_fields(wf: tl.Workflow) -> dict[str, str]:
    """A run in which a, b, d ended done and the loop was accepted in round 3; c done."""
    fields = {fld.F_WORKFLOW: wf.name, fld.F_VERSION: wf.version, fld.F_FINGERPRINT: wf.fingerprint,
              fld.F_STATUS: "done", fld.F_INPUT: '{"x": 1}', fld.F_INPUT_DIGEST: "dig"}
    for task in wf.tasks:
        record = initial_record(task).model_copy(update={"waiting_on": 0})
        if task.is_loop:
            record = record.model_copy(update={"status": TaskStatus.DONE, "phase": Phase.COMPLETE, "round": 3,
                                               "attempts": 3, "scores": [0.1, 0.2, 0.9], "started_at": 1.0})
            for n in (1, 2, 3):
                fields[fld.candidate_field("loop", n)] = json.dumps(f"draft {n}")
                fields[fld.check_field("loop", n)] = json.dumps({"done": n == 3, "feedback": f"fb {n}"})
                fields[fld.task_usage_field("loop", n, "input")] = "10"
        else:
            record = record.model_copy(update={"status": TaskStatus.DONE, "round": 1, "attempts": 1,
                                               "started_at": 1.0})
        fields[fld.task_field(task.key)] = record.dump()
        fields[fld.value_field(task.key)] = json.dumps(task.key)
    return fields


def test_downstream_follows_every_path() -> None:
    wf = _wf()
    assert downstream(wf, "a") == {"loop", "c"} and downstream(wf, "b") == {"c", "d"} and downstream(wf, "c") == set()


def test_a_fork_copies_what_is_upstream_or_beside_and_queues_the_round_after_the_copied_ones() -> None:
    wf = _wf()
    planner = plan_fork(wf, "orig", _finished_fields(wf), "new", "loop", 3, json.dumps("shorter"), NOW, SETTINGS)
    records = planner.tasks
    assert {k for k in ("a", "b", "d") if records[k].status is TaskStatus.DONE} == {"a", "b", "d"}  # copied
    forked = records["loop"]
    assert (forked.state, forked.round, forked.attempts, forked.scores) == (State.QUEUED_ATTEMPT, 3, 2, [0.1, 0.2])
    assert records["c"].state is State.WAITING and records["c"].waiting_on == 1  # waits for the loop only
    assert [(d.key, d.phase, d.round) for d in planner.dispatches] == [("loop", Phase.ATTEMPT, 3)]
    data = planner.data
    assert data[fld.feedback_field("loop", 3)] == '"shorter"'
    assert fld.candidate_field("loop", 3) not in data and data[fld.candidate_field("loop", 2)] == '"draft 2"'
    assert fld.value_field("loop") not in data and data[fld.value_field("a")] == '"a"'
    assert fld.value_field("c") not in data  # downstream: it runs again
    copied = json.loads(planner.run_updates[fld.F_COPIED])
    assert copied == {"tasks": ["a", "b", "d"], "rounds": {"loop": 2},
                      "usage": {"attempts": 5, "tokens": {"input": 20}}}
    assert planner.usage == {"attempts": 5, "input": 20}  # counted against the new run's budget
    assert json.loads(planner.run_updates[fld.F_FORKED_FROM]) == {"run_id": "orig", "task": "loop", "round": 3}
    assert planner.counters[fld.F_OPEN] == 2 and planner.counters[fld.F_ACTIVE] == 1
    batch = planner.batch()
    assert batch.guards[0] == ["nx", fld.F_WORKFLOW]  # one write that creates the run, or nothing
    assert planner.run_updates[fld.F_INPUT] == '{"x": 1}'


def test_a_fork_at_a_plain_task_runs_it_and_what_follows_it_again() -> None:
    wf = _wf()
    planner = plan_fork(wf, "orig", _finished_fields(wf), "new", "b", 1, None, NOW, SETTINGS)
    assert planner.tasks["b"].state is State.QUEUED_RUN and planner.tasks["b"].round == 1
    assert planner.tasks["d"].state is State.WAITING and planner.tasks["c"].state is State.WAITING
    assert planner.tasks["loop"].status is TaskStatus.DONE  # beside it: copied
    assert planner.tasks["c"].waiting_on == 1  # the loop is done (copied); b is not yet


def test_the_fork_event_only_takes_a_new_record_with_rounds_left() -> None:
    task = tl.define_loop_task("l", max_rounds=2, attempt=lambda c, f: 1, check=lambda c, x: tl.LoopCheck(done=True))
    fresh = initial_record(task).model_copy(update={"round": 1, "attempts": 1})
    assert advance(fresh, PhaseEvent(EventKind.FORK, NOW)).round == 2
    import pytest

    from taskloop.base.errors import IllegalTransition

    with pytest.raises(IllegalTransition, match="none is left to run"):
        advance(fresh.model_copy(update={"round": 2}), PhaseEvent(EventKind.FORK, NOW))
    with pytest.raises(IllegalTransition, match="already started"):
        advance(fresh.model_copy(update={"started_at": 1.0}), PhaseEvent(EventKind.FORK, NOW))


def test_data_fields_belong_to_their_task_and_round_only() -> None:
    assert fld.data_of_task("o:draft:3", "draft") == (True, 3)
    assert fld.data_of_task("n:draft:2:check", "draft") == (True, 2)
    assert fld.data_of_task("ut:draft:1:input", "draft") == (True, 1)
    assert fld.data_of_task("v:draft", "draft") == (True, None)
    assert fld.data_of_task("v:draft2", "draft") == (False, None)  # another task's value
    assert fld.data_of_task("o:draft2:1", "draft") == (False, None)
    assert fld.data_of_task("t:draft", "draft") == (False, None)  # the record is not data

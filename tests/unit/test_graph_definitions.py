"""Graph workflow and flow loop declarations (SPEC §7-8): every bad definition is a
DefinitionError that names the problem; the fingerprint covers the graph and the handler."""

from __future__ import annotations

import re
from typing import Any

import pytest

import taskloop as tl
from taskloop.base.names import action_key, step_of


def review(ctx: Any) -> dict[str, bool]:
    return {"approved": True}


def policy(run: Any, event: Any) -> tl.Transition:
    return tl.Transition(run.state, [])


HANDLER = tl.TransitionHandler("policy", "1", policy)
STATE = {"type": "object", "properties": {"rounds": {"type": "integer", "minimum": 0}}, "required": ["rounds"]}


def graph(name: str = "unit-graph", **changes: Any) -> tl.Workflow:
    options: dict[str, Any] = dict(version="1", entry="review", steps={"review": tl.step(review)},
                                   transitions=[("review", "review")], handler=HANDLER, initial_state={"rounds": 0},
                                   state_schema=STATE, max_transitions=3)
    options.update(changes)
    return tl.define_graph_workflow(name, **options)


@pytest.mark.parametrize(("changes", "message"), [
    ({"entry": "publish"}, r"entry 'publish' is not one of its steps \['review'\]"),
    ({"transitions": [("review", "publish")]},
     r"transition review -> publish names 'publish', which is not a step; steps are \['review'\]"),
    ({"transitions": ["review"]}, r"each transition must be a \(from, to\) pair"),
    ({"handler": policy}, r"handler must be a tl.TransitionHandler\(id, version, apply\)"),
    ({"state_schema": {"type": "objekt"}}, r"state_schema is not a valid JSON Schema: 'objekt' is not valid"),
    ({"initial_state": {"rounds": -1}},
     r"initial_state does not match state_schema: -1 is less than the minimum of 0 \(at \$\.rounds\)"),
    ({"initial_state": {"rounds": {1, 2}}}, r"initial_state must be lossless JSON: \$\.rounds is a set"),
    ({"max_transitions": 0}, r"max_transitions must be an integer >= 1"),
    ({"max_transitions": 2.5}, r"max_transitions must be an integer >= 1"),
    ({"steps": {}}, r"steps must be a non-empty mapping"),
    ({"steps": {"review": review}}, r"step review must be made with tl.step"),
    ({"steps": {"re@view": tl.step(review)}, "entry": "re@view"}, r"step name 're@view' is invalid"),
])
def test_bad_graph_definitions_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(tl.DefinitionError, match=message):
        graph(**changes)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: tl.step(), r"tl.step needs exactly one of: run=\.\.\., attempt=\.\.\."),
    (lambda: tl.step(review, gate="approval"), r"needs exactly one of"),
    (lambda: tl.step(gate="vote", prompt="?"), r"gate must be one of \('approval', 'pause', 'input'\)"),
    (lambda: tl.step(gate="approval", prompt="?", timeout_ms=10), r"gates cannot use retries, timeouts"),
    (lambda: tl.step(attempt=review, check=policy, max_rounds=2, retry=tl.Retry(attempts=2)),
     r"a loop step has no retry option"),
    (lambda: tl.step(review, output_schema={"type": 5}), r"output_schema is not a valid JSON Schema"),
    (lambda: tl.step(lambda: 1), r"task step: run must accept \(ctx\)"),
    (lambda: tl.TransitionHandler("p", "1", lambda run: None), r"apply must accept \(run, event\)"),
    (lambda: tl.TransitionHandler("p", "", policy), r"version must be a non-empty string"),
    (lambda: tl.TransitionHandler("p", "1", "apply"), r"apply must be a callable"),
    (lambda: tl.loop("l", "body"), r"loop l: body must be a callable \(ctx, state\) -> state"),
    (lambda: tl.loop("l", lambda ctx: 1), r"loop l: body must accept \(ctx, state\)"),
    (lambda: tl.loop("l", lambda ctx, state: state, on_iteration=lambda state: None),
     r"on_iteration must accept \(iteration, state\)"),
    (lambda: tl.loop("l", lambda ctx, state: state, max_iterations="5"), r"max_iterations must be an integer"),
    (lambda: tl.llm_check(""), r"llm_check: question must be a non-empty string"),
])
def test_bad_steps_handlers_and_loops_are_refused(build: Any, message: str) -> None:
    with pytest.raises(tl.DefinitionError, match=message):
        build()


def test_the_fingerprint_covers_the_graph_and_the_handler() -> None:
    base = graph("unit-fp-graph-a")
    other_handler = graph("unit-fp-graph-b", handler=tl.TransitionHandler("policy", "2", policy))
    other_limit = graph("unit-fp-graph-c", max_transitions=4)
    no_loop = graph("unit-fp-graph-d", transitions=[])
    assert graph("unit-fp-graph-a").fingerprint == base.fingerprint  # the same definition again: a no-op
    assert len({base.fingerprint, other_handler.fingerprint, other_limit.fingerprint, no_loop.fingerprint}) == 4


def test_action_keys_and_lookup() -> None:
    wf = graph("unit-lookup-graph")
    assert action_key("review", 2) == "review@2" and step_of("review@2") == "review" and step_of("review") is None
    task = wf.task("review@2")
    assert task.key == "review@2" and task.run is review
    with pytest.raises(tl.DefinitionError, match="has no task 'publish@1'"):
        wf.task("publish@1")


def test_flow_loop_caps() -> None:
    assert tl.loop("l", lambda ctx, state: state).max_rounds == 10
    assert tl.loop("l", lambda ctx, state: state, max_iterations=0).max_rounds == 10
    assert tl.loop("l", lambda ctx, state: state, max_iterations=-3).max_rounds == 10
    assert tl.loop("l", lambda ctx, state: state, max_iterations=5).max_rounds == 5


MERMAID_LINE = re.compile(
    r'^(flowchart TD'
    r'|    start\(\(start\)\) --> [A-Za-z0-9][A-Za-z0-9._-]*'
    r'|    [A-Za-z0-9][A-Za-z0-9._-]*\["[^"]*"\]'
    r'|    [A-Za-z0-9][A-Za-z0-9._-]*\(\["[^"]*"\]\)'
    r'|    [A-Za-z0-9][A-Za-z0-9._-]*\{"[^"]*"\}'
    r'|    [A-Za-z0-9][A-Za-z0-9._-]* --> [A-Za-z0-9][A-Za-z0-9._-]*)$')


def test_mermaid_output_stays_within_valid_flowchart_syntax() -> None:
    dag = tl.define_workflow("unit-mermaid-dag", version="1", tasks=[
        tl.define_task("a.b-c", run=review),
        tl.define_loop_task("loop_1", max_rounds=2, attempt=lambda ctx, fb: 1, check=lambda ctx, c: tl.LoopCheck(
            done=True), after=["a.b-c"]),
        tl.define_gate("ok", prompt='Say "yes"?', after=["loop_1"]),
    ])
    pipeline = graph("unit-mermaid-graph", steps={"review": tl.step(review), "fix": tl.step(
        attempt=lambda ctx, fb: 1, check=lambda ctx, c: tl.LoopCheck(done=True), max_rounds=3),
        "gate": tl.step(gate="pause", prompt="wait")},
        transitions=[("review", "fix"), ("fix", "review"), ("fix", "gate")])
    for wf in (dag, pipeline):
        lines = wf.mermaid().splitlines()
        assert lines[0] == "flowchart TD"
        bad = [line for line in lines if not MERMAID_LINE.match(line)]
        assert not bad, bad
        declared = {line.split('"')[0].split("[")[0].split("(")[0].split("{")[0].strip() for line in lines[1:]
                    if "-->" not in line}
        for line in lines:  # every edge joins declared nodes
            if "-->" in line and "start((start))" not in line:
                source, target = (part.strip() for part in line.split("-->"))
                assert {source, target} <= declared, line

"""Graph workflows with business state (SPEC §7, from the Comet seed): ``tl.step`` and
``define_graph_workflow`` (the parts are in graph_spec.py).

A graph workflow has named **steps**, declared **transitions** between them (loops included),
business **state** validated by a JSON Schema, and a pure **transition handler**. Each
activation of a step is its own action, a task record ``<step>@<n>`` with its own phases,
outcome and waits, run on the same runtime as loop tasks. When an action ends, the handler is
applied to the run and the event (``apply(run, event) -> Transition(state, next)``): the new state
is validated and stored, and each step in ``next`` is activated, if the transition is declared
and ``max_transitions`` (activations dispatched, the entry's included) is not reached
(taskloop/core/graph_plan.py).

The handler is pure: no model calls, no tools, no writes. Work with side effects belongs in
steps; that is what makes an interrupted run resumable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from taskloop.base.errors import DefinitionError
from taskloop.base.jsonvalue import lossless_problem
from taskloop.base.text import shown
from taskloop.define.graph_spec import GraphSpec, Step, TransitionHandler, schema, schema_problem
from taskloop.define.limits import Limit
from taskloop.define.options import Budget, Cache, Retry
from taskloop.define.tasks import GATE_KINDS, define_gate, define_loop_task, define_task
from taskloop.define.validate import check_budget, check_name, check_no_retry, check_observers, check_version, items_of
from taskloop.define.workflow import REGISTRY, Workflow, fingerprint_of


def step(
    run: Callable[..., Any] | None = None,
    *,
    attempt: Callable[..., Any] | None = None,
    check: Callable[..., Any] | None = None,
    max_rounds: int | None = None,
    gate: str | None = None,
    prompt: str | None = None,
    actors: Iterable[str] = (),
    output_schema: Mapping[str, Any] | None = None,
    timeout_ms: int | None = None,
    retry: Retry | None = None,
    cache: Cache | None = None,
    queue: str | None = None,
    limits: Iterable[Limit] | None = None,
    attempt_limits: Iterable[Limit] | None = None,
    check_limits: Iterable[Limit] | None = None,
) -> Step:
    """Declare a step: ``run(ctx)``; or ``attempt(ctx, feedback)``/``check(ctx, candidate)`` with
    ``max_rounds`` (a bounded loop); or ``gate="approval"|"pause"|"input"`` with a ``prompt``.
    ``output_schema`` (JSON Schema) validates what the step produces; ``ctx.activation`` is the
    input its activation was given. ``limits`` (``attempt_limits``, ``check_limits`` for a loop
    step): the fleet's rate limits and concurrency keys its phases start under."""
    kinds = [name for name, given in (("run", run), ("attempt/check", attempt or check), ("gate", gate)) if given]
    if len(kinds) != 1:
        raise DefinitionError(
            "tl.step needs exactly one of: run=..., attempt=... with check=... and max_rounds=..., or gate=...; "
            f"got {kinds or 'none'}"
        )
    placeholder = "step"  # the name comes from the steps= mapping of define_graph_workflow
    if run is not None:
        if attempt_limits or check_limits:
            raise DefinitionError("tl.step: attempt_limits and check_limits are for loop steps; use limits=")
        task = define_task(placeholder, run, timeout_ms=timeout_ms, retry=retry, cache=cache, queue=queue,
                           limits=limits)
    elif gate is not None:
        if gate not in GATE_KINDS:
            raise DefinitionError(f"tl.step: gate must be one of {GATE_KINDS}, got {shown(gate)}")
        if any(option is not None for option in (retry, timeout_ms, cache, output_schema)):
            raise DefinitionError("tl.step: gates cannot use retries, timeouts, caches or output schemas; remove them")
        if limits or attempt_limits or check_limits:
            raise DefinitionError("tl.step: a gate starts no phase, so it takes no limits; remove them")
        task = define_gate(placeholder, kind=gate, prompt=prompt or "", actors=actors)
    else:
        check_no_retry("tl.step", retry, "a loop step has")
        task = define_loop_task(placeholder, max_rounds=max_rounds, attempt=attempt, check=check,
                                timeout_ms=timeout_ms, cache=cache, queue=queue, limits=limits,
                                attempt_limits=attempt_limits, check_limits=check_limits)
    return Step(task, schema(output_schema, "output_schema"))


def define_graph_workflow(
    name: str,
    *,
    version: str,
    entry: str,
    steps: Mapping[str, Step],
    transitions: Iterable[tuple[str, str]],
    handler: TransitionHandler,
    initial_state: Any = None,
    state_schema: Mapping[str, Any] | None = None,
    max_transitions: int = 100,
    budget: Budget | None = None,
    delete_on_success: bool = False,
    observers: Iterable[Callable[..., Any]] = (),
) -> Workflow:
    """Validate a graph workflow and register it under ``name`` and ``version``."""
    check_name(name, "workflow name")
    where = f"graph workflow {name}"
    check_version(version, where)
    if not isinstance(steps, Mapping) or not steps:
        raise DefinitionError(f"{where}: steps must be a non-empty mapping of step names to tl.step(...)")
    named: dict[str, Step] = {}
    for step_name, found in steps.items():
        check_name(step_name, "step name")
        if not isinstance(found, Step):
            raise DefinitionError(f"{where}: step {step_name} must be made with tl.step(...), got {shown(found)}")
        named[step_name] = Step(replace(found.task, key=step_name), found.output_schema)
    if not isinstance(entry, str) or entry not in named:
        raise DefinitionError(f"{where}: entry {shown(entry)} is not one of its steps {sorted(named)}; "
                              "name the step the run starts with")
    pairs = _transitions(where, transitions, named)
    if not isinstance(handler, TransitionHandler):
        raise DefinitionError(
            f"{where}: handler must be a tl.TransitionHandler(id, version, apply), got {shown(handler)}")
    state = schema(state_schema, f"{where}: state_schema")
    problem = lossless_problem(initial_state, "$")
    if problem is not None:
        raise DefinitionError(f"{where}: initial_state must be lossless JSON: {problem}")
    problem = schema_problem(state, initial_state)
    if problem is not None:
        raise DefinitionError(f"{where}: initial_state does not match state_schema: {problem}")
    if type(max_transitions) is not int or max_transitions < 1:
        raise DefinitionError(f"{where}: max_transitions must be an integer >= 1 (activations a run may dispatch, "
                              f"the entry's included), got {shown(max_transitions)}")
    check_budget(where, budget)
    observer_list = check_observers(where, observers)
    order = (entry, *sorted(set(named) - {entry}))
    graph = GraphSpec(entry=entry, steps=named, transitions=frozenset(pairs), handler=handler,
                      initial_state=initial_state, state_schema=state, max_transitions=max_transitions, order=order)
    workflow = Workflow(
        name=name, version=version, tasks=tuple(named[s].task for s in order), budget=budget, stop_on_error=False,
        delete_on_success=delete_on_success, observers=observer_list, by_key={s: named[s].task for s in order},
        dependents={s: () for s in order}, order=order, graph=graph,
    )
    object.__setattr__(workflow, "fingerprint", fingerprint_of(workflow))
    REGISTRY.register(workflow)
    return workflow


def _named(end: Any) -> str:
    """A transition end in a message: a step name as is, anything else as a (safe) repr."""
    return end if isinstance(end, str) else shown(end)


def _transitions(where: str, transitions: Iterable[tuple[str, str]], steps: Mapping[str, Step]) -> set[tuple[str, str]]:
    pairs: set[tuple[str, str]] = set()
    for pair in items_of(transitions, f"{where}: transitions must be a list of (from, to) step pairs"):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise DefinitionError(
                f"{where}: each transition must be a (from, to) pair of step names, got {shown(pair)}")
        source, target = pair
        for end in (source, target):
            if not isinstance(end, str) or end not in steps:
                raise DefinitionError(f"{where}: transition {_named(source)} -> {_named(target)} names {shown(end)}, "
                                      f"which is not a step; steps are {sorted(steps)}")
        pairs.add((source, target))
    return pairs


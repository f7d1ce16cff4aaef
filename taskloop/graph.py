"""Graph workflows with business state (SPEC §7, from the Comet seed).

A graph workflow has named **steps**, declared **transitions** between them (loops included),
business **state** validated by a JSON Schema, and a pure **transition handler**. Each
activation of a step is its own action — a task record ``<step>@<n>`` with its own phases,
outcome and waits — run on the same runtime as loop tasks. When an action ends, the handler is
applied to the run and the event (``apply(run, event) -> Transition(state, next)``): the new state
is validated and stored, and each step in ``next`` is activated, if the transition is declared
and ``max_transitions`` (activations dispatched, the entry's included) is not reached.

The handler is pure: no model calls, no tools, no writes. Work with side effects belongs in
steps; that is what makes an interrupted run resumable.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jsonschema

from taskloop.definitions import (
    GATE_KINDS,
    REGISTRY,
    Task,
    Workflow,
    check_name,
    check_signature,
    define_gate,
    define_loop_task,
    define_task,
    fingerprint_of,
    got,
    is_text,
    items_of,
)
from taskloop.errors import DefinitionError
from taskloop.jsonvalue import lossless_problem, shown
from taskloop.options import Budget, Cache, Retry

ACTION_SEPARATOR = "@"
ACTION_KEY = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)@([1-9][0-9]{0,8})\Z")
OUTCOME_EVENT = "action-outcome"


def action_key(step: str, n: int) -> str:
    """The key of the ``n``-th activation of ``step``: ``review@2``."""
    return f"{step}{ACTION_SEPARATOR}{n}"


def step_of(key: str) -> str | None:
    """The step an action key belongs to (None when ``key`` is not an action key)."""
    found = ACTION_KEY.match(key)
    return found.group(1) if found else None


@dataclass(frozen=True)
class Step:
    """A step of a graph workflow (build it with ``tl.step``): a plain task, a bounded loop, or a gate."""

    task: Task
    output_schema: dict[str, Any] | None = None


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
) -> Step:
    """Declare a step: ``run(ctx)``; or ``attempt(ctx, feedback)``/``check(ctx, candidate)`` with
    ``max_rounds`` (a bounded loop); or ``gate="approval"|"pause"|"input"`` with a ``prompt``.
    ``output_schema`` (JSON Schema) validates what the step produces; ``ctx.activation`` is the
    input its activation was given."""
    kinds = [name for name, given in (("run", run), ("attempt/check", attempt or check), ("gate", gate)) if given]
    if len(kinds) != 1:
        raise DefinitionError(
            "tl.step needs exactly one of: run=..., attempt=... with check=... and max_rounds=..., or gate=...; "
            f"got {kinds or 'none'}"
        )
    placeholder = "step"  # the name comes from the steps= mapping of define_graph_workflow
    if run is not None:
        task = define_task(placeholder, run, timeout_ms=timeout_ms, retry=retry, cache=cache, queue=queue)
    elif gate is not None:
        if gate not in GATE_KINDS:
            raise DefinitionError(f"tl.step: gate must be one of {GATE_KINDS}, got {shown(gate)}")
        if any(option is not None for option in (retry, timeout_ms, cache, output_schema)):
            raise DefinitionError("tl.step: gates cannot use retries, timeouts, caches or output schemas; remove them")
        task = define_gate(placeholder, kind=gate, prompt=prompt or "", actors=actors)
    else:
        if retry is not None:
            raise DefinitionError("tl.step: a loop step has no retry option (a round is the retry); remove retry=")
        task = define_loop_task(placeholder, max_rounds=max_rounds, attempt=attempt, check=check,
                                timeout_ms=timeout_ms, cache=cache, queue=queue)
    return Step(task, _schema(output_schema, "output_schema"))


@dataclass(frozen=True)
class Activation:
    """An activation of ``step`` with an ``input`` (read by the step as ``ctx.activation``)."""

    step: str
    input: Any = None


@dataclass(frozen=True)
class Transition:
    """What a handler returns: the new business state, and the steps to activate next."""

    state: Any
    next: Sequence[str | Activation] = ()


@dataclass(frozen=True)
class TransitionHandler:
    """A pure function ``apply(run, event) -> Transition``, named by ``id`` and ``version`` (both part
    of the workflow's fingerprint: a resume after the handler changed is refused)."""

    id: str
    version: str
    apply: Callable[[Any, Any], Transition]

    def __post_init__(self) -> None:
        check_name(self.id, "transition handler id")
        if not is_text(self.version):
            raise DefinitionError(
                f"transition handler {self.id}: version must be a non-empty string, e.g. '1'{got(self.version)}")
        if not callable(self.apply):
            raise DefinitionError(f"transition handler {self.id}: apply must be a callable (run, event) -> Transition")
        check_signature(f"transition handler {self.id}", "apply", self.apply, ("run", "event"))


@dataclass(frozen=True)
class GraphSpec:
    """The graph part of a graph workflow (``Workflow.graph``)."""

    entry: str
    steps: dict[str, Step]
    transitions: frozenset[tuple[str, str]]
    handler: TransitionHandler
    initial_state: Any
    state_schema: dict[str, Any] | None
    max_transitions: int
    order: tuple[str, ...] = field(default=())

    def allows(self, source: str, target: str) -> bool:
        return (source, target) in self.transitions

    def describe(self) -> dict[str, Any]:
        return {
            "entry": self.entry,
            "steps": {name: {**s.task.describe(), "key": name, "output_schema": s.output_schema}
                      for name, s in sorted(self.steps.items())},
            "transitions": sorted(self.transitions),
            "handler": {"id": self.handler.id, "version": self.handler.version},
            "state_schema": self.state_schema,
            "max_transitions": self.max_transitions,
        }


def _schema(schema: Mapping[str, Any] | None, what: str) -> dict[str, Any] | None:
    if schema is None:
        return None
    if not isinstance(schema, Mapping):
        raise DefinitionError(f"{what} must be a JSON Schema (a dict){got(schema)}")
    schema = dict(schema)
    problem = lossless_problem(schema, "$")
    if problem is not None:  # it is part of the definition fingerprint (canonical JSON)
        raise DefinitionError(f"{what} must be a JSON Schema made of lossless JSON: {problem}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise DefinitionError(f"{what} is not a valid JSON Schema: {exc.message} (at {_where(exc.path)})") from None
    return schema


def _where(path: Iterable[Any]) -> str:
    parts = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    return f"${parts}"


def schema_problem(schema: dict[str, Any] | None, value: Any) -> str | None:
    """Why ``value`` does not match ``schema`` (None when it does, or there is no schema)."""
    if schema is None:
        return None
    error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
    return None if error is None else f"{error.message} (at {_where(error.absolute_path)})"


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
    if not isinstance(version, str) or not version:
        raise DefinitionError(f"{where}: version must be a non-empty string, e.g. version='1'")
    if not isinstance(steps, Mapping) or not steps:
        raise DefinitionError(f"{where}: steps must be a non-empty mapping of step names to tl.step(...)")
    named: dict[str, Step] = {}
    for step_name, found in steps.items():
        check_name(step_name, "step name")
        if ACTION_SEPARATOR in step_name:
            raise DefinitionError(f"{where}: step name {shown(step_name)} may not contain {shown(ACTION_SEPARATOR)}")
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
    schema = _schema(state_schema, f"{where}: state_schema")
    problem = lossless_problem(initial_state, "$")
    if problem is not None:
        raise DefinitionError(f"{where}: initial_state must be lossless JSON: {problem}")
    problem = schema_problem(schema, initial_state)
    if problem is not None:
        raise DefinitionError(f"{where}: initial_state does not match state_schema: {problem}")
    if type(max_transitions) is not int or max_transitions < 1:
        raise DefinitionError(f"{where}: max_transitions must be an integer >= 1 (activations a run may dispatch, "
                              f"the entry's included), got {shown(max_transitions)}")
    if budget is not None and not isinstance(budget, Budget):
        raise DefinitionError(f"{where}: budget must be a tl.Budget(...), got {shown(budget)}")
    observer_list = items_of(observers, f"{where}: observers must be a list of callables (event) -> None")
    for observer in observer_list:
        if not callable(observer):
            raise DefinitionError(f"{where}: observers must be callables (event) -> None")
    order = (entry, *sorted(set(named) - {entry}))
    graph = GraphSpec(entry=entry, steps=named, transitions=frozenset(pairs), handler=handler,
                      initial_state=initial_state, state_schema=schema, max_transitions=max_transitions, order=order)
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


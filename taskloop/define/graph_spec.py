"""The parts of a graph workflow (SPEC §7): its steps, the transitions it declares, its pure
transition handler and what the handler returns, its state schema (``GraphSpec``). Built by
``define_graph_workflow`` (graph.py); a Workflow holds one as ``workflow.graph``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from taskloop.base.errors import DefinitionError
from taskloop.base.jsonvalue import lossless_problem
from taskloop.define.tasks import Task
from taskloop.define.validate import check_callable, check_name, check_signature, check_version, got

OUTCOME_EVENT = "action-outcome"


@dataclass(frozen=True)
class Step:
    """A step of a graph workflow (build it with ``tl.step``): a plain task, a bounded loop, or a gate."""

    task: Task
    output_schema: dict[str, Any] | None = None


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
        check_version(self.version, f"transition handler {self.id}")
        check_callable(self.apply, f"transition handler {self.id}: apply must be a callable (run, event) -> Transition")
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


def schema(value: Mapping[str, Any] | None, what: str) -> dict[str, Any] | None:
    """A JSON Schema given in a declaration, checked now (None: no schema)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise DefinitionError(f"{what} must be a JSON Schema (a dict){got(value)}")
    found = dict(value)
    problem = lossless_problem(found, "$")
    if problem is not None:  # it is part of the definition fingerprint (canonical JSON)
        raise DefinitionError(f"{what} must be a JSON Schema made of lossless JSON: {problem}")
    import jsonschema  # imported where a schema is used: a process with none does not pay for it

    try:
        jsonschema.validators.validator_for(found).check_schema(found)
    except jsonschema.SchemaError as exc:
        raise DefinitionError(f"{what} is not a valid JSON Schema: {exc.message} (at {_where(exc.path)})") from None
    return found


def _where(path: Iterable[Any]) -> str:
    parts = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    return f"${parts}"


def schema_problem(schema: dict[str, Any] | None, value: Any) -> str | None:
    """Why ``value`` does not match ``schema`` (None when it does, or there is no schema)."""
    if schema is None:
        return None
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
    return None if error is None else f"{error.message} (at {_where(error.absolute_path)})"

"""Workflows: ``define_workflow`` validates a DAG of tasks and registers it by name and version
(``REGISTRY``). A graph workflow (graph.py) is a Workflow too, with a ``graph``.

Everything is validated at definition time and raises DefinitionError with a message that names
the field and the fix. Workers find callbacks through the registry, so the module that defines a
workflow must be importable by them.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from taskloop.base import names
from taskloop.base.errors import DefinitionError, WorkflowNotRegistered
from taskloop.base.jsonvalue import canonical
from taskloop.base.text import shown
from taskloop.define.graph_spec import GraphSpec
from taskloop.define.options import Budget
from taskloop.define.tasks import Task, TaskKind
from taskloop.define.validate import check_budget, check_flag, check_name, check_observers, check_version, items_of


@dataclass(frozen=True, eq=False)
class Workflow:
    """A validated DAG of tasks, registered by name and version."""

    name: str
    version: str
    tasks: tuple[Task, ...]
    budget: Budget | None = None
    stop_on_error: bool = True
    delete_on_success: bool = False
    observers: tuple[Callable[..., Any], ...] = ()
    by_key: dict[str, Task] = field(default_factory=dict, repr=False)
    dependents: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    order: tuple[str, ...] = field(default=(), repr=False)  # dependencies before dependents
    fingerprint: str = field(default="", repr=False)
    graph: GraphSpec | None = field(default=None, repr=False)  # a graph workflow (taskloop/define/graph.py)

    @property
    def roots(self) -> tuple[str, ...]:
        """Tasks with no dependencies: the ones a new run activates."""
        return tuple(key for key in self.order if not self.by_key[key].after)

    @property
    def gates(self) -> tuple[str, ...]:
        return tuple(key for key in self.order if self.by_key[key].is_gate)

    def __repr__(self) -> str:
        return f"<workflow {self.name} v{self.version}: {', '.join(self.order)}>"

    def lookup(self, key: str) -> Task | None:
        """The task a record key runs: a task of the DAG, or for a graph workflow the step of an
        action (``review@2`` runs step ``review`` under that key)."""
        found = self.by_key.get(key)
        if found is not None or self.graph is None:
            return found
        step = self.graph.steps.get(names.step_of(key) or "")
        return replace(step.task, key=key) if step is not None else None

    def task(self, key: str) -> Task:
        found = self.lookup(key)
        if found is None:
            raise DefinitionError(
                f"workflow {self.name} v{self.version} has no task {shown(key)}; its tasks are "
                f"{sorted(self.by_key)}"
            )
        return found

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "tasks": [self.by_key[k].describe() for k in self.order],
            "budget": self.budget.model_dump() if self.budget else None,
            "stop_on_error": self.stop_on_error,
            **({"graph": self.graph.describe()} if self.graph is not None else {}),
        }

    def mermaid(self) -> str:
        """The workflow as a Mermaid flowchart (``taskloop graph``): a DAG's ``after`` links, or a
        graph workflow's declared transitions (loops included)."""
        lines = ["flowchart TD"]
        if self.graph is not None:
            lines.append(f"    start((start)) --> {self.graph.entry}")
        for key in self.order:
            task = self.by_key[key]
            label = {
                TaskKind.TASK: f'{key}["{key}"]',
                TaskKind.LOOP: f'{key}(["{key} (loop, max {task.max_rounds} rounds)"])',
                TaskKind.GATE: f'{key}{{"{key} ({task.gate_kind} gate)"}}',
            }[task.kind]
            lines.append(f"    {label}")
            for dep in task.after:
                lines.append(f"    {dep} --> {key}")
        if self.graph is not None:
            lines += [f"    {source} --> {target}" for source, target in sorted(self.graph.transitions)]
        return "\n".join(lines)


def _topological_order(name: str, tasks: dict[str, Task]) -> tuple[str, ...]:
    """Depth-first topological sort (iterative: a chain of any length is fine) that reports the
    first cycle it finds, by name."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    for root in tasks:
        if root in state:
            continue
        state[root] = 1
        path = [root]
        stack = [iter(tasks[root].after)]
        while stack:
            dep = next(stack[-1], None)
            if dep is None:
                stack.pop()
                done = path.pop()
                state[done] = 2
                order.append(done)
                continue
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep):], dep]
                if len(cycle) > 12:  # a long cycle: its ends, and how many tasks between them
                    cycle = [*cycle[:6], f"... ({len(cycle) - 11} more) ...", *cycle[-5:]]
                raise DefinitionError(
                    f"workflow {name} has a dependency cycle: {' -> '.join(cycle)}; "
                    "remove one of these after= links"
                )
            if dep not in state:
                state[dep] = 1
                path.append(dep)
                stack.append(iter(tasks[dep].after))
    return tuple(order)


def define_workflow(
    name: str,
    *,
    version: str,
    tasks: Sequence[Task],
    budget: Budget | None = None,
    stop_on_error: bool = True,
    delete_on_success: bool = False,
    observers: Iterable[Callable[..., Any]] = (),
) -> Workflow:
    """Validate a DAG of tasks and register it under ``name`` and ``version``."""
    check_name(name, "workflow name")
    check_version(version, f"workflow {name}")
    not_a_list = f"workflow {name}: tasks must be a non-empty list of tasks"
    tasks = () if isinstance(tasks, Task) else items_of(tasks, not_a_list)
    if not tasks:
        raise DefinitionError(not_a_list)
    by_key: dict[str, Task] = {}
    for task in tasks:
        if not isinstance(task, Task):
            raise DefinitionError(
                f"workflow {name}: tasks must be made with define_task, define_loop_task or "
                f"define_gate, got {shown(task)}"
            )
        if task.key in by_key:
            raise DefinitionError(
                f"workflow {name}: duplicate task key {shown(task.key)}; keys must be unique within a workflow"
            )
        by_key[task.key] = task
    for task in by_key.values():
        for dep in task.after:
            if dep not in by_key:
                raise DefinitionError(
                    f"workflow {name}: task {task.key} runs after {shown(dep)}, which is not a task of "
                    f"this workflow; add it to tasks= or remove it from after="
                )
    check_budget(f"workflow {name}", budget)
    check_flag(f"workflow {name}", "stop_on_error", stop_on_error)
    check_flag(f"workflow {name}", "delete_on_success", delete_on_success)
    observer_list = check_observers(f"workflow {name}", observers)
    order = _topological_order(name, by_key)
    dependents: dict[str, list[str]] = {key: [] for key in order}
    for key in order:
        for dep in by_key[key].after:
            dependents[dep].append(key)
    workflow = Workflow(
        name=name,
        version=version,
        tasks=tuple(tasks),
        budget=budget,
        stop_on_error=stop_on_error,
        delete_on_success=delete_on_success,
        observers=observer_list,
        by_key=by_key,
        dependents={key: tuple(found) for key, found in dependents.items()},
        order=order,
    )
    object.__setattr__(workflow, "fingerprint", fingerprint_of(workflow))
    REGISTRY.register(workflow)
    return workflow


def fingerprint_of(workflow: Workflow) -> str:
    """The definition fingerprint a run pins: the shape of the workflow (tasks, limits, graph,
    transition handler id and version), not its code."""
    return hashlib.sha256(canonical(workflow.describe()).encode()).hexdigest()[:32]


class Registry:
    """Workflows by (name, version)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workflows: dict[tuple[str, str], Workflow] = {}

    def register(self, workflow: Workflow) -> None:
        """Register a workflow. The same definition again (a module imported twice) is a no-op;
        another definition under a registered name and version is refused."""
        with self._lock:
            known = self._workflows.get((workflow.name, workflow.version))
            if known is not None and _identity(known) != _identity(workflow):
                raise DefinitionError(
                    f"workflow {workflow.name} version {shown(workflow.version)} is already registered with another "
                    f"definition (fingerprint {known.fingerprint}, this one {workflow.fingerprint}); give the "
                    "changed workflow a new version, so that runs started under the old one keep it"
                )
            self._workflows[(workflow.name, workflow.version)] = workflow

    def unregister(self, name: str, version: str) -> None:
        """Forget a registration (tests, and tools that reload workflow modules)."""
        with self._lock:
            self._workflows.pop((name, version), None)

    def get(self, name: str, version: str | None = None) -> Workflow:
        with self._lock:
            if version is not None:
                found = self._workflows.get((name, version))
                if found is not None:
                    return found
                known = sorted(v for (n, v) in self._workflows if n == name)
            else:
                candidates = [w for (n, _), w in self._workflows.items() if n == name]
                if len(candidates) == 1:
                    return candidates[0]
                known = sorted(w.version for w in candidates)
                if candidates:
                    raise WorkflowNotRegistered(
                        f"workflow {name} has several versions registered ({known}); pass version="
                    )
        where = f"versions {known} are" if known else "no version is"
        raise WorkflowNotRegistered(
            f"workflow {shown(name)}{'' if version is None else f' version {shown(version)}'} is not registered "
            f"in this process ({where}); import the module that defines it (--import MODULE on the command, "
            "e.g. taskloop worker --import MODULE, or TASKLOOP_IMPORTS=MODULE)"
        )

    def has(self, name: str, version: str | None = None) -> bool:
        """Whether ``get(name, version)`` would find exactly one workflow."""
        with self._lock:
            if version is not None:
                return (name, version) in self._workflows
            return sum(1 for (n, _) in self._workflows if n == name) == 1

    def names(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._workflows)


def _identity(workflow: Workflow) -> tuple[str, tuple[tuple[str, ...], ...]]:
    """What makes two registrations the same definition: the shape (the fingerprint) and which
    functions it calls, by qualified name."""
    def name(fn: Callable[..., Any] | None) -> str:
        return "" if fn is None else f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
    callbacks = tuple(
        tuple(name(fn) for fn in (t.run, t.attempt, t.check, t.condition, t.cache.key if t.cache else None))
        for t in workflow.tasks)
    return workflow.fingerprint, callbacks


REGISTRY = Registry()

"""Declarations: define_task, define_loop_task, define_gate, define_workflow, and the registry.

Everything here is validated at definition time and raises `DefinitionError` with a message
that names the field and the fix. Workers find callbacks through the registry, keyed by
workflow name and version, so the module that defines a workflow must be importable by them.
"""

from __future__ import annotations

import hashlib
import inspect
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from taskloop.errors import DefinitionError, WorkflowNotRegistered
from taskloop.jsonvalue import canonical, shown, text_problem
from taskloop.options import Budget, Cache, Retry, check_timeout_ms, is_safe_int
from taskloop.phases import TaskKind

if TYPE_CHECKING:
    from taskloop.graph import GraphSpec

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
GATE_KINDS = ("approval", "pause", "input")


@dataclass(frozen=True, eq=False)
class Task:
    """One declared unit of work. Build it with define_task, define_loop_task or define_gate."""

    key: str
    kind: TaskKind
    after: tuple[str, ...] = ()
    run: Callable[..., Any] | None = None
    attempt: Callable[..., Any] | None = None
    check: Callable[..., Any] | None = None
    max_rounds: int | None = None
    condition: Callable[..., Any] | None = None
    timeout_ms: int | None = None
    retry: Retry | None = None
    cache: Cache | None = None
    queue: str | None = None
    gate_kind: str | None = None
    prompt: str | None = None
    actors: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"<{self.kind.value} {self.key}>"

    @property
    def is_loop(self) -> bool:
        return self.kind is TaskKind.LOOP

    @property
    def is_gate(self) -> bool:
        return self.kind is TaskKind.GATE

    def describe(self) -> dict[str, Any]:
        """The shape that the definition fingerprint covers (no callables, only their presence)."""
        return {
            "key": self.key,
            "kind": self.kind.value,
            "after": list(self.after),
            "max_rounds": self.max_rounds,
            "timeout_ms": self.timeout_ms,
            "retry": self.retry.describe() if self.retry else None,
            "condition": self.condition is not None,
            "cache": self.cache.describe() if self.cache else None,
            "gate": self.gate_kind,
            "actors": list(self.actors),
        }


TaskRef = Task | str


def task_key(ref: TaskRef) -> str:
    if isinstance(ref, Task):
        return ref.key
    if isinstance(ref, str):
        return ref
    raise DefinitionError(f"expected a task or a task key, got {shown(ref)}")


def is_text(value: object) -> bool:
    """A non-empty str that UTF-8 can encode (no lone surrogate): what versions, prompts, actors and
    queue names must be, since they are stored in Redis or in the definition fingerprint."""
    return isinstance(value, str) and bool(value) and text_problem(value) is None


def got(value: object) -> str:
    """``, got <value>`` for a message; for a str with a lone surrogate, why it is refused."""
    problem = text_problem(value) if isinstance(value, str) else None
    return f", got a string that {problem}" if problem else f", got {shown(value)}"


def items_of(value: object, message: str) -> tuple[Any, ...]:
    """The items of an iterable argument (a list, tuple, generator ...), or DefinitionError(message)."""
    if isinstance(value, str | bytes):
        raise DefinitionError(message)
    try:
        return tuple(value)  # type: ignore[arg-type]
    except TypeError:
        raise DefinitionError(f"{message}{got(value)}") from None


def check_name(key: object, what: str = "task key") -> str:
    if not isinstance(key, str) or not NAME_PATTERN.match(key):
        raise DefinitionError(
            f"{what} {shown(key)} is invalid: it must match [A-Za-z0-9][A-Za-z0-9._-]* "
            "(start with a letter or digit; then letters, digits, '.', '_' or '-')"
        )
    return key


def _check_after(key: str, after: Iterable[TaskRef] | None) -> tuple[str, ...]:
    if after is None:
        return ()
    if isinstance(after, Task | str):
        raise DefinitionError(f"task {key}: after must be a list of tasks, e.g. after=[{shown(after)}]")
    refs = items_of(after, f"task {key}: after must be a list of tasks")
    for ref in refs:
        if not isinstance(ref, Task | str):
            raise DefinitionError(f"task {key}: after must list tasks or task keys, got {shown(ref)} in it")
    keys = tuple(task_key(ref) for ref in refs)
    if key in keys:
        raise DefinitionError(f"task {key} cannot run after itself; remove {shown(key)} from after")
    if len(set(keys)) != len(keys):
        raise DefinitionError(f"task {key}: after lists a task twice; list each dependency once")
    return keys


def _check_callable(value: object, message: str) -> None:
    if not callable(value):
        raise DefinitionError(message)


def check_signature(owner: str, role: str, fn: Callable[..., Any], params: tuple[str, ...]) -> None:
    """The callback must accept the arguments taskloop calls it with (checked now, not at run time)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins cannot be inspected: nothing to check
        return
    try:
        signature.bind(*params)
    except TypeError:
        name = getattr(fn, "__qualname__", repr(fn))
        takes = ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in signature.parameters.values())
        raise DefinitionError(
            f"{owner}: {role} must accept ({', '.join(params)}), but {name}({takes}) does not; "
            f"define it as def {role}({', '.join(params)}): ..."
        ) from None


def _check_common(
    key: str,
    condition: object,
    timeout_ms: object,
    cache: object,
    queue: object,
) -> None:
    if condition is not None:
        _check_callable(condition, f"task {key}: condition must be a callable (ctx) -> bool")
        check_signature(f"task {key}", "condition", condition, ("ctx",))  # type: ignore[arg-type]
    check_timeout_ms(timeout_ms, f"task {key}")
    if cache is not None and not isinstance(cache, Cache):
        raise DefinitionError(f"task {key}: cache must be a tl.Cache(...), got {shown(cache)}")
    if isinstance(cache, Cache):
        check_signature(f"task {key}", "cache.key", cache.key, ("ctx",))
    if queue is not None and not is_text(queue):
        raise DefinitionError(f"task {key}: queue must be a non-empty queue name{got(queue)}")


def define_task(
    key: str,
    run: Callable[..., Any],
    *,
    after: Iterable[TaskRef] = (),
    condition: Callable[..., Any] | None = None,
    timeout_ms: int | None = None,
    retry: Retry | None = None,
    cache: Cache | None = None,
    queue: str | None = None,
) -> Task:
    """Declare a plain task: ``run(ctx)`` returns its (lossless JSON) value."""
    check_name(key)
    _check_callable(run, f"define_task requires a run callback: task {key}: run must be callable")
    check_signature(f"task {key}", "run", run, ("ctx",))
    _check_common(key, condition, timeout_ms, cache, queue)
    if retry is not None and not isinstance(retry, Retry):
        raise DefinitionError(f"task {key}: retry must be a tl.Retry(...), got {shown(retry)}")
    if retry is not None and retry.accepts is not None:
        check_signature(f"task {key}", "retry.accepts", retry.accepts, ("error", "attempt"))
    return Task(
        key=key,
        kind=TaskKind.TASK,
        after=_check_after(key, after),
        run=run,
        condition=condition,
        timeout_ms=timeout_ms,
        retry=retry,
        cache=cache,
        queue=queue,
    )


def define_loop_task(
    key: str,
    *,
    max_rounds: int | None = None,
    attempt: Callable[..., Any] | None = None,
    check: Callable[..., Any] | None = None,
    after: Iterable[TaskRef] = (),
    condition: Callable[..., Any] | None = None,
    timeout_ms: int | None = None,
    cache: Cache | None = None,
    queue: str | None = None,
    retry: object = None,
) -> Task:
    """Declare a loop task: attempt(ctx, feedback) then check(ctx, candidate), at most max_rounds."""
    check_name(key)
    if not is_safe_int(max_rounds):
        raise DefinitionError(
            f"task {key}: max_rounds must be a positive safe integer (1 .. 2**53-1), got {shown(max_rounds)}"
        )
    if not callable(attempt) or not callable(check):
        raise DefinitionError(f"define_loop_task requires attempt and check callbacks (task {key})")
    check_signature(f"task {key}", "attempt", attempt, ("ctx", "feedback"))
    check_signature(f"task {key}", "check", check, ("ctx", "candidate"))
    if retry is not None:
        raise DefinitionError(
            f"task {key}: loop tasks have no retry option (a round is the retry); "
            "remove retry= or raise max_rounds"
        )
    _check_common(key, condition, timeout_ms, cache, queue)
    return Task(
        key=key,
        kind=TaskKind.LOOP,
        after=_check_after(key, after),
        attempt=attempt,
        check=check,
        max_rounds=max_rounds,
        condition=condition,
        timeout_ms=timeout_ms,
        cache=cache,
        queue=queue,
    )


def define_gate(
    key: str,
    *,
    kind: str = "approval",
    prompt: str,
    actors: Iterable[str] = (),
    after: Iterable[TaskRef] = (),
    condition: object = None,
    retry: object = None,
    timeout_ms: object = None,
    cache: object = None,
) -> Task:
    """Declare a human gate: the run waits in status ``waiting`` until ``client.decide``."""
    check_name(key)
    if any(option is not None for option in (condition, retry, timeout_ms, cache)):
        raise DefinitionError(
            f"gate {key}: gates cannot use conditions, retries, timeouts or caches; remove them"
        )
    if kind not in GATE_KINDS:
        raise DefinitionError(f"gate {key}: kind must be one of {GATE_KINDS}, got {shown(kind)}")
    if not is_text(prompt):
        raise DefinitionError(f"gate {key}: prompt must be a non-empty string{got(prompt)}")
    if isinstance(actors, str):
        raise DefinitionError(f"gate {key}: actors must be a list of names, e.g. actors=[{shown(actors)}]")
    actor_names = items_of(actors, f"gate {key}: actors must be a list of names, e.g. actors=['alice']")
    bad = [a for a in actor_names if not is_text(a)]
    if bad:
        raise DefinitionError(f"gate {key}: actors must be non-empty strings{got(bad[0])} in {shown(actor_names)}")
    return Task(
        key=key,
        kind=TaskKind.GATE,
        after=_check_after(key, after),
        gate_kind=kind,
        prompt=prompt,
        actors=actor_names,
    )


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
    graph: GraphSpec | None = field(default=None, repr=False)  # a graph workflow (taskloop/graph.py)

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
        from taskloop.graph import step_of

        step = self.graph.steps.get(step_of(key) or "")
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
    if not is_text(version):
        raise DefinitionError(f"workflow {name}: version must be a non-empty string, e.g. version='1'{got(version)}")
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
    if budget is not None and not isinstance(budget, Budget):
        raise DefinitionError(f"workflow {name}: budget must be a tl.Budget(...), got {shown(budget)}")
    for flag, value in (("stop_on_error", stop_on_error), ("delete_on_success", delete_on_success)):
        if type(value) is not bool:
            raise DefinitionError(f"workflow {name}: {flag} must be True or False, got {shown(value)}")
    observer_list = items_of(observers, f"workflow {name}: observers must be a list of callables (event) -> None")
    for observer in observer_list:
        _check_callable(observer, f"workflow {name}: observers must be callables (event) -> None")
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
    """Workflows by (name, version). Defining a workflow registers it; workers look them up here."""

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
            f"in this process ({where}); import the module that defines it (taskloop worker --import "
            "MODULE, or TASKLOOP_IMPORTS=MODULE)"
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

"""Fuzzing definitions: define_task, define_loop_task, define_gate, define_workflow and
define_graph_workflow (with tl.step, Retry, Cache, Budget and TransitionHandler), called with random
names, keys, after-edges (cycles, unknown and self references included), max_rounds, timeouts,
budgets, caches, retries, callbacks of every arity and plain garbage.

Property: each call returns a valid Workflow or raises ``DefinitionError`` whose message names
one of the fields that were wrong; never another exception type. Pure: no Redis, no worker.

CI runs a few hundred examples; ``TASKLOOP_FUZZ_PROFILE=long python -m pytest
tests/fuzz/test_fuzz_definitions.py`` runs thousands (see tests/fuzz/__init__.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

import taskloop as tl
from taskloop.base import names as name_rules
from taskloop.base.errors import DefinitionError, InvalidCheckResult
from taskloop.define.graph_spec import Step
from taskloop.define.options import MAX_SAFE_INT, MAX_TIMEOUT_MS
from taskloop.define.workflow import REGISTRY
from tests.fuzz import TIMEOUT, fuzz
from tests.fuzz.strategies import (
    GARBAGE,
    NOT_ITERABLE,
    SOME_GARBAGE,
    SPEC_NAME,
    hostile_text,
    is_lossless,
    is_utf8_text,
    jsonish,
    names,
    valid_names,
)

pytestmark = pytest.mark.timeout(TIMEOUT)

_serial = itertools.count()


# --- callbacks of every shape ----------------------------------------------------------------


async def _async2(a: Any, b: Any) -> int:
    return 0


# (callable, the numbers of positional arguments it accepts; None = any)
CALLBACKS: list[tuple[Callable[..., Any], set[int] | None]] = [
    (lambda: 0, {0}),
    (lambda a: 0, {1}),
    (lambda a, b: 0, {2}),
    (lambda a, b, c: 0, {3}),
    (lambda *a: 0, None),
    (lambda a, *, b: 0, set()),  # a required keyword-only argument: never callable positionally
    (lambda a, b=0, c=0: 0, {1, 2, 3}),
    (lambda a, /, b: 0, {2}),
    (_async2, {2}),
    (print, None),
    (len, {1}),
]


def accepts(fn_spec: tuple[Callable[..., Any], set[int] | None], n: int) -> bool:
    return fn_spec[1] is None or n in fn_spec[1]


@dataclass
class Drawn:
    """Keyword arguments for one call, and the words one of which its error must contain (empty: valid)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    bad: set[str] = field(default_factory=set)

    def put(self, name: str, value: Any, bad_word: str | None) -> None:
        self.kwargs[name] = value
        if bad_word:
            self.bad.add(bad_word)


# Half of the examples are "clean": every argument is valid (so valid workflows are explored as
# deeply as broken ones); the test sets this before it draws the arguments.
_chaos = [True]


def chaos(draw: st.DrawFn, odds: int) -> bool:
    """In a chaotic example, True one time in ``odds`` + 1; never in a clean one."""
    return _chaos[0] and draw(st.integers(0, odds)) == 0


def callback(draw: st.DrawFn, arity: int, word: str) -> tuple[Any, str | None]:
    """A callback that must accept ``arity`` positional arguments: mostly one that does, sometimes
    one of another arity, or garbage that is not callable."""
    choice = draw(st.integers(0, 11)) if _chaos[0] else 2
    if choice == 0:
        return draw(SOME_GARBAGE), word
    fitting = [spec for spec in CALLBACKS if accepts(spec, arity)]
    spec = draw(st.sampled_from(CALLBACKS if choice == 1 else fitting))
    return spec[0], None if accepts(spec, arity) else word


def optional(draw: st.DrawFn, valid: st.SearchStrategy[Any], is_valid: Callable[[Any], bool],
             word: str, none_ok: bool = True) -> tuple[Any, str | None]:
    """None (when allowed), a valid value, or (one time in ten) garbage that ``is_valid`` refuses."""
    choice = draw(st.integers(0, 9))
    if choice <= 2 and none_ok:
        return None, None
    if choice <= 8 or not _chaos[0]:
        return draw(valid), None
    value = draw(GARBAGE.filter(lambda v: not is_valid(v)))
    return value, word


def _safe_int(minimum: int, maximum: int = MAX_SAFE_INT) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and minimum <= v <= maximum


def _opt_safe_int(minimum: int, maximum: int = MAX_SAFE_INT) -> Callable[[Any], bool]:
    return lambda v: v is None or (type(v) is int and minimum <= v <= maximum)


@st.composite
def retry_options(draw: st.DrawFn) -> tuple[Any, set[str]]:
    """A tl.Retry(...) call (built lazily: its own errors count) or a non-Retry value."""
    if chaos(draw, 19):
        garbage = draw(SOME_GARBAGE)
        return (lambda: garbage), {"retry"}
    d = Drawn()
    d.put("attempts", *optional(draw, st.integers(1, 10), _safe_int(1), "retry.attempts", none_ok=False))
    if draw(st.booleans()):
        d.put("delay_ms", *optional(draw, st.integers(0, 10_000), _safe_int(0), "retry.delay_ms", none_ok=False))
    if draw(st.booleans()):
        d.put("max_delay_ms", *optional(draw, st.integers(0, 10_000), _opt_safe_int(0), "retry.max_delay_ms"))
    if draw(st.booleans()):
        d.put("backoff", *optional(draw, st.sampled_from(["fixed", "exponential"]),
                                   lambda v: v in ("fixed", "exponential"), "retry.backoff", none_ok=False))
    if draw(st.booleans()):
        d.put("jitter", *optional(draw, st.sampled_from(["none", "full"]), lambda v: v in ("none", "full"),
                                  "retry.jitter", none_ok=False))
    if draw(st.booleans()):
        fn, bad = callback(draw, 2, "retry.accepts")
        d.put("accepts", fn, bad)
    if chaos(draw, 19):
        d.put(draw(st.sampled_from(["attempt", "delay", "max_attempts"])), 1, "retry.")
    kw = d.kwargs
    delay, cap = kw.get("delay_ms", 0), kw.get("max_delay_ms")
    if _safe_int(0)(delay) and _safe_int(0)(cap) and cap < delay:
        d.bad.add("retry.max_delay_ms")
    return (lambda: tl.Retry(**kw)), d.bad


@st.composite
def cache_options(draw: st.DrawFn) -> tuple[Any, set[str]]:
    if chaos(draw, 19):
        garbage = draw(SOME_GARBAGE)
        return (lambda: garbage), {"cache"}
    d = Drawn()
    d.put("key", *callback(draw, 1, "cache.key"))
    if draw(st.booleans()):
        d.put("version", *optional(draw, st.text(min_size=1, max_size=5), is_utf8_text, "cache.version",
                                   none_ok=False))
    if draw(st.booleans()):
        d.put("max_age_ms", *optional(draw, st.integers(1, 10**9), _opt_safe_int(1), "cache.max_age_ms"))
    if draw(st.booleans()):
        d.put("mode", *optional(draw, st.sampled_from(["reuse", "refresh"]), lambda v: v in ("reuse", "refresh"),
                                "cache.mode", none_ok=False))
    if chaos(draw, 19):
        d.put("store", draw(SOME_GARBAGE), "cache.store")
    kw = d.kwargs
    return (lambda: tl.Cache(**kw)), d.bad


@st.composite
def budget_options(draw: st.DrawFn) -> tuple[Any, set[str]]:
    choice = draw(st.integers(0, 9))
    if choice <= 3:
        return (lambda: None), set()
    if choice == 4 and _chaos[0]:
        garbage = draw(SOME_GARBAGE)
        return (lambda: garbage), {"budget"}
    d = Drawn()
    for name in ("attempts", "input_tokens", "output_tokens"):
        if draw(st.booleans()):
            d.put(name, *optional(draw, st.integers(1, 10**6), _opt_safe_int(1), f"budget.{name}"))
    if chaos(draw, 19):
        d.put("tokens", 1, "budget.tokens")
    kw = d.kwargs
    return (lambda: tl.Budget(**kw)), d.bad


@dataclass
class TaskSpec:
    kind: str
    key: str
    kwargs: dict[str, Any]
    bad: set[str]
    options: dict[str, Callable[[], Any]]  # built when the task is defined (their errors count)

    def define(self, after: Any) -> tl.Task:
        kwargs = {**self.kwargs, **{name: build() for name, build in self.options.items()}}
        if after is not None:
            kwargs["after"] = after
        if self.kind == "task":
            return tl.define_task(self.key, **kwargs)
        if self.kind == "loop":
            return tl.define_loop_task(self.key, **kwargs)
        return tl.define_gate(self.key, **kwargs)


@st.composite
def task_specs(draw: st.DrawFn) -> TaskSpec:
    kind = draw(st.sampled_from(["task", "loop", "gate"]))
    key = draw(names() if _chaos[0] else valid_names())
    d = Drawn()
    options: dict[str, Callable[[], Any]] = {}
    if not SPEC_NAME.match(key):
        d.bad.add("key")

    def option(name: str, strategy: st.SearchStrategy[tuple[Any, set[str]]]) -> None:
        build, bad = draw(strategy)
        options[name] = build
        d.bad.update(bad)

    if kind == "gate":
        d.put("kind", *optional(draw, st.sampled_from(["approval", "pause", "input"]),
                                lambda v: v in ("approval", "pause", "input"), "kind", none_ok=False))
        d.put("prompt", *optional(draw, st.text(min_size=1, max_size=20), is_utf8_text, "prompt", none_ok=False))
        actors = draw(st.one_of(st.lists(hostile_text(max_size=4), max_size=3), GARBAGE) if chaos(draw, 9)
                      else st.lists(st.text(min_size=1, max_size=6), max_size=3))
        items = _items(actors)
        ok = items is not None and all(is_utf8_text(a) for a in items)
        d.put("actors", actors, None if ok else "actors")
        for name in ("condition", "retry", "timeout_ms", "cache"):
            if chaos(draw, 40):
                d.put(name, draw(SOME_GARBAGE), "gates cannot use")
        return TaskSpec(kind, key, d.kwargs, d.bad, options)
    if kind == "task":
        d.put("run", *callback(draw, 1, "run"))
        if draw(st.booleans()):
            option("retry", retry_options())
    else:
        d.put("max_rounds", *optional(draw, st.one_of(st.integers(1, 20), st.just(MAX_SAFE_INT)), _safe_int(1),
                                      "max_rounds", none_ok=False))
        d.put("attempt", *callback(draw, 2, "attempt"))
        d.put("check", *callback(draw, 2, "check"))
        if chaos(draw, 19):
            d.put("retry", draw(SOME_GARBAGE), "retry")
    if draw(st.booleans()):
        fn, bad = callback(draw, 1, "condition")
        d.put("condition", fn, bad)
    if draw(st.booleans()):
        d.put("timeout_ms", *optional(draw, st.integers(1, MAX_TIMEOUT_MS), _opt_safe_int(1, MAX_TIMEOUT_MS),
                                      "timeout_ms"))
    if draw(st.booleans()):
        option("cache", cache_options())
    if draw(st.booleans()):
        d.put("queue", *optional(draw, valid_names(), lambda v: v is None or is_utf8_text(v), "queue"))
    return TaskSpec(kind, key, d.kwargs, d.bad, options)


def _items(value: Any) -> tuple[Any, ...] | None:
    """The items of an iterable that is not a string (what a list argument may be), else None."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        return tuple(value)
    except TypeError:
        return None


def _fresh_name(drawn: str) -> str:
    """A valid workflow name of the fuzz namespace (never one another test registered)."""
    return f"fuzz.{next(_serial)}.{drawn}"


def define_or_error(build: Callable[[], Any]) -> Any:
    """Call ``build``; return the Workflow or the DefinitionError. Any other exception fails the test
    (it propagates), as does anything else returned."""
    try:
        made = build()
    except DefinitionError as exc:
        message = str(exc)
        assert message.strip(), "a DefinitionError with an empty message"
        return exc
    return made


def _unregister(made: Any) -> None:
    if isinstance(made, tl.Workflow):
        REGISTRY.unregister(made.name, made.version)


def _assert_outcome(made: Any, bad: set[str]) -> None:
    event("workflow" if isinstance(made, tl.Workflow) else "DefinitionError")
    if bad:
        assert isinstance(made, DefinitionError), f"accepted a definition with wrong {sorted(bad)}: {made!r}"
        message = str(made)
        assert any(word in message for word in bad), f"the error names none of {sorted(bad)}: {message}"
    else:
        assert isinstance(made, tl.Workflow), f"refused a valid definition: {made}"


def _check_workflow(wf: tl.Workflow) -> None:
    """A Workflow's order is topological, its roots are the tasks without dependencies, and it is
    registered under its name and version."""
    position = {key: i for i, key in enumerate(wf.order)}
    assert sorted(position) == sorted(t.key for t in wf.tasks)
    for task in wf.tasks:
        assert all(position[dep] < position[task.key] for dep in task.after)
        for dep in task.after:
            assert task.key in wf.dependents[dep]
    assert set(wf.roots) == {t.key for t in wf.tasks if not t.after}
    assert REGISTRY.get(wf.name, wf.version) is wf
    assert len(wf.fingerprint) == 32


def _mostly(valid: st.SearchStrategy[Any], odds: int = 9) -> st.SearchStrategy[Any]:
    """``valid``, or in a chaotic example one time in ``odds`` + 1, garbage."""
    if not _chaos[0]:
        return valid
    return st.integers(0, odds).flatmap(lambda n: valid if n else GARBAGE)


@given(chaotic=st.booleans(), edges=st.data())
@fuzz(ci=300, long=10_000)
def test_definitions_are_a_workflow_or_a_definition_error_naming_the_field(chaotic: bool, edges: st.DataObject) -> None:
    _chaos[0] = chaotic
    specs = edges.draw(st.lists(task_specs(), min_size=0 if chaotic else 1, max_size=5), "tasks")
    name = edges.draw(names() if chaotic else valid_names(), "workflow name")
    version = edges.draw(_mostly(st.text(min_size=1, max_size=8)), "version")
    budget = edges.draw(budget_options(), "budget")
    flags = edges.draw(st.tuples(_mostly(st.booleans(), 19), _mostly(st.booleans(), 19)), "flags")
    observers = edges.draw(_mostly(st.lists(st.sampled_from([print, len]), max_size=2)), "observers")
    tasks_garbage = edges.draw(st.integers(0, 39)) if chaotic else 99
    bad: set[str] = set()
    # tasks first (each define_* call is a property of its own) ...
    tasks: list[Any] = []
    for i, spec in enumerate(specs):
        earlier = [t.key for t in tasks if t.key != spec.key]
        after: Any = edges.draw(st.lists(st.sampled_from(earlier), unique=True, max_size=3)) if earlier else None
        mutation = edges.draw(st.integers(0, 29)) if chaotic else 99
        if mutation == 0:  # not a list at all
            after = edges.draw(NOT_ITERABLE)
            spec.bad.add("after")
        elif mutation == 1:  # a list holding something that is neither a task nor a key
            after = [*(after or []), edges.draw(GARBAGE.filter(lambda v: not isinstance(v, str)))]
            spec.bad.add("after")
        made = define_or_error(lambda spec=spec, after=after: spec.define(after))
        if spec.bad:
            assert isinstance(made, DefinitionError), f"task {i} accepted with wrong {sorted(spec.bad)}: {made!r}"
            assert any(word in str(made) for word in spec.bad), f"names none of {sorted(spec.bad)}: {made}"
            continue
        assert isinstance(made, tl.Task), f"a valid task was refused: {made}"
        tasks.append(made)
    # ... then the workflow around the tasks that were defined
    keys = [t.key for t in tasks]
    if len(set(keys)) != len(keys):
        bad.add("duplicate task key")
    workflow_name = _fresh_name(name) if SPEC_NAME.match(name) else name
    if not SPEC_NAME.match(name):
        bad.add("workflow name")
    if name_rules.version_problem(version) is not None:  # 1-200 printable characters (base/names.py)
        bad.add("version")
    tasks_arg: Any = tasks
    if tasks_garbage == 0:
        tasks_arg = edges.draw(GARBAGE)
        bad.add("tasks")
    elif tasks_garbage == 1:
        tasks_arg = [*tasks, edges.draw(GARBAGE)]
        bad.add("tasks")
    elif not tasks:
        bad.add("tasks")
    build_budget, budget_bad = budget
    bad.update(budget_bad)
    for flag, value in zip(("stop_on_error", "delete_on_success"), flags, strict=True):
        if type(value) is not bool:
            bad.add(flag)
    observer_items = _items(observers)
    if observer_items is None or not all(callable(o) for o in observer_items):
        bad.add("observers")

    def build() -> tl.Workflow:
        return tl.define_workflow(workflow_name, version=version, tasks=tasks_arg, budget=build_budget(),
                                  stop_on_error=flags[0], delete_on_success=flags[1], observers=observers)

    made = define_or_error(build)
    try:
        _assert_outcome(made, bad)
        if isinstance(made, tl.Workflow):
            _check_workflow(made)
    finally:
        _unregister(made)


def _run(ctx: Any) -> int:
    return 1


def _cycle_is_real(message: str, graph: dict[str, list[str]]) -> bool:
    """``... a dependency cycle: a -> b -> a; ...``: every link is an after-edge of the graph (a long
    cycle is shown by its ends, around ``... (N more) ...``)."""
    chain = message.split("dependency cycle: ", 1)[1].split(";", 1)[0].split(" -> ")
    return chain[0] == chain[-1] and all(b in graph.get(a, []) for a, b in itertools.pairwise(chain)
                                         if not a.startswith("... (") and not b.startswith("... ("))


@given(
    keys=st.lists(valid_names(6), min_size=1, max_size=7, unique=True),
    data=st.data(),
)
@fuzz(ci=300, long=10_000)
def test_after_edges_cycles_and_unknown_references(keys: list[str], data: st.DataObject) -> None:
    """Arbitrary after-edges: unknown keys, self references, repeats and cycles are refused with the
    message the SPEC gives; an acyclic graph becomes a workflow in topological order."""
    pool = st.one_of(st.sampled_from(keys), valid_names(4))
    graph = {key: data.draw(st.lists(pool, max_size=4)) for key in keys}
    tasks: list[tl.Task] = []
    for key in keys:
        after = graph[key]
        made = define_or_error(lambda key=key, after=after: tl.define_task(key, _run, after=after))
        if key in after:
            assert isinstance(made, DefinitionError) and "cannot run after itself" in str(made)
            return
        if len(set(after)) != len(after):
            assert isinstance(made, DefinitionError) and "lists a task twice" in str(made)
            return
        assert isinstance(made, tl.Task)
        tasks.append(made)
    made = define_or_error(lambda: tl.define_workflow(_fresh_name("edges"), version="1", tasks=tasks))
    event("workflow" if isinstance(made, tl.Workflow) else next(
        (label for label in ("not a task of this workflow", "dependency cycle") if label in str(made)), str(made)))
    try:
        unknown = sorted({dep for deps in graph.values() for dep in deps if dep not in graph})
        if unknown:
            assert isinstance(made, DefinitionError)
            assert "which is not a task of this workflow" in str(made)
            assert any(repr(dep) in str(made) for dep in unknown)
        elif _has_cycle(graph):
            assert isinstance(made, DefinitionError) and "dependency cycle" in str(made), made
            assert _cycle_is_real(str(made), graph), made
        else:
            assert isinstance(made, tl.Workflow), made
            _check_workflow(made)
    finally:
        _unregister(made)


def _has_cycle(graph: dict[str, list[str]]) -> bool:
    remaining = {key: set(deps) for key, deps in graph.items()}
    while remaining:
        free = [key for key, deps in remaining.items() if not deps & remaining.keys()]
        if not free:
            return True
        for key in free:
            del remaining[key]
    return False


# --- graph workflows ----------------------------------------------------------------------------


def _apply(run: Any, event: Any) -> tl.Transition:
    return tl.Transition(state=None)


SCHEMAS = st.one_of(
    st.none(),
    st.just({"type": "object"}),
    st.just({"type": "object", "properties": {"n": {"type": "integer"}}}),
    st.just({"type": "objekt"}),  # not a valid schema
    st.just({"type": 5}),
    st.just({"type": "object", "x": {1, 2}}),  # not JSON
    st.just({"type": "object", "minimum": float("nan")}),
    st.just({"\ud800": 1}),
    st.just({5: "integer"}),
    GARBAGE,
)


def _schema_ok(schema: Any) -> bool:
    """None, or a dict of lossless JSON that is a valid JSON Schema (jsonschema's own check)."""
    if schema is None:
        return True
    if not isinstance(schema, dict) or not is_lossless(schema):
        return False
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError:
        return False
    return True


def _matches(schema: Any, value: Any) -> bool:
    return schema is None or not _schema_ok(schema) or jsonschema.validators.validator_for(schema)(schema).is_valid(
        value)


@st.composite
def steps(draw: st.DrawFn) -> tuple[Callable[[], Any], set[str]]:
    kind = draw(st.sampled_from(["run", "loop", "gate", "none", "two"] if _chaos[0] else ["run", "loop", "gate"]))
    d = Drawn()
    if kind == "run":
        d.put("run", *callback(draw, 1, "run"))
    if kind == "loop":
        d.put("attempt", *callback(draw, 2, "attempt"))
        d.put("check", *callback(draw, 2, "check"))
        d.put("max_rounds", *optional(draw, st.integers(1, 9), _safe_int(1), "max_rounds", none_ok=False))
    if kind == "two":  # a run and a loop at once: refused whatever else is right
        d.kwargs.update(run=_run, attempt=lambda ctx, feedback: 0, check=lambda ctx, candidate: 0, max_rounds=2)
    if kind == "gate":
        d.put("gate", *optional(draw, st.sampled_from(["approval", "pause", "input"]),
                                lambda v: v in ("approval", "pause", "input"), "gate", none_ok=False))
        d.put("prompt", *optional(draw, st.text(min_size=1, max_size=9), is_utf8_text, "prompt", none_ok=False))
    if kind in ("none", "two"):
        d.bad.add("tl.step needs exactly one of")
    if kind != "gate" and draw(st.booleans()):
        d.put("timeout_ms", *optional(draw, st.integers(1, MAX_TIMEOUT_MS), _opt_safe_int(1, MAX_TIMEOUT_MS),
                                      "timeout_ms"))
    if draw(st.booleans()):
        schema = draw(SCHEMAS if _chaos[0] else st.sampled_from([None, {"type": "object"}]))
        if kind == "gate" and schema is not None:
            d.bad.add("gates cannot use")
        d.put("output_schema", schema, None if _schema_ok(schema) else "output_schema")
    kw = d.kwargs
    return (lambda: tl.step(**kw)), d.bad


@given(chaotic=st.booleans(), data=st.data())
@fuzz(ci=300, long=10_000)
def test_graph_workflows_are_a_workflow_or_a_definition_error(chaotic: bool, data: st.DataObject) -> None:
    _chaos[0] = chaotic
    step_names = data.draw(st.lists(names() if chaotic else valid_names(), min_size=0 if chaotic else 1,
                                    max_size=4), "step names")
    step_specs = data.draw(st.lists(steps(), min_size=4, max_size=4), "steps")
    name = data.draw(names() if chaotic else valid_names(), "workflow name")
    version = data.draw(_mostly(st.text(min_size=1, max_size=5)), "version")
    bad: set[str] = set()
    built: dict[str, Any] = {}
    for step_name, (build, step_bad) in zip(step_names, step_specs, strict=False):
        made = define_or_error(build)
        if step_bad:
            assert isinstance(made, DefinitionError), f"tl.step accepted with wrong {sorted(step_bad)}: {made!r}"
            assert any(word in str(made) for word in step_bad), f"names none of {sorted(step_bad)}: {made}"
            continue
        assert isinstance(made, Step), made
        if step_name in built:
            continue  # a mapping holds each name once
        built[step_name] = made
        if not SPEC_NAME.match(step_name):
            bad.add("step name")
    if not built:
        bad.add("steps")
    known = list(built) or ["x"]
    entry = data.draw(_mostly(st.sampled_from(known), 3))
    if not (isinstance(entry, str) and entry in built):
        bad.add("entry")
    good_pairs = st.lists(st.tuples(st.sampled_from(known), st.sampled_from(known)), max_size=4)
    transitions = data.draw(st.one_of(
        good_pairs,
        st.lists(st.tuples(st.one_of(st.sampled_from(known), names()), st.sampled_from(known)), max_size=3),
        st.lists(GARBAGE, min_size=1, max_size=2), GARBAGE) if chaotic else good_pairs)
    if not _transitions_ok(transitions, built):
        bad.add("transition")
    handler_kind = data.draw(st.integers(0, 9)) if chaotic else 9
    handler: Any
    if handler_kind == 0:
        handler = data.draw(GARBAGE)
        bad.add("handler")
    else:
        handler_id = data.draw(names() if chaotic else valid_names())
        handler_version = data.draw(_mostly(st.text(min_size=1, max_size=4)))
        handler_fn = data.draw(st.sampled_from(CALLBACKS if chaotic else [c for c in CALLBACKS if accepts(c, 2)]))
        made = define_or_error(lambda: tl.TransitionHandler(handler_id, handler_version, handler_fn[0]))
        handler_bad = set()
        if not SPEC_NAME.match(handler_id):
            handler_bad.add("transition handler id")
        if name_rules.version_problem(handler_version) is not None:
            handler_bad.add("version")
        if not accepts(handler_fn, 2):
            handler_bad.add("apply")
        if handler_bad:
            assert isinstance(made, DefinitionError) and any(w in str(made) for w in handler_bad), made
            return
        assert isinstance(made, tl.TransitionHandler), made
        handler = made
    state_schema = data.draw(SCHEMAS if chaotic else st.sampled_from([None, {"type": "object"}]))
    if not _schema_ok(state_schema):
        bad.add("state_schema")
    initial_state = data.draw(st.one_of(st.none(), st.just({}), st.just({"n": 1}), jsonish(max_leaves=4))
                              if chaotic else st.sampled_from([{}, {"n": 1}]))
    if not is_lossless(initial_state) or not _matches(state_schema, initial_state):
        bad.add("initial_state")
    max_transitions = data.draw(_mostly(st.integers(1, 1000), 4))
    if type(max_transitions) is not int or max_transitions < 1:
        bad.add("max_transitions")
    if not SPEC_NAME.match(name):
        bad.add("workflow name")
    if name_rules.version_problem(version) is not None:  # 1-200 printable characters (base/names.py)
        bad.add("version")
    workflow_name = _fresh_name(name) if SPEC_NAME.match(name) else name

    def build() -> tl.Workflow:
        return tl.define_graph_workflow(
            workflow_name, version=version, entry=entry, steps=built, transitions=transitions, handler=handler,
            initial_state=initial_state, state_schema=state_schema, max_transitions=max_transitions)

    made = define_or_error(build)
    event("graph workflow" if isinstance(made, tl.Workflow) else "DefinitionError")
    try:
        if bad:
            assert isinstance(made, DefinitionError), f"accepted with wrong {sorted(bad)}: {made!r}"
            assert any(word in str(made) for word in bad), f"names none of {sorted(bad)}: {made}"
        else:
            assert isinstance(made, tl.Workflow) and made.graph is not None
            assert made.graph.entry == entry and REGISTRY.get(made.name, made.version) is made
    finally:
        _unregister(made)


def _transitions_ok(transitions: Any, steps: dict[str, Any]) -> bool:
    pairs = _items(transitions)
    return pairs is not None and all(isinstance(pair, (list, tuple)) and len(pair) == 2 and all(
        isinstance(end, str) and end in steps for end in pair) for pair in pairs)


# --- regressions (found by the fuzzer) ----------------------------------------------------------

def _loop(**kwargs: Any) -> tl.Task:
    return tl.define_loop_task("fix", **{"max_rounds": 2, "attempt": lambda ctx, feedback: 0,
                                         "check": lambda ctx, candidate: 0, **kwargs})


@pytest.mark.parametrize("build, message", [
    # arguments that are not lists raised TypeError ('int' object is not iterable)
    (lambda: tl.define_task("a", _run, after=5), "task a: after must be a list of tasks, got 5"),
    (lambda: tl.define_task("a", _run, after=[None]), "task a: after must list tasks or task keys, got None"),
    (lambda: tl.define_gate("g", prompt="p", actors=5), "gate g: actors must be a list of names"),
    (lambda: tl.define_workflow("w", version="1", tasks=5), "workflow w: tasks must be a non-empty list of tasks"),
    (lambda: tl.define_workflow("w", version="1", tasks=[tl.define_task("a", _run)], observers=5),
     "workflow w: observers must be a list of callables"),
    # an int past Python's 4300-digit limit in a message raised ValueError from repr()
    (lambda: _loop(max_rounds=10**5000), "max_rounds must be a positive safe integer (1 .. 2**53-1), got <an int of"),
    (lambda: tl.Retry(attempts=-(10**4400)), "retry.attempts must be a positive safe integer, got <an int of"),
    (lambda: tl.define_workflow("w", version=10**5000, tasks=[tl.define_task("a", _run)]),
     "version must be a non-empty string, e.g. version='1', got <an int of"),
    # a lone surrogate (not UTF-8) made the fingerprint fail with UnicodeEncodeError
    (lambda: tl.define_workflow("w", version="\ud800", tasks=[tl.define_task("a", _run)]),
     "version must be a non-empty string, e.g. version='1', got a string that contains the lone surrogate"),
    (lambda: tl.define_gate("g", prompt="p", actors=["al\udcffce"]), "actors must be non-empty strings, got a string"),
    (lambda: tl.define_gate("g", prompt="\ud800"), "prompt must be a non-empty string, got a string that contains"),
    (lambda: tl.define_task("a", _run, queue="q\ud800"), "queue must be a non-empty queue name, got a string"),
    (lambda: tl.Cache(_run, version="\udfff"), "cache.version must be a non-empty string, got a string that"),
    (lambda: tl.LoopCheck(done=False, feedback="\ud800"), "with a feedback string, got a feedback string that"),
])
def test_wrong_definitions_are_definition_errors(build: Callable[[], Any], message: str) -> None:
    with pytest.raises((DefinitionError, InvalidCheckResult)) as info:
        build()
    assert message in str(info.value)


def _graph(**changes: Any) -> tl.Workflow:
    kwargs: dict[str, Any] = {"version": "1", "entry": "a", "steps": {"a": tl.step(_run)}, "transitions": [],
                              "handler": tl.TransitionHandler("h", "1", _apply), **changes}
    return tl.define_graph_workflow(_fresh_name("graph"), **kwargs)


@pytest.mark.parametrize("changes, message", [
    ({"entry": ["a"]}, "entry ['a'] is not one of its steps"),  # TypeError: unhashable type
    ({"transitions": [(["a"], "a")]}, "names ['a'], which is not a step"),
    ({"transitions": 5}, "transitions must be a list of (from, to) step pairs, got 5"),
    ({"observers": 5}, "observers must be a list of callables"),
    ({"state_schema": 5}, "state_schema must be a JSON Schema (a dict), got 5"),  # TypeError from dict(5)
    ({"state_schema": {"type": "object", "x": {1, 2}}}, "state_schema must be a JSON Schema made of lossless JSON"),
    ({"state_schema": {"\ud800": 1}}, "state_schema must be a JSON Schema made of lossless JSON"),
    ({"handler": None}, "handler must be a tl.TransitionHandler"),
])
def test_wrong_graph_definitions_are_definition_errors(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(DefinitionError) as info:
        _graph(**changes)
    assert message in str(info.value)


def test_a_transition_handler_version_with_a_lone_surrogate_is_a_definition_error() -> None:
    with pytest.raises(DefinitionError, match="version must be a non-empty string"):
        tl.TransitionHandler("h", "\ud800", _apply)
    with pytest.raises(DefinitionError, match="output_schema must be a JSON Schema"):
        tl.step(_run, output_schema=[1])

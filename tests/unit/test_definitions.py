"""Definition-time validation (SPEC section 2) and LoopCheck coercion (SPEC section 3, point 3)."""

from __future__ import annotations

import re
from typing import Any

import pytest

import taskloop as tl
from taskloop.base.errors import DefinitionError, InvalidCheckResult, TaskLoopError
from taskloop.define.options import MAX_SAFE_INT, MAX_TIMEOUT_MS, LoopCheck
from taskloop.define.tasks import TaskKind
from taskloop.define.workflow import REGISTRY

NAME_RULE = re.escape("must match [A-Za-z0-9][A-Za-z0-9._-]*")
MAX_ROUNDS_MSG = "max_rounds must be a positive safe integer"
LOOP_CALLBACKS_MSG = "define_loop_task requires attempt and check callbacks"
GATE_MSG = re.escape("gates cannot use conditions, retries, timeouts or caches")
CHECK_MSG = re.escape("loop check must return done=True or done=False with a feedback string")


def run(ctx: Any) -> int:
    return 1


def attempt(ctx: Any, feedback: str | None) -> int:
    return 1


def check(ctx: Any, candidate: Any) -> LoopCheck:
    return LoopCheck(done=True)


def loop(key: str = "fix", **kwargs: Any) -> tl.Task:
    kwargs.setdefault("max_rounds", 3)
    kwargs.setdefault("attempt", attempt)
    kwargs.setdefault("check", check)
    return tl.define_loop_task(key, **kwargs)


INVALID_NAMES = [
    "",
    "-a",
    ".a",
    "_a",
    " a",
    "a b",
    "a/b",
    "a:b",
    "a$",
    "a\n",
    "é",
    "fix\u00e9",
    None,
    1,
    b"abc",
]
VALID_NAMES = ["a", "A", "0", "a1", "fix.v2", "a_b-c", "9-lives", "x" * 200]


# --- DefinitionError -----------------------------------------------------------------------


def test_definition_error_is_a_value_error() -> None:
    assert issubclass(DefinitionError, ValueError)
    assert issubclass(DefinitionError, TaskLoopError)
    assert tl.DefinitionError is DefinitionError
    with pytest.raises(ValueError, match=NAME_RULE):
        tl.define_task("bad key", run=run)


# --- keys and workflow names ---------------------------------------------------------------


@pytest.mark.parametrize("key", INVALID_NAMES, ids=repr)
@pytest.mark.parametrize(
    "define",
    [
        lambda key: tl.define_task(key, run=run),
        lambda key: loop(key),
        lambda key: tl.define_gate(key, prompt="ok?"),
    ],
    ids=["task", "loop", "gate"],
)
def test_invalid_task_keys_are_refused(define: Any, key: object) -> None:
    with pytest.raises(DefinitionError, match=NAME_RULE) as info:
        define(key)
    assert "task key" in str(info.value)


@pytest.mark.parametrize("key", VALID_NAMES)
def test_valid_task_keys_are_accepted(key: str) -> None:
    assert tl.define_task(key, run=run).key == key
    assert loop(key).key == key
    assert tl.define_gate(key, prompt="ok?").key == key


@pytest.mark.parametrize("name", INVALID_NAMES, ids=repr)
def test_invalid_workflow_names_are_refused(name: object) -> None:
    with pytest.raises(DefinitionError, match=NAME_RULE) as info:
        tl.define_workflow(name, version="1", tasks=[tl.define_task("a", run=run)])  # type: ignore[arg-type]
    assert "workflow name" in str(info.value)


@pytest.mark.parametrize("name", VALID_NAMES)
def test_valid_workflow_names_are_accepted(name: str) -> None:
    workflow = tl.define_workflow(name, version="unit", tasks=[tl.define_task("a", run=run)])
    assert workflow.name == name


def test_duplicate_keys_are_refused() -> None:
    with pytest.raises(DefinitionError, match="duplicate task key 'a'") as info:
        tl.define_workflow(
            "unit-dup", version="1", tasks=[tl.define_task("a", run=run), loop("a")]
        )
    assert "unique within a workflow" in str(info.value)


# --- max_rounds ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_rounds",
    [True, False, 0, -1, 1.5, 1.0, float("inf"), float("nan"), 2**53, 2**64, "3", None],
    ids=repr,
)
def test_max_rounds_must_be_a_positive_safe_integer(max_rounds: object) -> None:
    with pytest.raises(DefinitionError, match=MAX_ROUNDS_MSG):
        loop(max_rounds=max_rounds)


@pytest.mark.parametrize("max_rounds", [1, 2, 3, 2**53 - 1])
def test_max_rounds_accepts_safe_integers(max_rounds: int) -> None:
    task = loop(max_rounds=max_rounds)
    assert task.max_rounds == max_rounds
    assert task.kind is TaskKind.LOOP
    assert task.is_loop and not task.is_gate
    assert MAX_SAFE_INT == 2**53 - 1


# --- callbacks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "callbacks",
    [
        {"attempt": None},
        {"check": None},
        {"attempt": None, "check": None},
        {"attempt": "write"},
        {"check": 42},
        {"attempt": attempt, "check": object()},
    ],
    ids=["no-attempt", "no-check", "neither", "attempt-str", "check-int", "check-object"],
)
def test_loop_task_requires_callable_attempt_and_check(callbacks: dict[str, Any]) -> None:
    with pytest.raises(DefinitionError, match=LOOP_CALLBACKS_MSG):
        loop(**callbacks)


def test_loop_task_without_callback_arguments_is_refused() -> None:
    with pytest.raises(tl.DefinitionError, match="define_loop_task requires attempt and check callbacks"):
        tl.define_loop_task("fix", max_rounds=3)


async def _async_attempt(ctx: Any, feedback: str | None) -> int:
    return 1


@pytest.mark.parametrize(
    "attempt_cb", [attempt, lambda ctx, feedback: 1, _async_attempt], ids=["def", "lambda", "async"]
)
def test_loop_task_accepts_functions_lambdas_and_coroutines(attempt_cb: Any) -> None:
    task = loop(attempt=attempt_cb)
    assert task.attempt is attempt_cb
    assert task.check is check


@pytest.mark.parametrize("bad_run", [None, "run", 3])
def test_plain_task_requires_a_callable_run(bad_run: object) -> None:
    with pytest.raises(DefinitionError, match="run must be callable"):
        tl.define_task("a", run=bad_run)  # type: ignore[arg-type]


def test_condition_must_be_callable() -> None:
    with pytest.raises(DefinitionError, match="condition must be a callable"):
        tl.define_task("a", run=run, condition=True)  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match="condition must be a callable"):
        loop(condition="yes")


# --- timeout_ms ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "timeout_ms",
    [0, -1, MAX_TIMEOUT_MS + 1, True, False, 1.0, 1.5, float("inf"), "1000"],
    ids=repr,
)
@pytest.mark.parametrize(
    "define",
    [lambda t: tl.define_task("a", run=run, timeout_ms=t), lambda t: loop(timeout_ms=t)],
    ids=["task", "loop"],
)
def test_timeout_ms_out_of_range_is_refused(define: Any, timeout_ms: object) -> None:
    with pytest.raises(DefinitionError, match=r"timeout_ms must be an integer from 1 to 2147483647"):
        define(timeout_ms)


@pytest.mark.parametrize("timeout_ms", [None, 1, 1000, MAX_TIMEOUT_MS])
def test_timeout_ms_in_range_is_accepted(timeout_ms: int | None) -> None:
    assert MAX_TIMEOUT_MS == 2_147_483_647
    assert tl.define_task("a", run=run, timeout_ms=timeout_ms).timeout_ms == timeout_ms
    assert loop(timeout_ms=timeout_ms).timeout_ms == timeout_ms


# --- after and the graph ------------------------------------------------------------------


def test_after_must_name_tasks_of_the_same_workflow() -> None:
    outsider = tl.define_task("outsider", run=run)
    inner = tl.define_task("inner", run=run, after=[outsider])
    with pytest.raises(DefinitionError, match="runs after 'outsider', which is not a task of this"):
        tl.define_workflow("unit-after", version="1", tasks=[inner])


def test_after_by_unknown_key_string_is_refused() -> None:
    task = tl.define_task("b", run=run, after=["ghost"])
    with pytest.raises(DefinitionError, match="task b runs after 'ghost'"):
        tl.define_workflow("unit-after-str", version="1", tasks=[tl.define_task("a", run=run), task])


def test_after_accepts_tasks_and_keys() -> None:
    a = tl.define_task("a", run=run)
    b = tl.define_task("b", run=run, after=[a])
    c = loop("c", after=["a", b])
    assert b.after == ("a",)
    assert c.after == ("a", "b")
    workflow = tl.define_workflow("unit-after-ok", version="1", tasks=[c, b, a])
    assert workflow.order == ("a", "b", "c")
    assert workflow.dependents == {"a": ("b", "c"), "b": ("c",), "c": ()}


def test_after_must_be_a_list() -> None:
    a = tl.define_task("a", run=run)
    with pytest.raises(DefinitionError, match="after must be a list of tasks"):
        tl.define_task("b", run=run, after=a)  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match="after must be a list of tasks"):
        tl.define_task("b", run=run, after="a")


def test_a_task_cannot_run_after_itself() -> None:
    with pytest.raises(DefinitionError, match="cannot run after itself"):
        tl.define_task("a", run=run, after=["a"])


@pytest.mark.parametrize(
    ("links", "cycle"),
    [
        ({"a": ["b"], "b": ["a"]}, "a -> b -> a"),
        ({"x": ["z"], "y": ["x"], "z": ["y"]}, "x -> z -> y -> x"),
        ({"root": [], "a": ["root", "c"], "b": ["a"], "c": ["b"]}, "a -> c -> b -> a"),
    ],
    ids=["two", "three", "behind-a-root"],
)
def test_cycles_are_refused_and_named(links: dict[str, list[str]], cycle: str) -> None:
    tasks = [tl.define_task(key, run=run, after=after) for key, after in links.items()]
    with pytest.raises(DefinitionError, match="dependency cycle") as info:
        tl.define_workflow("unit-cycle", version="1", tasks=tasks)
    assert cycle in str(info.value)


# --- loop retry and gates -----------------------------------------------------------------


@pytest.mark.parametrize("retry", [tl.Retry(3), 3, {"attempts": 2}], ids=["Retry", "int", "dict"])
def test_loop_task_has_no_retry_option(retry: object) -> None:
    with pytest.raises(DefinitionError, match=re.escape("loop tasks have no retry option")):
        loop(retry=retry)


@pytest.mark.parametrize(
    "option",
    [
        {"condition": lambda ctx: True},
        {"retry": tl.Retry(2)},
        {"timeout_ms": 1000},
        {"cache": tl.Cache(lambda ctx: "k")},
    ],
    ids=["condition", "retry", "timeout", "cache"],
)
def test_gates_refuse_condition_retry_timeout_and_cache(option: dict[str, Any]) -> None:
    with pytest.raises(DefinitionError, match=GATE_MSG):
        tl.define_gate("approve", prompt="Ship it?", **option)


@pytest.mark.parametrize("kind", ["approval", "pause", "input"])
def test_gate_kinds(kind: str) -> None:
    gate = tl.define_gate("approve", kind=kind, prompt="Ship it?", actors=["alice"])
    assert gate.is_gate
    assert gate.gate_kind == kind
    assert gate.actors == ("alice",)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "vote"}, "kind must be one of"),
        ({"prompt": ""}, "prompt must be a non-empty string"),
        ({"actors": "alice"}, "actors must be a list of names"),
        ({"actors": ["alice", ""]}, "actors must be non-empty strings"),
    ],
)
def test_gate_fields_are_validated(kwargs: dict[str, Any], message: str) -> None:
    kwargs.setdefault("prompt", "Ship it?")
    with pytest.raises(DefinitionError, match=message):
        tl.define_gate("approve", **kwargs)


def test_task_options_must_be_option_models() -> None:
    with pytest.raises(DefinitionError, match=re.escape("retry must be a tl.Retry(...)")):
        tl.define_task("a", run=run, retry={"attempts": 3})  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match=re.escape("cache must be a tl.Cache(...)")):
        loop(cache="key")
    with pytest.raises(DefinitionError, match="queue must be a non-empty queue name"):
        tl.define_task("a", run=run, queue="")
    with pytest.raises(DefinitionError, match=re.escape("budget must be a tl.Budget(...)")):
        tl.define_workflow(
            "unit-budget", version="1", tasks=[tl.define_task("a", run=run)], budget={"attempts": 1}
        )


# --- Retry, Cache, Budget -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: tl.Retry(), "retry.attempts must be a positive safe integer"),
        (lambda: tl.Retry(0), "retry.attempts must be a positive safe integer"),
        (lambda: tl.Retry(True), "retry.attempts must be a positive safe integer"),
        (lambda: tl.Retry(2.0), "retry.attempts must be a positive safe integer"),
        (lambda: tl.Retry(2**53), "retry.attempts must be a positive safe integer"),
        (lambda: tl.Retry(3, delay_ms=-1), "retry.delay_ms must be a >= 0 safe integer"),
        (lambda: tl.Retry(3, delay_ms=None), "retry.delay_ms must be a >= 0 safe integer"),
        (lambda: tl.Retry(3, max_delay_ms=-1), "retry.max_delay_ms must be a >= 0 safe integer"),
        (
            lambda: tl.Retry(3, delay_ms=100, max_delay_ms=50),
            re.escape("retry.max_delay_ms (50) must be >= retry.delay_ms (100)"),
        ),
        (lambda: tl.Retry(3, backoff="linear"), "retry.backoff must be one of"),
        (lambda: tl.Retry(3, jitter="half"), "retry.jitter must be one of"),
        (lambda: tl.Retry(3, accepts=1), "retry.accepts must be a callable"),
        (lambda: tl.Retry(3, tries=2), "retry.tries is not an option of retry"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_retry_fields_are_validated(build: Any, message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        build()


def test_valid_retry_and_its_delays() -> None:
    retry = tl.Retry(4, delay_ms=100, max_delay_ms=300, backoff="exponential", jitter="full",
                     accepts=lambda error, attempt: True)
    assert retry.attempts == 4
    # exponential delay = delay_ms * 2**(n-1), n = retry number, capped by max_delay_ms
    assert [retry.delay_before(a) for a in (2, 3, 4, 5)] == [100, 200, 300, 300]
    assert [tl.Retry(3, delay_ms=50).delay_before(a) for a in (2, 3)] == [50, 50]
    assert retry.describe()["accepts"] is True


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: tl.Cache(), "cache.key must be a callable"),
        (lambda: tl.Cache("k"), "cache.key must be a callable"),
        (lambda: tl.Cache(run, version=""), "cache.version must be a non-empty string"),
        (lambda: tl.Cache(run, version=1), "cache.version must be a non-empty string"),
        (lambda: tl.Cache(run, max_age_ms=0), "cache.max_age_ms must be a positive safe integer"),
        (lambda: tl.Cache(run, max_age_ms=1.5), "cache.max_age_ms must be a positive safe integer"),
        (lambda: tl.Cache(run, mode="always"), "cache.mode must be 'reuse' or 'refresh'"),
        (lambda: tl.Cache(run, store=object()), re.escape("cache.store must have read(fingerprint)")),
        (lambda: tl.Cache(run, ttl=5), "cache.ttl is not an option of cache"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_cache_fields_are_validated(build: Any, message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        build()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: tl.Budget(attempts=0), "budget.attempts must be a positive safe integer"),
        (lambda: tl.Budget(attempts=True), "budget.attempts must be a positive safe integer"),
        (lambda: tl.Budget(input_tokens=-5), "budget.input_tokens must be a positive safe integer"),
        (lambda: tl.Budget(output_tokens=1.5), "budget.output_tokens must be a positive safe integer"),
        (lambda: tl.Budget(dollars=3), "budget.dollars is not an option of budget"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_budget_fields_are_validated(build: Any, message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        build()


def test_valid_options_are_frozen_models() -> None:
    budget = tl.Budget(attempts=10, input_tokens=1000)
    assert (budget.attempts, budget.input_tokens, budget.output_tokens) == (10, 1000, None)
    cache = tl.Cache(lambda ctx: ctx.input, version="2", max_age_ms=60_000, mode="refresh")
    assert cache.describe() == {"version": "2", "max_age_ms": 60_000, "mode": "refresh"}
    with pytest.raises(ValueError):
        budget.attempts = 3  # type: ignore[misc]


# --- workflows: registry, fingerprint, mermaid ---------------------------------------------


def test_workflow_fields_are_validated() -> None:
    a = tl.define_task("a", run=run)
    with pytest.raises(DefinitionError, match="version must be a non-empty string"):
        tl.define_workflow("unit-wf", version="", tasks=[a])
    with pytest.raises(DefinitionError, match="tasks must be a non-empty list"):
        tl.define_workflow("unit-wf", version="1", tasks=[])
    with pytest.raises(DefinitionError, match="tasks must be made with define_task"):
        tl.define_workflow("unit-wf", version="1", tasks=[run])  # type: ignore[list-item]
    with pytest.raises(DefinitionError, match="stop_on_error must be True or False"):
        tl.define_workflow("unit-wf", version="1", tasks=[a], stop_on_error=1)  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match="observers must be callables"):
        tl.define_workflow("unit-wf", version="1", tasks=[a], observers=[1])  # type: ignore[list-item]


def test_define_workflow_registers_by_name_and_version() -> None:
    v1 = tl.define_workflow("unit-registry", version="1", tasks=[tl.define_task("a", run=run)])
    v2 = tl.define_workflow("unit-registry", version="2", tasks=[loop("a")])
    assert REGISTRY.get("unit-registry", "1") is v1
    assert REGISTRY.get("unit-registry", "2") is v2
    assert ("unit-registry", "1") in REGISTRY.names()
    assert ("unit-registry", "2") in REGISTRY.names()
    with pytest.raises(LookupError, match="versions \\['1', '2'\\] are"):
        REGISTRY.get("unit-registry", "3")
    with pytest.raises(LookupError, match="several versions"):
        REGISTRY.get("unit-registry")
    with pytest.raises(LookupError, match="not registered"):
        REGISTRY.get("unit-never-defined")


def _fix_workflow(max_rounds: int, name: str = "unit-fp") -> tl.Workflow:
    source = tl.define_task("source", run=run)
    fix = loop("fix", max_rounds=max_rounds, after=[source])
    return tl.define_workflow(name, version="1", tasks=[source, fix])


def test_fingerprint_is_stable_and_changes_with_max_rounds() -> None:
    first = _fix_workflow(3)
    again = _fix_workflow(3)  # the same definition again (a module imported twice): accepted
    changed = _fix_workflow(4, name="unit-fp-4")
    assert re.fullmatch(r"[0-9a-f]{32}", first.fingerprint)
    assert first.fingerprint == again.fingerprint
    assert changed.fingerprint != first.fingerprint
    assert REGISTRY.get("unit-fp", "1") is again


def test_another_definition_under_a_registered_name_and_version_is_refused() -> None:
    _fix_workflow(3, name="unit-redefined")
    with pytest.raises(DefinitionError, match=r"workflow unit-redefined version '1' is already registered with "
                                              r"another definition .*give the changed workflow a new version"):
        _fix_workflow(4, name="unit-redefined")
    assert REGISTRY.get("unit-redefined", "1").task("fix").max_rounds == 3  # the first one stays


def test_fingerprint_changes_with_the_graph() -> None:
    a = tl.define_task("a", run=run)
    b_after = tl.define_task("b", run=run, after=[a])
    b_free = tl.define_task("b", run=run)
    linked = tl.define_workflow("unit-fp-graph", version="1", tasks=[a, b_after])
    free = tl.define_workflow("unit-fp-graph", version="2", tasks=[a, b_free])
    assert linked.fingerprint != free.fingerprint


def test_workflow_task_lookup() -> None:
    workflow = _fix_workflow(3, name="unit-lookup")
    assert workflow.task("fix").max_rounds == 3
    with pytest.raises(DefinitionError, match="has no task 'nope'"):
        workflow.task("nope")


def test_mermaid() -> None:
    source = tl.define_task("source", run=run)
    fix = loop("fix", max_rounds=3, after=[source])
    gate = tl.define_gate("approve", kind="pause", prompt="Ship it?", after=[fix])
    publish = tl.define_task("publish", run=run, after=[gate, source])
    workflow = tl.define_workflow("unit-mermaid", version="1", tasks=[publish, gate, fix, source])
    assert workflow.mermaid() == "\n".join(
        [
            "flowchart TD",
            '    source["source"]',
            '    fix(["fix (loop, max 3 rounds)"])',
            "    source --> fix",
            '    approve{"approve (pause gate)"}',
            "    fix --> approve",
            '    publish["publish"]',
            "    approve --> publish",
            "    source --> publish",
        ]
    )


# --- LoopCheck ----------------------------------------------------------------------------


def test_loop_check_coerce_keeps_loop_checks() -> None:
    accepted = LoopCheck(done=True)
    rejected = LoopCheck(done=False, feedback="Try again")
    assert LoopCheck.coerce(accepted) is accepted
    assert LoopCheck.coerce(rejected) is rejected
    assert tl.LoopCheck is LoopCheck


@pytest.mark.parametrize(
    ("value", "done", "feedback"),
    [
        ({"done": True}, True, None),
        ({"done": True, "feedback": None}, True, None),
        ({"done": True, "feedback": "great"}, True, "great"),
        ({"done": False, "feedback": "x"}, False, "x"),
        ({"done": False, "feedback": ""}, False, ""),
    ],
)
def test_loop_check_coerce_accepts_dicts(value: dict[str, Any], done: bool, feedback: str) -> None:
    result = LoopCheck.coerce(value)
    assert isinstance(result, LoopCheck)
    assert result.done is done
    assert result.feedback == feedback


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        "done",
        1,
        [True],
        (True, None),
        {},
        {"feedback": "x"},
        {"done": False},
        {"done": False, "feedback": None},
        {"done": False, "feedback": 3},
        {"done": 1},
        {"done": "yes"},
        {"done": None, "feedback": "x"},
        {"done": True, "verdict": "ok"},
    ],
    ids=repr,
)
def test_loop_check_coerce_refuses_other_shapes(value: object) -> None:
    with pytest.raises(InvalidCheckResult, match=CHECK_MSG):
        LoopCheck.coerce(value)


def test_loop_check_coerce_refuses_non_string_feedback_when_done() -> None:
    with pytest.raises(InvalidCheckResult, match=CHECK_MSG):
        LoopCheck.coerce({"done": True, "feedback": 5})


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"done": False}, {"done": 1}, {"done": False, "feedback": ["x"]}],
    ids=repr,
)
def test_loop_check_constructor_refuses_invalid_results(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidCheckResult, match=CHECK_MSG):
        LoopCheck(**kwargs)
    assert issubclass(InvalidCheckResult, ValueError)


# --- callback signatures (checked at definition time) ---------------------------------------------


def one(ctx: object) -> int:
    return 1


def two(ctx: object, other: object) -> int:
    return 2


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: tl.define_task("bad", run=two),
         r"task bad: run must accept \(ctx\), but two\(ctx, other\) does not; define it as def run\(ctx\)"),
        (lambda: tl.define_loop_task("bad", max_rounds=2, attempt=one, check=two),
         r"task bad: attempt must accept \(ctx, feedback\), but one\(ctx\) does not"),
        (lambda: tl.define_loop_task("bad", max_rounds=2, attempt=two, check=lambda ctx: 1),
         r"task bad: check must accept \(ctx, candidate\)"),
        (lambda: tl.define_task("bad", run=one, condition=two), r"task bad: condition must accept \(ctx\)"),
        (lambda: tl.define_task("bad", run=one, cache=tl.Cache(key=two)), r"task bad: cache.key must accept \(ctx\)"),
        (lambda: tl.define_task("bad", run=one, retry=tl.Retry(attempts=2, accepts=one)),
         r"task bad: retry.accepts must accept \(error, attempt\)"),
    ],
)
def test_a_callback_with_the_wrong_parameters_is_refused_at_definition_time(build: Any, message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        build()


def test_callbacks_with_defaults_varargs_and_async_are_accepted() -> None:
    async def attempt(ctx: object, feedback: str | None, extra: int = 0) -> int:
        return extra

    def check(*args: object) -> tl.LoopCheck:
        return tl.LoopCheck(done=True)

    assert tl.define_loop_task("fine", max_rounds=2, attempt=attempt, check=check).is_loop
    assert tl.define_task("fine", run=print).run is print  # a builtin that cannot be inspected


def test_a_chain_of_5000_tasks_defines_and_a_long_cycle_is_named() -> None:
    """Topological order and cycle checks are iterative: a chain of 1,200 tasks used to raise
    RecursionError at definition time."""
    def chain(n: int, close: bool) -> list[Any]:
        first = tl.define_task("c0", run=lambda ctx: 1, after=[f"c{n - 1}"] if close else [])
        return [first, *(tl.define_task(f"c{i}", run=lambda ctx: 1, after=[f"c{i - 1}"]) for i in range(1, n))]

    workflow = tl.define_workflow("chain-5000", version="test", tasks=chain(5000, close=False))
    assert len(workflow.tasks) == 5000
    with pytest.raises(DefinitionError) as info:
        tl.define_workflow("cycle-5000", version="test", tasks=chain(5000, close=True))
    # the message names the cycle's ends and stays short
    assert "dependency cycle: c0 -> c4999 -> c4998 -> c4997 -> c4996 -> c4995 -> ... (4990 more) ... -> c4 -> " \
           "c3 -> c2 -> c1 -> c0; remove one of these after= links" in str(info.value)
    assert len(str(info.value)) < 300

"""Tasks: ``define_task``, ``define_loop_task`` and ``define_gate``. A ``Task`` is an immutable
declaration; workflows put them together (workflow.py, graph.py). Everything is validated now,
with a DefinitionError that names the field and the fix: the options every task declaration
shares by ``task_options`` (``TaskOptions``), the other checks shared with graph steps in
validate.py."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypedDict

from taskloop.base.errors import DefinitionError
from taskloop.base.text import shown
from taskloop.define.limits import Limit, merge
from taskloop.define.limits import check_limits as limits_option
from taskloop.define.options import ON_EXHAUSTED, Cache, Plateau, Retry, check_timeout_ms, is_safe_int
from taskloop.define.validate import (
    check_callable,
    check_name,
    check_no_retry,
    check_signature,
    got,
    is_text,
    items_of,
)

GATE_KINDS = ("approval", "pause", "input")


class TaskKind(str, Enum):
    TASK = "task"
    LOOP = "loop"
    GATE = "gate"


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
    plateau: Plateau | None = None  # a loop: end early when the best score stops improving
    on_exhausted: str = "fail"  # a loop: "fail" (LoopTaskExhausted) or "best" (done with its best round)
    limits: tuple[Limit, ...] = ()  # fleet flow control of every phase (a plain task's run, a loop's both)
    attempt_limits: tuple[Limit, ...] = ()  # a loop: of its attempts only
    check_limits: tuple[Limit, ...] = ()  # a loop: of its checks only

    def __repr__(self) -> str:
        return f"<{self.kind.value} {self.key}>"

    @property
    def is_loop(self) -> bool:
        return self.kind is TaskKind.LOOP

    @property
    def is_gate(self) -> bool:
        return self.kind is TaskKind.GATE

    def limits_of(self, phase: str) -> tuple[Limit, ...]:
        """The limits a phase (``run``, ``attempt`` or ``check``) starts under."""
        if phase == "attempt":
            return self.limits + self.attempt_limits
        if phase == "check":
            return self.limits + self.check_limits
        return self.limits

    @property
    def limited(self) -> bool:
        return bool(self.limits or self.attempt_limits or self.check_limits)

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
            # only when set: the fingerprint of every definition without them stays what it was
            **({"plateau": self.plateau.describe()} if self.plateau is not None else {}),
            **({"on_exhausted": self.on_exhausted} if self.on_exhausted != "fail" else {}),
            **({"limits": {phase: [limit.describe() for limit in found] for phase, found in
                           (("every", self.limits), ("attempt", self.attempt_limits), ("check", self.check_limits))
                           if found}} if self.limited else {}),
        }


TaskRef = Task | str


def task_key(ref: TaskRef) -> str:
    if isinstance(ref, Task):
        return ref.key
    if isinstance(ref, str):
        return ref
    raise DefinitionError(f"expected a task or a task key, got {shown(ref)}")


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


class TaskOptions(TypedDict):
    """The options every task declaration shares, checked (``task_options``): what a Task keeps of
    them. define_task and define_loop_task take them, and through those tl.loop and tl.step."""

    after: tuple[str, ...]
    condition: Callable[..., Any] | None
    timeout_ms: int | None
    retry: Retry | None
    cache: Cache | None
    queue: str | None
    limits: tuple[Limit, ...]  # of every phase


def task_options(key: str, *, after: Any, condition: Any, timeout_ms: Any, retry: Any, cache: Any, queue: Any,
                 limits: Any) -> TaskOptions:
    """The shared options of task ``key``, each checked the one way, in this order (a loop task
    refuses ``retry=`` before: check_no_retry)."""
    owner = f"task {key}"
    if condition is not None:
        check_callable(condition, f"{owner}: condition must be a callable (ctx) -> bool")
        check_signature(owner, "condition", condition, ("ctx",))
    check_timeout_ms(timeout_ms, owner)
    if cache is not None and not isinstance(cache, Cache):
        raise DefinitionError(f"{owner}: cache must be a tl.Cache(...), got {shown(cache)}")
    if cache is not None:
        check_signature(owner, "cache.key", cache.key, ("ctx",))
    if queue is not None and not is_text(queue):
        raise DefinitionError(f"{owner}: queue must be a non-empty queue name{got(queue)}")
    if retry is not None and not isinstance(retry, Retry):
        raise DefinitionError(f"{owner}: retry must be a tl.Retry(...), got {shown(retry)}")
    if retry is not None and retry.accepts is not None:
        check_signature(owner, "retry.accepts", retry.accepts, ("error", "attempt"))
    return TaskOptions(after=_check_after(key, after), condition=condition, timeout_ms=timeout_ms, retry=retry,
                       cache=cache, queue=queue, limits=limits_option(owner, "limits", limits))


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
    limits: Iterable[Limit] | None = None,
) -> Task:
    """Declare a plain task: ``run(ctx)`` returns its (lossless JSON) value. ``limits``: the fleet's
    rate limits and concurrency keys each try starts under (tl.RateLimit, tl.Concurrency)."""
    check_name(key)
    check_callable(run, f"define_task requires a run callback: task {key}: run must be callable")
    check_signature(f"task {key}", "run", run, ("ctx",))
    options = task_options(key, after=after, condition=condition, timeout_ms=timeout_ms, retry=retry, cache=cache,
                           queue=queue, limits=limits)
    return Task(key=key, kind=TaskKind.TASK, run=run, **options)


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
    plateau: Plateau | None = None,
    on_exhausted: str = "fail",
    limits: Iterable[Limit] | None = None,
    attempt_limits: Iterable[Limit] | None = None,
    check_limits: Iterable[Limit] | None = None,
) -> Task:
    """Declare a loop task: attempt(ctx, feedback) then check(ctx, candidate), at most max_rounds.
    ``plateau``: end early (an exhaustion, reason "plateau") when the checks' scores stop
    improving; ``on_exhausted="best"``: an exhausted loop ends done with its best-scoring candidate.
    ``limits``: the fleet's rate limits and concurrency keys every phase starts under;
    ``attempt_limits`` / ``check_limits``: those of one phase only."""
    check_name(key)
    if not is_safe_int(max_rounds):
        raise DefinitionError(
            f"task {key}: max_rounds must be a positive safe integer (1 .. 2**53-1), got {shown(max_rounds)}"
        )
    if not callable(attempt) or not callable(check):
        raise DefinitionError(f"define_loop_task requires attempt and check callbacks (task {key})")
    check_signature(f"task {key}", "attempt", attempt, ("ctx", "feedback"))
    check_signature(f"task {key}", "check", check, ("ctx", "candidate"))
    check_no_retry(f"task {key}", retry)
    options = task_options(key, after=after, condition=condition, timeout_ms=timeout_ms, retry=retry, cache=cache,
                           queue=queue, limits=limits)
    if plateau is not None and not isinstance(plateau, Plateau):
        raise DefinitionError(f"task {key}: plateau must be a tl.Plateau(rounds=..., min_gain=...), "
                              f"got {shown(plateau)}")
    if on_exhausted not in ON_EXHAUSTED:
        raise DefinitionError(f"task {key}: on_exhausted must be one of {list(ON_EXHAUSTED)}, "
                              f"got {shown(on_exhausted)}")
    owner, every = f"task {key}", options["limits"]
    attempt_only = merge(owner, every, limits_option(owner, "attempt_limits", attempt_limits))[len(every):]
    check_only = merge(owner, every, limits_option(owner, "check_limits", check_limits))[len(every):]
    return Task(key=key, kind=TaskKind.LOOP, attempt=attempt, check=check, max_rounds=max_rounds, plateau=plateau,
                on_exhausted=on_exhausted, attempt_limits=attempt_only, check_limits=check_only, **options)


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
    return Task(key=key, kind=TaskKind.GATE, after=_check_after(key, after), gate_kind=kind, prompt=prompt,
                actors=actor_names)

"""Flow loops (SPEC §8, from the Go Micro seed): ``tl.loop`` runs a body that maps state to state
until a stop condition holds or ``max_iterations`` is reached; ``tl.llm_check`` is a ready-made
model-judged check for loop tasks.

A flow loop is a loop task: iteration n is round n. Its attempt runs ``body(ctx, state)`` on the
state the previous iteration produced (``initial(ctx)``, or the run input, for iteration 1); its
check runs ``on_iteration(n, state)``, then ``until(ctx, state, n)``, then ``until_llm``. So every
iteration is checkpointed: a worker killed in iteration 4 resumes at iteration 4. Unlike a loop
task, reaching the cap is not an error: the loop ends done with the latest state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from taskloop.base.errors import DefinitionError, LLMCallFailed, LoopIterationError, TaskLoopError
from taskloop.define.context import LoopContext, ask_model
from taskloop.define.limits import Limit
from taskloop.define.options import Cache, LoopCheck, Retry
from taskloop.define.tasks import Task, TaskRef, define_loop_task
from taskloop.define.validate import check_signature

DEFAULT_MAX_ITERATIONS = 10


def llm_check(question: str) -> Callable[[LoopContext, Any], LoopCheck]:
    """A check for ``define_loop_task``: the model says whether ``question`` holds of the candidate;
    the feedback (to the next attempt) is its reply. Needs TASKLOOP_LLM_BASE_URL and
    TASKLOOP_LLM_MODEL on the workers (``until_llm requires a model`` otherwise)."""
    if not isinstance(question, str) or not question.strip():
        raise DefinitionError("llm_check: question must be a non-empty string, e.g. 'Is the essay clear?'")

    def check(ctx: LoopContext, candidate: Any) -> LoopCheck:
        verdict = ask_model(ctx, question, candidate)
        return LoopCheck(done=verdict.affirmative, feedback=verdict.reply or "(no reply)")

    check.__qualname__ = f"llm_check({question!r})"
    return check


def llm_score(question: str, *, passing: float, scale: float = 10) -> Callable[[LoopContext, Any], LoopCheck]:
    """A check for ``define_loop_task`` that the model grades: it gives the candidate a score from
    0 to ``scale`` (and says what to improve: the feedback to the next attempt); the round passes
    at ``passing`` or more. The score is the round's (for ``tl.Plateau`` and
    ``on_exhausted="best"``); a reply without a score rejects the round, unscored. Needs
    TASKLOOP_LLM_BASE_URL and TASKLOOP_LLM_MODEL on the workers."""
    if not isinstance(question, str) or not question.strip():
        raise DefinitionError("llm_score: question must be a non-empty string, e.g. 'How clear is this essay?'")
    if type(scale) not in (int, float) or not 0 < scale < float("inf"):
        raise DefinitionError(f"llm_score: scale must be a positive number (the top score), got {scale!r}")
    if type(passing) not in (int, float) or not 0 < passing <= scale:
        raise DefinitionError(f"llm_score: passing must be a number in (0, scale={scale:g}], got {passing!r}")

    def check(ctx: LoopContext, candidate: Any) -> LoopCheck:
        verdict = ask_model(ctx, question, candidate, scale=float(scale))
        score = verdict.score
        return LoopCheck(done=score is not None and score >= passing, feedback=verdict.reply or "(no reply)",
                         score=score)

    check.__qualname__ = f"llm_score({question!r})"
    return check


def loop(
    key: str,
    body: Callable[..., Any],
    *,
    initial: Callable[..., Any] | None = None,
    until: Callable[..., Any] | None = None,
    until_llm: str | None = None,
    max_iterations: int = DEFAULT_MAX_ITERATIONS,
    on_iteration: Callable[..., Any] | None = None,
    after: Iterable[TaskRef] = (),
    timeout_ms: int | None = None,
    retry: Retry | None = None,
    cache: Cache | None = None,
    queue: str | None = None,
    limits: Iterable[Limit] | None = None,
) -> Task:
    """Declare a flow loop: ``body(ctx, state) -> state`` from ``initial(ctx)`` (default: the run
    input), stopped by ``until(ctx, state, iteration)`` or ``until_llm`` (a yes/no question for the
    model), at most ``max_iterations`` times (<= 0 means 10). ``on_iteration(iteration, state)``
    runs after each body, before the stop check. ``retry`` applies to the model's judgement.
    ``limits``: the fleet's rate limits and concurrency keys each body and stop check start under."""
    if not callable(body):
        raise DefinitionError(f"loop {key}: body must be a callable (ctx, state) -> state, got {body!r}")
    check_signature(f"loop {key}", "body", body, ("ctx", "state"))
    for name, fn, params in (("initial", initial, ("ctx",)), ("until", until, ("ctx", "state", "iteration")),
                             ("on_iteration", on_iteration, ("iteration", "state"))):
        if fn is not None:
            if not callable(fn):
                raise DefinitionError(f"loop {key}: {name} must be a callable {params}, got {fn!r}")
            check_signature(f"loop {key}", name, fn, params)
    if until_llm is not None and (not isinstance(until_llm, str) or not until_llm.strip()):
        raise DefinitionError(f"loop {key}: until_llm must be a yes/no question (a non-empty string)")
    if type(max_iterations) is not int:
        raise DefinitionError(f"loop {key}: max_iterations must be an integer, got {max_iterations!r}")
    cap = max_iterations if max_iterations > 0 else DEFAULT_MAX_ITERATIONS

    def attempt(ctx: LoopContext, feedback: str | None) -> Any:
        state = ctx.previous if ctx.round > 1 else (initial(ctx) if initial is not None else ctx.input)
        try:
            return body(ctx, state)
        except TaskLoopError:
            raise
        except Exception as exc:
            raise LoopIterationError(f"loop iteration {ctx.round}: {type(exc).__name__}: {exc}") from exc

    def check(ctx: LoopContext, state: Any) -> LoopCheck:
        iteration = ctx.round
        if on_iteration is not None:
            on_iteration(iteration, state)
        if until is not None and until(ctx, state, iteration):
            return LoopCheck(done=True, feedback=f"until: stopped after iteration {iteration}")
        if until_llm is not None:
            verdict = ask_model(ctx, until_llm, state)
            if verdict.affirmative:
                return LoopCheck(done=True, feedback=f"until_llm: {verdict.reply}")
        if iteration >= cap:
            return LoopCheck(done=True, feedback=f"max_iterations: stopped at the cap of {cap} (not an error)")
        return LoopCheck(done=False, feedback=f"iteration {iteration}: go on")

    attempt.__qualname__ = f"loop({key}).body={getattr(body, '__qualname__', 'body')}"
    check.__qualname__ = f"loop({key}).stop"
    task = define_loop_task(key, max_rounds=cap, attempt=attempt, check=check, after=after, timeout_ms=timeout_ms,
                            cache=cache, queue=queue, limits=limits)
    if retry is not None:
        if not isinstance(retry, Retry):
            raise DefinitionError(f"loop {key}: retry must be a tl.Retry(...), got {retry!r}")
        if retry.accepts is None:  # by default only model calls that may work next time are tried again
            retry = retry.model_copy(update={"accepts": _retryable})
        task = replace(task, retry=retry)
    return task


def _retryable(error: BaseException, attempt: int) -> bool:
    return isinstance(error, LLMCallFailed) and error.retryable

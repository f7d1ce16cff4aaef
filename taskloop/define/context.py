"""What a callback receives: TaskContext (plain tasks, conditions, cache keys) and LoopContext."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from taskloop.base import clock
from taskloop.base.errors import Cancelled, DefinitionError, LLMNotConfigured
from taskloop.define.tasks import Task, task_key


class Signal:
    """Cancellation of the running phase: by ``client.cancel`` (its reason), by a failed task under
    ``stop_on_error`` (reason ``stopped``), or by the task's timeout (reason ``timeout``)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._reason: str | None = None
        self._lock = threading.Lock()
        self.set_at: float | None = None  # when the signal was set (epoch seconds)
        self._listeners: list[Callable[[str], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    @property
    def reason(self) -> str | None:
        return self._reason

    def raise_if_cancelled(self) -> None:
        if self._event.is_set():
            raise Cancelled(self._reason or "cancelled")

    def wait(self, seconds: float | None = None) -> bool:
        """Sleep up to ``seconds`` (None: until cancelled); True when the phase was cancelled."""
        return self._event.wait(seconds)

    def set(self, reason: str) -> None:
        """Cancel the phase. The first reason wins."""
        with self._lock:
            if self._event.is_set():
                return
            self._reason = reason
            self.set_at = clock.now()
            self._event.set()
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener(reason)

    def forget_listeners(self) -> None:
        """The phase is over: drop the listeners (they reference what watched it, which references
        this signal: without this, every phase would leave a reference cycle for the collector)."""
        with self._lock:
            self._listeners = []

    def on_set(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` once the phase is cancelled (now, if it is): how the asyncio pool
        cancels an async callback's task (worker/pools/asyncio_pool.py)."""
        with self._lock:
            if not self._event.is_set():
                self._listeners.append(listener)
                return
            reason = self._reason or "cancelled"
        listener(reason)


_UNREAD: Any = object()


class UsageSink(Protocol):
    def report(self, counts: dict[str, int]) -> None: ...

    def report_once(self, receipt: str, counts: dict[str, int]) -> bool: ...


class StreamSink(Protocol):
    """Where ``ctx.stream`` puts a phase's live text (the worker's buffer,
    worker/execution/streaming.py): it never blocks on I/O and never raises."""

    def __call__(self, text: str) -> None: ...


@dataclass(frozen=True)
class Judgement:
    """A model's answer to a question about a state: what ``until_llm``, ``tl.llm_check`` and
    ``tl.llm_score`` decide on (define/flow.py)."""

    reply: str
    affirmative: bool  # the reply says yes (connections/llm.py's is_affirmative)
    score: float | None  # asked for a score: the one the reply gives (None when it gives none)
    usage: dict[str, int]  # the tokens it took: input, cached, output (ctx.report_usage's names)
    record: dict[str, Any]  # what is recorded with the phase (JSON): the prompt, the reply, the usage


class Judge(Protocol):
    """The model a context asks. The runtime supplies it (runtime/judge.py, over the chat-completions
    client of connections/llm.py), so that declarations do no I/O."""

    def __call__(self, question: str, state: Any, *, deadline: float | None,
                 scale: float | None = None) -> Judgement: ...


MAX_TOKENS = 2**53 - 1  # per report: a safe integer (Redis counters stop at 2**63 - 1)


def _usage(input: object, cached: object, output: object) -> dict[str, int]:
    counts = {"input": input, "cached": cached, "output": output}
    for name, value in counts.items():
        if type(value) is not int or not 0 <= value <= MAX_TOKENS:
            shown = f"an int of {value.bit_length()} bits" if type(value) is int and value.bit_length() > 64 \
                else repr(value)[:80]
            raise DefinitionError(
                f"ctx.report_usage: {name} must be a non-negative integer token count up to 2**53-1, got {shown}"
            )
    return counts  # type: ignore[return-value]


class TaskContext:
    """Context of a plain task's run, and of any condition or cache key (with attempt 0)."""

    def __init__(
        self,
        *,
        run_id: str,
        workflow: str,
        key: str,
        load_input: Callable[[], Any],
        attempt: int,
        signal: Signal,
        idempotency_key: str,
        after: tuple[str, ...],
        load_value: Callable[[str], Any],
        usage: UsageSink,
        load_activation: Callable[[], Any] | None = None,
        deadline: float | None = None,
        judge: Judge | None = None,
        stream: StreamSink | None = None,
    ) -> None:
        self.run_id = run_id
        self.workflow = workflow
        self.key = key
        self._load_input = load_input
        self._input: Any = _UNREAD
        self.attempt = attempt
        self.signal = signal
        self.idempotency_key = idempotency_key
        self._after = after
        self._load_value = load_value
        self._usage = usage
        self._load_activation = load_activation
        self.deadline = deadline  # epoch seconds by which this round (or try) must end, or None
        self.notes: dict[str, Any] = {}  # recorded with the phase's outcome (e.g. a model's verdict)
        self._judge = judge
        self._stream = stream

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.workflow}/{self.key} run={self.run_id} attempt={self.attempt}>"

    @property
    def input(self) -> Any:
        """The run input (JSON), read from Redis the first time a callback asks for it."""
        if self._input is _UNREAD:
            self._input = self._load_input()
        return self._input

    @property
    def activation(self) -> Any:
        """In a graph workflow's step: the input its activation was given (``tl.Activation(step,
        input)``), None for a plain activation. The run input (``ctx.input``) never changes."""
        return self._load_activation() if self._load_activation is not None else None

    def value(self, task: Task | str) -> Any:
        """The value of a task listed in this task's ``after``."""
        key = task_key(task)
        if key not in self._after:
            raise DefinitionError(
                f"task {self.key} cannot read the value of {key!r}: ctx.value only reads tasks named "
                f"in after=; add {key!r} to after= of {self.key}"
            )
        return self._load_value(key)

    def stream(self, text: str) -> None:
        """Append ``text`` to this phase's live output (SPEC §13): ``client.stream``, ``taskloop
        watch`` and the run page show it as it comes, in order. It never fails the phase: the text
        is buffered and written a few times a second (with the store unreachable it is dropped and
        counted), and past ``TASKLOOP_STREAM_MAX_BYTES`` the rest is dropped. The live text is
        kept a while after the phase ends (``TASKLOOP_STREAM_GRACE_S``); what the callback returns
        is what is recorded. Outside a phase (a condition, a cache key) it does nothing."""
        if not isinstance(text, str):
            raise DefinitionError(f"ctx.stream: text must be a str (a piece of the phase's output), got "
                                  f"{type(text).__name__}; stream str(value), or the text of it")
        if text and self._stream is not None:
            self._stream(text)

    def report_usage(self, input: int = 0, cached: int = 0, output: int = 0) -> None:
        """Add token usage to the run's ``result.usage`` (and its token budget)."""
        self._usage.report(_usage(input, cached, output))

    def report_usage_once(self, receipt: str, input: int = 0, cached: int = 0, output: int = 0) -> bool:
        """Like report_usage, but a receipt id is counted once per run, across replays.
        Returns False when the receipt was already counted."""
        if not isinstance(receipt, str) or not receipt:
            raise DefinitionError("ctx.report_usage_once: receipt must be a non-empty string id")
        return self._usage.report_once(receipt, _usage(input, cached, output))


class LoopContext(TaskContext):
    """Context of a loop task's attempt or check: adds ``round`` (1-based) and ``phase``."""

    def __init__(self, *, round: int, phase: str, load_previous: Callable[[], Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.round = round
        self.phase = phase
        self._load_previous = load_previous

    @property
    def previous(self) -> Any:
        """The candidate of the previous round (None in round 1): what a loop that refines its
        own output starts from."""
        return self._load_previous() if self._load_previous is not None and self.round > 1 else None

    def __repr__(self) -> str:
        return (f"<LoopContext {self.workflow}/{self.key} run={self.run_id} round={self.round} "
                f"phase={self.phase}>")


def ask_model(ctx: TaskContext, question: str, state: Any, scale: float | None = None) -> Judgement:
    """Ask the model the runtime gave ``ctx`` about ``state`` (with ``scale``: for a score from 0
    to ``scale``), bounded by the round's deadline; record its prompt, reply and usage with the
    phase, and count its tokens."""
    if ctx._judge is None:
        raise LLMNotConfigured("until_llm requires a model: this context was built without one "
                               "(a worker gives the contexts it builds the model of TASKLOOP_LLM_BASE_URL)")
    judgement = ctx._judge(question, state, deadline=ctx.deadline, scale=scale)
    ctx.notes["llm"] = judgement.record
    ctx.report_usage(**judgement.usage)
    return judgement

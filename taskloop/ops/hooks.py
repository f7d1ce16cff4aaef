"""The instrumentation interface: the points of a run that metrics, tracing, the workflows'
observers and any exporter hang on (issue 43), like dramatiq's middleware.

A concern is a subclass of ``Hook`` that overrides the methods it needs; the process's hooks are
registered in one place (taskloop/runtime/instruments.py), and the core paths call one
dispatcher, ``Hooks``, at each point. What a hook receives is a typed, frozen record (below).

The points, each a method of ``Hook``: a run started, a write committed (its events), a run
ended; a phase began and ended (around its callback), a model asked, a chunk streamed, the live
text written or dropped; a phase throttled by a fleet limit and how long it waited; a message
refused; a reconcile pass; a worker process ending. Two points answer: the context a run is started in (stored with it),
and the headers of a phase message (both for tracing: the W3C trace context).

A hook that raises is logged and skipped: it never changes an outcome. A point no hook listens
to costs a tuple check (``Hooks.wants``): with no exporter on, nothing is built or imported.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from taskloop.core import events as ev
from taskloop.core.events import Event
from taskloop.core.records import ErrorRecord

if TYPE_CHECKING:
    from taskloop.define.workflow import Workflow
    from taskloop.store.redis_store import RedisStore

log = logging.getLogger("taskloop.ops.hooks")


@dataclass(frozen=True, slots=True)
class RunStarting:
    """A run about to be written by a start in this process (by definition, by name, a fork)."""

    run_id: str
    workflow: str
    version: str | None


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A phase message about to be sent (built by the outbox or by Celery). ``stored_context`` reads
    the context its run was started in (``tc``: one read; None when it has none)."""

    run_id: str
    key: str
    round: int
    phase: str
    stored_context: Callable[[], str | None]


@dataclass(frozen=True, slots=True)
class RunStarted:
    run_id: str
    workflow: str
    version: str | None
    at: float


@dataclass(frozen=True, slots=True)
class RunEnded:
    """A write ended the run: its final status and termination (``run.finished``)."""

    run_id: str
    workflow: str
    version: str | None
    status: str
    termination: str | None
    at: float
    store: RedisStore  # where the run is (its history: ``store.events(run_id)``)


@dataclass(frozen=True, slots=True)
class Committed:
    """One write of a run's records: the events it wrote (the run's history), and whether it ended
    the run. ``store`` is where it was written."""

    store: RedisStore
    workflow: Workflow
    run_id: str
    events: list[Event]
    finished: bool


@dataclass(frozen=True, slots=True)
class PhaseBegan:
    """A phase's callback is about to run here. ``traceparent``: the W3C trace context its message
    carried."""

    run_id: str
    workflow: str
    version: str | None
    task: str
    round: int
    phase: str
    attempt: int
    worker: str | None
    at: float
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class PhaseEnded:
    """What the callback came to (before the run's rules resolve it: a late outcome may still be
    recorded as a timeout): the outcome's kind (``core/phases.py`` EventKind: candidate, accept,
    reject, succeed, fail, cancel ...), its error and exception, a check's score, the tokens it
    reported (``ctx.report_usage``: input, cached, output)."""

    began: PhaseBegan
    outcome: str
    at: float
    error: ErrorRecord | None = None
    exception: BaseException | None = None
    score: float | None = None
    usage: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelAsked:
    """The runtime's model answered (or failed) a question of ``tl.llm_check``, ``tl.llm_score`` or
    ``until_llm``, inside the callback that asked: ``model``, when (``at`` to ``ended``), the
    tokens it took, and the error (its type name) when it failed."""

    model: str | None
    at: float
    ended: float
    usage: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    error_type: str | None = None


@dataclass(frozen=True, slots=True)
class PhaseRef:
    """Which phase: of which run, task and round."""

    run_id: str
    task: str
    round: int
    phase: str


@dataclass(frozen=True, slots=True)
class ChunkStreamed(PhaseRef):
    """A text a callback gave ``ctx.stream`` (its size in bytes, kept or not)."""

    size: int = 0


@dataclass(frozen=True, slots=True)
class StreamWritten:
    """One write of the live text every phase of a process streamed since the last one."""

    pieces: int


@dataclass(frozen=True, slots=True)
class StreamDropped:
    """Live text dropped: ``reason`` unavailable (the store), capped or ended."""

    reason: str
    chunks: int
    size: int


@dataclass(frozen=True, slots=True)
class Throttled(PhaseRef):
    """A queued phase waits for a fleet limit."""

    limit: str = "?"


@dataclass(frozen=True, slots=True)
class LimitWaited:
    """A phase that waited for a fleet limit starts, after ``seconds``."""

    limit: str
    seconds: float


@dataclass(frozen=True, slots=True)
class Refused:
    """A message refused: stale, superseded, unknown run, unknown task, malformed."""

    reason: str


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What a reconcile pass did, by action (redispatched, replayed, abandoned, ...)."""

    counts: dict[str, int]


class Hook:
    """One concern's implementation of the interface: override the methods you need (the others
    are never called). Calls come from many threads; keep them short."""

    def run_context(self, run: RunStarting) -> str | None:
        """A run is being started here: the context it starts in (a W3C traceparent), stored with
        it, or None. The first hook's answer is kept."""
        return None

    def message_headers(self, message: Outgoing) -> dict[str, str] | None:
        """A phase message is being sent: headers to put on it (``traceparent``), or None."""
        return None

    def run_started(self, run: RunStarted) -> None:
        """A write started a run (told after its ``committed``)."""

    def committed(self, write: Committed) -> None:
        """A write of a run's records was applied, in the process that wrote it: its events are
        the run's history (what metrics and the observers are made of)."""

    def run_ended(self, run: RunEnded) -> None:
        """A write ended a run (told after its ``committed``)."""

    def phase_began(self, phase: PhaseBegan) -> None:
        """A phase's callback is about to run, in the thread or task that runs it: what this makes
        current (a span, a context variable), the callback sees."""

    def phase_ended(self, phase: PhaseEnded) -> None:
        """The callback returned or raised (same thread or task as ``phase_began``)."""

    def model_asked(self, asked: ModelAsked) -> None:
        """The runtime's model answered a question (in the callback that asked, after the call)."""

    def chunk_streamed(self, chunk: ChunkStreamed) -> None:
        """A callback gave ``ctx.stream`` a text (called inside the callback: keep it short)."""

    def stream_written(self, written: StreamWritten) -> None:
        """The process's flusher wrote the live text of its phases (one call)."""

    def stream_dropped(self, dropped: StreamDropped) -> None:
        """Live text was dropped: the store did not take it, the phase's cap was reached, or it came
        after the phase's outcome."""

    def limit_throttled(self, throttled: Throttled) -> None:
        """A queued phase waits for a fleet limit (once per limit it waits on)."""

    def limit_waited(self, waited: LimitWaited) -> None:
        """A phase that waited for a fleet limit starts."""

    def delivery_refused(self, refused: Refused) -> None:
        """A message was refused before it reached a run's records, or its outcome was discarded."""

    def reconciled(self, report: Reconciled) -> None:
        """A reconcile pass ended."""

    def process_ending(self, pid: int) -> None:
        """The worker process ``pid`` is about to end (a pool process may skip ``atexit``): send what
        is buffered now."""


POINTS = ("run_context", "message_headers", "run_started", "run_ended", "committed", "phase_began", "phase_ended",
          "model_asked", "chunk_streamed", "stream_written", "stream_dropped", "limit_throttled", "limit_waited",
          "delivery_refused", "reconciled", "process_ending")


class Hooks(Hook):
    """The dispatcher: the hooks as one. Each point calls the hooks that override it, in the order
    registered; a hook that raises is logged and skipped."""

    def __init__(self, hooks: Sequence[Hook] = ()) -> None:
        self.hooks = tuple(hooks)
        self._at: dict[str, tuple[Callable[[Any], Any], ...]] = {
            point: tuple(getattr(hook, point) for hook in self.hooks
                         if getattr(type(hook), point) is not getattr(Hook, point))
            for point in POINTS}
        for point in POINTS:
            if point not in ("committed", "run_context", "message_headers"):
                setattr(self, point, functools.partial(self._each, point))

    def wants(self, point: str) -> bool:
        """Whether any hook listens at ``point`` (a caller may skip building what it would get)."""
        return bool(self._at[point])

    def _each(self, point: str, arg: Any) -> None:
        for fn in self._at[point]:
            self._call(fn, point, arg)

    @staticmethod
    def _call(fn: Callable[[Any], Any], point: str, arg: Any) -> Any:
        try:
            return fn(arg)
        except Exception:  # instrumentation never breaks a loop
            log.exception("instrumentation hook %s.%s failed", type(getattr(fn, "__self__", fn)).__name__, point)
            return None

    def run_context(self, run: RunStarting) -> str | None:
        for fn in self._at["run_context"]:
            found = self._call(fn, "run_context", run)
            if found:
                return str(found)
        return None

    def message_headers(self, message: Outgoing) -> dict[str, str] | None:
        headers: dict[str, str] = {}
        for fn in self._at["message_headers"]:
            headers.update(self._call(fn, "message_headers", message) or {})
        return headers or None

    def committed(self, write: Committed) -> None:
        """A write, then the run it started or ended (told from its events)."""
        self._each("committed", write)
        if not (self._at["run_started"] or self._at["run_ended"]):
            return
        workflow = write.workflow
        for event in write.events:
            if event.type == ev.RUN_STARTED:
                self._each("run_started", RunStarted(write.run_id, workflow.name, workflow.version, event.at))
            elif event.type == ev.RUN_FINISHED and write.finished:
                data = event.data or {}
                self._each("run_ended", RunEnded(write.run_id, workflow.name, workflow.version,
                                                 str(data.get("status", "")), data.get("termination"), event.at,
                                                 write.store))

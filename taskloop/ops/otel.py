"""OpenTelemetry tracing (SPEC §14) as a hook: imported only when tracing is on (ops/tracing.py).

A run is one trace. Its ``run`` span is a child of the span that was current where it was
started (``run_context``: the context is stored with the run, ``tc``, as a traceparent whose
parent-id is that span, all zeros for none); under it a span per task, per round (a loop's round,
a plain task's try) and per phase. Spans that would have to stay open across processes for days
(a run waiting at a gate) are made when they end, by the process whose write ended them, with
their start times from the run's history and ids every process derives alike from the trace and
the run (``span_id``); the run, task and round spans are therefore made with chosen ids
(``Chosen``, the id generator of a tracer of our own). A phase span is made live, around its
callback, in the process that runs it: its parent, the round's span, comes in the message
(``traceparent``, put there by ``message_headers`` for every message, also those the outbox
builds), and it is current inside the callback, so a model client's own instrumentation nests
under it; the runtime's model calls (``tl.llm_check``, ``until_llm``) get CLIENT spans.

Attributes: ``taskloop.run_id``, ``.workflow``, ``.version``, ``.task``, ``.round``, ``.phase``,
``.verdict``, ``.score``, ``.worker``, ``.attempt``, ``.status``, and ``gen_ai.usage.input_tokens``
/ ``output_tokens`` as reported by ``ctx.report_usage``. Errors set their span's status (and a
phase's exception is recorded on it).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextvars import Token
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.events import Event
from taskloop.core.states import TERMINAL_TASK
from taskloop.ops.hooks import Committed, Hook, ModelAsked, Outgoing, PhaseBegan, PhaseEnded, RunStarting

log = logging.getLogger("taskloop.ops.otel")

SAMPLED = 0x01
KNOWN_RUNS = 10_000  # the runs whose trace context a process keeps (it is stored with the run)
_ENDED = {status.value for status in TERMINAL_TASK}


@dataclass(frozen=True)
class RunTrace:
    """A run's trace: its id, the span the run is a child of (0: none), its sampled flag."""

    trace_id: int
    parent: int
    flags: int

    def stored(self) -> str:
        return f"00-{self.trace_id:032x}-{self.parent:016x}-{self.flags:02x}"

    @classmethod
    def parse(cls, text: str | None, parent_required: bool = False) -> RunTrace | None:
        """A traceparent (version 00), or None when it is not one."""
        parts = text.split("-") if isinstance(text, str) else []
        if len(parts) != 4 or parts[0] != "00" or [len(p) for p in parts[1:]] != [32, 16, 2]:
            return None
        try:
            found = cls(int(parts[1], 16), int(parts[2], 16), int(parts[3], 16))
        except ValueError:
            return None
        if found.trace_id == 0 or (parent_required and found.parent == 0):
            return None
        return found

    def context(self, span: int) -> Any:
        """An OpenTelemetry context whose current span is ``span`` of this trace (0: an empty one)."""
        if not span:
            return otel_context.Context()
        parent = SpanContext(self.trace_id, span, is_remote=True, trace_flags=TraceFlags(self.flags))
        return trace.set_span_in_context(NonRecordingSpan(parent))


def span_id(run: RunTrace, *parts: object) -> int:
    """The id of a span every process derives alike: the run's (``run_id``), a task's (``run_id,
    key``), a round's (``run_id, key, round``)."""
    digest = hashlib.blake2b(repr((run.trace_id, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


class Chosen(IdGenerator):
    """The ids of the spans made when they end: chosen (``chosen``, under the hook's lock), else
    the provider's."""

    def __init__(self, base: IdGenerator) -> None:
        self.base = base
        self.chosen: tuple[int, int] | None = None

    def generate_span_id(self) -> int:
        return self.chosen[1] if self.chosen else self.base.generate_span_id()

    def generate_trace_id(self) -> int:
        return self.chosen[0] if self.chosen else self.base.generate_trace_id()


def _ns(at: float) -> int:
    return int(at * 1e9)


class TracingHook(Hook):
    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("taskloop")
        self.made = provider.get_tracer("taskloop.ended")  # its own tracer: the ids it makes are chosen
        base = getattr(self.made, "id_generator", None)
        self.ids = Chosen(base) if isinstance(base, IdGenerator) else None
        if self.ids is None:
            log.warning("the TracerProvider is not OpenTelemetry's SDK one: runs get phase spans only")
        else:
            self.made.id_generator = self.ids
        self.lock = threading.Lock()
        self.known: OrderedDict[str, RunTrace | None] = OrderedDict()
        self.open: dict[int, tuple[Span, Token[Context]]] = {}

    # the trace of a run ---------------------------------------------------------------------
    def run_context(self, run: RunStarting) -> str | None:
        current = trace.get_current_span().get_span_context()
        if current.is_valid:
            found = RunTrace(current.trace_id, current.span_id, int(current.trace_flags) & SAMPLED)
        else:
            trace_id = (self.ids.base if self.ids else _random()).generate_trace_id()
            found = RunTrace(trace_id, 0, SAMPLED if self._sampled(trace_id, run.workflow) else 0)
        self._know(run.run_id, found)
        return found.stored()

    def _sampled(self, trace_id: int, workflow: str) -> bool:
        sampler = getattr(self.provider, "sampler", None)
        return sampler is None or sampler.should_sample(None, trace_id, f"run {workflow}").decision.is_sampled()

    def _know(self, run_id: str, found: RunTrace | None) -> None:
        with self.lock:
            self.known[run_id] = found
            self.known.move_to_end(run_id)
            while len(self.known) > KNOWN_RUNS:
                self.known.popitem(last=False)

    def _trace_of(self, run_id: str, stored: Callable[[], str | None]) -> RunTrace | None:
        with self.lock:
            if run_id in self.known:
                return self.known[run_id]
        found = RunTrace.parse(stored())
        self._know(run_id, found)
        return found

    def message_headers(self, message: Outgoing) -> dict[str, str] | None:
        run = self._trace_of(message.run_id, message.stored_context)
        if run is None:
            return None
        parent = span_id(run, message.run_id, message.key, message.round)
        return {"traceparent": RunTrace(run.trace_id, parent, run.flags).stored()}

    # a phase, live --------------------------------------------------------------------------
    def phase_began(self, phase: PhaseBegan) -> None:
        parent = RunTrace.parse(phase.traceparent, parent_required=True)
        if parent is None:  # a message of a run not traced (or sent where tracing was off)
            return
        span = self.tracer.start_span(f"{phase.phase} {phase.task}", context=parent.context(parent.parent),
                                      start_time=_ns(phase.at), attributes=_attributes(
                                          run_id=phase.run_id, workflow=phase.workflow, version=phase.version,
                                          task=phase.task, round=phase.round, phase=phase.phase,
                                          worker=phase.worker, attempt=phase.attempt))
        token = otel_context.attach(trace.set_span_in_context(span))
        self.open[id(phase)] = (span, token)

    def phase_ended(self, phase: PhaseEnded) -> None:
        found = self.open.pop(id(phase.began), None)
        if found is None:
            return
        span, token = found
        try:
            span.set_attribute("taskloop.outcome", phase.outcome)
            verdict = {"accept": "accepted", "reject": "rejected"}.get(phase.outcome)
            span.set_attributes(_attributes(verdict=verdict, score=phase.score))
            span.set_attributes(_usage(phase.usage))
            if phase.exception is not None:
                span.record_exception(phase.exception)
            if phase.error is not None:
                span.set_status(Status(StatusCode.ERROR, f"{phase.error.type}: {phase.error.message}"))
            span.end(end_time=_ns(phase.at))
        finally:
            otel_context.detach(token)

    def model_asked(self, asked: ModelAsked) -> None:
        model = asked.model or "unknown"
        span = self.tracer.start_span(f"chat {model}", kind=SpanKind.CLIENT, start_time=_ns(asked.at), attributes={
            "gen_ai.operation.name": "chat", "gen_ai.request.model": model, **_usage(asked.usage)})
        if asked.error is not None:
            span.set_attribute("error.type", asked.error_type or "error")
            span.set_status(Status(StatusCode.ERROR, asked.error))
        span.end(end_time=_ns(asked.ended))

    def process_ending(self, pid: int) -> None:
        flush = getattr(self.provider, "force_flush", None)
        if flush is not None:
            flush(5_000)

    # what ended, from the history -----------------------------------------------------------
    def committed(self, write: Committed) -> None:
        ended = list(dict.fromkeys(e.key for e in write.events
                                   if e.type == ev.TASK and e.key and (e.data or {}).get("status") in _ENDED))
        finished = [e for e in write.events if e.type == ev.RUN_FINISHED] if write.finished else []
        if not (ended or finished) or self.ids is None:
            return
        run = self._trace_of(write.run_id, lambda: write.store.hmget(write.run_id, [fld.F_TRACE])[0])
        if run is None:
            return
        history = write.store.events(write.run_id)
        common = {"run_id": write.run_id, "workflow": write.workflow.name, "version": write.workflow.version}
        for key in ended:
            self._task(run, common, key, [e for e in history if e.key == key])
        if finished and history:
            data = finished[-1].data or {}
            status = str(data.get("status", ""))
            self._made(f"run {write.workflow.name}", run, span_id(run, write.run_id), run.parent, history[0].at,
                       finished[-1].at, _attributes(**common, status=status,
                                                    termination=data.get("termination")),
                       f"run failed: {data.get('termination')}" if status == "failed" else None)

    def _task(self, run: RunTrace, common: dict[str, Any], key: str, mine: Sequence[Event]) -> None:
        ends = [e for e in mine if e.type == ev.TASK and (e.data or {}).get("status") in _ENDED]
        if not mine or not ends:
            return
        end = ends[-1]
        data = end.data or {}
        task_id = span_id(run, common["run_id"], key)
        rounds = _rounds(mine, end.at)
        error = f"{data.get('error')}: {data.get('message')}" if data.get("error") else None
        self._made(f"task {key}", run, task_id, span_id(run, common["run_id"]), mine[0].at, end.at,
                   _attributes(**common, task=key, status=data.get("status"), rounds=len(rounds) or None), error)
        for number, (start, stop, verdict, score) in rounds.items():
            self._made(f"round {key}", run, span_id(run, common["run_id"], key, number), task_id, start, stop,
                       _attributes(**common, task=key, round=number, verdict=verdict, score=score), None)

    def _made(self, name: str, run: RunTrace, span: int, parent: int, start: float, end: float,
              attributes: dict[str, Any], error: str | None) -> None:
        """A span that ended, made now with its id and times (the tracer of chosen ids)."""
        assert self.ids is not None
        with self.lock:
            self.ids.chosen = (run.trace_id, span)
            try:
                made = self.made.start_span(name, context=run.context(parent), start_time=_ns(start),
                                            attributes=attributes)
            finally:
                self.ids.chosen = None
        if error is not None:
            made.set_status(Status(StatusCode.ERROR, error))
        made.end(end_time=_ns(max(end, start)))


def _rounds(mine: Sequence[Event], ended: float) -> dict[int, tuple[float, float, str | None, float | None]]:
    """A task's rounds (a loop's rounds, a plain task's tries) from its events: when each started
    (its attempt or run entered), when it ended (its check's verdict, else the next round, else the
    task's end), the verdict and the score."""
    starts: dict[int, float] = {}
    verdicts: dict[int, tuple[float, str, float | None]] = {}
    for event in mine:
        if event.type != ev.PHASE or not event.round:
            continue
        if event.phase in ("attempt", "run"):
            starts.setdefault(event.round, event.at)
        elif event.phase == "complete":
            data = event.data or {}
            score = data.get("score")
            verdicts[event.round] = (event.at, "accepted" if data.get("done") else "rejected",
                                     float(score) if isinstance(score, int | float) else None)
    found = {}
    numbers = sorted(starts)
    for i, number in enumerate(numbers):
        later = starts[numbers[i + 1]] if i + 1 < len(numbers) else ended
        at, verdict, score = verdicts.get(number, (later, None, None))
        found[number] = (starts[number], at, verdict, score)
    return found


def _attributes(**values: Any) -> dict[str, Any]:
    """``taskloop.<name>`` attributes, those with a value."""
    return {f"taskloop.{name}": value for name, value in values.items() if value is not None}


def _usage(usage: dict[str, int]) -> dict[str, int]:
    """Token usage as OpenTelemetry's GenAI conventions name it."""
    names = {"input": "gen_ai.usage.input_tokens", "output": "gen_ai.usage.output_tokens",
             "cached": "gen_ai.usage.cache_read.input_tokens"}
    return {names[name]: amount for name, amount in usage.items() if name in names and amount}


def _random() -> IdGenerator:
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    return RandomIdGenerator()


@functools.cache
def tracing_hook() -> TracingHook:
    """This process's tracing hook, on the application's TracerProvider, or on one made from the
    ``OTEL_*`` variables (set as the global one, so that other instrumentation shares it)."""
    return TracingHook(provider())


def provider() -> Any:
    current = trace.get_tracer_provider()
    if not isinstance(current, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return current
    env = os.environ
    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    made = TracerProvider(resource=Resource.create({} if named else {"service.name": "taskloop"}))
    made.add_span_processor(BatchSpanProcessor(exporter()))
    trace.set_tracer_provider(made)
    return trace.get_tracer_provider()


def exporter() -> SpanExporter:
    """``OTEL_TRACES_EXPORTER``: otlp (OTLP over HTTP, the default: its ``OTEL_EXPORTER_OTLP_*``
    variables) or console."""
    name = (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").split(",")[0].strip().lower()
    if name == "console":
        return ConsoleSpanExporter()
    if name not in ("otlp", "otlp_proto_http"):
        log.warning("OTEL_TRACES_EXPORTER=%s is not one taskloop makes (otlp, console): otlp is used", name)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()

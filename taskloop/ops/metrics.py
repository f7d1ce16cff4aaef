"""Prometheus metrics (prometheus-client).

Two exporters:

- **a worker's** (``taskloop worker --metrics-port P``): what its processes did — phases by
  workflow, task and outcome, their duration and queue wait, rounds, exhaustions, retries,
  refused deliveries, lost executions, budget refusals, cache lookups, reconciler actions, runs
  finished, supervisor restarts. A prefork worker has several processes: they write through
  prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set up by the supervisor),
  and the supervisor serves the sum on the port.
- **the fleet's** (``taskloop metrics --port P``): read from Redis at each scrape — runs live,
  phases queued per broker queue, expired leases, the reconciler's last pass, and fleet
  counters kept in Redis (runs started and finished by workflow, status and termination).

A worker's metrics are a hook of the instrumentation interface (``MetricsHook``, ops/hooks.py),
derived from the events a commit wrote (one source of truth with the run history); recording them
never fails a phase: a failing hook is logged and ignored. Metrics are on only in processes that
export them (``TASKLOOP_METRICS=1``, set by ``--metrics-port``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from taskloop.base import clock
from taskloop.base.errors import LoopTaskExhausted, WorkflowBudgetExceeded, is_recorded
from taskloop.base.names import MAX_LENGTH, step_of
from taskloop.core import events as ev
from taskloop.core.events import Event
from taskloop.ops.hooks import (
    Committed,
    Hook,
    LimitWaited,
    Reconciled,
    Refused,
    StreamDropped,
    StreamWritten,
    Throttled,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

log = logging.getLogger("taskloop.ops.metrics")

ENABLED_ENV = "TASKLOOP_METRICS"
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)


class _Instruments:
    """The metric objects, made on first use: a process whose metrics are off (no --metrics-port)
    never imports prometheus-client (about 10 MB in each of a worker's processes)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.PHASES = Counter("taskloop_phases", "Phases executed, by outcome of the execution",
                              ["workflow", "task", "phase", "outcome"])
        self.PHASE_SECONDS = Histogram("taskloop_phase_duration_seconds", "How long a phase's callback ran",
                                       ["workflow", "task", "phase"], buckets=DURATION_BUCKETS)
        self.QUEUE_WAIT = Histogram("taskloop_queue_wait_seconds",
                                    "From a phase's message being sent to the phase beginning",
                                    ["workflow", "phase"], buckets=DURATION_BUCKETS)
        self.ROUNDS = Counter("taskloop_rounds", "Loop rounds started (a plain task's tries count as rounds too)",
                              ["workflow", "task"])
        self.EXHAUSTED = Counter("taskloop_exhaustions",
                                 "Loop tasks that ran out, by reason: rounds (max_rounds), plateau (scores "
                                 "stopped improving), budget (the workflow's budget), best-of loops included",
                                 ["workflow", "task", "reason"])
        self.ROUNDS_TO_ACCEPT = Histogram("taskloop_loop_rounds_to_accept",
                                          "Rounds a loop needed until its check accepted", ["workflow", "task"],
                                          buckets=(1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50, 100))
        self.SCORES = Histogram("taskloop_loop_scores", "The scores checks gave their rounds (higher is better)",
                                ["workflow", "task"],
                                buckets=(0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1, 2, 5, 10, 100))
        self.RETRIES = Counter("taskloop_retries", "Tries queued again by a retry policy", ["workflow", "task"])
        self.RUNS_FINISHED = Counter("taskloop_runs_finished", "Runs ended by this process's writes",
                                     ["workflow", "status", "termination"])
        self.REFUSED = Counter("taskloop_refused_deliveries", "Messages refused: stale or duplicate tokens, "
                               "superseded executions, unknown runs, malformed messages", ["reason"])
        self.LOST = Counter("taskloop_lost_executions", "Executions found lost (dead worker, expired lease) and "
                            "replayed or abandoned", ["workflow"])
        self.HANDED_BACK = Counter("taskloop_handed_back_phases", "Running phases a worker gave back when it shut "
                                   "down (queued again at once for another worker)", ["workflow"])
        self.BUDGET = Counter("taskloop_budget_refusals", "Phases refused by a spent budget", ["workflow"])
        self.CACHE = Counter("taskloop_cache_lookups", "Cache events: hit, miss, stored, failed",
                             ["workflow", "result"])
        self.RECONCILER = Counter("taskloop_reconciler_actions", "What reconcile passes did", ["action"])
        self.THROTTLED = Counter("taskloop_limit_throttled", "Phases a fleet limit held back (each counted once "
                                 "per limit it waited on)", ["limit"])
        self.LIMIT_WAIT = Histogram("taskloop_limit_wait_seconds", "How long a phase held back by fleet limits "
                                    "waited before it started", ["limit"],
                                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800))
        self.RESTARTS = Counter("taskloop_worker_restarts", "Celery workers restarted by their supervisor")
        self.STREAM_WRITES = Counter("taskloop_stream_writes", "Writes of live text (ctx.stream): one call carries "
                                     "what every phase of a process streamed since the last one")
        self.STREAM_DROPPED = Counter("taskloop_stream_dropped_chunks", "Texts given to ctx.stream that were "
                                      "dropped, by reason: unavailable (the store could not be reached), capped "
                                      "(past TASKLOOP_STREAM_MAX_BYTES), ended (after the phase's outcome)",
                                      ["reason"])
        self.STREAM_DROPPED_BYTES = Counter("taskloop_stream_dropped_bytes", "Bytes of live text dropped, by "
                                            "reason (as taskloop_stream_dropped_chunks)", ["reason"])


@functools.cache
def _m() -> _Instruments:
    return _Instruments()


def enabled() -> bool:
    return os.environ.get(ENABLED_ENV) == "1"


def _label(key: str | None) -> str:
    """A task label of bounded cardinality: a graph action counts under its step."""
    if key is None:
        return ""
    return step_of(key) or key


def _capped(value: str) -> str:
    """A label value read from Redis, cut to the longest name taskloop accepts (a counter written
    before names were capped may hold megabytes)."""
    return value[:MAX_LENGTH]


class MetricsHook(Hook):
    """The worker's metrics as a hook (registered where metrics are on: runtime/instruments.py)."""

    def committed(self, write: Committed) -> None:
        observe_events(write.workflow.name, write.events)

    def delivery_refused(self, refused: Refused) -> None:
        _m().REFUSED.labels(refused.reason).inc()

    def reconciled(self, report: Reconciled) -> None:
        for action in RECONCILER_ACTIONS:
            amount = report.counts.get(action, 0)
            if amount:
                _m().RECONCILER.labels(action).inc(amount)

    def limit_throttled(self, throttled: Throttled) -> None:
        _m().THROTTLED.labels(throttled.limit).inc()

    def limit_waited(self, waited: LimitWaited) -> None:
        _m().LIMIT_WAIT.labels(waited.limit).observe(max(waited.seconds, 0.0))

    def stream_written(self, written: StreamWritten) -> None:
        _m().STREAM_WRITES.inc()

    def stream_dropped(self, dropped: StreamDropped) -> None:
        _m().STREAM_DROPPED.labels(dropped.reason).inc(dropped.chunks)
        _m().STREAM_DROPPED_BYTES.labels(dropped.reason).inc(dropped.size)


RECONCILER_ACTIONS = ("redispatched", "replayed", "abandoned", "cleaned", "moved", "gates_cancelled", "forgotten",
                      "conflicts", "unbegun_replayed")


def observe_events(workflow: str, events: Iterable[Event]) -> None:
    """What a committed write tells: phases run, rounds, exhaustions, retries, cache, run endings."""
    for event in events:
        data = event.data or {}
        info = data.get("exec")
        task = _label(event.key)
        if info and not info.get("lost") and not info.get("handed_back"):
            phase = _ran_phase(event)
            outcome = "failed" if event.type == ev.TASK and data.get("status") == "failed" else "completed"
            _m().PHASES.labels(workflow, task, phase, outcome).inc()
            if info.get("took") is not None:
                _m().PHASE_SECONDS.labels(workflow, task, phase).observe(info["took"])
            if info.get("wait") is not None:
                _m().QUEUE_WAIT.labels(workflow, phase).observe(max(info["wait"], 0.0))
        if info and info.get("lost"):
            _m().LOST.labels(workflow).inc()
        if info and info.get("handed_back"):
            _m().HANDED_BACK.labels(workflow).inc()
        if event.type == ev.PHASE and event.phase in ("attempt", "run"):
            _m().ROUNDS.labels(workflow, task).inc()
            if event.phase == "run" and (event.round or 0) > 1:
                _m().RETRIES.labels(workflow, task).inc()
        elif event.type == ev.PHASE and event.phase == "complete":
            if isinstance(data.get("score"), int | float):
                _m().SCORES.labels(workflow, task).observe(data["score"])
            if data.get("done") and event.round:
                _m().ROUNDS_TO_ACCEPT.labels(workflow, task).observe(event.round)
        elif event.type == ev.RETRY:
            _m().RETRIES.labels(workflow, task).inc()
        elif event.type == ev.TASK and (data.get("exhausted") or is_recorded(data.get("error"), LoopTaskExhausted)):
            # failed with LoopTaskExhausted, or a best-of loop that ran out and ended done all the same
            _m().EXHAUSTED.labels(workflow, task, str(data.get("exhausted") or "rounds")).inc()
        elif event.type == ev.TASK and is_recorded(data.get("error"), WorkflowBudgetExceeded):
            _m().BUDGET.labels(workflow).inc()
            if event.phase in ("attempt", "check"):  # a loop's phase: the loop ran out of budget
                _m().EXHAUSTED.labels(workflow, task, "budget").inc()
        elif event.type.startswith(f"{ev.CACHE}."):
            _m().CACHE.labels(workflow, event.type.removeprefix(f"{ev.CACHE}.")).inc()
        elif event.type == ev.RUN_FINISHED:
            _m().RUNS_FINISHED.labels(workflow, data.get("status", ""), data.get("termination") or "").inc()


def _ran_phase(event: Event) -> str:
    """Which phase an outcome's first event closes: a check's 'complete', the attempt behind a
    'check', a plain task's run."""
    if event.type == ev.PHASE and event.phase == "complete":
        return "check"
    if event.type == ev.PHASE and event.phase == "check":
        return "attempt"
    return event.phase or "run"


def restarted() -> None:
    """A supervisor restarted its Celery worker (the supervisor's own process: no hooks there)."""
    if not enabled():
        return
    try:
        _m().RESTARTS.inc()
    except Exception:  # instrumentation never breaks a worker
        log.exception("recording a metric failed")


class FleetCollector:
    """The fleet's gauges and counters, read from Redis at each scrape (``taskloop metrics``)."""

    def __init__(self, store: Any, queues: list[str], broker: Any = None) -> None:
        self.store = store
        self.queues = queues
        self.broker = broker or store.client

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        now = clock.now()
        found = self.store.fleet_view(now)
        live = GaugeMetricFamily("taskloop_runs_live", "Runs not known to be finished (finished runs leave the "
                                 "live index within one reconcile pass)")
        live.add_metric([], found["live"])
        yield live
        due = GaugeMetricFamily("taskloop_leases_expired", "Leases expired and not yet reconciled (phases stuck "
                                "past their lease)")
        due.add_metric([], found["expired_leases"])
        yield due
        queued = GaugeMetricFamily("taskloop_phases_queued", "Messages waiting in a broker queue", labels=["queue"])
        for queue in self.queues:
            queued.add_metric([queue], int(self.broker.llen(queue)))
        yield queued
        last = GaugeMetricFamily("taskloop_reconciler_last_pass_age_seconds", "Seconds since the last reconcile pass")
        if found["last_pass_at"] is not None:
            last.add_metric([], max(now - found["last_pass_at"], 0.0))
        yield last
        started = CounterMetricFamily("taskloop_runs_started", "Runs started, by workflow", labels=["workflow"])
        finished = CounterMetricFamily("taskloop_fleet_runs_finished", "Runs ended, by workflow, status and "
                                       "termination", labels=["workflow", "status", "termination"])
        refused = CounterMetricFamily("taskloop_fleet_refused_deliveries", "Stale or duplicate deliveries refused",
                                      labels=["reason"])
        for name, value in found["stats"].items():
            kind, _, rest = name.partition(":")
            if kind == "started":
                started.add_metric([_capped(rest)], value)
            elif kind == "finished":
                wf, status, term = [*rest.split(":"), "", "", ""][:3]
                finished.add_metric([_capped(wf), _capped(status), _capped(term)], value)
            elif name in ("stale_deliveries", "stale_commits", "dropped_unknown_run"):
                refused.add_metric([name], value)
        yield started
        yield finished
        yield refused
        in_use = GaugeMetricFamily("taskloop_limit_in_use", "A fleet limit's use now: slots held (concurrency), "
                                   "starts or tokens in the window (rate)", labels=["limit"])
        allowed = GaugeMetricFamily("taskloop_limit_allowed", "A fleet limit's slots or rate as it applies now "
                                    "(an operator's override included)", labels=["limit"])
        waiting = GaugeMetricFamily("taskloop_limit_waiting", "Phases waiting for a fleet limit", labels=["limit"])
        totals: dict[str, list[float]] = {}
        for use in self.store.limit_uses(now):
            entry = totals.setdefault(use.name, [0.0, use.allowed, 0.0])
            entry[0] += use.used
            entry[2] += use.waiting
        for name, (used, cap, queued_n) in sorted(totals.items()):
            in_use.add_metric([name], used)
            allowed.add_metric([name], cap)
            waiting.add_metric([name], queued_n)
        yield in_use
        yield allowed
        yield waiting


def fleet_registry(store: Any, queues: list[str], broker: Any = None) -> CollectorRegistry:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(FleetCollector(store, queues, broker))
    return registry

"""Tracing (SPEC §14) on real `taskloop worker` processes, a real Redis and a real OTLP/HTTP
receiver on 127.0.0.1 (tests/otlp.py): the workers export over OTLP as the ``OTEL_*`` variables
say, the test's process (the starter) with a TracerProvider of its own.

- a run is one trace, a child of the span current where it was started: its run span, a span per
  task, per round and per phase, each under the right parent, with the attributes; a span a
  callback makes (a model client's instrumentation) nests under its phase's; a try retried after
  a delay (a message Celery itself builds, collected by the outbox) is in it too; errors are on
  their spans; the runtime's model call (``tl.llm_check``) is a CLIENT span under its check;
- the same with the broker on another Redis (no outbox: messages sent after the write);
- a run that waits at a gate, approved after a pause, still gets its spans right: the gate's task
  span covers the wait, and what runs after the approval is in the same trace;
- with tracing off, a worker imports no opentelemetry module (checked inside a callback).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

pytest.importorskip("opentelemetry.sdk", reason="tracing needs taskloop[otel]")

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import taskloop as tl
from taskloop.ops.embedded import RedisServer
from taskloop.ops.otel import TracingHook
from taskloop.runtime import instruments
from taskloop.runtime.client import TaskLoop
from tests.conftest import REPO
from tests.integration import trace_flows as tf
from tests.integration.flows import recorded
from tests.llm_server import ChatServer, Reply
from tests.otlp import Received, Receiver
from tests.waiting import wait_until
from tests.workers import WorkerProcess

pytestmark = pytest.mark.timeout(180)
IMPORTS = ["tests.integration.trace_flows"]
# where opentelemetry is installed, for the workers' PYTHONPATH (tests/workers.py sets it to the repository)
OTEL_PATH = str(Path(importlib.util.find_spec("opentelemetry.sdk").submodule_search_locations[0]).parents[1])  # type: ignore[union-attr,index]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """This module's own Redis (conftest's ``client`` and ``probe`` use it)."""
    with RedisServer(tmp_path_factory.mktemp("tracing-redis")) as server:
        yield server


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver() as found:
        yield found


@pytest.fixture(scope="module")
def chat() -> Iterator[ChatServer]:
    with ChatServer() as server:
        yield server


@pytest.fixture(scope="module")
def starter(receiver: Receiver) -> Iterator[Any]:
    """The test's process as an application with its own TracerProvider: its tracer, and the
    tracing hook on it (added for this module, removed after)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "starter"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")))
    tl.add_hook(TracingHook(provider))
    yield provider.get_tracer("the-app")
    instruments.reset(added=True)
    provider.shutdown()


def traced_env(receiver: Receiver, **more: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_SERVICE_NAME": "taskloop-worker",
            "OTEL_BSP_SCHEDULE_DELAY": "50", "PYTHONPATH": f"{REPO}:{OTEL_PATH}", **more}


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer, receiver: Receiver, chat: ChatServer,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    found = WorkerProcess(redis_server.url, IMPORTS, tmp_path_factory.mktemp("tracing") / "w.log", name="tr",
                          env=traced_env(receiver, TASKLOOP_LLM_BASE_URL=chat.base_url,
                                         TASKLOOP_LLM_MODEL="judge-model")).ready()
    yield found
    found.terminate()
    found.wait(30)


def started(client: TaskLoop, tracer: Any, workflow: tl.Workflow) -> tuple[str, str, str]:
    """Start a run inside a span of the application: (run id, trace id, that span's id)."""
    with tracer.start_as_current_span("request") as request:
        run_id = client.start(workflow, {}).run_id
    context = request.get_span_context()
    return run_id, f"{context.trace_id:032x}", f"{context.span_id:016x}"


def trace_of(receiver: Receiver, trace_id: str, count: int) -> dict[str, list[Received]]:
    """The spans of a trace by name, once ``count`` have arrived."""
    spans = receiver.wait_for(lambda found: sum(s.trace_id == trace_id for s in found) >= count,
                              f"{count} spans of trace {trace_id}")
    named: dict[str, list[Received]] = {}
    for span in sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start):
        named.setdefault(span.name, []).append(span)
    return named


def one(named: dict[str, list[Received]], name: str) -> Received:
    [span] = named[name]
    return span


def check_run(named: dict[str, list[Received]], request: str, run_id: str, workflow: str,
              status: str = "done") -> Received:
    run = one(named, f"run {workflow}")
    assert run.parent == request and run.service == "taskloop-worker"
    assert run.attributes == {"taskloop.run_id": run_id, "taskloop.workflow": workflow, "taskloop.version": "1",
                              "taskloop.status": status, **({"taskloop.termination": "failed"}
                                                             if status == "failed" else {})}
    return run


def under(child: Received, parent: Received, slack: float = 0.05) -> None:
    """``child`` is a child of ``parent`` and within its time."""
    assert child.parent == parent.span_id, (child.name, parent.name)
    assert parent.start - slack <= child.start and child.end <= parent.end + slack, (child, parent)


def check_traced(named: dict[str, list[Received]], request: str, run_id: str) -> None:
    """The tree of a run of trace_flows.traced."""
    run = check_run(named, request, run_id, "traced")
    draft, publish = one(named, "task draft"), one(named, "task publish")
    for task in (draft, publish):
        under(task, run)
        assert task.attributes["taskloop.status"] == "done" and task.attributes["taskloop.rounds"] == 2
    rounds = {(s.attributes["taskloop.task"], s.attributes["taskloop.round"]): s
              for s in named["round draft"] + named["round publish"]}
    assert sorted(rounds) == [("draft", 1), ("draft", 2), ("publish", 1), ("publish", 2)]
    for (key, _), span in rounds.items():
        under(span, draft if key == "draft" else publish)
    assert [(rounds["draft", n].attributes["taskloop.verdict"], rounds["draft", n].attributes["taskloop.score"])
            for n in (1, 2)] == [("rejected", 0.5), ("accepted", 1.0)]
    assert "taskloop.verdict" not in rounds["publish", 1].attributes
    phases = named["attempt draft"] + named["check draft"] + named["run publish"]
    assert len(phases) == 6
    for phase in phases:
        attributes = phase.attributes
        under(phase, rounds[attributes["taskloop.task"], attributes["taskloop.round"]])
        assert attributes["taskloop.run_id"] == run_id and attributes["taskloop.workflow"] == "traced"
        assert attributes["taskloop.version"] == "1" and attributes["taskloop.worker"].startswith("tr@")
        assert attributes["taskloop.phase"] in ("attempt", "check", "run") and attributes["taskloop.attempt"] >= 1
    for attempt in named["attempt draft"]:
        assert attempt.attributes["gen_ai.usage.input_tokens"] == 10
        assert attempt.attributes["gen_ai.usage.output_tokens"] == 5
    checks = {s.attributes["taskloop.round"]: s for s in named["check draft"]}
    assert (checks[2].attributes["taskloop.verdict"], checks[2].attributes["taskloop.score"]) == ("accepted", 1.0)
    # a span the callback made nests under its phase's (the phase's span is current inside it)
    attempts = {s.span_id: s for s in named["attempt draft"]}
    assert sorted(attempts[s.parent].attributes["taskloop.round"] for s in named["model.generate"]) == [1, 2]
    # the try that failed is an error on its phase, with the exception; the retried one is fine
    tries = {s.attributes["taskloop.round"]: s for s in named["run publish"]}
    assert tries[1].status == 2 and "ConnectionError: first try fails" in tries[1].message
    assert tries[1].events == ["exception"] and tries[2].status == 0


def test_a_run_is_one_trace_under_the_span_that_started_it(client: TaskLoop, starter: Any, worker: WorkerProcess,
                                                           receiver: Receiver) -> None:
    run_id, trace_id, request = started(client, starter, tf.traced)
    assert client.wait(run_id, timeout=30).status == "done"
    named = trace_of(receiver, trace_id, 16)  # request, run, 2 tasks, 4 rounds, 6 phases, 2 of the callbacks
    assert one(named, "request").parent == ""
    check_traced(named, request, run_id)


def test_errors_are_recorded_on_their_spans(client: TaskLoop, starter: Any, worker: WorkerProcess,
                                            receiver: Receiver) -> None:
    run_id, trace_id, request = started(client, starter, tf.traced_fails)
    assert client.wait(run_id, timeout=30).status == "failed"
    named = trace_of(receiver, trace_id, 5)  # request, run, task, round, phase
    run = check_run(named, request, run_id, "traced-fails", status="failed")
    task, round_, phase = one(named, "task boom"), one(named, "round boom"), one(named, "run boom")
    under(task, run)
    under(round_, task)
    under(phase, round_)
    assert run.status == task.status == phase.status == 2
    assert task.message == "ValueError: no luck" and phase.message == "ValueError: no luck"
    assert phase.events == ["exception"] and phase.attributes["taskloop.outcome"] == "fail"


def test_a_model_call_is_a_client_span_under_its_check(client: TaskLoop, starter: Any, worker: WorkerProcess,
                                                       receiver: Receiver, chat: ChatServer) -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    chat.script(Reply("No: add a conclusion.", usage=usage), Reply("Done.", usage=usage))
    run_id, trace_id, request = started(client, starter, tf.traced_judged)
    assert client.wait(run_id, timeout=30).status == "done"
    named = trace_of(receiver, trace_id, 11)  # request, run, task, 2 rounds, 4 phases, 2 model calls
    check_run(named, request, run_id, "traced-judged")
    checks = {s.span_id: s for s in named["check essay"]}
    calls = named["chat judge-model"]
    assert len(calls) == 2 and {c.kind for c in calls} == {3}  # CLIENT
    for call in calls:
        under(call, checks[call.parent])
        assert call.attributes == {"gen_ai.operation.name": "chat", "gen_ai.request.model": "judge-model",
                                   "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 3}


def test_a_gate_that_waits_still_gets_its_spans_right(client: TaskLoop, starter: Any, worker: WorkerProcess,
                                                      receiver: Receiver) -> None:
    run_id, trace_id, request = started(client, starter, tf.traced_gate)
    wait_until(lambda: client.inspect(run_id).status == "waiting", timeout=20, what="the gate to wait")
    time.sleep(1.5)  # the decision comes later, from this process
    client.decide(run_id, "approval", "approve", actor="alice")
    assert client.wait(run_id, timeout=30).status == "done"
    named = trace_of(receiver, trace_id, 9)  # request, run, 3 tasks, 2 rounds, 2 phases
    run = check_run(named, request, run_id, "traced-gate")
    prep, gate, ship = one(named, "task prep"), one(named, "task approval"), one(named, "task ship")
    for task in (prep, gate, ship):
        under(task, run)
    assert prep.end <= gate.start + 0.05 and gate.end <= ship.start + 0.05
    assert gate.end - gate.start >= 1.5 and "round approval" not in named  # a gate has no rounds
    under(one(named, "run ship"), one(named, "round ship"))
    under(one(named, "round ship"), ship)
    assert one(named, "task approval").service == "starter"  # the decision's write ended it, here


def test_the_same_with_the_broker_on_another_redis(client: TaskLoop, starter: Any, receiver: Receiver,
                                                   redis_server: RedisServer, tmp_path: Path) -> None:
    (tmp_path / "broker").mkdir()
    with RedisServer(tmp_path / "broker") as broker:
        found = WorkerProcess(redis_server.url, IMPORTS, tmp_path / "w.log", name="tr", broker_url=broker.url,
                              env=traced_env(receiver)).ready()
        other = TaskLoop(redis_server.url, broker_url=broker.url)
        try:
            assert not other.send.folds  # no outbox: the messages are sent after each write
            run_id, trace_id, request = started(other, starter, tf.traced)
            assert other.wait(run_id, timeout=30).status == "done"
            check_traced(trace_of(receiver, trace_id, 16), request, run_id)
        finally:
            other.close()
            found.terminate()
            found.wait(30)


def test_a_worker_that_stops_sends_the_spans_it_buffered(client: TaskLoop, starter: Any, receiver: Receiver,
                                                          redis_server: RedisServer, tmp_path: Path) -> None:
    """Its pool processes end without ``atexit``: the hooks' ``process_ending`` flushes them."""
    found = WorkerProcess(redis_server.url, IMPORTS, tmp_path / "w.log", name="buf", queues="buffered",
                          env=traced_env(receiver, OTEL_BSP_SCHEDULE_DELAY="600000")).ready()
    try:
        run_id, trace_id, request = started(client, starter, tf.buffered)
        assert client.wait(run_id, timeout=30).status == "done"
        time.sleep(1.0)
        assert [s.name for s in receiver.of_trace(trace_id)] == ["request"]  # the worker's are buffered
    finally:
        found.terminate()
        found.wait(30)
    named = trace_of(receiver, trace_id, 5)  # request, run, task, round, phase
    check_run(named, request, run_id, "traced-buffered")
    under(one(named, "run once"), one(named, "round once"))


def test_with_tracing_off_a_worker_imports_no_opentelemetry(client: TaskLoop, starter: Any, probe: redis.Redis,
                                                            redis_server: RedisServer, tmp_path: Path) -> None:
    """redis-py (8.x) imports opentelemetry's metrics API and SDK by itself when they are installed
    (redis/observability): taskloop adds nothing to that, no tracing module, no exporter, no span."""
    env = {"PYTHONPATH": f"{REPO}:{OTEL_PATH}"}
    probe_modules = ("import sys, taskloop.worker.tasks, redis.asyncio; print(' '.join(sorted(m for m in sys.modules "
                     "if m.split('.')[0] == 'opentelemetry')))")
    redis_own = set(subprocess.run([sys.executable, "-c", probe_modules], capture_output=True, text=True, check=True,
                                   env={**os.environ, **env}, timeout=60).stdout.split())
    # opentelemetry is installed where the worker looks, and the run's messages carry a traceparent
    found = WorkerProcess(redis_server.url, IMPORTS, tmp_path / "w.log", name="off", queues="untraced",
                          env=env).ready()
    try:
        run_id, _, _ = started(client, starter, tf.untraced)
        assert client.wait(run_id, timeout=30).status == "done"
    finally:
        found.terminate()
        found.wait(30)
    [loaded] = recorded(probe, run_id, "otel")
    assert set(loaded) <= redis_own
    assert not [m for m in loaded if m.startswith(("taskloop.ops.otel", "opentelemetry.sdk.trace",
                                                   "opentelemetry.exporter", "opentelemetry.propagate"))]
    assert client.store.hmget(run_id, ["tc"])[0]  # it was started traced all the same (compacted or not)

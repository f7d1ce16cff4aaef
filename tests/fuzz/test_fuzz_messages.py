"""Fuzzing the broker: raw messages published straight onto taskloop's queue with kombu, as anyone
who can write to the broker could (see tests/faults/test_malformed.py for the hand-picked cases).

Each example publishes a batch of hostile messages: phase tasks (``taskloop.attempt|check|run``)
with wrong types, ids, rounds, tokens, extra args, kwargs; ``taskloop.dispatch``, ``.settle`` and
``.start`` with bad arguments; unknown task names; bodies that are not JSON, JSON of the wrong
shape, ints JSON cannot turn into Python ints, pickle and other content types; huge strings;
line breaks in ids, keys, task names, task ids and shadow names. Properties, after the batch:

* every process of the worker (supervisor, Celery worker, pool) is the same, still alive, and it
  keeps consuming: a real run started after the batch finishes;
* no record of the runs that exist changes (their run hash, events, leases and end marker are
  byte for byte the same, but for the ``s:`` counters of refused deliveries);
* nothing is created in Redis for run ids that do not exist (no new taskloop key, no new entry
  in the run indexes) but the run started after the batch;
* every log line is a line of its own: no text from a message starts a line of the worker's log
  (the ``FORGED`` marker after a line break never begins one), and no line is huge.

CI publishes a few batches; ``TASKLOOP_FUZZ_PROFILE=long python -m pytest
tests/fuzz/test_fuzz_messages.py`` publishes hundreds.
"""

from __future__ import annotations

import itertools
import json
import pickle
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from hypothesis import event, example, given
from hypothesis import strategies as st

from taskloop.core import fields as fld
from taskloop.runtime.client import TaskLoop
from taskloop.runtime.fleet import HEARTBEAT_S
from taskloop.store import keys as k
from tests.fuzz import TIMEOUT, fuzz
from tests.fuzz.conftest import FuzzWorker
from tests.fuzz.flows import CHECKS, GATES, PING
from tests.fuzz.strategies import SPEC_NAME, hostile_text
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(TIMEOUT)]

QUEUE = "taskloop"
MARKER = "FORGED"
FORGE = f"\n{MARKER} CRITICAL/MainProcess] forged line\r{MARKER}\u2028{MARKER}"
FINISHED, LOOP, WAITING = "fuzz-msg-finished", "fuzz-msg-loop", "fuzz-msg-waiting"  # the runs that exist
MAX_LINE = 20_000  # a log line longer than this is a payload dumped into the log
_serial = itertools.count()


@dataclass
class Existing:
    """Runs that exist while the messages arrive: one finished, one exhausted loop, one waiting at a gate."""

    ids: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def existing(fuzz_worker: FuzzWorker, fuzz_client: TaskLoop) -> Existing:
    found = Existing()
    found.ids["finished"] = fuzz_client.start(PING, {}, run_id=FINISHED).run_id
    exhausted = {"check": {"loopcheck": {"done": {"json": False}, "feedback": {"json": "no"}}}}
    found.ids["loop"] = fuzz_client.start(CHECKS, exhausted, run_id=LOOP).run_id
    found.ids["waiting"] = fuzz_client.start(GATES["approval"], {}, run_id=WAITING).run_id
    for name in ("finished", "loop"):
        fuzz_client.wait(found.ids[name], timeout=30)
        # the worker's reconciler compacts a finished run (store/compacted.py): once, before the tests
        # compare its records, not while they do
        run = k.RunKeys.of(found.ids[name]).run
        wait_until(lambda run=run: fuzz_client.store.client.hget(run, fld.F_COMPACT), timeout=30,
                   what=f"the {name} run to be compacted")
    wait_until(lambda: fuzz_client.inspect(found.ids["waiting"]).status == "waiting", what="the gate run to wait")
    return found


# --- messages -----------------------------------------------------------------------------------

def _huge(n: int) -> str:
    return "r" * n


RUN_IDS = st.one_of(
    st.sampled_from([FINISHED, LOOP, WAITING]),
    st.sampled_from(["fuzz-msg-nope", "0", "a" * 200, "a" * 201]),
    hostile_text(max_size=20).map(lambda s: s + FORGE),
    st.sampled_from([10_000, 2_000_000]).map(_huge),
    st.one_of(st.integers(), st.none(), st.booleans(), st.floats(allow_nan=False), st.lists(st.text(max_size=3),
                                                                                             max_size=2)),
)
KEYS = st.one_of(
    st.sampled_from(["judged", "ping", "gate", "prep", "after", "nope", "gate@1", "judged@2"]),
    hostile_text(max_size=10).map(lambda s: s + FORGE),
    st.sampled_from([300, 1_000_000]).map(_huge),
    st.one_of(st.integers(), st.none(), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)),
)
NUMBERS = st.one_of(
    st.integers(-3, 5), st.sampled_from([0, -1, 2**31, 2**53 + 1, 2**63, 2**64 + 1, 10**40]),
    st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.sampled_from(["1", "", None]),
)
PHASE_TASKS = ["taskloop.attempt", "taskloop.check", "taskloop.run"]
TASK_NAMES = st.one_of(
    st.sampled_from(PHASE_TASKS), st.sampled_from(PHASE_TASKS),
    st.sampled_from(["taskloop.dispatch", "taskloop.settle", "taskloop.start", "taskloop.nope", "celery.ping", ""]),
    hostile_text(max_size=12).map(lambda s: "taskloop." + s + FORGE),
)


@st.composite
def phase_args(draw: st.DrawFn) -> list[Any]:
    if draw(st.integers(0, 5)) == 0:  # the wrong number of arguments
        return draw(st.lists(st.one_of(RUN_IDS, KEYS, NUMBERS), max_size=6))
    return [draw(RUN_IDS), draw(KEYS), draw(NUMBERS), draw(NUMBERS)]


@st.composite
def start_kwargs(draw: st.DrawFn) -> dict[str, Any]:
    """taskloop.start by keyword is how any Celery client starts a run: only ones that must be
    refused are sent here (a bad workflow name, version or run id, or an unknown keyword)."""
    kwargs: dict[str, Any] = {"workflow": draw(st.one_of(st.just("fuzz-ping"), hostile_text(max_size=8)))}
    if draw(st.booleans()):
        kwargs["input"] = draw(st.one_of(st.none(), st.integers(), st.text(max_size=5)))
    bad = []
    if not (isinstance(kwargs["workflow"], str) and SPEC_NAME.match(kwargs["workflow"])):
        bad.append("workflow")
    if draw(st.booleans()):
        kwargs["run_id"] = draw(st.one_of(hostile_text(max_size=8).map(lambda s: s + FORGE), st.integers()))
        bad.append("run_id")
    if draw(st.booleans()):
        kwargs["version"] = draw(st.one_of(st.just(""), st.integers(), st.just("\ud800")))
        bad.append("version")
    if not bad or draw(st.booleans()):
        kwargs[draw(st.sampled_from(["extra", "workflow_name", "runid"]))] = 1
    return kwargs


@dataclass
class Message:
    task: str
    body: bytes
    content_type: str = "application/json"
    content_encoding: str = "utf-8"
    headers: dict[str, Any] | None = None  # None: the usual protocol-2 headers for ``task``

    def __repr__(self) -> str:
        body = self.body if len(self.body) < 200 else self.body[:200] + b"..."
        return f"Message({self.task!r}, {body!r}, {self.content_type!r}, {self.content_encoding!r}, {self.headers!r})"


EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def _json_body(args: Any, kwargs: Any) -> bytes:
    return json.dumps([args, kwargs, EMBED]).encode()


@st.composite
def messages(draw: st.DrawFn) -> Message:
    task = draw(TASK_NAMES)
    if task == "taskloop.start":
        args, kwargs = ([], draw(start_kwargs())) if draw(st.booleans()) else ([draw(RUN_IDS)], {})
    elif task == "taskloop.dispatch":
        args, kwargs = [draw(RUN_IDS), draw(st.one_of(st.lists(KEYS, max_size=3), KEYS))], {}
    elif task == "taskloop.settle":
        args, kwargs = draw(st.lists(RUN_IDS, min_size=0, max_size=2)), {}
    else:
        args = draw(phase_args())
        kwargs = draw(st.one_of(st.just({}), st.just({}), st.dictionaries(st.sampled_from(["extra", "run_id", "round"]),
                                                                           st.integers(), min_size=1, max_size=2)))
    shape = draw(st.sampled_from(["json"] * 6 + ["broken", "wrong-shape", "huge-int", "pickle", "content-type",
                                                  "binary", "protocol-1", "headers"]))
    if shape == "json":
        return Message(task, _json_body(args, kwargs))
    if shape == "broken":
        broken = [b'{"not": json', b"[[1,2", b"", b"\x00\xff", b'["a\n' + FORGE.encode()]
        return Message(task, draw(st.sampled_from(broken)))
    if shape == "wrong-shape":
        value = draw(st.one_of(st.none(), st.integers(), st.text(max_size=5), st.just({}), st.just([1]),
                               st.just([args]), st.just([args, kwargs]), st.just([args, "x", EMBED])))
        return Message(task, json.dumps(value).encode())
    if shape == "huge-int":  # JSON text holds any int; Python refuses to parse one past 4300 digits
        digits = draw(st.sampled_from([4300, 4301, 20_000]))
        return Message(task, b'[["fuzz-msg-nope","k",1' + b"0" * digits + b",0],{},{}]")
    if shape == "pickle":
        return Message(task, pickle.dumps((tuple(args), kwargs, EMBED)), "application/x-python-serialize", "binary")
    if shape == "content-type":
        content_type = draw(st.sampled_from(["application/x-yaml", "text/plain", "application/data", "",
                                             "application/x-msgpack", "application/json; charset=latin-1"]))
        return Message(task, _json_body(args, kwargs), content_type)
    if shape == "binary":
        return Message(task, draw(st.binary(max_size=40)), "application/json", draw(st.sampled_from(["binary", "utf-16",
                                                                                                        "gzip"])))
    if shape == "protocol-1":  # no task header: Celery reads the body as a protocol 1 message
        body = {"task": task, "id": draw(hostile_text(max_size=6)) + FORGE, "args": args, "kwargs": kwargs}
        return Message(task, json.dumps(body).encode(), headers={})
    # protocol 2 with hostile headers: task id, shadow name, argsrepr, retries, a root id
    forged = hostile_text(max_size=8).map(lambda s: s + FORGE)
    headers = {"lang": "py", "task": task, "id": draw(st.one_of(st.just(str(uuid.uuid4())), forged, st.integers())),
               "shadow": draw(st.one_of(st.none(), forged)), "argsrepr": draw(forged),
               "retries": draw(st.one_of(st.just(0), st.text(max_size=2), st.integers())), "root_id": None,
               "parent_id": None, "group": None, "kwargsrepr": "", "origin": "fuzz" + FORGE}
    return Message(task, _json_body(args, kwargs), headers=headers)


def publish(client: TaskLoop, batch: list[Message]) -> None:
    app = client.app
    with app.connection_for_write() as conn:
        producer = conn.Producer()
        for message in batch:
            headers = message.headers
            if headers is None:
                headers = {"lang": "py", "task": message.task, "id": str(uuid.uuid4()), "root_id": None,
                           "parent_id": None, "group": None, "argsrepr": "", "kwargsrepr": "", "origin": "fuzz"}
            producer.publish(message.body, exchange=QUEUE, routing_key=QUEUE, content_type=message.content_type,
                             content_encoding=message.content_encoding, headers=headers,
                             declare=[app.amqp.queues[QUEUE]])


# --- what must not change -----------------------------------------------------------------------

def record_of(probe: redis.Redis, run_id: str) -> dict[str, Any]:
    """Everything Redis holds about a run, but the counters of refused deliveries (``s:`` fields)."""
    keys = k.RunKeys.of(run_id)
    fields = {name: value for name, value in probe.hgetall(keys.run).items() if not name.startswith(b"s:")}
    return {"run": fields, "events": probe.xrange(keys.events), "leases": probe.zrange(keys.leases, 0, -1,
                                                                                      withscores=True),
            "end": probe.lrange(keys.end, 0, -1)}


def taskloop_keys(probe: redis.Redis) -> set[bytes]:
    return set(probe.keys("tl:*"))


def indexed(probe: redis.Redis) -> set[bytes]:
    return set(probe.zrange(k.RUNS_INDEX, 0, -1)) | set(probe.zrange(k.LIVE_INDEX, 0, -1))


def drained(probe: redis.Redis) -> bool:
    """Every message was taken off the queue and is done: the queue is empty, and the workers'
    heartbeats written after that hold nothing (kombu keeps no copy of a message a worker took:
    what a worker holds, its heartbeat lists, taskloop/worker/liveness/presence.py)."""
    if probe.llen(QUEUE):
        return False
    since = time.time()
    deadline = since + 3 * HEARTBEAT_S
    while time.time() < deadline:
        beats = [json.loads(raw) for raw in probe.hvals("tl:workers")]
        fresh = [beat for beat in beats if beat.get("at", 0) > since]
        if beats and len(fresh) == len(beats):
            return all(not beat.get("held") for beat in fresh) and probe.llen(QUEUE) == 0
        time.sleep(0.05)
    return False


@given(batch=st.lists(messages(), min_size=1, max_size=20))
@example(batch=[Message("taskloop.attempt", _json_body(["x" + FORGE, "k", 1, 0], {})),
                Message("taskloop.attempt", _json_body([WAITING, "gate", 1, 0], {}),
                        headers={"lang": "py", "task": "taskloop.attempt", "id": "id" + FORGE, "shadow": "s" + FORGE}),
                Message("taskloop.nope" + FORGE, _json_body([1], {})),
                Message("taskloop.check", _json_body([LOOP, "judged", 2, 0], {"extra": True})),
                Message("taskloop.attempt", pickle.dumps(((FINISHED, "ping", 1, 0), {}, EMBED)),
                        "application/x-python-serialize", "binary"),
                Message("taskloop.run", b'{"not": json'),
                Message("taskloop.run", _json_body([_huge(2_000_000), "ping", 1, 0], {})),
                Message("taskloop.start", _json_body([], {"workflow": "x" + FORGE, "input": 1})),
                Message("taskloop.dispatch", _json_body([WAITING, ["gate", "after", "prep"]], {})),
                Message("taskloop.settle", _json_body([WAITING], {}))])
@fuzz(ci=10, long=400, live=True)
def test_hostile_messages_change_nothing_and_workers_keep_consuming(
        fuzz_worker: FuzzWorker, fuzz_client: TaskLoop, fuzz_probe: redis.Redis, existing: Existing,
        batch: list[Message]) -> None:
    for message in batch:
        event(f"task {message.task if message.task in PHASE_TASKS else 'other'}")
    records = {run_id: record_of(fuzz_probe, run_id) for run_id in existing.ids.values()}
    keys, runs = taskloop_keys(fuzz_probe), indexed(fuzz_probe)
    log_from = len(fuzz_worker.log())
    publish(fuzz_client, batch)
    # the worker keeps consuming: a run started after the batch ends
    ping_id = f"fuzz-msg-ping-{next(_serial)}"
    result = fuzz_client.start(PING, {}, run_id=ping_id).wait(timeout=60)
    assert result.status == "done", result
    wait_until(lambda: drained(fuzz_probe), timeout=60, what="every message to be consumed")
    time.sleep(0.05)  # the last acknowledgement may come a moment before its log line
    # every process is the one that started
    assert fuzz_worker.processes() == fuzz_worker.pids, "a worker process died or was replaced"
    # no record of a run that exists changed
    for run_id, before in records.items():
        assert record_of(fuzz_probe, run_id) == before, f"the records of run {run_id} changed"
    # nothing was created for runs that do not exist
    # (the ping runs exist: this one's keys, and an earlier one's compact record, written as it is compacted)
    created = {key for key in taskloop_keys(fuzz_probe) - keys if not key.startswith(b"tl:{fuzz-msg-ping-")}
    assert not {key for key in created if key.startswith(b"tl:{")}, f"keys created: {created}"
    assert indexed(fuzz_probe) - runs <= {ping_id.encode()}, "runs indexed that were never started"
    # one record, one line
    log = fuzz_worker.log()[log_from:]
    lines = log.splitlines()
    forged = [line for line in lines if line.startswith(MARKER)]
    assert not forged, f"a message forged log lines: {forged[:3]}"
    longest = max((len(line) for line in lines), default=0)
    assert longest <= MAX_LINE, f"a log line of {longest} characters"
    # every taskloop task refused what it was sent (Refused) instead of failing on it
    unexpected = [line for line in lines if "raised unexpected" in line or "Unrecoverable error" in line]
    assert not unexpected, f"a message made a task fail or the worker stop: {unexpected[:3]}"


def test_stale_messages_for_an_existing_run_only_count(fuzz_worker: FuzzWorker, fuzz_client: TaskLoop,
                                                        fuzz_probe: redis.Redis, existing: Existing) -> None:
    """Well-formed messages with stale tokens for the waiting run are refused as stale: counted in
    the run's ``s:stale_deliveries``, nothing else of it changes, the log says so on one line each."""
    run_id = existing.ids["waiting"]
    before = record_of(fuzz_probe, run_id)
    count = int(fuzz_probe.hget(k.RunKeys.of(run_id).run, fld.stat_field("stale_deliveries")) or 0)
    publish(fuzz_client, [Message(task, _json_body([run_id, key, 1, token], {}))
                          for task, key, token in itertools.product(PHASE_TASKS, ("gate", "prep", "after"), (0, 99))])
    wait_until(lambda: int(fuzz_probe.hget(k.RunKeys.of(run_id).run, fld.stat_field("stale_deliveries")) or 0)
               >= count + 18, what="18 stale deliveries counted")
    assert record_of(fuzz_probe, run_id) == before
    assert fuzz_worker.processes() == fuzz_worker.pids


# --- regressions (found by the fuzzer) ----------------------------------------------------------

def _consumed_and_alive(worker: FuzzWorker, client: TaskLoop, probe: redis.Redis) -> None:
    result = client.start(PING, {}, run_id=f"fuzz-msg-ping-{next(_serial)}").wait(timeout=30)
    assert result.status == "done", result
    wait_until(lambda: drained(probe), what="every message to be consumed")
    assert worker.processes() == worker.pids, "a worker process died or was replaced"


@pytest.mark.parametrize("body", [b"", b"5", b"null", b'"x"', b"true", b"1.5"])
def test_a_task_message_whose_body_is_a_json_scalar_does_not_stop_the_worker(
        fuzz_worker: FuzzWorker, fuzz_client: TaskLoop, fuzz_probe: redis.Redis, body: bytes) -> None:
    """Celery 5.7's consumer raised TypeError on such a message ('args' not in message.payload) and the
    worker stopped ("Unrecoverable error"), restoring the message to the queue for the next worker to
    die on. taskloop's consumer (taskloop/worker/consumer.py) drops it with one log line."""
    log_from = len(fuzz_worker.log())
    publish(fuzz_client, [Message("taskloop.attempt", body)])
    _consumed_and_alive(fuzz_worker, fuzz_client, fuzz_probe)
    log = fuzz_worker.log()[log_from:]
    assert "malformed task message dropped: " in log and "Unrecoverable error" not in log


def test_a_line_break_in_a_task_id_or_shadow_header_forges_no_log_line(
        fuzz_worker: FuzzWorker, fuzz_client: TaskLoop, fuzz_probe: redis.Redis) -> None:
    """Celery logs a message's task id and shadow name as they are (``Task %(name)s[%(id)s] received``);
    the worker's log filter (taskloop/worker/tasks.py OneLineArgs) escapes line breaks in them."""
    log_from = len(fuzz_worker.log())
    headers = {"lang": "py", "task": "taskloop.attempt", "id": "id" + FORGE, "shadow": "shadow" + FORGE,
               "root_id": None, "parent_id": None, "group": None, "argsrepr": "", "kwargsrepr": ""}
    publish(fuzz_client, [Message("taskloop.attempt", _json_body([WAITING, "gate", 1, 0], {}), headers=headers)])
    _consumed_and_alive(fuzz_worker, fuzz_client, fuzz_probe)
    lines = fuzz_worker.log()[log_from:].splitlines()
    assert any("id\\nFORGED" in line for line in lines), lines
    assert not [line for line in lines if line.startswith(MARKER)]


def test_a_start_message_with_a_name_no_workflow_can_have_records_no_run(
        fuzz_worker: FuzzWorker, fuzz_client: TaskLoop, fuzz_probe: redis.Redis) -> None:
    """``taskloop.start`` by keyword recorded a run for any workflow string (line breaks included) and
    then failed it; a name, version or run id that no run can have is refused before Redis now."""
    keys, runs = taskloop_keys(fuzz_probe), indexed(fuzz_probe)
    log_from = len(fuzz_worker.log())
    publish(fuzz_client, [Message("taskloop.start", _json_body([], kwargs)) for kwargs in (
        {"workflow": "x" + FORGE, "input": 1}, {"workflow": "fuzz-ping", "version": ""},
        {"workflow": "fuzz-ping", "run_id": "bad id" + FORGE}, {"workflow": "fuzz-ping", "version": 5})])
    _consumed_and_alive(fuzz_worker, fuzz_client, fuzz_probe)
    new_runs = indexed(fuzz_probe) - runs
    assert len(new_runs) == 1 and next(iter(new_runs)).startswith(b"fuzz-msg-ping-"), new_runs
    assert {key for key in taskloop_keys(fuzz_probe) - keys if b"fuzz-msg-ping-" not in key} <= {k.STATS.encode()}
    log = fuzz_worker.log()[log_from:]
    assert log.count("malformed taskloop.start message dropped") == 4, log

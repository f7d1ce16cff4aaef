"""Fuzzing what a client hands to taskloop: run inputs, run ids, workflow names and versions, and
the run ids of every reading or control call, against a real redis-server (no worker needed: the
phase messages the starts dispatch just wait on the queue).

Properties:

* a run input is accepted exactly when it is lossless JSON (decided here by a json round trip,
  not by taskloop's own check), and then the stored input reads back equal with the same types;
  otherwise ``InvalidInput`` names the input and the path of the offending element. Never another
  exception, whatever the value: NaN, inf, -0.0, ints past 4300 digits, lone surrogates, non-str
  keys, bytes, sets, tuples, objects, nesting 10,000 deep;
* a run id is accepted exactly when it matches the documented pattern, else ``InvalidInput``;
  a refused start writes nothing to Redis;
* every call that takes a run id answers an unknown or malformed one with ``RunNotFound``,
  ``InvalidInput`` or ``GateRefused``, and writes nothing.

Long run: ``TASKLOOP_FUZZ_PROFILE=long python -m pytest tests/fuzz/test_fuzz_inputs.py``.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import assume, event, given
from hypothesis import strategies as st

import taskloop as tl
from taskloop.base import names
from taskloop.base.config import Settings
from taskloop.base.errors import GateRefused, InvalidInput, RunNotFound, TaskLoopError
from taskloop.define.workflow import REGISTRY
from taskloop.ops.embedded import RedisServer
from taskloop.runtime.client import TaskLoop
from taskloop.store import keys as k
from tests.fuzz import TIMEOUT, fuzz
from tests.fuzz.strategies import (
    SPEC_NAME,
    SPEC_RUN_ID,
    deep_values,
    hostile_text,
    is_lossless,
    jsonish,
    lossless_json,
    nested,
    same_json,
)

pytestmark = pytest.mark.timeout(TIMEOUT)

_serial = itertools.count()

echo = tl.define_task("echo", run=lambda ctx: ctx.input)
ECHO = tl.define_workflow("fuzz-inputs-echo", version="1", tasks=[echo])
UNREGISTERED = "fuzz-inputs-nobody-has-this"  # started by name: recorded pending, planned by no one
INPUT_ERROR = re.compile(r"run input must be lossless JSON values: \$")


def _run_id() -> str:
    return f"fuzz-input-{next(_serial)}"


def _keys(probe: redis.Redis) -> set[bytes]:
    """Every taskloop key but the global counters (a refused call may count itself there)."""
    return {key for key in probe.keys("tl:*") if key != k.STATS.encode()}


INPUTS = st.one_of(jsonish(), lossless_json(), deep_values())


@given(value=INPUTS, by_name=st.booleans())
@fuzz(ci=120, long=5000)
def test_run_inputs_round_trip_or_are_refused_with_a_path(fuzz_client: TaskLoop, fuzz_probe: redis.Redis,
                                                           value: Any, by_name: bool) -> None:
    run_id = _run_id()
    before = _keys(fuzz_probe)
    try:
        handle = fuzz_client.start(UNREGISTERED if by_name else ECHO, value, run_id=run_id)
    except InvalidInput as exc:
        event("refused")
        assert not is_lossless(value), f"a lossless input was refused: {exc}"
        assert INPUT_ERROR.match(str(exc)), str(exc)
        assert _keys(fuzz_probe) == before, "a refused start wrote to Redis"
        return
    event("accepted")
    assert is_lossless(value), f"accepted an input that is not lossless JSON: {value!r}"
    assert handle.run_id == run_id
    stored = fuzz_client.inspect(run_id).input
    assert same_json(stored, value), f"the stored input differs: {stored!r} != {value!r}"
    # starting the same run again with the same input is the same run (the digest is stable)
    assert fuzz_client.start(UNREGISTERED if by_name else ECHO, value, run_id=run_id).run_id == run_id


@pytest.mark.parametrize("depth", [199, 200, 201, 1_000, 10_000])
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_deep_inputs_are_refused_with_the_depth_not_a_recursion_error(fuzz_client: TaskLoop, depth: int,
                                                                       kind: str) -> None:
    value = nested(depth, 1, kind)
    if depth <= 200:  # the leaf is `depth` levels down: 200 is the documented limit
        assert fuzz_client.start(ECHO, value, run_id=_run_id())
        return
    with pytest.raises(InvalidInput, match=r"run input must be lossless JSON values: \$.* is nested deeper than 200"):
        fuzz_client.start(ECHO, value, run_id=_run_id())


@pytest.mark.parametrize("value, path", [
    (10**4300 - 1, None),  # 4300 digits: the most Python turns into text
    (10**4300, r"\$ is an int of more than 4300 digits"),
    ({"n": [1, -(10**5000)]}, r"\$\.n\[1\] is an int of more than 4300 digits"),
    ("a\ud800", r"\$ contains the lone surrogate '\\ud800'"),
    ({"k": ["ok", "\udfff"]}, r"\$\.k\[1\] contains the lone surrogate"),
    ({"\ud83d": 1}, r"\$ has a key '\\ud83d' that contains the lone surrogate"),
    ({"x": "💥 é"}, None),
], ids=["4300-digits", "4301-digits", "5001-digits-inside", "surrogate", "surrogate-inside", "surrogate-key", "emoji"])
def test_values_json_text_cannot_carry_are_invalid_input(fuzz_client: TaskLoop, value: Any, path: str | None) -> None:
    """Regression (found by the fuzzer): an int past Python's 4300-digit limit raised ValueError and
    a str with a lone surrogate UnicodeEncodeError from deep inside the client; both are
    InvalidInput naming the path now, and refused before anything is written."""
    if path is None:
        run_id = _run_id()
        fuzz_client.start(ECHO, value, run_id=run_id)
        assert same_json(fuzz_client.inspect(run_id).input, value)
        return
    with pytest.raises(InvalidInput, match="run input must be lossless JSON values: " + path):
        fuzz_client.start(ECHO, value, run_id=_run_id())
    with pytest.raises(InvalidInput, match="gate value must be lossless JSON values"):
        fuzz_client.decide("fuzz-no-such-run", "gate", "approve", actor="a", value=value)


RUN_IDS = st.one_of(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,30}", fullmatch=True),
    hostile_text(max_size=30),
    st.text(st.sampled_from("ab:._-\n"), min_size=190, max_size=210),
    st.integers(), st.binary(max_size=5), st.lists(st.text(max_size=3), max_size=2),
)


@pytest.fixture(scope="module")
def db1(fuzz_redis: RedisServer) -> Iterator[tuple[TaskLoop, redis.Redis]]:
    """A client and a probe on database 1, so that the run ids fuzzed there stay out of the way of
    the other properties (which look for runs that do not exist on database 0)."""
    url = fuzz_redis.url.rsplit("/", 1)[0] + "/1"
    client, probe = TaskLoop(config=Settings(redis_url=url, broker_url=url)), redis.Redis.from_url(url)
    try:
        yield client, probe
    finally:
        client.close()
        probe.close()


@given(run_id=RUN_IDS)
@fuzz(ci=80, long=5000)
def test_run_ids_match_the_documented_pattern_or_are_refused(db1: tuple[TaskLoop, redis.Redis], run_id: Any) -> None:
    client, probe = db1
    before = _keys(probe)
    unique = isinstance(run_id, str) and SPEC_RUN_ID.match(run_id) and not probe.exists(k.RunKeys.of(run_id).run)
    try:
        handle = client.start(ECHO, {"n": 1}, run_id=run_id)
    except InvalidInput as exc:
        event("refused")
        assert not (isinstance(run_id, str) and SPEC_RUN_ID.match(run_id)), f"a valid run id was refused: {exc}"
        assert "run_id" in str(exc) and "\n" not in str(exc), str(exc)
        assert _keys(probe) == before
        return
    except tl.RunExists:
        assert not unique
        return
    event("accepted")
    assert isinstance(run_id, str) and SPEC_RUN_ID.match(run_id)
    assert handle.run_id == run_id and client.inspect(run_id).input == {"n": 1}


@given(name=st.one_of(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True), hostile_text(),
                      st.integers(), st.none()),
       version=st.one_of(st.none(), st.text(min_size=1, max_size=5), hostile_text(max_size=5), st.integers()))
@fuzz(ci=60, long=3000)
def test_workflow_names_and_versions_started_by_name(fuzz_client: TaskLoop, fuzz_probe: redis.Redis, name: Any,
                                                     version: Any) -> None:
    """A name that no workflow can have, or a version that is not a string, is InvalidInput (before
    anything is written); a valid unknown name is recorded pending for a worker to refuse."""
    before = _keys(fuzz_probe)
    run_id = _run_id()
    valid_name = isinstance(name, str) and SPEC_NAME.match(name)
    # 1-200 printable characters (taskloop/base/names.py: the definitions' rule, F1 of Security III)
    valid_version = version is None or (isinstance(version, str) and names.version_problem(version) is None)
    # a name a test module registered in this process (unit tests define "demo", "c0" ...) starts at once
    assume(not (valid_name and valid_version and REGISTRY.has(name, version)))
    try:
        fuzz_client.start(name, {}, run_id=run_id, version=version)
    except InvalidInput as exc:
        assert not (valid_name and valid_version), f"refused a valid name and version: {exc}"
        assert ("workflow" in str(exc) and not valid_name) or ("version" in str(exc) and not valid_version), exc
        assert _keys(fuzz_probe) == before
        return
    assert valid_name and valid_version
    assert fuzz_client.status(run_id) == "pending"


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


READERS = ["inspect", "events", "status", "result", "wait", "cancel", "resume", "decide", "find"]


@given(run_id=RUN_IDS, call=st.sampled_from(READERS))
@fuzz(ci=80, long=5000)
def test_calls_on_unknown_or_malformed_run_ids_fail_clearly_and_write_nothing(
        fuzz_client: TaskLoop, fuzz_probe: redis.Redis, run_id: Any, call: str) -> None:
    if isinstance(run_id, str) and SPEC_RUN_ID.match(run_id):
        # never a run this module started, nor (for find) the prefix of exactly one
        assume(not fuzz_client.store.run_ids_with_prefix(run_id, limit=2))
    before = _keys(fuzz_probe)
    calls = {
        "inspect": lambda: fuzz_client.inspect(run_id),
        "events": lambda: fuzz_client.events(run_id),
        "status": lambda: fuzz_client.status(run_id),
        "result": lambda: fuzz_client.result(run_id),
        "wait": lambda: fuzz_client.wait(run_id, timeout=0.2),
        "cancel": lambda: fuzz_client.cancel(run_id, "fuzz"),
        "resume": lambda: fuzz_client.resume(run_id),
        "decide": lambda: fuzz_client.decide(run_id, "gate", "approve", actor="fuzz"),
        "find": lambda: fuzz_client.find(run_id),
    }
    with pytest.raises(TaskLoopError) as info:
        calls[call]()
    assert isinstance(info.value, RunNotFound | InvalidInput | GateRefused), repr(info.value)
    assert str(info.value).strip()
    assert _keys(fuzz_probe) == before, f"{call} on an unknown run wrote to Redis"


def test_clients_that_are_not_closed_do_not_block_later_starts(fuzz_redis: RedisServer) -> None:
    """Found while fuzzing the CLI in one process: every client kept a producer, and with it one of
    kombu's process-wide broker connections (``broker_pool_limit``, 10), until close(); the 11th
    client that was not closed blocked forever in start(). A client now takes a producer from the
    pool for each send and gives it back."""
    clients: list[TaskLoop] = []
    started: list[str] = []

    def start_many() -> None:
        for _ in range(12):
            clients.append(TaskLoop(config=Settings(redis_url=fuzz_redis.url, broker_url=fuzz_redis.url)))
            started.append(clients[-1].start(ECHO, {"n": len(started)}, run_id=_run_id()).run_id)

    thread = threading.Thread(target=start_many, daemon=True)
    thread.start()
    thread.join(timeout=3)
    blocked = thread.is_alive()
    for client in clients:  # releases the connections, so a blocked start goes on and the thread ends
        client.close()
    thread.join(timeout=10)
    assert not blocked, f"start() blocked after {len(started)} clients that were not closed"


@pytest.mark.parametrize("call, error, message", [
    # reading calls sent any run id to Redis: a lone surrogate raised UnicodeEncodeError
    (lambda c: c.inspect("a\ud800"), InvalidInput, "run_id 'a\\ud800' is invalid"),
    (lambda c: c.events("a\ud800"), InvalidInput, "run_id 'a\\ud800' is invalid"),
    (lambda c: c.status("a\nb"), InvalidInput, "run_id 'a\\nb' is invalid"),
    (lambda c: c.cancel("\udfff", "why"), InvalidInput, "is invalid"),
    (lambda c: c.wait(["x"], timeout=0.1), InvalidInput, "is invalid"),
    (lambda c: c.events("fuzz-x", after=5), InvalidInput, "after must be the id of an event"),
    (lambda c: c.cancel("fuzz-x", "why\ud800"), InvalidInput, "reason must be a non-empty string"),
    # decide: an unhashable key raised TypeError; an actor or reason that is not a str (or not UTF-8)
    # failed while the gate event was being written (TypeError, UnicodeEncodeError)
    (lambda c: c.decide("fuzz-x", ["gate"], "approve", actor="a"), GateRefused, "key must be the key of a gate"),
    (lambda c: c.decide("fuzz-x", "gate", "approve", actor=object()), InvalidInput, "actor must be a string"),
    (lambda c: c.decide("fuzz-x", "gate", "approve", actor="a", reason=5), InvalidInput, "reason must be a string"),
    (lambda c: c.decide("fuzz-x", "gate", "approve", actor="al\ud800"), InvalidInput, "actor must be a string"),
    # start by name: a name no workflow can have was recorded (and one with a lone surrogate raised
    # UnicodeEncodeError); so was a version that is not a string
    (lambda c: c.start("bad name\n", {}), InvalidInput, "workflow must be a workflow or its name"),
    (lambda c: c.start("x\ud800", {}), InvalidInput, "workflow must be a workflow or its name"),
    (lambda c: c.start("fuzz-x", {}, version=5), InvalidInput, "version must be None or a non-empty string"),
    (lambda c: c.start("fuzz-x", {}, version="\ud800"), InvalidInput, "version must be None or a non-empty string"),
], ids=["inspect", "events", "status", "cancel", "wait", "events-after", "cancel-reason", "decide-key", "decide-actor",
        "decide-reason", "decide-actor-surrogate", "start-name", "start-name-surrogate", "start-version",
        "start-version-surrogate"])
def test_client_calls_refuse_what_they_cannot_use(fuzz_client: TaskLoop, fuzz_probe: redis.Redis, call: Any,
                                                   error: type[Exception], message: str) -> None:
    before = _keys(fuzz_probe)
    with pytest.raises(error) as info:
        call(fuzz_client)
    assert message in str(info.value)
    assert _keys(fuzz_probe) == before

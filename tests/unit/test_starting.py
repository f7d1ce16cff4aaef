"""Starting runs (taskloop/runtime/starting.py) against a real redis-server: the stored input and
its checks, idempotent starts on a run id, RunExists naming what differs, runs recorded by name and
planned (or failed) later by a worker."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import taskloop as tl
from taskloop.base.config import Settings
from taskloop.base.errors import InvalidInput, RunExists
from taskloop.base.jsonvalue import canonical
from taskloop.core import fields as fld
from taskloop.core.records import ErrorRecord
from taskloop.core.states import RunStatus, State, Termination
from taskloop.define.workflow import REGISTRY, Workflow
from taskloop.ops.embedded import RedisServer
from taskloop.runtime import starting
from taskloop.store import keys as k
from taskloop.store.redis_store import RedisStore
from tests.harness import Sent

INPUT = {"topic": "loops", "tags": ["a", "b"], "depth": 2}


@pytest.fixture()
def settings(redis_server: RedisServer) -> Settings:
    return Settings(redis_url=redis_server.url)


@pytest.fixture()
def workflow() -> Iterator[Workflow]:
    """Two roots and a task after them, under a name of its own."""
    a = tl.define_task("a", run=lambda ctx: 1)
    b = tl.define_task("b", run=lambda ctx: 2)
    c = tl.define_task("c", run=lambda ctx: 3, after=[a, b])
    wf = tl.define_workflow(f"start-{uuid.uuid4().hex[:12]}", version="1", tasks=[a, b, c])
    yield wf
    REGISTRY.unregister(wf.name, wf.version)


def _run_id() -> str:
    return f"start-{uuid.uuid4().hex}"


# --- prepare_input ----------------------------------------------------------------------------------


def test_the_stored_input_is_compact_json_and_its_digest_ignores_key_order() -> None:
    raw, digest = starting.prepare_input({"b": 1, "a": [1, 2]})
    assert raw == '{"b":1,"a":[1,2]}'
    assert digest == hashlib.sha256(canonical({"a": [1, 2], "b": 1}).encode()).hexdigest()
    assert starting.prepare_input({"a": [1, 2], "b": 1})[1] == digest
    assert starting.prepare_input({"a": [2, 1], "b": 1})[1] != digest  # list order matters


@pytest.mark.parametrize(("value", "where"), [
    (float("nan"), "$ is nan"),
    ({"when": {1, 2}}, "$.when is a set"),
    ({"pair": [1, (2, 3)]}, "$.pair[1] is a tuple"),
    ({1: "x"}, "has a key 1 of type int"),
    (b"bytes", "$ is a bytes"),
])
def test_an_input_that_is_not_lossless_json_is_invalid_input_naming_the_field(value: Any, where: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        starting.prepare_input(value)
    assert "run input" in str(caught.value) and where in str(caught.value)


def test_an_input_over_its_cap_is_invalid_input_naming_the_field_and_the_setting() -> None:
    with pytest.raises(InvalidInput) as caught:
        starting.prepare_input({"text": "x" * 100}, max_bytes=50)
    message = str(caught.value)
    assert message.startswith("run input is 111 bytes of JSON, over the limit of 50 bytes")
    assert "TASKLOOP_MAX_INPUT_BYTES" in message
    with pytest.raises(InvalidInput, match="run input is 71 bytes"):  # bytes of UTF-8, not characters (41)
        starting.prepare_input({"text": "é" * 30}, max_bytes=50)
    assert starting.prepare_input({"text": "x" * 30}, max_bytes=50)[0] == '{"text":"' + "x" * 30 + '"}'


# --- start_defined ----------------------------------------------------------------------------------


def test_start_defined_writes_the_run_and_dispatches_its_roots(store: RedisStore, workflow: Workflow,
                                                               settings: Settings) -> None:
    run_id, sent = _run_id(), Sent()
    started = starting.start_defined(store, sent, workflow, INPUT, run_id, settings)
    assert started == starting.Started(run_id, created=True, pending=False)
    snap = store.snapshot(run_id, [fld.F_INPUT, fld.F_INPUT_DIGEST])
    assert snap.meta().status is RunStatus.RUNNING and snap.meta().open == 3
    assert snap.json(fld.F_INPUT) == INPUT
    assert snap.get(fld.F_INPUT_DIGEST) == starting.prepare_input(INPUT)[1]
    assert [(name, rid, sorted(key for key, *_ in found)) for name, rid, found in sent.calls] == [
        (workflow.name, run_id, ["a", "b"])]
    assert store.client.zscore(k.RUNS_INDEX, run_id) is not None


def test_start_defined_is_idempotent_on_a_run_id(store: RedisStore, workflow: Workflow, settings: Settings) -> None:
    # Given a started run
    run_id, sent = _run_id(), Sent()
    starting.start_defined(store, sent, workflow, INPUT, run_id, settings)
    fields = store.all_fields(run_id)
    # When it is started again with the same input (its keys in another order)
    again = starting.start_defined(store, sent, workflow, dict(reversed(INPUT.items())), run_id, settings)
    # Then it is the same run, unchanged, and its queued phases are sent again under the same tokens
    assert again == starting.Started(run_id, created=False, pending=False)
    assert store.all_fields(run_id) == fields
    assert len(sent.calls) == 2
    assert sorted(sent.calls[1][2]) == sorted(sent.calls[0][2])


def test_a_start_with_another_input_names_the_first_difference(store: RedisStore, workflow: Workflow,
                                                                settings: Settings) -> None:
    run_id = _run_id()
    starting.start_defined(store, Sent(), workflow, INPUT, run_id, settings)
    changed = {**INPUT, "tags": ["a", "c"]}
    with pytest.raises(RunExists) as caught:
        starting.start_defined(store, Sent(), workflow, changed, run_id, settings)
    message = str(caught.value)
    assert "already exists with another input" in message
    assert starting.first_difference(INPUT, changed) == '$.tags[1]: "b" (stored) vs "c" (given)'
    assert '$.tags[1]: "b" (stored) vs "c" (given)' in message


def test_a_start_of_another_workflow_under_the_same_run_id_is_refused(store: RedisStore, workflow: Workflow,
                                                                       settings: Settings) -> None:
    run_id = _run_id()
    starting.start_defined(store, Sent(), workflow, INPUT, run_id, settings)
    other = tl.define_workflow(f"start-other-{uuid.uuid4().hex[:12]}", version="1",
                               tasks=[tl.define_task("x", run=lambda ctx: 1)])
    try:
        with pytest.raises(RunExists, match=f"already belongs to workflow {workflow.name} v1"):
            starting.start_defined(store, Sent(), other, INPUT, run_id, settings)
    finally:
        REGISTRY.unregister(other.name, other.version)


def test_an_invalid_start_writes_nothing(store: RedisStore, workflow: Workflow, settings: Settings) -> None:
    run_id, sent = _run_id(), Sent()
    with pytest.raises(InvalidInput):
        starting.start_defined(store, sent, workflow, {"when": {1}}, run_id, settings)
    with pytest.raises(InvalidInput, match="run_id"):
        starting.start_defined(store, sent, workflow, INPUT, "not a run id!", settings)
    assert store.all_fields(run_id) == {} and sent.calls == []


@pytest.mark.parametrize(("old", "new", "expected"), [
    ({"a": 1, "b": {"c": [1, 2]}}, {"a": 1, "b": {"c": [1, 3]}}, "$.b.c[1]: 2 (stored) vs 3 (given)"),
    ({"a": 1}, {"a": 1, "z": 2}, "$.z is new"),
    ({"a": 1, "m": 0}, {"a": 1}, "$.m is missing"),
    ([1, 2], [1, 2, 3], "$ has 3 items, the stored input 2"),
    ({"t": 1}, {"t": 1.0}, "$.t: 1 (stored) vs 1.0 (given)"),
    ({"t": [1]}, {"t": {"x": 1}}, '$.t: [1] (stored) vs {"x": 1} (given)'),
    ("a", "b", '$: "a" (stored) vs "b" (given)'),
])
def test_first_difference(old: Any, new: Any, expected: str) -> None:
    assert starting.first_difference(old, new) == expected


# --- by name ----------------------------------------------------------------------------------------


def test_a_run_recorded_by_name_is_pending_and_idempotent(store: RedisStore, settings: Settings) -> None:
    run_id, name = _run_id(), f"nowhere-{uuid.uuid4().hex[:8]}"
    first = starting.record_pending(store, name, "3", INPUT, run_id, settings)
    again = starting.record_pending(store, name, "3", INPUT, run_id, settings)
    assert first == starting.Started(run_id, created=True, pending=True)
    assert again == starting.Started(run_id, created=False, pending=True)
    meta = store.snapshot(run_id).meta()
    assert (meta.status, meta.workflow, meta.version) == (RunStatus.PENDING, name, "3")
    assert [e.type for e in store.events(run_id)] == ["run.pending"]
    with pytest.raises(RunExists, match=r"\$.depth: 2 \(stored\) vs 3 \(given\)"):
        starting.record_pending(store, name, "3", {**INPUT, "depth": 3}, run_id, settings)


def test_planning_a_run_of_an_unregistered_workflow_fails_it(store: RedisStore, settings: Settings) -> None:
    # Given a run recorded by the name of a workflow no process here has
    run_id, name = _run_id(), f"nowhere-{uuid.uuid4().hex[:8]}"
    starting.record_pending(store, name, None, INPUT, run_id, settings)
    sent = Sent()
    # When a worker plans it
    result = starting.plan_pending(store, sent, run_id, settings)
    # Then the run ends failed with WorkflowNotRegistered, and nothing is dispatched
    assert result == "workflow not registered"
    meta = store.snapshot(run_id).meta()
    assert meta.status is RunStatus.FAILED and meta.stored_status == "failed"
    assert meta.termination is Termination.FAILED and meta.finished is not None and meta.open == 0
    assert meta.error is not None and meta.error.type == "WorkflowNotRegistered"
    assert name in meta.error.message
    assert [e.type for e in store.events(run_id)] == ["run.pending", "run.finished"]
    assert store.client.lrange(k.RunKeys.of(run_id).end, 0, -1) == ["failed"]
    assert sent.calls == []
    # and a second look at it leaves it as it is
    assert starting.plan_pending(store, sent, run_id, settings) == "already planned"


def test_planning_a_pending_run_of_a_registered_workflow(store: RedisStore, workflow: Workflow,
                                                         settings: Settings) -> None:
    run_id, sent = _run_id(), Sent()
    starting.record_pending(store, workflow.name, workflow.version, INPUT, run_id, settings)
    created = store.hmget(run_id, [fld.F_CREATED])
    assert starting.plan_pending(store, sent, run_id, settings) == "planned"
    snap = store.snapshot(run_id, [fld.F_INPUT])
    assert snap.meta().status is RunStatus.RUNNING and snap.json(fld.F_INPUT) == INPUT
    assert store.hmget(run_id, [fld.F_CREATED]) == created  # the run keeps its creation time
    assert snap.record("a") is not None and snap.record("a").state is State.QUEUED_RUN  # type: ignore[union-attr]
    assert [sorted(key for key, *_ in found) for _, _, found in sent.calls] == [["a", "b"]]
    assert starting.plan_pending(store, sent, run_id, settings) == "already planned"
    assert starting.plan_pending(store, sent, _run_id(), settings) == "unknown run"


def test_a_pending_run_cancelled_before_it_was_planned_ends_cancelled(store: RedisStore, workflow: Workflow,
                                                                      settings: Settings) -> None:
    run_id, sent = _run_id(), Sent()
    starting.record_pending(store, workflow.name, workflow.version, INPUT, run_id, settings)
    store.client.hset(k.RunKeys.of(run_id).run, fld.F_CONTROL, "cancel:user")
    assert starting.plan_pending(store, sent, run_id, settings) == "cancelled before it was planned"
    meta = store.snapshot(run_id).meta()
    assert (meta.status, meta.termination, meta.error) == (RunStatus.CANCELLED, Termination.ABORTED, None)
    assert sent.calls == []


def test_fail_pending_ends_a_pending_run_failed_or_cancelled(store: RedisStore, settings: Settings) -> None:
    failed, cancelled = _run_id(), _run_id()
    for run_id in (failed, cancelled):
        starting.record_pending(store, "somewhere", None, INPUT, run_id, settings)
    assert store.client.zscore("tl:runs:w:somewhere:s:pending", failed) is not None
    snap = store.snapshot(failed, starting.START_FIELDS)
    starting.fail_pending(store, snap, ErrorRecord(type="Boom", message="could not plan"), settings)
    starting.fail_pending(store, store.snapshot(cancelled, starting.START_FIELDS), None, settings)
    # it moved from the pending lists to the failed ones, at its creation time
    created = float(snap.get(fld.F_CREATED) or 0)
    assert store.client.zscore("tl:runs:w:somewhere:s:failed", failed) == created
    assert store.client.zscore("tl:runs:w:somewhere:s:pending", failed) is None
    assert store.list_page("failed", None, 0, 10)[0].count(failed) == 1  # across workflows: merged
    assert failed not in store.list_page("pending", None, 0, 10)[0]
    assert store.client.zscore("tl:runs:w:somewhere", failed) == created
    meta = store.snapshot(failed).meta()
    assert (meta.status, meta.termination) == (RunStatus.FAILED, Termination.FAILED)
    assert meta.error == ErrorRecord(type="Boom", message="could not plan")
    finished = store.events(failed)[-1]
    assert finished.type == "run.finished"
    assert finished.data == {"status": "failed", "termination": "failed", "error": "could not plan"}
    meta = store.snapshot(cancelled).meta()
    assert (meta.status, meta.termination, meta.error) == (RunStatus.CANCELLED, Termination.ABORTED, None)
    assert store.client.lrange(k.RunKeys.of(cancelled).end, 0, -1) == ["cancelled"]
    assert 0 < store.client.ttl(k.RunKeys.of(cancelled).run) <= settings.retention_s


def test_fail_pending_leaves_a_planned_run_alone(store: RedisStore, workflow: Workflow, settings: Settings) -> None:
    run_id = _run_id()
    starting.start_defined(store, Sent(), workflow, INPUT, run_id, settings)
    fields = store.all_fields(run_id)
    late = ErrorRecord(type="Boom", message="late")
    starting.fail_pending(store, store.snapshot(run_id, starting.START_FIELDS), late, settings)
    assert store.all_fields(run_id) == fields  # guarded on the pending status: nothing written

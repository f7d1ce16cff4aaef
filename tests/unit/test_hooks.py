"""The instrumentation interface (taskloop/ops/hooks.py, runtime/instruments.py): each point
calls the hooks that override it, a hook that raises is logged and never changes what is
written, the observers, metrics and an application's hooks hang on it, and bad input names
the fix. Against a real redis-server (the commit path)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest

import taskloop as tl
from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.core.events import Event
from taskloop.core.planner import Planner
from taskloop.core.snapshot import Snapshot
from taskloop.define.workflow import REGISTRY, Workflow
from taskloop.ops import hooks as h
from taskloop.ops.embedded import RedisServer
from taskloop.ops.metrics import MetricsHook
from taskloop.runtime import commit as cm
from taskloop.runtime import instruments
from taskloop.runtime.observing import ObserverHook
from taskloop.store.redis_store import RedisStore
from tests.harness import Sent


class Recording(tl.Hook):
    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    def committed(self, write: h.Committed) -> None:
        self.seen.append(("committed", [e.type for e in write.events]))

    def run_started(self, run: h.RunStarted) -> None:
        self.seen.append(("run_started", run.run_id))

    def run_ended(self, run: h.RunEnded) -> None:
        self.seen.append(("run_ended", (run.run_id, run.status)))

    def delivery_refused(self, refused: h.Refused) -> None:
        self.seen.append(("refused", refused.reason))


class Broken(tl.Hook):
    def committed(self, write: h.Committed) -> None:
        raise RuntimeError("exporter down")

    def run_started(self, run: h.RunStarted) -> None:
        raise RuntimeError("exporter down")

    def delivery_refused(self, refused: h.Refused) -> None:
        raise ValueError("exporter down")


@pytest.fixture()
def added() -> Iterator[None]:
    yield
    instruments.reset(added=True)


@pytest.fixture()
def settings(redis_server: RedisServer) -> Settings:
    return Settings(redis_url=redis_server.url)


@pytest.fixture()
def observed() -> Iterator[tuple[Workflow, list[Event]]]:
    seen: list[Event] = []
    a = tl.define_task("a", run=lambda ctx: 1)
    wf = tl.define_workflow(f"hooks-{uuid.uuid4().hex[:12]}", version="1", tasks=[a], observers=[seen.append])
    yield wf, seen
    REGISTRY.unregister(wf.name, wf.version)


def _start(store: RedisStore, wf: Workflow, settings: Settings) -> str:
    run_id = f"hooks-{uuid.uuid4().hex}"

    def plan(snap: Snapshot) -> Planner:
        return Planner.start_run(wf, run_id, "{}", "digest", clock.now(), settings)

    cm.commit(store, plan, Snapshot(run_id), Sent(), retry=cm.never)
    return run_id


def test_a_point_calls_only_the_hooks_that_override_it_in_order() -> None:
    first, second = Recording(), Recording()
    hooks = h.Hooks([first, tl.Hook(), second])
    assert hooks.wants("delivery_refused") and not hooks.wants("phase_began") and not hooks.wants("chunk_streamed")
    hooks.delivery_refused(h.Refused("stale"))
    assert first.seen == second.seen == [("refused", "stale")]
    assert not h.Hooks().wants("committed")


def test_a_failing_hook_is_logged_and_the_others_still_hear(caplog: pytest.LogCaptureFixture) -> None:
    after = Recording()
    hooks = h.Hooks([Broken(), after])
    with caplog.at_level(logging.ERROR, logger="taskloop.ops.hooks"):
        hooks.delivery_refused(h.Refused("malformed"))
    assert after.seen == [("refused", "malformed")]
    assert "instrumentation hook Broken.delivery_refused failed" in caplog.text
    assert "ValueError: exporter down" in caplog.text


def test_the_registered_hooks_are_metrics_where_on_the_observers_and_the_added(
        monkeypatch: pytest.MonkeyPatch, added: None) -> None:
    monkeypatch.delenv("TASKLOOP_METRICS", raising=False)
    instruments.reset()
    assert [type(x) for x in instruments.hooks().hooks] == [ObserverHook]
    monkeypatch.setenv("TASKLOOP_METRICS", "1")
    mine = Recording()
    tl.add_hook(mine)  # registers again
    assert [type(x) for x in instruments.hooks().hooks] == [MetricsHook, ObserverHook, Recording]
    assert instruments.hooks().hooks[-1] is mine


def test_add_hook_refuses_what_is_not_a_hook_naming_the_fix(added: None) -> None:
    with pytest.raises(tl.DefinitionError, match=r"add_hook: hook must be an instance of a subclass of "
                                                 r"taskloop\.Hook .* got function"):
        tl.add_hook(lambda event: None)  # type: ignore[arg-type]


def test_a_commit_tells_its_events_and_the_run_it_started(store: RedisStore, settings: Settings, added: None,
                                                          observed: tuple[Workflow, list[Event]]) -> None:
    wf, seen = observed
    mine = Recording()
    tl.add_hook(mine)
    run_id = _start(store, wf, settings)
    assert mine.seen[0] == ("committed", ["run.started", "phase"])
    assert mine.seen[1] == ("run_started", run_id)
    assert [e.type for e in seen] == ["run.started", "phase"]  # the observers hang on the same point
    assert {e.run_id for e in seen} == {run_id}


def test_a_failing_hook_never_changes_what_a_commit_writes_or_what_the_observers_hear(
        store: RedisStore, settings: Settings, added: None, observed: tuple[Workflow, list[Event]],
        caplog: pytest.LogCaptureFixture) -> None:
    wf, seen = observed
    tl.add_hook(Broken())
    with caplog.at_level(logging.ERROR, logger="taskloop.ops.hooks"):
        run_id = _start(store, wf, settings)
    assert [e.type for e in store.events(run_id)] == ["run.started", "phase"]
    assert [e.type for e in seen] == ["run.started", "phase"]
    assert store.snapshot(run_id, ["status"]).get("status") == "running"
    assert "instrumentation hook Broken.committed failed" in caplog.text
    assert "instrumentation hook Broken.run_started failed" in caplog.text


def test_the_end_of_a_run_is_told_once_from_the_write_that_ended_it() -> None:
    mine = Recording()
    a = tl.define_task("a", run=lambda ctx: 1)
    wf = tl.define_workflow(f"hooks-{uuid.uuid4().hex[:12]}", version="1", tasks=[a])
    try:
        finished = Event(type="run.finished", at=5.0, data={"status": "done", "termination": None})
        hooks = h.Hooks([mine])
        hooks.committed(h.Committed(None, wf, "r1", [finished], finished=False))  # type: ignore[arg-type]
        assert mine.seen == [("committed", ["run.finished"])]  # its finishing part was not applied
        hooks.committed(h.Committed(None, wf, "r1", [finished], finished=True))  # type: ignore[arg-type]
        assert mine.seen[-1] == ("run_ended", ("r1", "done"))
    finally:
        REGISTRY.unregister(wf.name, wf.version)

"""What each page shows, read through the client's read API (``run_page``, ``inspect``, the fleet
view) and shaped for the templates. Nothing here writes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from taskloop.base import clock
from taskloop.core.events import Event
from taskloop.core.states import RunStatus
from taskloop.runtime import shapes, views
from taskloop.runtime.client import TaskLoop
from taskloop.runtime.fleet import FleetView, fleet_view
from taskloop.runtime.models import LoopProgress, RunPage, RunView, TaskView
from taskloop.store.redis_store import RedisStore
from taskloop.ui.graph import Drawing, TaskState, draw

EVENTS_SHOWN = 500  # the timeline shows the last ones; the API serves them all
STATUSES = [s.value for s in RunStatus]


@dataclass
class RunsModel:
    page: RunPage
    progress: dict[str, list[LoopProgress]]
    workflows: list[str]
    status: str | None
    workflow: str | None
    prefix: str | None
    now: float
    statuses: list[str] = field(default_factory=lambda: STATUSES)

    def query(self, **changes: Any) -> str:
        """The list's query string with ``changes`` (pagination links keep the filters)."""
        from urllib.parse import urlencode

        values = {"status": self.status, "workflow": self.workflow, "q": self.prefix, "offset": self.page.offset,
                  **changes}
        return urlencode({k: v for k, v in values.items() if v not in (None, "", 0)})


def runs_model(client: TaskLoop, status: str | None, workflow: str | None, prefix: str | None, offset: int,
               limit: int) -> RunsModel:
    page = client.run_page(status=status, workflow=workflow, offset=offset, limit=limit, prefix=prefix)
    progress = views.loop_progress(client.store, [r.run_id for r in page.runs])
    workflows = sorted({*client.store.listed_workflows(), *(r.workflow for r in page.runs)} - {""})
    return RunsModel(page=page, progress=progress, workflows=workflows, status=status, workflow=workflow,
                     prefix=prefix, now=clock.now())


@dataclass
class Gate:
    key: str
    kind: str  # approval | input | pause
    prompt: str | None
    actors: list[str]
    status: str
    waiting: bool
    decisions: list[Event]


@dataclass
class RunModel:
    run: RunView
    shape: dict[str, Any] | None
    drawing: Drawing
    events: list[Event]
    events_total: int
    last_entry: str
    gates: list[Gate]
    budget: dict[str, Any] | None
    activations: list[TaskView]
    loops: list[TaskView]
    others: list[TaskView]
    now: float
    rendered_ms: float = 0.0

    @property
    def terminal(self) -> bool:
        return self.run.status in ("done", "failed", "cancelled", "rejected")

    @property
    def graph_workflow(self) -> bool:
        return bool(self.shape and self.shape.get("graph")) or bool(self.activations)


def run_model(client: TaskLoop, run_id: str, known: list[Event] | None = None) -> RunModel:
    """A run page's model. ``known``: the events a live page read before (only later ones are read)."""
    started = time.perf_counter()
    run, events = views.run_view_and_events(client.store, run_id, known)
    shape = shapes.read(client.store, run.fingerprint)
    described = {t["key"]: t for t in (shape or {}).get("tasks", [])}
    states = {key: TaskState(status=t.status, kind=t.kind, round=t.round,
                             max_rounds=described.get(key, {}).get("max_rounds"))
              for key, t in run.tasks.items()}
    activations = [t for t in run.tasks.values() if t.step is not None]
    steps: dict[str, TaskState] = {}
    for task in activations:  # the latest activation of each step (they are in start order)
        assert task.step is not None
        count = steps[task.step].activations + 1 if task.step in steps else 1
        steps[task.step] = TaskState(status=task.status, kind=task.kind, round=task.round, activations=count)
    drawing = draw(shape, states, steps)
    decisions: dict[str, list[Event]] = {}
    for event in events:
        if event.type == "gate" and event.key:
            decisions.setdefault(event.key, []).append(event)
    gates = [Gate(key=key, kind=(described.get(key) or {}).get("gate") or "approval",
                  prompt=(described.get(key) or {}).get("prompt"), actors=(described.get(key) or {}).get("actors", []),
                  status=t.status, waiting=t.status == "paused", decisions=decisions.get(key, []))
             for key, t in run.tasks.items() if t.kind == "gate"]
    loops = [t for t in run.tasks.values() if t.kind == "loop" and t.step is None]
    others = [t for t in run.tasks.values() if t.kind not in ("loop", "gate") and t.step is None]
    last_entry = next((e.entry_id for e in reversed(events) if e.entry_id), None) or "0-0"
    model = RunModel(run=run, shape=shape, drawing=drawing, events=events[-EVENTS_SHOWN:], events_total=len(events),
                     last_entry=last_entry, gates=gates, budget=(shape or {}).get("budget"),
                     activations=activations, loops=loops, others=others, now=clock.now())
    model.rendered_ms = (time.perf_counter() - started) * 1000
    return model


class FleetCache:
    """The fleet view, read at most once per ``max_age_s`` (every open fleet page polls it)."""

    def __init__(self, client: TaskLoop, max_age_s: float = 2.0) -> None:
        self.client = client
        self.max_age_s = max_age_s
        self._view: FleetView | None = None
        self._at = 0.0
        same = client.settings.broker_url == client.settings.redis_url
        self._broker = client.store if same else RedisStore(client.settings.broker_url)

    def get(self) -> FleetView:
        if self._view is None or time.monotonic() - self._at > self.max_age_s:
            self._view = fleet_view(self.client.store, self._broker, self.client.app.conf.task_default_queue)
            self._at = time.monotonic()
        return self._view

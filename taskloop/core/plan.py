"""What a topology sees of the plan it settles: the part of the Planner (planner.py) that the DAG
(dag.py) and the graph (graph_plan.py) topologies use. A protocol, so that neither needs the
Planner itself."""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from taskloop.base.config import Settings
from taskloop.core.events import Event
from taskloop.core.phases import PhaseEvent
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Termination
from taskloop.define.workflow import Workflow


class Plan(Protocol):
    workflow: Workflow
    snapshot: Snapshot
    run_id: str
    now: float
    settings: Settings
    control: str | None
    tasks: dict[str, TaskRecord]
    changed: dict[str, TaskRecord]
    events: list[Event]
    data: dict[str, str]
    run_updates: dict[str, str]
    counters: Counter[str]

    def record(self, key: str) -> TaskRecord:
        """A task's record as the plan sees it (reading it makes the write guard it)."""

    def move(self, key: str, event: PhaseEvent) -> TaskRecord:
        """Apply a phase event to a task's record."""

    def activate(self, key: str) -> None:
        """Queue a task whose dependencies are done (or end it, if the run may not progress)."""

    def end_by_control(self, key: str) -> None:
        """End a waiting task of a cancelled (cancelled) or stopped (skipped) run."""

    def guard(self, field: str) -> str | None:
        """Read a run field that the plan rewrites from what it read (the write guards it)."""

    def note_failure(self, record: TaskRecord) -> None:
        """A task failed for good: the run's termination, and a stop when the workflow stops on errors."""

    def fail_run(self, error: ErrorRecord, termination: Termination = Termination.FAILED) -> None:
        """End the run by its own rules (a graph's handler, state or transition was invalid)."""


class Topology(Protocol):
    """How the tasks of a run follow one another: a DAG's ``after`` edges (dag.py), or a graph
    workflow's transition handler (graph_plan.py). The Planner asks it at three points."""

    def start(self, plan: Plan) -> None:
        """The records of a new run, and what it activates first."""

    def record_keys(self, plan: Plan) -> list[str]:
        """Every task record of the run, dependencies first."""

    def settle(self, plan: Plan, record: TaskRecord) -> None:
        """A task ended (``record``): note what it means for the run, and move what follows it."""

"""Views returned to clients: RunResult, RunView, TaskView, RoundView, ErrorInfo (pydantic, JSON-safe)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from taskloop.errors import (
    IncompatibleDefinition,
    RunRejected,
    TaskLoopError,
    WorkflowNotRegistered,
    error_from_info,
)
from taskloop.events import PHASE, Event


class ErrorInfo(BaseModel):
    """A task's recorded error: the original type name and message."""

    model_config = ConfigDict(frozen=True)
    key: str
    type: str
    message: str
    details: dict[str, Any] | None = None


class ExecView(BaseModel):
    """One execution of a phase: where it ran and how long it took (``lost``: its worker died or
    lost its lease, and the phase was replayed; ``handed_back``: its worker shut down and gave it
    back, and the phase was replayed)."""

    model_config = ConfigDict(frozen=True)
    round: int
    phase: str
    attempt: int | None = None  # the task's attempt count once this execution began
    worker: str | None = None
    began_at: float | None = None
    took_s: float | None = None
    replay: bool = False  # not the phase's first execution
    lost: bool = False
    handed_back: bool = False


class RoundView(BaseModel):
    """One round of a loop task: the candidate (output) and what check said about it."""

    model_config = ConfigDict(frozen=True)
    round: int
    phase: str  # "attempt" | "check" | "complete"
    output: Any = None
    check: dict[str, Any] | None = None
    execs: list[ExecView] = Field(default_factory=list)
    notes: dict[str, Any] = Field(default_factory=dict)  # e.g. {"check": {"llm": {prompt, reply, usage}}}


class TaskView(BaseModel):
    model_config = ConfigDict(frozen=True)
    key: str
    kind: str
    status: str
    phase: str | None = None
    round: int = 0
    attempts: int = 0
    value: Any = None
    error: ErrorInfo | None = None
    cache_hit: bool = False
    worker: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    reason: str | None = None  # why it was skipped or cancelled
    step: str | None = None  # a graph workflow's action: the step it activates ("review" for review@2)
    activation: Any = None  # ... and the input of that activation
    rounds: list[RoundView] = Field(default_factory=list)
    execs: list[ExecView] = Field(default_factory=list)  # a plain task's tries


class RunView(BaseModel):
    """Everything recorded about a run (``client.inspect``)."""

    model_config = ConfigDict(frozen=True)
    run_id: str
    workflow: str
    version: str
    status: str
    termination_code: str | None = None
    input: Any = None
    state: Any = None
    created_at: float
    finished_at: float | None = None
    usage: dict[str, Any]
    tasks: dict[str, TaskView]
    stats: dict[str, int] = Field(default_factory=dict)
    error: ErrorInfo | None = None  # a run that failed before any task ran (e.g. unknown workflow)
    control: str | None = None  # "cancel:<reason>" or "stop:<reason>" once the run may not progress


class RunSummary(BaseModel):
    """One line of ``client.runs``."""

    model_config = ConfigDict(frozen=True)
    run_id: str
    workflow: str
    version: str
    status: str
    termination_code: str | None = None
    created_at: float
    finished_at: float | None = None


_RUN_ERRORS: dict[str, type[TaskLoopError]] = {
    cls.__name__: cls for cls in (WorkflowNotRegistered, IncompatibleDefinition)
}


class RunResult(BaseModel):
    """How a run ended (``RunHandle.wait``)."""

    model_config = ConfigDict(frozen=True)
    run_id: str
    status: str  # "done" | "failed" | "cancelled" | "rejected"
    termination_code: str | None = None
    values: dict[str, Any] = Field(default_factory=dict)
    errors: list[ErrorInfo] = Field(default_factory=list)
    usage: dict[str, Any] = Field(default_factory=dict)
    observer_errors: list[dict[str, Any]] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "done"

    def raise_for_status(self) -> RunResult:
        """Raise the typed error of a failed or rejected run; return self otherwise.

        A cancelled run does not raise: cancellation is a normal ending."""
        if self.status == "failed" and self.errors:
            first = self.errors[0]
            if not first.key:  # the run itself failed (before any task ran)
                raise _RUN_ERRORS.get(first.type, TaskLoopError)(first.message)
            raise error_from_info(first.key, first.type, first.message, first.details)
        if self.status == "failed":
            raise error_from_info("?", "RunFailed", f"run {self.run_id} failed", None)
        if self.status == "rejected":
            raise RunRejected(f"run {self.run_id} was rejected at a gate")
        return self


def executions(events: list[Event]) -> dict[str, list[ExecView]]:
    """Every phase execution of a run, by task, from the ``data.exec`` of the events its outcome
    wrote (see events.py), in order."""
    found: dict[str, list[ExecView]] = {}
    phases: dict[str, tuple[int, str]] = {}  # the phase each task is in, as the events tell it
    for event in events:
        if event.key is None:
            continue
        info = (event.data or {}).get("exec")
        if info:
            round_, phase = phases.get(event.key, (event.round or 0, event.phase or "run"))
            found.setdefault(event.key, []).append(ExecView(
                round=round_, phase=phase, attempt=info.get("attempt"), worker=info.get("worker"),
                began_at=info.get("began"), took_s=info.get("took"), replay=int(info.get("execs") or 1) > 1,
                lost=bool(info.get("lost")), handed_back=bool(info.get("handed_back"))))
        if event.type == PHASE and event.round is not None and event.phase not in (None, "complete"):
            phases[event.key] = (event.round, event.phase or "run")
    return found

"""Views returned to clients: RunResult, RunView, TaskView, RoundView, ErrorInfo (pydantic, JSON-safe)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from taskloop.base.errors import (
    RunRejected,
    TaskLoopError,
    error_from_info,
)
from taskloop.core.events import PHASE, Event


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
    copied: bool = False  # a fork's round copied from the run it was forked from
    feedback_given: str | None = None  # a fork's round: the feedback its attempt was given (not round - 1's)


class ThrottleView(BaseModel):
    """A queued phase that a fleet limit holds back (SPEC §10)."""

    model_config = ConfigDict(frozen=True)
    limit: str
    value: str = ""  # a concurrency limit's key value
    since: float  # when it first waited
    retry_at: float | None = None  # when the limit expected to have room, as of the last look


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
    exhausted: str | None = None  # a best-of loop that ran out ("rounds" or "plateau"), done all the same
    kept_round: int | None = None  # ... the round whose candidate is its value
    copied: bool = False  # a fork's task copied as it ended in the run it was forked from
    throttled: ThrottleView | None = None  # its queued phase waits for a fleet limit


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


class RunPage(BaseModel):
    """A page of ``client.run_page``: the runs, and where the page is in its list (``total`` None
    when it is not known: a prefix search, or the derived ``waiting`` status)."""

    model_config = ConfigDict(frozen=True)
    runs: list[RunSummary]
    total: int | None
    offset: int
    limit: int
    more: bool  # a next page may hold runs


class LoopProgress(BaseModel):
    """Where a loop task of a run stands (``views.loop_progress``, the UI's list of runs)."""

    model_config = ConfigDict(frozen=True)
    key: str
    round: int
    max_rounds: int
    status: str


class RunView(RunSummary):
    """Everything recorded about a run (``client.inspect``): its summary, and all the rest."""

    fingerprint: str | None = None  # of the definition the run pinned
    input: Any = None
    state: Any = None
    usage: dict[str, Any]
    tasks: dict[str, TaskView]
    stats: dict[str, int] = Field(default_factory=dict)
    error: ErrorInfo | None = None  # a run that failed before any task ran (e.g. unknown workflow)
    control: str | None = None  # "cancel:<reason>" or "stop:<reason>" once the run may not progress
    forked_from: dict[str, Any] | None = None  # a fork: {"run_id", "task", "round"} it was forked from
    copied: dict[str, Any] | None = None  # a fork: what it copied ({"tasks", "rounds", "usage"})



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
            raise error_from_info(first.key, first.type, first.message, first.details)
        if self.status == "failed":
            raise TaskLoopError(f"run {self.run_id} failed")
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

"""Views returned to clients: RunResult, RunView, TaskView, RoundView, ErrorInfo (pydantic, JSON-safe)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from taskloop.errors import RunRejected, error_from_info


class ErrorInfo(BaseModel):
    """A task's recorded error: the original type name and message."""

    model_config = ConfigDict(frozen=True)
    key: str
    type: str
    message: str
    details: dict[str, Any] | None = None


class RoundView(BaseModel):
    """One round of a loop task: the candidate (output) and what check said about it."""

    model_config = ConfigDict(frozen=True)
    round: int
    phase: str  # "attempt" | "check" | "complete"
    output: Any = None
    check: dict[str, Any] | None = None


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
    rounds: list[RoundView] = Field(default_factory=list)


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
            raise error_from_info("?", "RunFailed", f"run {self.run_id} failed", None)
        if self.status == "rejected":
            raise RunRejected(f"run {self.run_id} was rejected at a gate")
        return self

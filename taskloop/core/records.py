"""A task's stored record (pure, pydantic): `TaskRecord`, the durable record of one task in one
run, and `ErrorRecord`, the error it recorded.

A record is an immutable value; the phase machine (phases.py) makes a new one on every
transition. Its JSON (``dump``) is the state machine's part, which the store compares byte for
byte; its execution (worker, began_at, deadline) is stored in fields of its own and joined again
by ``load``. ``TaskRecord.state`` names where the task stands (states.py), and ``overdue`` is the
deadline rule: the round (or try) has run out of time.
"""

from __future__ import annotations

import builtins
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from taskloop.base.errors import TaskLoopError, is_recorded, resumable
from taskloop.base.jsonvalue import utf8_safe, utf8_safe_json
from taskloop.core.states import TERMINAL_TASK, Phase, Slot, State, TaskStatus, active_state
from taskloop.define.tasks import TaskKind


class ErrorRecord(BaseModel):
    """A recorded task error: the original type name and message, plus typed details."""

    model_config = ConfigDict(frozen=True)
    type: str
    message: str
    details: dict[str, Any] | None = None

    def of(self, cls: builtins.type[TaskLoopError]) -> bool:
        """Whether this error was recorded as ``cls`` (through the table of taskloop/base/errors.py)."""
        return is_recorded(self.type, cls)

    @property
    def resumable(self) -> bool:
        return resumable(self.type)

    @field_validator("type", "message", "details", mode="before")
    @classmethod
    def _storable(cls, value: Any) -> Any:
        """An exception's message (and traceback) may hold lone surrogates, which UTF-8 cannot
        encode: they are escaped, or the outcome could never be recorded."""
        if isinstance(value, dict):
            return utf8_safe_json(value)
        return utf8_safe(value) if isinstance(value, str) else value


class TaskRecord(BaseModel):
    """The durable record of one task in one run (JSON in Redis, compared byte for byte)."""

    model_config = ConfigDict(frozen=True, use_enum_values=False)

    key: str
    kind: TaskKind
    limit: int = 1  # loop: max_rounds; plain task: tries allowed by its retry policy
    status: TaskStatus = TaskStatus.WAITING
    phase: Phase | None = None
    slot: Slot | None = None
    round: int = 0  # loop: 1-based round; plain task: 1-based try; 0 before activation
    token: int = 0  # fencing token: +1 on every transition
    attempts: int = 0  # attempts consumed: one per round/try, plus one per replay
    execs: int = 0  # executions of the current phase (1 = first, more = replays)
    tries: int = 0  # retries of the current check (a flow loop's stop judgement)
    lost: int = 0  # executions of the current phase lost to a dead worker or an expired lease
    deadline: float | None = None  # epoch seconds; set when the round (or try) starts
    not_before: float | None = None  # retry backoff: the message is due at this time
    waiting_on: int = 0  # dependencies that are not done yet (WAITING only)
    worker: str | None = None
    began_at: float | None = None  # when the current execution began
    queued_at: float | None = None  # when the current phase's message was (last) sent
    cache_hit: bool = False
    prepared: bool = False  # condition (and cache) consulted for this activation
    started_at: float | None = None
    finished_at: float | None = None
    error: ErrorRecord | None = None
    reason: str | None = None  # why a task was skipped or cancelled (condition, dependency, stopped, ...)
    scores: list[float | None] | None = None  # a loop's score per round (None until a round is scored)
    exhausted: str | None = None  # a best-of loop that ended done: why it stopped ("rounds", "plateau")
    kept_round: int | None = None  # ... and the round whose candidate is its value
    # a queued phase that keeps the lease of an earlier queueing (``kept_lease``): that
    # lease's time in the run's lease set; absent when its own lease was written for it
    lease_kept: float | None = None

    @property
    def state(self) -> State:
        if self.status is TaskStatus.ACTIVE:
            assert self.phase is not None and self.slot is not None
            return active_state(self.phase, self.slot)
        return State(self.status.value)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_TASK

    def overdue(self, now: float) -> bool:
        """The deadline rule: the round (or try) has run out of time."""
        return self.deadline is not None and now >= self.deadline

    def dump(self) -> str:
        """The record's JSON: the state machine's part. Its execution (worker, began_at, deadline)
        is stored in fields of its own (``execution``, core/fields.py)."""
        return self.model_dump_json(exclude_defaults=True, exclude=set(EXECUTION))

    def execution(self) -> tuple[str | None, str | None, str | None]:
        """The execution as stored: worker, began_at and deadline as text (None: absent)."""
        return (self.worker, None if self.began_at is None else repr(self.began_at),
                None if self.deadline is None else repr(self.deadline))

    @classmethod
    def load(cls, raw: str | bytes, worker: str | None = None, began_at: str | None = None,
             deadline: str | None = None) -> TaskRecord:
        """A record from its stored parts (a record written whole, with its execution inside its
        JSON, still loads). An empty execution field is absent: the planner clears one that way
        inside the HSET it sends anyway, and deletes it when the task ends."""
        record = cls.model_validate_json(raw)
        found = {name: value for name, value in (("worker", worker or None), ("began_at", _number(began_at)),
                                                 ("deadline", _number(deadline))) if value is not None}
        return record.model_copy(update=found) if found else record


EXECUTION = frozenset({"worker", "began_at", "deadline"})


def _number(text: str | None) -> float | None:
    return float(text) if text else None  # "" is a cleared field (the planner clears in its HSET)

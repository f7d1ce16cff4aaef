"""Option models: Retry, Cache, Budget and LoopCheck (pydantic, validated with clear messages)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from taskloop.base.errors import DefinitionError, InvalidCheckResult
from taskloop.base.jsonvalue import text_problem
from taskloop.base.text import shown

MAX_SAFE_INT = 2**53 - 1
MAX_TIMEOUT_MS = 2_147_483_647


def is_safe_int(value: object, minimum: int = 1, maximum: int = MAX_SAFE_INT) -> bool:
    """True for a real int (never a bool) within [minimum, maximum]."""
    return type(value) is int and minimum <= value <= maximum


def check_timeout_ms(value: object, owner: str) -> None:
    if value is not None and not is_safe_int(value, 1, MAX_TIMEOUT_MS):
        raise DefinitionError(
            f"{owner}: timeout_ms must be an integer from 1 to {MAX_TIMEOUT_MS} (milliseconds), "
            f"got {shown(value)}"
        )


class _Options(BaseModel):
    """Frozen options model whose validation errors surface as DefinitionError."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True, extra="forbid")
    label: ClassVar[str] = "options"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise DefinitionError(_message(self.label, exc)) from None


def _message(label: str, exc: ValidationError) -> str:
    first = exc.errors()[0]
    original = (first.get("ctx") or {}).get("error")
    if isinstance(original, Exception):
        return str(original)
    field = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"{label}.{field} is not an option of {label}; remove it"
    return f"{label}.{field} {first['msg'].lower()}, got {shown(first.get('input'))}"


def _safe_int_field(label: str, name: str, value: Any, minimum: int, optional: bool) -> Any:
    if value is None and optional:
        return value
    if not is_safe_int(value, minimum):
        bound = "a positive" if minimum == 1 else f"a >= {minimum}"
        none = " or None" if optional else ""
        raise ValueError(f"{label}.{name} must be {bound} safe integer{none}, got {shown(value)}")
    return value


class Retry(_Options):
    """Retry policy for plain tasks. ``attempts`` counts every try, the first one included."""

    label: ClassVar[str] = "retry"
    attempts: int
    delay_ms: int = 0
    max_delay_ms: int | None = None
    backoff: Literal["fixed", "exponential"] = "fixed"
    jitter: Literal["none", "full"] = "none"
    accepts: Callable[[BaseException, int], bool] | None = None

    def __init__(self, attempts: Any = None, **data: Any) -> None:
        super().__init__(attempts=attempts, **data)

    @field_validator("attempts", "delay_ms", "max_delay_ms", mode="before")
    @classmethod
    def _ints(cls, value: Any, info: Any) -> Any:
        minimum = 1 if info.field_name == "attempts" else 0
        return _safe_int_field("retry", info.field_name, value, minimum, info.field_name == "max_delay_ms")

    @field_validator("backoff", "jitter", mode="before")
    @classmethod
    def _choices(cls, value: Any, info: Any) -> Any:
        allowed = ("fixed", "exponential") if info.field_name == "backoff" else ("none", "full")
        if value not in allowed:
            raise ValueError(f"retry.{info.field_name} must be one of {allowed}, got {shown(value)}")
        return value

    @field_validator("accepts", mode="before")
    @classmethod
    def _accepts(cls, value: Any) -> Any:
        if value is not None and not callable(value):
            raise ValueError(f"retry.accepts must be a callable (error, attempt) -> bool, got {shown(value)}")
        return value

    @model_validator(mode="after")
    def _cap(self) -> Retry:
        if self.max_delay_ms is not None and self.max_delay_ms < self.delay_ms:
            raise ValueError(
                f"retry.max_delay_ms ({self.max_delay_ms}) must be >= retry.delay_ms ({self.delay_ms})"
            )
        return self

    def delay_before(self, attempt: int) -> int:
        """Upper bound in ms of the wait before try number ``attempt`` (2 = first retry)."""
        n = attempt - 1
        delay = self.delay_ms if self.backoff == "fixed" else self.delay_ms * 2 ** (n - 1)
        if self.max_delay_ms is not None:
            delay = min(delay, self.max_delay_ms)
        return int(delay)

    def describe(self) -> dict[str, Any]:
        data = self.model_dump(exclude={"accepts"})
        data["accepts"] = self.accepts is not None
        return data


class Cache(_Options):
    """Result cache of a task: ``key(ctx)`` (JSON) plus ``version`` select an entry."""

    label: ClassVar[str] = "cache"
    key: Callable[..., Any]
    version: str = "1"
    max_age_ms: int | None = None
    mode: Literal["reuse", "refresh"] = "reuse"
    store: Any = None

    def __init__(self, key: Any = None, **data: Any) -> None:
        super().__init__(key=key, **data)

    @field_validator("key", mode="before")
    @classmethod
    def _key(cls, value: Any) -> Any:
        if not callable(value):
            raise ValueError(f"cache.key must be a callable (ctx) -> JSON value, got {shown(value)}")
        return value

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> Any:
        problem = text_problem(value) if isinstance(value, str) else None
        if not isinstance(value, str) or not value or problem:
            given = f"a string that {problem}" if problem else shown(value)
            raise ValueError(f"cache.version must be a non-empty string, got {given}")
        return value

    @field_validator("max_age_ms", mode="before")
    @classmethod
    def _age(cls, value: Any) -> Any:
        return _safe_int_field("cache", "max_age_ms", value, 1, True)

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, value: Any) -> Any:
        if value not in ("reuse", "refresh"):
            raise ValueError(f"cache.mode must be 'reuse' or 'refresh', got {shown(value)}")
        return value

    @field_validator("store", mode="before")
    @classmethod
    def _store(cls, value: Any) -> Any:
        usable = callable(getattr(value, "read", None)) and callable(getattr(value, "write", None))
        if value is not None and not usable:
            raise ValueError("cache.store must have read(fingerprint) and write(fingerprint, entry) methods")
        return value

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, "max_age_ms": self.max_age_ms, "mode": self.mode}


class Budget(_Options):
    """Workflow budget: rounds/attempts and token totals admitted before each callback runs."""

    label: ClassVar[str] = "budget"
    attempts: int | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None

    @field_validator("attempts", "input_tokens", "output_tokens", mode="before")
    @classmethod
    def _ints(cls, value: Any, info: Any) -> Any:
        return _safe_int_field("budget", info.field_name, value, 1, True)


class LoopCheck(BaseModel):
    """What a loop task's ``check`` returns: accept (``done=True``) or reject with feedback, with
    an optional ``score`` (a finite number, higher is better) for plateaus and best-of."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    done: bool
    feedback: str | None = None
    score: float | None = None

    def __init__(self, done: Any = None, feedback: Any = None, score: Any = None) -> None:
        bad_feedback = not isinstance(feedback, str) if done is False else feedback is not None and not isinstance(
            feedback, str)
        if type(done) is not bool or bad_feedback:
            raise InvalidCheckResult(CHECK_RESULT_MESSAGE + f", got done={shown(done)}, feedback={shown(feedback)}")
        problem = text_problem(feedback) if isinstance(feedback, str) else None
        if problem is not None:  # it is stored (and passed to the next attempt) as UTF-8 JSON
            raise InvalidCheckResult(CHECK_RESULT_MESSAGE + f", got a feedback string that {problem}")
        if score is not None and (type(score) not in (int, float) or not math.isfinite(score)):
            raise InvalidCheckResult(f"{SCORE_MESSAGE}, got score={shown(score)}")
        super().__init__(done=done, feedback=feedback, score=None if score is None else float(score))

    @classmethod
    def coerce(cls, value: Any) -> LoopCheck:
        """Accept a LoopCheck or a dict with the same keys; refuse anything else."""
        if isinstance(value, LoopCheck):
            return value
        if isinstance(value, dict) and set(value) <= {"done", "feedback", "score"} and "done" in value:
            return cls(value["done"], value.get("feedback"), value.get("score"))
        raise InvalidCheckResult(CHECK_RESULT_MESSAGE + f", got {shown(value)}")

    def stored(self) -> dict[str, Any]:
        """What is recorded of it (``c:<key>:<round>``): the score only when there is one (the
        form ``core/checks.py`` encodes and decodes; tests/unit/test_checks.py holds them together)."""
        found: dict[str, Any] = {"done": self.done, "feedback": self.feedback}
        if self.score is not None:
            found["score"] = self.score
        return found


CHECK_RESULT_MESSAGE = "loop check must return done=True or done=False with a feedback string"
SCORE_MESSAGE = "loop check score must be a finite number (higher is better) or None"
ON_EXHAUSTED = ("fail", "best")


class Plateau(_Options):
    """End a loop early, as an exhaustion (reason ``plateau``), when its best score has not grown
    by ``min_gain`` over its last ``rounds`` scored rounds (rounds without a score do not count)."""

    label: ClassVar[str] = "plateau"
    rounds: int
    min_gain: float = 0.0

    @field_validator("rounds", mode="before")
    @classmethod
    def _rounds(cls, value: Any) -> Any:
        return _safe_int_field("plateau", "rounds", value, 1, False)

    @field_validator("min_gain", mode="before")
    @classmethod
    def _gain(cls, value: Any) -> Any:
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"plateau.min_gain must be a finite number >= 0, e.g. 0.01, got {shown(value)}")
        return float(value)

    def describe(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "min_gain": self.min_gain}

"""The messages a worker takes, validated (pydantic): a phase, a fan-out, a settle, a start. What
is not one of them is refused here, and only here: one log line (its parts quoted, escaped and
cut), the ``taskloop_refused_deliveries{reason="malformed"}`` metric, and a reply that Flower
shows as IGNORED with the reason (replies.py). A malformed message never reaches a run."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator

from taskloop.base import names
from taskloop.base.text import cut, shown
from taskloop.core import reads
from taskloop.ops.hooks import Refused
from taskloop.runtime.instruments import hooks
from taskloop.worker.execution import replies

log = logging.getLogger("taskloop.messages")

M = TypeVar("M", bound=BaseModel)


def _run_id(value: str, what: str = "run_id") -> str:
    if not names.is_run_id(value):
        raise ValueError(f"{what} must be {names.RUN_ID_RULE}")
    return value


def _task_key(value: str) -> str:
    if not names.is_task_key(value):
        raise ValueError("key must be a task key or a graph action key (step@n)")
    return value


class PhaseMessage(BaseModel):
    """The only payload taskloop puts on the queue for a phase: which phase of which run."""

    model_config = ConfigDict(frozen=True)
    run_id: StrictStr
    key: StrictStr
    round: StrictInt = Field(ge=1)
    token: StrictInt = Field(ge=0)

    @field_validator("run_id")
    @classmethod
    def _check_run(cls, value: str) -> str:
        return _run_id(value)

    @field_validator("key")
    @classmethod
    def _check_key(cls, value: str) -> str:
        return _task_key(value)


class FanoutMessage(BaseModel):
    """``taskloop.dispatch``: send the messages of these queued tasks of one run."""

    model_config = ConfigDict(frozen=True)
    run_id: StrictStr
    keys: list[StrictStr] = Field(min_length=1, max_length=10_000)

    @field_validator("run_id")
    @classmethod
    def _check_run(cls, value: str) -> str:
        return _run_id(value)

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        return [_task_key(key) for key in keys]


class RunMessage(BaseModel):
    """A message that names one run: ``taskloop.settle`` (end the paused gates of a cancelled run),
    or ``taskloop.start`` with a run recorded by name."""

    model_config = ConfigDict(frozen=True)
    run_id: StrictStr

    @field_validator("run_id")
    @classmethod
    def _check_run(cls, value: str) -> str:
        return _run_id(value)


class RequestMessage(BaseModel):
    """``taskloop.act``: the id of an action asked by run id (its request is in Redis)."""

    model_config = ConfigDict(frozen=True)
    request_id: StrictStr

    @field_validator("request_id")
    @classmethod
    def _check_request(cls, value: str) -> str:
        return _run_id(value, "request_id")


class StartMessage(BaseModel):
    """``taskloop.start`` from any Celery client: kwargs workflow, input, and optionally version
    and run_id (JSON body; the input is the only user payload taskloop accepts on the queue)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    workflow: StrictStr
    input: Any = None
    version: StrictStr | None = None
    run_id: StrictStr | None = None

    @field_validator("workflow")
    @classmethod
    def _name(cls, value: str) -> str:
        if not names.is_name(value):
            raise ValueError(f"workflow must be a workflow name: {names.NAME_RULE}")
        return value

    @field_validator("version")
    @classmethod
    def _version(cls, value: str | None) -> str | None:
        problem = names.version_problem(value) if value is not None else None
        if problem is not None:
            raise ValueError(f"version must be {names.VERSION_RULE}; {problem}")
        return value

    @field_validator("run_id")
    @classmethod
    def _run(cls, value: str | None) -> str | None:
        return None if value is None else _run_id(value)


class Carried(BaseModel):
    """What a phase message carries besides its ids, when the write that queued it put the fields it
    reads into it (core/reads.py): their values, when it was queued, and whether it is marked as
    delivered before (worker/execution/replies.py). A header that is not this is ignored: the worker reads."""

    model_config = ConfigDict(frozen=True)

    values: list[StrictStr | None] = Field(max_length=1000)
    queued_at: float | None
    redelivered: bool = False


def carried_of(request: Any) -> Carried | None:
    """The carried fields of a Celery task request (its ``tl_carry`` and ``tl_at`` headers and its
    ``redelivered`` mark, in the headers or the delivery info), or None. ``request`` is the task's
    context (headers as attributes) or the worker's request (headers in its ``request_dict``: the
    asyncio pool's)."""
    headers = getattr(request, "request_dict", None)
    if isinstance(headers, dict):
        values, queued_at = headers.get(reads.CARRY_HEADER), headers.get(reads.QUEUED_AT_HEADER)
        marked = headers.get("redelivered")
    else:
        values, queued_at = getattr(request, reads.CARRY_HEADER, None), getattr(request, reads.QUEUED_AT_HEADER, None)
        marked = getattr(request, "redelivered", None)
    if values is None:
        return None
    info = getattr(request, "delivery_info", None) or {}
    redelivered = bool(marked or (isinstance(info, dict) and info.get("redelivered")))
    try:
        return Carried(values=values, queued_at=queued_at, redelivered=redelivered)
    except ValidationError as exc:
        log.warning("a phase message's %s header is not what taskloop writes (%s); the worker reads instead",
                    reads.CARRY_HEADER, problem_of(exc))
        return None


TRACE_HEADER = "traceparent"  # the W3C trace context of a phase message (the hooks': ops/tracing.py)


def traceparent_of(headers: Any) -> str | None:
    """A phase message's ``traceparent`` header (from its request's headers or attributes), or None
    when it has none or not a short text (a hook parses it)."""
    found = headers.get(TRACE_HEADER) if isinstance(headers, dict) else getattr(headers, TRACE_HEADER, None)
    return found if isinstance(found, str) and len(found) <= 128 else None


def positional(args: tuple[Any, ...], kwargs: dict[str, Any], *fields: str) -> dict[str, Any]:
    """A message's positional arguments by name (ValueError when there are others, or keywords)."""
    if kwargs or len(args) != len(fields):
        raise ValueError(f"expected {len(fields)} positional args ({', '.join(fields)}), got {len(args)} args and "
                        f"{len(kwargs)} kwargs")
    return dict(zip(fields, args, strict=True))


def problem_of(exc: Exception) -> str:
    """The first line of what is wrong with a message, cut short (a validation error quotes the input)."""
    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        return cut(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}", 300)
    return cut((str(exc).splitlines() or [""])[0], 300)


def read(model: type[M], task: str, args: tuple[Any, ...], kwargs: dict[str, Any],
         fields: tuple[str, ...] | None = None) -> M | str:
    """The message as ``model`` (from keyword arguments, or from positional ``fields``), or the
    reply that refuses it."""
    try:
        values = positional(args, kwargs, *fields) if fields is not None else _keywords(args, kwargs)
        return model(**values)
    except (ValueError, TypeError, ValidationError) as exc:
        return refuse(task, problem_of(exc), args, kwargs)


def _keywords(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    if args:
        raise ValueError("pass the run by keyword: workflow=..., input=..., version=..., run_id=...")
    return kwargs


def refuse(task: str, problem: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> str:
    """Refuse a malformed message: logged on one line, counted, and the IGNORED reply for Celery."""
    log.error("malformed %s message dropped: %s (args %s, kwargs %s)", task, shown(problem), shown(args),
              shown(sorted(kwargs or {})))
    hooks().delivery_refused(Refused("malformed"))
    return replies.ignored(f"malformed: {problem}")

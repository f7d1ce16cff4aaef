"""Payload caps: how large a value taskloop agrees to store (pure: no I/O, no settings of its own).

Every user payload that reaches Redis is measured once, as the UTF-8 bytes of the compact JSON
taskloop stores (``jsonvalue.dumps``), against a cap from the settings:

========================  ===============================  ==========  ==============================
value                     setting (environment variable)   default     past the cap
========================  ===============================  ==========  ==============================
run input                 TASKLOOP_MAX_INPUT_BYTES         1 MiB       client: InvalidInput
task output, candidate,   TASKLOOP_MAX_OUTPUT_BYTES        1 MiB       worker: the phase (or graph
graph state / activation                                               run) fails with OutputTooLarge
check result (feedback)   TASKLOOP_MAX_FEEDBACK_BYTES      1 MiB       worker: OutputTooLarge
gate value (decide)       TASKLOOP_MAX_GATE_VALUE_BYTES    1 MiB       client: InvalidInput
usage receipt id          TASKLOOP_MAX_RECEIPT_BYTES       1 KiB       worker: OutputTooLarge
========================  ===============================  ==========  ==============================

A value over its cap is never written to Redis. Error messages are cut to MESSAGE_LIMIT
characters (their tracebacks already are), so an exception cannot smuggle a large payload in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from taskloop.base.errors import InvalidInput
from taskloop.base.jsonvalue import dumps, lossless_problem, not_lossless

MIB = 1_048_576
DEFAULT_BYTES = MIB
DEFAULT_RECEIPT_BYTES = 1024  # a receipt is an id (a request id, a hash): 1 KiB is plenty
UNLIMITED = 2**63  # a cap no value reaches (a custom cache store read without a cap)
DEFAULT_CACHE_TTL_S = 30 * 24 * 3600  # TASKLOOP_CACHE_TTL_S: a cache entry without max_age_ms

INPUT_ENV = "TASKLOOP_MAX_INPUT_BYTES"
OUTPUT_ENV = "TASKLOOP_MAX_OUTPUT_BYTES"
FEEDBACK_ENV = "TASKLOOP_MAX_FEEDBACK_BYTES"
GATE_VALUE_ENV = "TASKLOOP_MAX_GATE_VALUE_BYTES"
RECEIPT_ENV = "TASKLOOP_MAX_RECEIPT_BYTES"
STREAM_ENV = "TASKLOOP_STREAM_MAX_BYTES"  # a phase's live text (ctx.stream): past it, dropped and marked


@dataclass(frozen=True)
class Caps:
    """The caps a process enforces, in bytes of UTF-8 JSON (``Settings.caps()``)."""

    input: int = DEFAULT_BYTES
    output: int = DEFAULT_BYTES
    feedback: int = DEFAULT_BYTES
    gate_value: int = DEFAULT_BYTES
    receipt: int = DEFAULT_RECEIPT_BYTES


DEFAULT_CAPS = Caps()


def oversize(raw: str, limit: int) -> int | None:
    """The size in bytes of ``raw`` (UTF-8) when it is over ``limit``, else None.

    Cheap for the common case: a str of n characters is at most 4n bytes, so a value well
    under its cap is decided by its length alone, without encoding it."""
    if len(raw) * 4 <= limit:
        return None
    size = len(raw.encode("utf-8", "surrogatepass"))
    return size if size > limit else None


def too_large(what: str, size: int, limit: int, setting: str) -> str:
    """The message for a value over its cap: what, how large, the limit, and how to raise it."""
    return (f"{what} is {size:,} bytes of JSON, over the limit of {limit:,} bytes; store large data elsewhere "
            f"(a file, a bucket, a database) and pass a reference, or raise the limit with {setting}")


def require_size(raw: str, what: str, limit: int, setting: str) -> None:
    """Client side: InvalidInput naming the field, the size, the limit and the setting."""
    size = oversize(raw, limit)
    if size is not None:
        raise InvalidInput(too_large(what, size, limit, setting))


def check_positive(name: str, value: int, unit: str) -> int:
    """A cap from the settings must be a positive integer (``unit``: what it counts)."""
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be a positive {unit}, got {value!r}")
    return value


@dataclass(frozen=True)
class Stored:
    """A value as taskloop stores it (``raw``: compact JSON), or why it cannot be stored:
    ``problem`` (not lossless JSON: where and why) or ``size`` (bytes, over the cap)."""

    raw: str | None = None
    problem: str | None = None
    size: int | None = None


def store_form(value: Any, limit: int, path: str = "$") -> Stored:
    """The one rule for every value taskloop records: lossless JSON first, then its compact JSON,
    then its size against ``limit``."""
    problem = lossless_problem(value, path)
    if problem is not None:
        return Stored(problem=problem)
    raw = dumps(value)
    size = oversize(raw, limit)
    return Stored(raw=raw) if size is None else Stored(size=size)


def require_storable(value: Any, what: str, limit: int, setting: str, path: str = "$",
                     sized: str | None = None) -> str:
    """Client side: the stored form of ``value``, or InvalidInput naming the field (``what``; ``sized``
    in the message of a value over its cap), the problem or the size, and the fix."""
    found = store_form(value, limit, path)
    if found.problem is not None:
        raise InvalidInput(not_lossless(what, found.problem))
    if found.size is not None:
        raise InvalidInput(too_large(sized or what, found.size, limit, setting))
    assert found.raw is not None
    return found.raw

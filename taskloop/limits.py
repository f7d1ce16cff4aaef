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

from taskloop.errors import InvalidInput

MIB = 1_048_576
DEFAULT_BYTES = MIB
DEFAULT_RECEIPT_BYTES = 1024  # a receipt is an id (a request id, a hash): 1 KiB is plenty
MESSAGE_LIMIT = 8_000  # characters of a recorded error message
DEFAULT_CACHE_TTL_S = 30 * 24 * 3600  # TASKLOOP_CACHE_TTL_S: a cache entry without max_age_ms

INPUT_ENV = "TASKLOOP_MAX_INPUT_BYTES"
OUTPUT_ENV = "TASKLOOP_MAX_OUTPUT_BYTES"
FEEDBACK_ENV = "TASKLOOP_MAX_FEEDBACK_BYTES"
GATE_VALUE_ENV = "TASKLOOP_MAX_GATE_VALUE_BYTES"
RECEIPT_ENV = "TASKLOOP_MAX_RECEIPT_BYTES"


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


def cut(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters (saying how much was cut)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters cut)"


def check_positive(name: str, value: int, unit: str) -> int:
    """A cap from the settings must be a positive integer (``unit``: what it counts)."""
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be a positive {unit}, got {value!r}")
    return value

"""What the asyncio pool's two processes say to each other (asyncio_pool.py, the worker's main
process, and loop_process.py, its pool process): a phase message to run, and what it came to.

Each frame is one JSON object after a 4-byte big-endian length, on a socket pair. The main process
validates what comes back (pydantic), as anything that crosses a process boundary: a frame that
does not parse is a pool process gone wrong, and is treated as its loss."""

from __future__ import annotations

import struct
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictStr

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024  # far above any phase message (its carried values stop at 64 KB)


class PhaseFrame(BaseModel):
    """A phase message for the pool process: what Celery's request of it says."""

    model_config = ConfigDict(frozen=True)
    id: StrictStr  # the Celery task id
    task: StrictStr  # taskloop.attempt, taskloop.check or taskloop.run
    args: list[Any]
    kwargs: dict[str, Any]
    name: str | None  # the shadow name, <workflow>.<key>.<phase>
    hostname: str | None  # the worker's node name
    carry: list[str | None] | None = None  # the tl_carry header (core/reads.py)
    queued_at: float | None = None  # the tl_at header
    redelivered: bool = False
    traceparent: str | None = None  # the W3C trace context it carried (messages.traceparent_of)


class ReplyFrame(BaseModel):
    """What a phase message came to in the pool process: the reply Celery records, or the store was
    away before it began (the message goes back to its queue), or an error of taskloop's own."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: StrictStr
    reply: str | None = None
    requeue: str | None = None
    error: str | None = None  # the traceback, as text


class StopFrame(BaseModel):
    """The main process stops the pool process: it takes nothing more and exits once its phases end."""

    model_config = ConfigDict(frozen=True)
    stop: bool = True


def pack(frame: BaseModel) -> bytes:
    body = frame.model_dump_json(exclude_defaults=True).encode()
    return HEADER.pack(len(body)) + body


class Reader:
    """Frames out of a byte stream that arrives in pieces."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The whole frames now in the stream (their JSON bodies); raises ValueError on a frame too
        long to be one of ours."""
        self._buffer += data
        found = []
        while len(self._buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer)
            if size > MAX_FRAME:
                raise ValueError(f"a frame of {size} bytes: not one of taskloop's")
            if len(self._buffer) < HEADER.size + size:
                break
            found.append(bytes(self._buffer[HEADER.size:HEADER.size + size]))
            del self._buffer[:HEADER.size + size]
        return found

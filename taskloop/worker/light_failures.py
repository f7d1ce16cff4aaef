"""Cheap exception info for the failures taskloop raises on purpose.

A phase whose failure taskloop has already committed (a callback error, a timeout, an exhausted
loop) raises ``PhaseFailed`` so that Celery and Flower show ``FAILURE``; a refused delivery raises
``Refused`` (Flower: ``IGNORED``). Celery turns every exception into billiard's ``ExceptionInfo``,
which copies each frame's code positions into a picklable traceback and formats the whole
traceback, and the pool process then pickles all of it to the main process. Measured with celery
5.7.0 and billiard 4.3 on Python 3.11 (a profile of 500 exhausted loops): about 1.8 ms of CPU per
failure, most of it for the frames of Celery's own tracer, so an exhausted loop cost 15 % more
than an accepted one.

Those tracebacks say nothing: the frames are taskloop's and Celery's, and the user's own
traceback is already recorded with the run (``taskloop inspect``). ``install()`` replaces the
``ExceptionInfo`` that Celery's tracer uses with a subclass that, for these two exceptions only,
keeps the exception and a one-line traceback (``PhaseFailed: LoopTaskExhausted: ...``) and no
frames. Every other exception gets billiard's full ``ExceptionInfo``. Worker start-up
(taskloop/worker/app.py) calls it; ``TASKLOOP_LIGHT_FAILURES=0`` leaves Celery as it is.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from billiard.einfo import ExceptionInfo, ExceptionWithTraceback

log = logging.getLogger("taskloop.light_failures")

_expected: tuple[type[BaseException], ...] = ()


class LightExceptionInfo(ExceptionInfo):  # type: ignore[misc]  # billiard is untyped
    """billiard's ExceptionInfo, without frames for taskloop's expected failures."""

    def __init__(self, exc_info: Any = None, internal: bool = False) -> None:
        found = exc_info or sys.exc_info()
        exception = found[1]
        if not _expected or not isinstance(exception, _expected):
            super().__init__(exc_info, internal)
            return
        self.type = found[0]
        self.tb = None
        self.traceback = f"{type(exception).__name__}: {exception}\n"
        self.internal = internal
        self.exception = ExceptionWithTraceback(exception, self.traceback)


def installed() -> bool:
    from celery.app import trace

    return trace.ExceptionInfo is LightExceptionInfo


def install(*expected: type[BaseException]) -> bool:
    """Make Celery's tracer build light exception info for ``expected`` exceptions."""
    global _expected
    if os.environ.get("TASKLOOP_LIGHT_FAILURES", "1") == "0":
        return False
    from celery.app import trace

    if getattr(trace, "ExceptionInfo", None) not in (ExceptionInfo, LightExceptionInfo):
        log.debug("celery's tracer does not use billiard's ExceptionInfo; left as it is")
        return False
    _expected = tuple({*_expected, *expected})
    trace.ExceptionInfo = LightExceptionInfo
    return True

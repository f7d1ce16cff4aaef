"""The worker's logs: every record on its own lines. Celery logs a message's task id, shadow name
or exception text as it is (``Task %(name)s[%(id)s] received``), so a line break in a forged
header would forge a log line of its own. Every argument of every record goes through
``taskloop.base.text.log_arg`` (escaped, cut); the format strings, and tracebacks, which are not
arguments, keep their line breaks."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from taskloop.base.text import log_arg


class OneLineArgs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(log_arg(a) for a in args)
        elif isinstance(args, Mapping):
            record.args = {name: log_arg(value) for name, value in args.items()}
        return True


ONE_LINE = OneLineArgs()


def one_line_logs(logger: logging.Logger | None = None, **_: Any) -> None:
    """Put the filter on every handler of ``logger`` (Celery's after_setup_logger signals)."""
    for handler in (logger or logging.getLogger()).handlers:
        if ONE_LINE not in handler.filters:
            handler.addFilter(ONE_LINE)

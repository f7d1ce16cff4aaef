"""Print the fault-injection summary table at the end of the session (see docs/reliability.md)."""

from __future__ import annotations

from typing import Any

from tests.faults.harness import HEADER, RESULTS


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    terminalreporter.section("fault injection summary")
    terminalreporter.write_line(HEADER)
    for outcome in RESULTS:
        terminalreporter.write_line(outcome.row())

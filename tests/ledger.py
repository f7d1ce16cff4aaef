"""An offline checker of a run's event history: every phase that was opened is closed exactly once.

Grammar per task: ``phase(n, attempt|run)`` opens a phase; ``phase(n, check)`` closes the
attempt and opens the check; ``phase(n, complete)`` closes the check; the next ``phase`` event
closes the open one (a new round, or a retry); a terminal ``task`` event closes whatever is
open. An execution (the ``data.exec`` of an outcome's first event) must belong to an open phase.
"""

from __future__ import annotations

from collections.abc import Iterable

from taskloop.core.events import Event

TERMINAL = {"done", "failed", "skipped", "cancelled", "rejected"}


def ledger_problems(events: Iterable[Event]) -> list[str]:
    problems: list[str] = []
    open_phase: dict[str, tuple[int, str] | None] = {}
    finished: set[str] = set()
    for e in events:
        if e.key is None:
            continue
        current = open_phase.get(e.key)
        if (e.data or {}).get("exec") and current is None:
            problems.append(f"{e.key}: an execution recorded outside any open phase ({e.type} {e.round}/{e.phase})")
        if e.type == "phase":
            assert e.round is not None and e.phase is not None
            if e.phase == "complete":
                if current != (e.round, "check"):
                    problems.append(f"{e.key}: complete of round {e.round} without an open check ({current})")
                open_phase[e.key] = None
            else:
                if e.phase == "check" and current != (e.round, "attempt"):
                    problems.append(f"{e.key}: check of round {e.round} without an open attempt ({current})")
                open_phase[e.key] = (e.round, e.phase)
        elif e.type == "task" and e.key in finished and e.data and e.data.get("status") in ("active", "waiting"):
            finished.discard(e.key)  # client.resume reopened it, at its interrupted phase if any
            if e.data["status"] == "active":
                assert e.round is not None and e.phase is not None
                open_phase[e.key] = (e.round, e.phase)
        elif e.type == "task" and e.data and e.data.get("status") in TERMINAL:
            if e.key in finished:
                problems.append(f"{e.key}: a second terminal status ({e.data['status']})")
            finished.add(e.key)
            open_phase[e.key] = None
    for key, current in open_phase.items():
        if current is not None:
            problems.append(f"{key}: phase {current} was never closed")
    return problems


def assert_balanced(events: Iterable[Event]) -> None:
    problems = ledger_problems(events)
    assert not problems, "\n".join(problems)

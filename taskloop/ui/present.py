"""What the pages show, in words a person reads: times, durations, statuses, JSON values, long
text collapsed. Pure functions, installed as the templates' filters (taskloop/ui/app.py).

Every stored string (feedback, outputs, reasons, error messages, tracebacks) is a model's reply
or a user's input. The templates escape HTML (Jinja's autoescape); ``page_text`` also escapes
what HTML would show silently or wrongly (controls, bidi overrides). A filter here returns plain
``str``, never ``Markup``, so nothing it returns bypasses the escaping.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from taskloop.base.text import page_text

LONG_CHARS = 600  # a value longer than this (as text) is shown collapsed, with its start as summary
LONG_LINES = 12
SUMMARY_CHARS = 160

STATUS_CLASS = {
    "done": "ok", "running": "live", "active": "live", "pending": "wait", "waiting": "wait", "paused": "wait",
    "throttled": "wait", "failed": "bad", "rejected": "bad", "cancelled": "off", "skipped": "off",
}


def status_class(status: str | None) -> str:
    """The CSS class of a run or task status (its colour)."""
    return STATUS_CLASS.get(status or "", "off")


def clock_time(at: float | None) -> str:
    """``2026-12-01 18:04:05 UTC``."""
    if at is None:
        return "-"
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def time_of_day(at: float | None) -> str:
    """``18:04:05.123`` (the event timeline; the date is in the run's header)."""
    if at is None:
        return "-"
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%H:%M:%S.%f")[:-3]


def duration(seconds: float | None) -> str:
    """``350 ms``, ``1.2 s``, ``3 min 5 s``, ``2 h 4 min``."""
    if seconds is None:
        return "-"
    if seconds < 0:
        seconds = 0.0
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min"
    return f"{hours // 24} d {hours % 24} h"


def ago(at: float | None, now: float) -> str:
    if at is None:
        return "-"
    return f"{duration(now - at)} ago"


def took(start: float | None, end: float | None, now: float) -> str:
    """How long a run or task took (so far, while it goes on)."""
    if start is None:
        return "-"
    return duration((end if end is not None else now) - start) + ("" if end is not None else " so far")


def as_text(value: Any) -> str:
    """A stored value as a person reads it: a string as it is, anything else as indented JSON."""
    if isinstance(value, str):
        return page_text(value)
    try:
        return page_text(json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False))
    except (TypeError, ValueError):
        return page_text(repr(value))


def one_line(value: Any, limit: int = SUMMARY_CHARS) -> str:
    """A value on one line, cut to ``limit`` characters (a collapsed value's summary, a table cell)."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    text = " ".join(text.split())
    return page_text(text if len(text) <= limit else text[: limit - 1] + "…")


def is_long(value: Any) -> bool:
    text = as_text(value)
    return len(text) > LONG_CHARS or text.count("\n") >= LONG_LINES


def plain(text: Any) -> str:
    """Any stored text, escaped for the page (see the module docstring)."""
    return page_text(text if isinstance(text, str) else str(text))


def counted(count: int, word: str, many: str | None = None) -> str:
    """``1 task``, ``2 tasks``, ``0 rounds``: a count and its noun, singular for one (``many``: an
    irregular plural). Every count a page says goes through here."""
    return f"{count} {word if count == 1 else (many or word + 's')}"


STOPS = {"failed": "stopped after a failure", "stopped": "stopped"}


def control_text(control: str | None) -> str:
    """A run's control (``cancel:<reason>``, ``stop:<reason>``, core/rules.py) in words:
    ``cancelled: changed my mind``, ``stopped after a failure``."""
    if not control:
        return ""
    kind, _, reason = control.partition(":")
    if kind == "stop":
        return STOPS.get(reason, f"stopped: {reason}" if reason else "stopped")
    if kind == "cancel":
        return f"cancelled: {reason}" if reason and reason != "cancelled" else "cancelled"
    return control


def scored(rounds: Any) -> bool:
    """Whether any of a loop's rounds has a score (its Score column shows only then)."""
    return any((r.check or {}).get("score") is not None for r in rounds)


def resume_note(run: Any) -> tuple[bool, str] | None:
    """What to say beside a failed run's resume, when its failure was ``WorkflowNotRegistered``
    (no worker could import the workflow's module): ``(offered, why)``. A run that failed before any
    task ran has nothing to replay, so resuming can only fail: it is not offered. A task that failed
    so replays once the workers import the module, and only then."""
    module = f"the workflow {run.workflow!r} is not registered: no worker imports its module"
    if run.error is not None and run.error.type == "WorkflowNotRegistered":
        return False, (f"No resume: {module}, so the run failed before any step ran and has nothing to replay. "
                       "Start the workers with it (taskloop worker --import MODULE) and start a new run.")
    if any(t.error is not None and t.error.type == "WorkflowNotRegistered" for t in run.tasks.values()):
        return True, (f"Resuming now fails again: {module}. Start the workers with it "
                      "(taskloop worker --import MODULE) first.")
    return None


DONE_NOTICES = {
    "cancel": "Cancel requested: the run stops at its next step.",
    "nothing-to-cancel": "Nothing to cancel: the run had already ended.",
    "resume": "Resumed: the failed step runs again.",
    "approve": "Approved.", "reject": "Rejected.", "forked": "Forked: this run starts from the round chosen.",
}


def done_notice(done: str | None) -> str | None:
    """The notice a page shows after an action succeeded (its ``?done=`` or ``?forked=1``)."""
    return DONE_NOTICES.get(done or "")


def event_details(event: Any) -> str:
    """What an event says, in a few words (the timeline's last column)."""
    data: dict[str, Any] = dict(event.data or {})
    parts: list[str] = []
    execution = data.pop("exec", None)
    kind = event.type
    if kind == "phase" and event.phase == "complete":
        verdict = "accepted" if data.pop("done", None) else "rejected"
        feedback = data.pop("feedback", None)
        parts.append(verdict + (f": {one_line(feedback, 120)}" if feedback else ""))
        if data.get("score") is not None:
            parts.append(f"score {data.pop('score')}")
    elif kind == "task":
        status = str(data.pop("status", ""))
        parts.append(status)
        for name in ("error", "message", "reason"):
            if data.get(name) == status:  # a task cancelled for the reason "cancelled": said once
                data.pop(name)
            elif data.get(name):
                parts.append(one_line(data.pop(name), 120))
    elif kind in ("run.cancel", "run.resumed", "gate"):
        actor = data.pop("actor", None)
        if kind == "gate":
            parts.append(f"{event.phase}")
        if data.get("reason"):
            parts.append(f"“{one_line(data.pop('reason'), 120)}”")
        if data.get("tasks"):
            parts.append("replays " + ", ".join(map(str, data.pop("tasks"))))
        if actor:
            parts.append(f"by {one_line(actor, 60)}")
    if isinstance(execution, dict):
        ran = [f"on {one_line(execution.get('worker') or '?', 60)}"]
        if execution.get("took") is not None:
            ran.append(f"took {duration(execution['took'])}")
        if execution.get("wait") is not None:
            ran.append(f"waited {duration(execution['wait'])}")
        if int(execution.get("execs") or 1) > 1:
            ran.append(f"execution {execution['execs']}")
        for flag in ("lost", "handed_back"):
            if execution.get(flag):
                ran.append(flag.replace("_", " "))
        parts.append(", ".join(ran))
    if data:
        parts.append(one_line(data, 200))
    return " · ".join(p for p in parts if p)


FILTERS = {
    "status_class": status_class, "clock_time": clock_time, "time_of_day": time_of_day, "duration": duration,
    "as_text": as_text, "one_line": one_line, "is_long": is_long, "plain": plain,
    "event_details": event_details, "control_text": control_text,
    "counted": counted, "scored": scored, "resume_note": resume_note,
}

"""What the command line shows: the live progress of a run, a run's full record, events with
human timestamps, and results."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from taskloop import events as ev
from taskloop.events import Event
from taskloop.models import RunResult, RunView, TaskView

STATUS_STYLE = {"done": "green", "failed": "red", "rejected": "red", "cancelled": "yellow", "skipped": "dim",
                "active": "cyan", "paused": "magenta", "waiting": "dim", "running": "cyan", "pending": "dim"}
TRACEBACK_LINES = 8  # the last lines of a traceback that `inspect` shows


def iso(at: float | None) -> str:
    if at is None:
        return ""
    return dt.datetime.fromtimestamp(at).astimezone().isoformat(timespec="milliseconds")


def relative(at: float, since: float | None) -> str:
    return f"+{at - since:.3f}s" if since is not None else ""


def ago(at: float, now: float) -> str:
    seconds = max(now - at, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(event: Event) -> str:
    """One event in words (without its time)."""
    data = event.data or {}
    if event.type == ev.PHASE and event.phase == "complete":
        verdict = "accepted" if data.get("done") else f"rejected: {data.get('feedback')}"
        return f"{event.key} round {event.round} check {verdict}"
    if event.type == ev.PHASE:
        what = f"try {event.round}" if event.phase == "run" else f"round {event.round} {event.phase}"
        return f"{event.key} {what}"
    if event.type == ev.TASK:
        detail = f" ({data['error']}: {data.get('message')})" if data.get("error") else ""
        reason = f" ({data['reason']})" if data.get("reason") and not detail else ""
        return f"{event.key} {data.get('status')}{detail}{reason}"
    if event.type == ev.RUN_FINISHED:
        term = f", termination {data['termination']}" if data.get("termination") else ""
        return f"run {data.get('status')}{term}"
    if event.type == ev.RUN_CANCEL:
        return f"run cancel requested: {data.get('reason')}"
    if event.type == ev.LOST:
        return f"{event.key} round {event.round} {event.phase}: execution lost, replaying"
    parts = [event.key or "", event.phase or "", json.dumps(data) if data else ""]
    return " ".join(p for p in parts if p)


def event_line(event: Event, since: float | None) -> str:
    exec_info = (event.data or {}).get("exec")
    ran = f"  [{exec_info.get('worker')}, {exec_info.get('took', 0):.3f}s]" if exec_info and "took" in exec_info else ""
    return f"{iso(event.at)} {relative(event.at, since):>10}  {event.type:<14} {describe(event)}{ran}"


@dataclass
class TaskLine:
    key: str
    status: str = "waiting"
    round: int | None = None
    phase: str | None = None
    verdict: str = ""
    last: str = ""


@dataclass
class Progress:
    """The live view of one run: a row per task, updated from its events."""

    run_id: str
    console: Console
    tasks: dict[str, TaskLine] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    started: float | None = None
    live: Live | None = None
    status: str = "running"
    printed: int = 0

    MAX_LINES = 200  # lines printed above the live table; past this only the table changes
    MAX_ROWS = 25  # rows of the live table (the busiest first)

    def seed(self, view: RunView) -> None:
        for key, task in view.tasks.items():
            self.tasks[key] = TaskLine(key, task.status, task.round or None, task.phase)
        self.started = view.created_at

    def __call__(self, event: Event) -> None:
        if self.started is None:
            self.started = event.at
        if event.type == ev.RUN_FINISHED:
            self.status = (event.data or {}).get("status", self.status)
        if event.key is not None:
            line = self.tasks.setdefault(event.key, TaskLine(event.key))
            data = event.data or {}
            if event.type == ev.PHASE and event.phase == "complete":
                line.verdict = "accepted" if data.get("done") else f"rejected: {data.get('feedback')}"
            elif event.type == ev.PHASE:
                line.status, line.round, line.phase = "active", event.round, event.phase
            elif event.type == ev.TASK:
                line.status = str(data.get("status", line.status))
                if data.get("message"):
                    line.verdict = f"{data.get('error')}: {data['message']}"
            line.last = describe(event)
        if self.live is None:
            self.console.print(f"  {relative(event.at, self.started):>10}  {describe(event)}")
            return
        if _worth_a_line(event) and self.printed < self.MAX_LINES:
            self.printed += 1
            self.live.console.print(f"  {relative(event.at, self.started):>10}  {describe(event)}")
        self.live.update(self.render())

    def notice(self, message: str) -> None:
        self.notices.append(message)
        if self.live is not None:
            self.live.update(self.render())
        else:
            self.console.print(f"  ! {message}")

    def render(self) -> Group:
        table = Table("task", "status", "round", "phase", "last check / error", title=f"run {self.run_id}",
                      title_justify="left")
        lines = sorted(self.tasks.values(), key=lambda t: (t.status != "active", t.status == "waiting"))
        for line in lines[: self.MAX_ROWS]:
            style = STATUS_STYLE.get(line.status, "")
            table.add_row(line.key, Text(line.status, style=style), str(line.round or ""), line.phase or "",
                          Text(line.verdict, overflow="fold"))
        if len(lines) > self.MAX_ROWS:
            table.add_row(f"... {len(lines) - self.MAX_ROWS} more", "", "", "", "")
        parts: list[Any] = [table]
        parts += [Text(f"! {message}", style="yellow") for message in self.notices[-3:]]
        return Group(*parts)


def _worth_a_line(event: Event) -> bool:
    """What a live display also prints as a line: check verdicts, task endings, lost executions."""
    data = event.data or {}
    return (event.type == ev.PHASE and event.phase == "complete") or event.type == ev.LOST or (
        event.type == ev.TASK and data.get("status") not in (None, "active", "waiting", "paused"))


def print_result(console: Console, result: RunResult) -> None:
    style = STATUS_STYLE.get(result.status, "")
    term = f" (termination {result.termination_code})" if result.termination_code else ""
    console.print(f"status [{style}]{result.status}[/]{term}")
    for key, value in result.values.items():
        console.print(f"  {key} = {short(value, 200)}")
    for error in result.errors:
        where = f"{error.key}: " if error.key else ""
        console.print(f"  [red]{where}{error.type}: {error.message}[/]")
        feedback = (error.details or {}).get("feedback")
        if feedback:
            console.print(f"    last feedback: {feedback}")
    console.print(f"usage {json.dumps(result.usage)}")


def render_run(console: Console, view: RunView) -> None:
    style = STATUS_STYLE.get(view.status, "")
    term = f", termination {view.termination_code}" if view.termination_code else ""
    console.print(f"run [bold]{view.run_id}[/] {view.workflow} v{view.version}: [{style}]{view.status}[/]{term}")
    took = f", took {view.finished_at - view.created_at:.3f}s" if view.finished_at else ""
    console.print(f"created {iso(view.created_at)}{took}")
    if view.control:
        kind, _, reason = view.control.partition(":")
        console.print(f"[yellow]{'cancel requested' if kind == 'cancel' else 'stopped'}: {reason}[/]")
    if view.error is not None:
        console.print(f"[red]{view.error.type}: {view.error.message}[/]")
    console.print(f"input {short(view.input, 200)}  usage {json.dumps(view.usage)}")
    graph = any(task.step is not None for task in view.tasks.values())
    if graph:
        console.print(f"state {json.dumps(view.state, ensure_ascii=False)}", markup=False)
    table = Table("action" if graph else "task", "kind", "status", "round", "attempts", "took", "value / error")
    if graph:
        table.add_column("activation input")
    for task in view.tasks.values():
        detail = f"{task.error.type}: {task.error.message}" if task.error else short(task.value)
        if task.reason and task.status in ("skipped", "cancelled"):
            detail = f"({task.reason})"
        duration = f"{task.finished_at - task.started_at:.3f}s" if task.finished_at and task.started_at else ""
        status = Text(task.status, style=STATUS_STYLE.get(task.status, ""))
        row: list[str | Text] = [task.key, task.kind, status, str(task.round), str(task.attempts), duration,
                                 Text(detail, overflow="fold")]
        table.add_row(*row, *([Text(short(task.activation), overflow="fold")] if graph else []))
    console.print(table)
    for task in view.tasks.values():
        _render_rounds(console, task)
        _render_error(console, task)


def _render_rounds(console: Console, task: TaskView) -> None:
    if task.rounds:
        rounds = Table("round", "phase", "output", "check", "worker", "attempt s", "check s",
                       title=f"{task.key}: rounds", title_justify="left")
        for r in task.rounds:
            runs = {e.phase: e for e in r.execs if not e.lost}
            verdict = ""
            if r.check is not None:
                verdict = "accepted" if r.check.get("done") else f"rejected: {r.check.get('feedback')}"
            workers = sorted({e.worker for e in r.execs if e.worker})
            lost = sum(1 for e in r.execs if e.lost)
            table_workers = ", ".join(workers) + (f" ({lost} lost)" if lost else "")
            rounds.add_row(str(r.round), r.phase, Text(short(r.output), overflow="fold"),
                           Text(verdict, overflow="fold"), table_workers, _took(runs.get("attempt")),
                           _took(runs.get("check")))
        console.print(rounds)
    elif task.execs:
        tries = Table("try", "worker", "took", "lost", title=f"{task.key}: executions", title_justify="left")
        for e in task.execs:
            tries.add_row(str(e.round), e.worker or "", _took(e), "yes" if e.lost else "")
        console.print(tries)


def _took(found: Any) -> str:
    return f"{found.took_s:.3f}" if found is not None and found.took_s is not None else ""


def _render_error(console: Console, task: TaskView) -> None:
    if task.error is None:
        return
    details = task.error.details or {}
    if details.get("feedback") is not None:
        console.print(f"{task.key}: last feedback: {details['feedback']}")
    trace = details.get("traceback")
    if trace:
        lines = trace.rstrip().splitlines()[-TRACEBACK_LINES:]
        console.print(f"{task.key}: traceback (last {len(lines)} lines):", style="red")
        for line in lines:
            console.print(f"  {line}", markup=False)

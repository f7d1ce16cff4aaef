"""What the command line shows: the live progress of a run, a run's full record, events with
human timestamps, results, and a run's live text (``taskloop watch``).

Every stored string (feedback, outputs, inputs, reasons, versions, error messages, worker names)
is untrusted: it goes through ``taskloop.base.text.visible`` and is printed as a ``Text`` (or with
``markup=False``), never as Rich markup. Only this module's own literals carry markup."""

from __future__ import annotations

import datetime as dt
import json
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from taskloop.base.text import cut, preview, terminal_text, visible
from taskloop.core import events as ev
from taskloop.core.events import Event
from taskloop.core.streamed import StreamChunk
from taskloop.runtime.models import RunResult, RunView, TaskView

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
    """A JSON value on one visible line of at most about ``limit`` characters."""
    return visible(preview(value, limit))


def plain(*parts: str | Text, style: str = "") -> Text:
    """A line made of this module's words and stored text: nothing in it is read as markup."""
    line = Text(style=style)
    for part in parts:
        line.append(part if isinstance(part, Text) else Text(part))
    return line


def describe(event: Event) -> str:
    """One event in words (without its time), on one visible line: the stored text in it
    (feedback, messages, reasons, keys) is escaped."""
    return visible(_describe(event))


def _describe(event: Event) -> str:
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
    """One event on one line (for ``taskloop events``; plain text, no markup)."""
    exec_info = (event.data or {}).get("exec")
    ran = ""
    if exec_info and "took" in exec_info:
        ran = f"  [{visible(str(exec_info.get('worker')))}, {float(exec_info.get('took') or 0):.3f}s]"
    return f"{iso(event.at)} {relative(event.at, since):>10}  {visible(event.type):<14} {describe(event)}{ran}"


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
            self.console.print(plain(f"  {relative(event.at, self.started):>10}  {describe(event)}"))
            return
        if _worth_a_line(event) and self.printed < self.MAX_LINES:
            self.printed += 1
            self.live.console.print(plain(f"  {relative(event.at, self.started):>10}  {describe(event)}"))
        self.live.update(self.render())

    def notice(self, message: str) -> None:
        self.notices.append(message)
        if self.live is not None:
            self.live.update(self.render())
        else:
            self.console.print(plain(f"  ! {visible(message)}"))

    def render(self) -> Group:
        table = Table("task", "status", "round", "phase", "last check / error", title=plain(f"run {self.run_id}"),
                      title_justify="left")
        lines = sorted(self.tasks.values(), key=lambda t: (t.status != "active", t.status == "waiting"))
        for line in lines[: self.MAX_ROWS]:
            style = STATUS_STYLE.get(line.status, "")
            table.add_row(plain(visible(line.key)), plain(visible(line.status), style=style), str(line.round or ""),
                          plain(visible(line.phase or "")), Text(visible(line.verdict), overflow="fold"))
        if len(lines) > self.MAX_ROWS:
            table.add_row(f"... {len(lines) - self.MAX_ROWS} more", "", "", "", "")
        parts: list[Any] = [table]
        parts += [Text(f"! {visible(message)}", style="yellow") for message in self.notices[-3:]]
        return Group(*parts)


def _worth_a_line(event: Event) -> bool:
    """What a live display also prints as a line: check verdicts, task endings, lost executions."""
    data = event.data or {}
    return (event.type == ev.PHASE and event.phase == "complete") or event.type == ev.LOST or (
        event.type == ev.TASK and data.get("status") not in (None, "active", "waiting", "paused"))


@dataclass
class LiveText:
    """A run's live text as ``taskloop watch`` prints it: a heading whenever the phase changes (a
    later execution of the same phase says it starts over), then its text as it comes (line breaks
    and tabs kept, every other control escaped: ``terminal_text``), and a note where text was
    dropped or the phase reached its cap."""

    write: Any  # (text, styled heading?) -> None
    at_line_start: bool = True
    phase: tuple[str, int, str, int] | None = None
    shown: int = 0  # chunks printed

    def __call__(self, chunk: StreamChunk) -> None:
        self.shown += 1
        where = (chunk.task, chunk.round, chunk.phase, chunk.segment)
        if where != self.phase:
            self.phase = where
            again = f" · executed again (segment {chunk.segment}): its text starts over" if chunk.replay else ""
            self.line(f"── {visible(chunk.task)} · round {chunk.round} · {visible(chunk.phase)}{again} ──", True)
        if chunk.dropped:
            self.line(f"[… {chunk.dropped:,} bytes of live text dropped here: the store did not take them …]", True)
        text = terminal_text(chunk.text)
        if text:
            self.write(text, False)
            self.at_line_start = text.endswith("\n")
        if chunk.capped:
            self.line("[… the phase reached TASKLOOP_STREAM_MAX_BYTES: the rest is in its recorded output …]", True)

    def line(self, text: str, heading: bool = False) -> None:
        """A line of this module's own (on a line of its own)."""
        self.write(("" if self.at_line_start else "\n") + text + "\n", heading)
        self.at_line_start = True


def print_result(console: Console, result: RunResult) -> None:
    style = STATUS_STYLE.get(result.status, "")
    term = f" (termination {visible(result.termination_code)})" if result.termination_code else ""
    console.print(plain("status ", Text(visible(result.status), style=style), term))
    for key, value in result.values.items():
        console.print(plain(f"  {visible(key)} = {short(value, 200)}"))
    for error in result.errors:
        where = f"{error.key}: " if error.key else ""
        console.print(plain(f"  {visible(cut(f'{where}{error.type}: {error.message}', 2000))}", style="red"))
        feedback = (error.details or {}).get("feedback")
        if feedback:
            console.print(plain(f"    last feedback: {visible(cut(str(feedback), 2000))}"))
    console.print(plain(f"usage {visible(json.dumps(result.usage))}"))


def render_run(console: Console, view: RunView) -> None:
    style = STATUS_STYLE.get(view.status, "")
    term = f", termination {visible(view.termination_code)}" if view.termination_code else ""
    console.print(plain("run ", Text(visible(view.run_id), style="bold"),
                        f" {visible(view.workflow)} v{visible(view.version)}: ",
                        Text(visible(view.status), style=style), term))
    took = f", took {view.finished_at - view.created_at:.3f}s" if view.finished_at else ""
    console.print(plain(f"created {iso(view.created_at)}{took}"))
    if view.forked_from:
        origin = view.forked_from
        console.print(plain(f"forked from run {visible(str(origin.get('run_id')))} at "
                            f"{visible(str(origin.get('task')))} round {origin.get('round')}"))
    if view.control:
        kind, _, reason = view.control.partition(":")
        what = "cancel requested" if kind == "cancel" else "stopped"
        console.print(plain(f"{what}: {visible(reason)}", style="yellow"))
    if view.error is not None:
        console.print(plain(visible(cut(f"{view.error.type}: {view.error.message}", 2000)), style="red"))
    console.print(plain(f"input {short(view.input, 200)}  usage {visible(json.dumps(view.usage))}"))
    graph = any(task.step is not None for task in view.tasks.values())
    if graph:
        console.print(plain(f"state {short(view.state, 2000)}"))
    table = Table("action" if graph else "task", "kind", "status", "round", "attempts", "took", "value / error")
    if graph:
        table.add_column("activation input")
    for task in view.tasks.values():
        detail = visible(cut(f"{task.error.type}: {task.error.message}", 500)) if task.error else short(task.value)
        if task.reason and task.status in ("skipped", "cancelled"):
            detail = f"({visible(task.reason)})"
        if task.throttled is not None:
            held = task.throttled
            value = f" [{visible(held.value)}]" if held.value else ""
            detail = f"throttled by {visible(held.limit)}{value} for {max(time.time() - held.since, 0.0):.1f}s"
        duration = f"{task.finished_at - task.started_at:.3f}s" if task.finished_at and task.started_at else ""
        status = Text(visible(task.status) + (" (copied)" if task.copied else ""),
                      style=STATUS_STYLE.get(task.status, ""))
        row: list[str | Text] = [plain(visible(task.key)), plain(visible(task.kind)), status, str(task.round),
                                 str(task.attempts), duration, Text(detail, overflow="fold")]
        table.add_row(*row, *([Text(short(task.activation), overflow="fold")] if graph else []))
    console.print(table)
    for task in view.tasks.values():
        _render_rounds(console, task)
        _render_error(console, task)


def _render_rounds(console: Console, task: TaskView) -> None:
    if task.rounds:
        rounds = Table("round", "phase", "output", "check", "worker", "attempt s", "check s",
                       title=plain(f"{visible(task.key)}: rounds"), title_justify="left")
        for r in task.rounds:
            runs = {e.phase: e for e in r.execs if not e.lost}
            verdict = ""
            if r.check is not None:
                verdict = "accepted" if r.check.get("done") else f"rejected: {cut(str(r.check.get('feedback')), 500)}"
                if r.check.get("score") is not None:
                    verdict += f" (score {r.check['score']:g})"
            if r.copied:
                verdict = f"{verdict} [copied]".strip()
            if r.feedback_given is not None:
                verdict = f"{verdict} [fed: {cut(r.feedback_given, 200)}]".strip()
            workers = sorted({e.worker for e in r.execs if e.worker})
            lost = sum(1 for e in r.execs if e.lost)
            table_workers = ", ".join(workers) + (f" ({lost} lost)" if lost else "")
            rounds.add_row(str(r.round), plain(visible(r.phase)), Text(short(r.output), overflow="fold"),
                           Text(visible(verdict), overflow="fold"), plain(visible(table_workers)),
                           _took(runs.get("attempt")), _took(runs.get("check")))
        console.print(rounds)
    elif task.execs:
        tries = Table("try", "worker", "took", "lost", title=plain(f"{visible(task.key)}: executions"),
                      title_justify="left")
        for e in task.execs:
            tries.add_row(str(e.round), plain(visible(e.worker or "")), _took(e), "yes" if e.lost else "")
        console.print(tries)


def _took(found: Any) -> str:
    return f"{found.took_s:.3f}" if found is not None and found.took_s is not None else ""


def _render_error(console: Console, task: TaskView) -> None:
    if task.error is None:
        return
    details = task.error.details or {}
    if details.get("feedback") is not None:
        console.print(plain(f"{visible(task.key)}: last feedback: {visible(cut(str(details['feedback']), 2000))}"))
    trace = details.get("traceback")
    if trace:
        lines = str(trace).rstrip().splitlines()[-TRACEBACK_LINES:]
        console.print(plain(f"{visible(task.key)}: traceback (last {len(lines)} lines):", style="red"))
        for line in lines:
            console.print(plain(f"  {visible(line)}"))

"""Commands about runs: start, inspect, runs, events, watch, cancel, decide, resume, graph."""

from __future__ import annotations

import difflib
import json
import sys
import threading
from typing import Any, NoReturn

import click
from rich.live import Live
from rich.table import Table

from taskloop.base import clock
from taskloop.base.errors import RunNotFound, StoreUnavailable
from taskloop.base.text import terminal_json, visible
from taskloop.cli.common import (
    IMPORT_OPTION,
    JSON_OPTION,
    REQUEST_OPTION,
    Seconds,
    cli_run_id,
    console,
    import_modules,
    make_client,
    parse_json,
    resolve,
)
from taskloop.cli.display import LiveText, Progress, ago, event_line, iso, plain, print_result, render_run
from taskloop.core.states import RunStatus
from taskloop.runtime.models import RunResult

STATUSES = [s.value for s in RunStatus]
ENDED_WELL = ("done", "cancelled")  # exit code 0 (docs/semantics.md: a cancellation is an ending asked for)
PIPED_COLUMNS = ("run_id", "workflow", "version", "status", "termination", "created")  # `taskloop runs | ...`
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells count it (128 + SIGINT)


def exit_code(status: str) -> int:
    """A command that waited for a run: 0 when it ended done or cancelled, 1 otherwise."""
    return 0 if status in ENDED_WELL else 1


class ConsumerWatch:
    """While a run is waited for: say when no worker consumes its queue (Celery's inspect), and
    when one does again. The wait goes on either way."""

    def __init__(self, client: Any, notice: Any, hint: str) -> None:
        self.client = client
        self.notice = notice
        self.hint = hint
        self.queue = client.app.conf.task_default_queue
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="taskloop-consumer-watch", daemon=True)
        self.missing = False

    def __enter__(self) -> ConsumerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _loop(self) -> None:
        delay = 1.0
        while not self._stop.wait(delay):
            delay = 10.0
            try:
                replies = self.client.app.control.inspect(timeout=1.0).active_queues() or {}
            except Exception:  # the broker is away: the wait itself reports Redis outages
                continue
            consumed = any(q.get("name") == self.queue for queues in replies.values() for q in queues)
            if not consumed and not self.missing and not self._stop.is_set():
                self.missing = True
                self.notice(f"no worker is consuming queue {self.queue!r}; start one with "
                            f"`taskloop worker --import {self.hint}` (still waiting)")
            elif consumed and self.missing:
                self.missing = False
                self.notice(f"a worker is consuming queue {self.queue!r} now")


def wait_with_progress(client: Any, run_id: str, timeout: float | None, quiet: bool = False,
                       hint: str = "MODULE") -> RunResult:
    """Wait for a run, showing every task's round and phase as they happen (a live table in a
    terminal, one line per event otherwise)."""
    progress = Progress(run_id, console)
    if quiet:
        with ConsumerWatch(client, lambda m: click.echo(f"! {m}", err=True), hint):
            return client.wait(run_id, timeout=timeout,  # type: ignore[no-any-return]
                               on_notice=lambda m: click.echo(f"! {m}", err=True))
    try:
        progress.seed(client.inspect(run_id))
    except (RunNotFound, StoreUnavailable):
        pass
    with ConsumerWatch(client, progress.notice, hint):
        if not console.is_terminal:
            console.print(plain(f"run {visible(run_id)}"))
            return client.wait(run_id, timeout=timeout, on_event=progress,  # type: ignore[no-any-return]
                               on_notice=progress.notice)
        with Live(progress.render(), console=console, refresh_per_second=8) as live:
            progress.live = live
            result: RunResult = client.wait(run_id, timeout=timeout, on_event=progress, on_notice=progress.notice)
            live.update(progress.render())
            return result


def wait_print_exit(client: Any, run_id: str, timeout: float | None, as_json: bool = False,
                    hint: str = "MODULE") -> NoReturn:
    """``--wait`` (start, resume, fork): wait with progress, print the result, and exit with
    ``exit_code``. Ctrl-C ends the waiting, not the run: it says how to follow the run."""
    try:
        result = wait_with_progress(client, run_id, timeout, quiet=as_json, hint=hint)
    except KeyboardInterrupt:
        shown = visible(run_id)
        click.echo(f"\nstopped waiting (Ctrl-C); run {shown} goes on without you: follow it to its end with "
                   f"`taskloop watch {shown}`, see where it is with `taskloop inspect {shown}`, stop it with "
                   f"`taskloop cancel {shown}`", err=True)
        sys.exit(EXIT_INTERRUPTED)
    if as_json:
        click.echo(terminal_json(result.model_dump_json(indent=2)))
    else:
        print_result(console, result)
    sys.exit(exit_code(result.status))


def check_registered(workflow: str) -> None:
    """``start --import``: a workflow that the imported modules do not define is refused here, with
    the nearest names, rather than recorded as a run that fails with WorkflowNotRegistered."""
    from taskloop.define.workflow import REGISTRY

    known = sorted({name for name, _ in REGISTRY.names()})
    if workflow in known:
        return
    close = difflib.get_close_matches(workflow, known, n=3)
    guess = f"; did you mean {' or '.join(close)}?" if close else ""
    listed = f" (they define: {', '.join(known[:20])}{', ...' if len(known) > 20 else ''})" if known else ""
    raise click.BadParameter(f"{visible(workflow)} is not a workflow of the imported modules{listed}{guess}",
                             param_hint="'WORKFLOW'")


@click.command()
@click.argument("workflow")
@IMPORT_OPTION
@click.option("--input", "input_json", default=None, metavar="JSON", help="Run input as JSON (default null).")
@click.option("--version", "version", default=None, help="Workflow version (when several are registered).")
@click.option("--run-id", default=None,
              help="Your id for the run: starting it twice with the same input gives one run.")
@click.option("--wait", is_flag=True, help="Wait for the run to end, showing its progress.")
@click.option("--timeout", type=Seconds(), default=None,
              help="With --wait: seconds to wait at most (default: no limit).")
@click.option("--json", "as_json", is_flag=True, help="With --wait: print the result as JSON.")
def start(workflow: str, imports: tuple[str, ...], input_json: str | None, version: str | None,
          run_id: str | None, wait: bool, timeout: float | None, as_json: bool) -> None:
    """Start a run of WORKFLOW. Without --import the run is started by name: a worker that has
    the workflow plans it."""
    import_modules(imports)
    if imports:  # the code is at hand: a name it does not define is a typo (without it: started by name)
        check_registered(workflow)
    if run_id is not None:
        cli_run_id(run_id, "'--run-id'")
    client = make_client()
    handle = client.start(workflow, parse_json("--input", input_json), run_id=run_id, version=version)
    if not wait:
        click.echo(handle.run_id)
        return
    wait_print_exit(client, handle.run_id, timeout, as_json, hint=imports[0] if imports else "MODULE")


@click.command()
@click.argument("run_id")
@JSON_OPTION
def inspect(run_id: str, as_json: bool) -> None:
    """Show a run: its tasks, every round's output, check, worker and durations, and errors.
    RUN_ID may be a unique prefix."""
    client = make_client()
    view = client.inspect(resolve(client, run_id))
    if as_json:
        click.echo(terminal_json(view.model_dump_json(indent=2)))
    else:
        render_run(console, view)


@click.command()
@click.option("--status", type=click.Choice(STATUSES), default=None, help="Only runs with this status.")
@click.option("--workflow", default=None, help="Only runs of this workflow.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="At most this many runs.")
@click.option("--ids", is_flag=True, help="Print only the run ids, one per line.")
@JSON_OPTION
def runs(status: str | None, workflow: str | None, limit: int, ids: bool, as_json: bool) -> None:
    """List recent runs, newest first (full run ids; any unique prefix works in other commands)."""
    found = make_client().runs(status=status, workflow=workflow, limit=limit)
    if as_json:
        click.echo(terminal_json(json.dumps([r.model_dump() for r in found], indent=2, ensure_ascii=False)))
        return
    if ids or not console.is_terminal:  # one run a line, its fields tab-separated (each escaped: one line)
        if not ids:  # under a header line; a run that has no termination shows "-", never an empty field
            click.echo("\t".join(PIPED_COLUMNS))
        for r in found:
            fields = [r.run_id] if ids else [r.run_id, r.workflow, r.version, r.status, r.termination_code or "-",
                                             iso(r.created_at)]
            click.echo("\t".join(visible(f) for f in fields))
        return
    now = clock.now()
    table = Table("run id", "workflow", "status", "termination", "created")
    table.columns[0].no_wrap = True
    for r in found:
        table.add_row(plain(visible(r.run_id)), plain(f"{visible(r.workflow)} v{visible(r.version)}"),
                      plain(visible(r.status)), plain(visible(r.termination_code or "")),
                      f"{iso(r.created_at)} ({ago(r.created_at, now)})")
    console.print(table)


@click.command()
@click.argument("run_id")
@JSON_OPTION
def events(run_id: str, as_json: bool) -> None:
    """Print a run's events in order, with their time and the time since the run started.
    RUN_ID may be a unique prefix."""
    client = make_client()
    found = client.events(resolve(client, run_id))
    since = found[0].at if found else None
    for event in found:
        click.echo(terminal_json(event.model_dump_json()) if as_json else event_line(event, since))


@click.command()
@click.argument("run_id")
@click.option("--task", default=None, help="Only this task's live text.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per chunk (task, round, phase, text, segment, dropped, capped, id), then "
                   "the run's status.")
def watch(run_id: str, task: str | None, as_json: bool) -> None:
    """Print the live text of a run's phases (what they stream with ctx.stream) as it comes, until the
    run ends, then its status. RUN_ID may be a unique prefix."""
    client = make_client()
    run_id = resolve(client, run_id)

    def write(text: str, heading: bool) -> None:
        click.echo(click.style(text, bold=True) if heading else text, nl=False)

    shown = LiveText(write)
    for chunk in client.stream(run_id, task):
        if as_json:
            click.echo(terminal_json(json.dumps(chunk.as_json(), ensure_ascii=False)))
        else:
            shown(chunk)
    result = client.result(run_id)
    assert result is not None  # the live text ends once the run has ended
    if as_json:
        click.echo(terminal_json(json.dumps({"run_id": run_id, "status": result.status,
                                             "termination": result.termination_code})))
    else:
        if not shown.shown:
            shown.line(f"(no live text: the phases of run {visible(run_id)} streamed none, or it expired "
                       "TASKLOOP_STREAM_GRACE_S after they ended; `taskloop inspect` shows what they recorded)")
        shown.line("")
        print_result(console, result)
    sys.exit(exit_code(result.status))


@click.command()
@click.argument("run_id")
@click.option("--reason", default="cancelled", show_default=True,
              help="Why: recorded in the run, shown by inspect and events, and seen by ctx.signal.reason.")
def cancel(run_id: str, reason: str) -> None:
    """Cancel a run (a finished run is left as it is). RUN_ID may be a unique prefix."""
    client = make_client()
    click.echo(visible(client.cancel(resolve(client, run_id), reason).message))


@click.command()
@click.argument("run_id")
@IMPORT_OPTION
@REQUEST_OPTION
@click.option("--wait", is_flag=True, help="Wait for the resumed run to end.")
@click.option("--timeout", type=Seconds(), default=None, help="With --wait: seconds to wait at most.")
def resume(run_id: str, imports: tuple[str, ...], request_id: str | None, wait: bool, timeout: float | None) -> None:
    """Replay the interrupted phases of a failed run. RUN_ID may be a unique prefix. Without
    --import, a worker that has the workflow does it and this command prints its verdict."""
    import_modules(imports)
    client = make_client()
    handle = client.resume(resolve(client, run_id), request_id=request_id)
    click.echo(f"run {handle.run_id} resumed")
    if wait:
        wait_print_exit(client, handle.run_id, timeout)


@click.command()
@click.argument("run_id")
@click.argument("task")
@click.argument("round", type=click.IntRange(1))
@click.option("--feedback", default=None, help="The feedback round ROUND's attempt gets (default: the one recorded "
                                                "for the round before).")
@click.option("--run-id", "new_run_id", default=None, help="The new run's id (default: a new one).")
@IMPORT_OPTION
@REQUEST_OPTION
@click.option("--wait", is_flag=True, help="Wait for the new run to end.")
@click.option("--timeout", type=Seconds(), default=None, help="With --wait: seconds to wait at most.")
def fork(run_id: str, task: str, round: int, feedback: str | None, new_run_id: str | None, imports: tuple[str, ...],
         request_id: str | None, wait: bool, timeout: float | None) -> None:
    """Start a new run from round ROUND of TASK of a finished run: the rounds before it are copied,
    ROUND runs again with --feedback. RUN_ID may be a unique prefix. Without --import, a worker that
    has the workflow forks it and this command prints its verdict."""
    import_modules(imports)
    client = make_client()
    original = resolve(client, run_id)
    handle = client.fork(original, task, round, feedback, new_run_id=new_run_id, request_id=request_id)
    click.echo(f"run {handle.run_id} forked from {original} at {visible(task)} round {round}")
    if wait:
        wait_print_exit(client, handle.run_id, timeout)


@click.command()
@click.argument("run_id")
@click.argument("key")
@click.argument("action", type=click.Choice(["approve", "reject", "resume"]))
@click.option("--actor", required=True, help="Who decides (checked against the gate's actors).")
@click.option("--reason", default="", help="Why: recorded with the decision.")
@click.option("--value", "value_json", default=None, metavar="JSON", help="The gate's output as JSON (resume).")
@IMPORT_OPTION
@REQUEST_OPTION
def decide(run_id: str, key: str, action: str, actor: str, reason: str, value_json: str | None,
           imports: tuple[str, ...], request_id: str | None) -> None:
    """Decide gate KEY of a waiting run: approve, reject, or resume (pause and input gates). Without
    --import, a worker that has the workflow decides it and this command prints its verdict."""
    import_modules(imports)
    client = make_client()
    view = client.decide(resolve(client, run_id), key, action, actor, reason, parse_json("--value", value_json),
                         request_id=request_id)
    click.echo(f"run {visible(view.run_id)}: {visible(view.status)}")


@click.command()
@click.argument("workflow")
@IMPORT_OPTION
@click.option("--version", "version", default=None, help="Workflow version (when several are registered).")
def graph(workflow: str, imports: tuple[str, ...], version: str | None) -> None:
    """Print a workflow as a Mermaid flowchart."""
    from taskloop.define.workflow import REGISTRY

    import_modules(imports)
    click.echo(REGISTRY.get(workflow, version).mermaid())


"""The ``taskloop`` command line."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from taskloop import config
from taskloop.errors import TaskLoopError

console = Console()


def _import_modules(modules: tuple[str, ...]) -> None:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    names = [*modules, *config.settings().imports]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise click.ClickException(
                f"cannot import workflow module {name!r}: {exc}; run from the directory that contains "
                "it or add that directory to PYTHONPATH"
            ) from exc


def _client() -> Any:
    from taskloop.client import TaskLoop

    return TaskLoop()


def _parse_json(option: str, raw: str | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc}); pass e.g. {option} '{{\"topic\": \"x\"}}'") from None


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except TaskLoopError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        with _errors():
            return super().invoke(ctx)


@click.group(cls=_Group)
def cli() -> None:
    """Durable, bounded loop tasks and workflows on Celery + Redis."""


IMPORT_OPTION = click.option("--import", "-I", "imports", multiple=True, metavar="MODULE",
                             help="Module that defines workflows (repeatable; also TASKLOOP_IMPORTS).")


@cli.command()
@IMPORT_OPTION
@click.option("-c", "--concurrency", type=int, default=None, help="Worker processes (default: CPU count).")
@click.option("-Q", "--queues", default=None, help="Comma-separated queues to consume (default: taskloop).")
@click.option("-n", "--hostname", default=None, help="Worker node name, e.g. w1@%h.")
@click.option("--loglevel", "-l", default="INFO")
@click.option("--logfile", default=None)
@click.option("--pool", "-P", default=None, help="Celery pool (default prefork).")
@click.option("--beat", "-B", is_flag=True, help="Also run the beat scheduler (the periodic reconciler).")
@click.option("--events", "-E", is_flag=True, help="Send task events (for Flower; Flower also turns them on itself).")
def worker(imports: tuple[str, ...], concurrency: int | None, queues: str | None, hostname: str | None,
           loglevel: str, logfile: str | None, pool: str | None, beat: bool, events: bool) -> None:
    """Run a Celery worker that executes taskloop phases."""
    if imports:
        os.environ["TASKLOOP_IMPORTS"] = ",".join([*imports, *config.settings().imports])
        config.reset()
    _import_modules(())
    from taskloop.worker.app import app

    argv = ["worker", "--loglevel", loglevel, "--without-gossip", "--without-mingle", "-O", "fair"]
    if events:
        argv += ["-E"]
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    if queues:
        argv += ["-Q", queues]
    if hostname:
        argv += ["-n", hostname]
    if logfile:
        argv += ["--logfile", logfile]
    if pool:
        argv += ["--pool", pool]
    if beat:
        argv += ["--beat"]
    app.worker_main(argv)


@cli.command()
@click.argument("workflow")
@IMPORT_OPTION
@click.option("--input", "input_json", default=None, help="Run input as JSON.")
@click.option("--version", "version", default=None, help="Workflow version (when several are registered).")
@click.option("--run-id", default=None, help="Idempotency: starting the same run id twice gives one run.")
@click.option("--wait", is_flag=True, help="Wait for the run to end, showing progress.")
@click.option("--timeout", type=float, default=None, help="Seconds to wait at most (with --wait).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def start(workflow: str, imports: tuple[str, ...], input_json: str | None, version: str | None,
          run_id: str | None, wait: bool, timeout: float | None, as_json: bool) -> None:
    """Start a run of WORKFLOW."""
    _import_modules(imports)
    client = _client()
    handle = client.start(workflow, _parse_json("--input", input_json), run_id=run_id, version=version)
    if not wait:
        click.echo(handle.run_id)
        return
    result = _wait_with_progress(client, handle.run_id, timeout, quiet=as_json)
    if as_json:
        click.echo(result.model_dump_json(indent=2))
    else:
        _print_result(result)
    sys.exit(0 if result.status in ("done", "cancelled") else 1)


def _wait_with_progress(client: Any, run_id: str, timeout: float | None, quiet: bool = False) -> Any:
    from taskloop.events import Event

    def show(event: Event) -> None:
        if event.type == "phase":
            what = f"round {event.round} {event.phase}" if event.phase != "run" else f"try {event.round}"
            console.print(f"  [cyan]{event.key}[/] {what}")
        elif event.type == "task" and event.data and event.data.get("status") not in (None, "active"):
            status = event.data["status"]
            colour = {"done": "green", "failed": "red"}.get(status, "yellow")
            console.print(f"  [cyan]{event.key}[/] [{colour}]{status}[/]"
                          + (f" ({event.data.get('message')})" if event.data.get("message") else ""))

    if quiet:
        return client.wait(run_id, timeout=timeout)
    console.print(f"run [bold]{run_id}[/]")
    with console.status("waiting for workers..."):
        return client.wait(run_id, timeout=timeout, on_event=show)


def _print_result(result: Any) -> None:
    colour = "green" if result.status == "done" else "red" if result.status == "failed" else "yellow"
    term = f" (termination {result.termination_code})" if result.termination_code else ""
    console.print(f"status [{colour}]{result.status}[/]{term}")
    for key, value in result.values.items():
        console.print(f"  {key} = {json.dumps(value)}")
    for error in result.errors:
        console.print(f"  [red]{error.key}: {error.type}: {error.message}[/]")
    console.print(f"usage {json.dumps(result.usage)}")


@cli.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True)
def inspect(run_id: str, as_json: bool) -> None:
    """Show a run: its tasks, and every round's output and check."""
    view = _client().inspect(run_id)
    if as_json:
        click.echo(view.model_dump_json(indent=2))
        return
    term = f", termination {view.termination_code}" if view.termination_code else ""
    console.print(f"run [bold]{view.run_id}[/] {view.workflow} v{view.version}: {view.status}{term}")
    console.print(f"input {json.dumps(view.input)}  usage {json.dumps(view.usage)}")
    table = Table("task", "kind", "status", "round", "attempts", "value / error")
    for task in view.tasks.values():
        detail = f"{task.error.type}: {task.error.message}" if task.error else json.dumps(task.value)
        table.add_row(task.key, task.kind, task.status, str(task.round), str(task.attempts), detail)
    console.print(table)
    for task in view.tasks.values():
        if task.rounds:
            rounds = Table("round", "phase", "output", "check", title=f"{task.key}: rounds")
            for r in task.rounds:
                rounds.add_row(str(r.round), r.phase, json.dumps(r.output), json.dumps(r.check))
            console.print(rounds)


@cli.command()
@click.option("--status", default=None)
@click.option("--workflow", default=None)
@click.option("--limit", type=int, default=50)
@click.option("--json", "as_json", is_flag=True)
def runs(status: str | None, workflow: str | None, limit: int, as_json: bool) -> None:
    """List recent runs, newest first."""
    found = _client().runs(status=status, workflow=workflow, limit=limit)
    if as_json:
        click.echo(json.dumps([r.model_dump() for r in found], indent=2))
        return
    table = Table("run id", "workflow", "status", "termination", "created")
    for r in found:
        import datetime as dt

        created = dt.datetime.fromtimestamp(r.created_at).isoformat(timespec="seconds")
        table.add_row(r.run_id, f"{r.workflow} v{r.version}", r.status, r.termination_code or "", created)
    console.print(table)


@cli.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True)
def events(run_id: str, as_json: bool) -> None:
    """Print a run's events in order."""
    found = _client().events(run_id)
    for event in found:
        if as_json:
            click.echo(event.model_dump_json())
        else:
            parts = [f"{event.at:.3f}", event.type, event.key or "-",
                     f"round={event.round}" if event.round is not None else "",
                     event.phase or "", f"attempt={event.attempt}" if event.attempt is not None else "",
                     json.dumps(event.data) if event.data else ""]
            click.echo(" ".join(p for p in parts if p))


@cli.command()
@click.argument("run_id")
@click.option("--reason", default="cancelled")
def cancel(run_id: str, reason: str) -> None:
    """Cancel a run (a finished run is left as it is)."""
    result = _client().cancel(run_id, reason)
    click.echo(result.message)


@cli.command()
@click.argument("run_id")
@IMPORT_OPTION
@click.option("--wait", is_flag=True, help="Wait for the resumed run to end.")
@click.option("--timeout", type=float, default=None)
def resume(run_id: str, imports: tuple[str, ...], wait: bool, timeout: float | None) -> None:
    """Replay the interrupted phases of a failed run."""
    _import_modules(imports)
    client = _client()
    handle = client.resume(run_id)
    click.echo(f"run {run_id} resumed")
    if wait:
        result = _wait_with_progress(client, handle.run_id, timeout)
        _print_result(result)
        sys.exit(0 if result.status == "done" else 1)


@cli.command(name="reconcile")
@IMPORT_OPTION
@click.option("--every", type=float, default=None, help="Keep going, one pass every N seconds.")
def reconcile_command(imports: tuple[str, ...], every: float | None) -> None:
    """Re-dispatch phases whose lease expired (lost messages, dead or paused workers)."""
    import time

    from taskloop.app import PhaseSender, make_app
    from taskloop.store import RedisStore
    from taskloop.worker.reconciler import reconcile

    _import_modules(imports)
    settings = config.settings()
    store = RedisStore(settings.redis_url)
    app = make_app(settings)
    while True:
        report = reconcile(store, settings, PhaseSender(app, settings.redis_url))
        click.echo(str(report))
        if every is None:
            return
        time.sleep(every)


@cli.command()
@click.argument("run_id")
@click.argument("key")
@click.argument("action", type=click.Choice(["approve", "reject", "resume"]))
@click.option("--actor", required=True)
@click.option("--reason", default="")
@click.option("--value", "value_json", default=None, help="Gate output as JSON (resume).")
@IMPORT_OPTION
def decide(run_id: str, key: str, action: str, actor: str, reason: str, value_json: str | None,
           imports: tuple[str, ...]) -> None:
    """Decide a gate of a waiting run."""
    _import_modules(imports)
    view = _client().decide(run_id, key, action, actor, reason, _parse_json("--value", value_json))
    click.echo(f"run {run_id}: {view.status}")


@cli.command()
@click.argument("workflow")
@IMPORT_OPTION
@click.option("--version", "version", default=None)
def graph(workflow: str, imports: tuple[str, ...], version: str | None) -> None:
    """Print a workflow as a Mermaid flowchart."""
    from taskloop.definitions import REGISTRY

    _import_modules(imports)
    click.echo(REGISTRY.get(workflow, version).mermaid())


@cli.command()
@click.option("--workers", type=int, default=2, help="Worker processes to start.")
def demo(workers: int) -> None:
    """Run the README example end to end on a real Redis and a real worker.

    Uses TASKLOOP_REDIS_URL when set; otherwise starts an embedded redis-server."""
    from taskloop.embedded import RedisServer, spawn_worker

    server = None
    url = os.environ.get("TASKLOOP_REDIS_URL")
    if not url:
        server = RedisServer().start()
        url = server.url
        console.print(f"embedded redis-server on {url}")
    os.environ["TASKLOOP_REDIS_URL"] = url
    config.reset()
    proc: subprocess.Popen[bytes] | None = None
    logdir = tempfile.mkdtemp(prefix="taskloop-demo-")
    try:
        logfile = os.path.join(logdir, "worker.log")
        proc = spawn_worker(url, ["taskloop.examples.demo"], concurrency=workers, loglevel="INFO", logfile=logfile)
        console.print(f"worker started: {workers} processes (log: {logfile})")
        from taskloop.client import TaskLoop
        from taskloop.examples.demo import demo as workflow

        client = TaskLoop(url)
        handle = client.start(workflow, input={"topic": "demo"})
        result = _wait_with_progress(client, handle.run_id, timeout=120)
        _print_result(result)
        inspect.callback(handle.run_id, False)  # type: ignore[misc]
        if result.status != "done":
            sys.exit(1)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if server is not None:
            server.stop()


def main() -> None:
    cli(prog_name="taskloop")

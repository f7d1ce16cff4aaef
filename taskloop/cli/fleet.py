"""Commands that run the fleet: worker (supervised), reconcile, demo, completion."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import click

from taskloop.base import config
from taskloop.base.errors import TaskLoopError
from taskloop.base.text import visible
from taskloop.cli.common import IMPORT_OPTION, JSON_OPTION, Seconds, check_port, console, import_modules
from taskloop.cli.display import plain, print_result, render_run


@click.command()
@IMPORT_OPTION
@click.option("-c", "--concurrency", type=click.IntRange(1), default=None,
              help="Phases at once: pool processes (prefork, default: the number of CPUs), or threads, greenlets "
                   "or async phases in one process (threads, gevent, asyncio).")
@click.option("-Q", "--queues", default=None, help="Comma-separated queues to consume (default: taskloop).")
@click.option("-n", "--hostname", default=None,
              help="Worker node name, e.g. w1@%h (default: taskloop-<pid>@%h, unique on the host).")
@click.option("--loglevel", "-l", default="INFO", show_default=True, help="DEBUG, INFO, WARNING or ERROR.")
@click.option("--logfile", default=None, help="Write the log here instead of stderr.")
@click.option("--pool", "-P", default=None,
              help="prefork (default; CPU-bound callbacks), threads or gevent (sync callbacks that wait on a model), "
                   "asyncio (async def callbacks, thousands at once), solo.")
@click.option("--beat", "-B", is_flag=True, help="Also run the beat scheduler (the periodic reconciler).")
@click.option("--events", "-E", is_flag=True, help="Send task events (Flower also turns them on by itself).")
@click.option("--supervise/--no-supervise", default=True, show_default=True,
              help="Restart the Celery worker with backoff if it dies unexpectedly.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve this worker's Prometheus metrics on this port (all its processes summed).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="The address the metrics port binds to (keep it local unless a proxy guards it).")
def worker(imports: tuple[str, ...], concurrency: int | None, queues: str | None, hostname: str | None,
           loglevel: str, logfile: str | None, pool: str | None, beat: bool, events: bool, supervise: bool,
           metrics_port: int | None, metrics_host: str) -> None:
    """Run a Celery worker that executes taskloop phases (supervised: restarted if it dies)."""
    if metrics_port is not None:
        if not supervise:
            raise click.UsageError("--metrics-port needs the supervisor (it sums the metrics of the worker's "
                                   "processes); drop --no-supervise")
        # before anything imports prometheus-client: every process writes to one directory, removed
        # when the supervisor exits (taskloop/worker/supervisor.py)
        _metrics_dir()
    if imports:
        os.environ["TASKLOOP_IMPORTS"] = ",".join([*imports, *config.settings().imports])
        config.reset()
    # A wrong module name fails here, with a clear message. Only found, not imported: the
    # supervisor stays a small process (the Celery worker imports them, and a module that fails
    # there stops the worker with the same message, not restarted: EXIT_BAD_IMPORT).
    import_modules((), find_only=supervise)
    argv = ["--loglevel", loglevel, "--without-gossip", "--without-mingle", "-O", "fair"]
    if pool is not None:  # refused here, with the reason, rather than by a worker that hangs
        from taskloop.worker import pools

        try:
            pools.celery_pool(pool)
        except TaskLoopError as exc:
            raise click.UsageError(str(exc)) from None
        # the worker's app sets Celery's worker_pool from it (taskloop's own pool classes are no
        # choice of Celery's --pool); Celery's own pools also go on its command line, where
        # -P gevent tells the worker to monkey-patch before anything else (worker/boot.py)
        os.environ["TASKLOOP_POOL"] = pool
        pool = pool if pool in pools.COMMAND_LINE else None
    for flag, value in (("--concurrency", concurrency), ("-Q", queues), ("-n", hostname or default_node_name()),
                        ("--logfile", logfile), ("--pool", pool)):
        if value:
            argv += [flag, str(value)]
    argv += ["--beat"] if beat else []
    argv += ["-E"] if events else []
    if not supervise:
        from taskloop.worker.app import run_worker

        sys.exit(run_worker(argv))
    from taskloop.worker.supervisor import command

    # the supervisor takes this process's place (the same pid): a small process, without the CLI's imports
    line = command(argv, loglevel, logfile, (metrics_host, metrics_port) if metrics_port is not None else None)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(line[0], line)


def default_node_name() -> str:
    """``taskloop-<pid>@%h``: Celery's default, ``celery@%h``, is the same for every worker on a host,
    so two of them would count as one in ``taskloop status``, Flower and the metrics (Celery warns
    ``DuplicateNodenameWarning``). The pid is the supervisor's (or, with ``--no-supervise``, the
    worker's own): unique on the host while it runs, and kept when the supervisor restarts Celery."""
    return f"taskloop-{os.getpid()}@%h"


def _metrics_dir() -> str:
    """prometheus-client's multiprocess mode: a fresh directory that the worker's processes share."""
    directory = tempfile.mkdtemp(prefix="taskloop-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    os.environ["TASKLOOP_METRICS"] = "1"
    return directory


@click.command(name="metrics")
@click.option("--port", type=click.IntRange(1, 65535), required=True, help="Serve the fleet's metrics on this port.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="The address to bind (keep it local unless a proxy guards it).")
@click.option("--queue", "queues", multiple=True, help="Broker queues to report (default: taskloop's default queue).")
def metrics_command(port: int, host: str, queues: tuple[str, ...]) -> None:
    """Serve the fleet's Prometheus metrics, read from Redis at each scrape: runs live, phases
    queued, expired leases, the reconciler's last pass, runs started and finished."""
    from prometheus_client import start_http_server

    from taskloop.ops.metrics import fleet_registry
    from taskloop.runtime.celery_app import make_app
    from taskloop.store.redis_store import RedisStore

    settings = config.settings()
    app = make_app(settings)
    store = RedisStore(settings.redis_url)
    broker = RedisStore(settings.broker_url).client if settings.broker_url != settings.redis_url else None
    start_http_server(port, addr=host, registry=fleet_registry(store, list(queues) or [app.conf.task_default_queue],
                                                               broker))
    click.echo(f"fleet metrics on http://{host}:{port}/metrics")
    while True:
        time.sleep(3600)


@click.command()
@JSON_OPTION
def status(as_json: bool) -> None:
    """The fleet at a glance: workers online (by their heartbeats) with their queues and
    processes, queue lengths, live runs by status, expired leases, the reconciler's last pass,
    and the fleet limits. Plain reads: the read-only monitor user may run it."""
    from taskloop.cli.display import ago
    from taskloop.runtime.celery_app import make_app
    from taskloop.runtime.fleet import fleet_view
    from taskloop.store.redis_store import RedisStore

    settings = config.settings()
    view = fleet_view(RedisStore(settings.redis_url), RedisStore(settings.broker_url),
                      make_app(settings).conf.task_default_queue)
    if as_json:
        found = view.model_dump(exclude={"at", "live_runs"})
        found["workers"] = {w.pop("node"): w for w in found["workers"]}
        click.echo(json.dumps(found, indent=2))
        return
    console.print(f"[bold]{len(view.workers)} worker(s) online[/]" if view.workers else "[red]no worker online[/]")
    for worker in view.workers:
        console.print(plain(f"  {visible(worker.node)}: {worker.processes} processes, {worker.active} running, queues "
                            f"{visible(', '.join(worker.queues)) or '-'}"))
    console.print(plain("queues: " + ", ".join(f"{visible(name)} {n}" for name, n in view.queues.items())))
    console.print("live runs: " + (", ".join(f"{n} {s}" for s, n in sorted(view.live_runs_by_status.items()))
                                   or "none"))
    console.print("runs kept: " + (", ".join(f"{n} {s}" for s, n in sorted(view.runs_by_status.items())) or "none"))
    console.print(f"expired leases: {view.expired_leases}")
    last = view.reconciler_last_pass
    if last:
        console.print(f"reconciler: last pass {ago(last['at'], view.at)} ({last['examined']} leases examined, "
                      f"{last['redispatched']} redispatched, {last['replayed']} replayed)")
    else:
        console.print("reconciler: no pass recorded yet")
    for info in view.limits:
        value = f" [{visible(info.value)}]" if info.value else ""
        allows = f"{info.allowed:g} at once" if info.kind == "concurrency" else \
            f"{info.allowed:g} {info.unit} / {info.per_s or 0:g}s"
        console.print(plain(f"limit {visible(info.name)}{value}: {info.used} in use of {allows}, "
                            f"{info.waiting} throttled"))


@click.command(name="reconcile")
@IMPORT_OPTION
@click.option("--every", type=Seconds(positive=True), default=None, help="Keep going: one pass every N seconds.")
def reconcile_command(imports: tuple[str, ...], every: float | None) -> None:
    """Re-dispatch phases whose lease expired (lost messages, dead or paused workers)."""
    from taskloop.runtime.celery_app import PhaseSender, make_app
    from taskloop.runtime.fleet import WorkerInfo
    from taskloop.store.redis_store import RedisStore
    from taskloop.worker.recovery.census import Census
    from taskloop.worker.recovery.orphans import settle_orphans
    from taskloop.worker.recovery.reconciler import reconcile

    import_modules(imports)
    settings = config.settings()
    store = RedisStore(settings.redis_url)
    app = make_app(settings)
    send = PhaseSender(app, settings.redis_url)

    def restore(beats: dict[str, WorkerInfo] | None) -> int:
        return settle_orphans(app, store, settings, send, beats=beats)

    census = Census(app, store, settings, send)

    if every is None:
        # one pass: its error is the command's
        click.echo(str(reconcile(store, settings, send, restore=restore, census=census)))
        return
    while True:  # a sidecar keeps going through Redis outages and refusals, as the worker thread does
        try:
            click.echo(str(reconcile(store, settings, send, restore=restore, census=census)))
        except TaskLoopError as exc:
            click.echo(f"reconcile pass failed: {exc}; next pass in {every:g} s", err=True)
        time.sleep(every)


@click.command()
@click.option("--workers", type=click.IntRange(1, 16), default=2, show_default=True, help="Worker processes to start.")
@click.option("--ui", "with_ui", is_flag=True, help="Then keep the run open in the run UI (Ctrl-C ends the demo).")
@click.option("--port", type=click.IntRange(1, 65535), default=8188, show_default=True, help="The UI's port (--ui).")
def demo(workers: int, with_ui: bool, port: int) -> None:
    """Run the README example end to end on a real Redis and a real worker.

    Uses TASKLOOP_REDIS_URL when set; otherwise starts an embedded redis-server. With --ui, the
    worker and the Redis stay up and the run UI serves the demo's run on 127.0.0.1 until Ctrl-C."""
    from taskloop.cli.runs import wait_with_progress
    from taskloop.examples.demo import demo as workflow
    from taskloop.ops.embedded import RedisServer, spawn_worker, wait_until_ready
    from taskloop.runtime.client import TaskLoop

    if with_ui:  # before the demo runs, not after it
        check_port("127.0.0.1", port, "taskloop ui or demo --ui")
    server = None
    url = os.environ.get("TASKLOOP_REDIS_URL")
    if not url:
        server = RedisServer().start()
        url = server.url
        console.print(f"embedded redis-server on {url}")
    os.environ["TASKLOOP_REDIS_URL"] = url
    config.reset()
    proc: subprocess.Popen[bytes] | None = None
    folder = tempfile.mkdtemp(prefix="taskloop-demo-")  # the worker's log: removed at exit unless the demo failed
    logfile = os.path.join(folder, "worker.log")
    ended_well = False
    try:
        proc = spawn_worker(url, ["taskloop.examples.demo"], concurrency=workers, loglevel="INFO", logfile=logfile)
        wait_until_ready(proc, logfile)
        console.print(f"worker started: {workers} processes (log: {logfile})")
        client = TaskLoop(url)
        handle = client.start(workflow, input={"topic": "demo"})
        result = wait_with_progress(client, handle.run_id, timeout=120, hint="taskloop.examples.demo")
        print_result(console, result)
        render_run(console, client.inspect(handle.run_id))
        if result.status != "done":
            sys.exit(1)
        ended_well = True
        if with_ui:
            from taskloop.ui.serve import serve

            console.print(f"the demo's run: http://127.0.0.1:{port}/runs/{handle.run_id}  (Ctrl-C to stop)")
            try:
                serve(client, "127.0.0.1", port)
            except KeyboardInterrupt:
                pass
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if server is not None:
            server.stop()
        if ended_well:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            click.echo(f"the worker's log is kept: {logfile}", err=True)


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script, e.g. `eval "$(taskloop completion bash)"` in ~/.bashrc."""
    from click.shell_completion import get_completion_class

    root = click.get_current_context().find_root().command  # the taskloop group (taskloop/cli/__init__.py)
    found = get_completion_class(shell)
    assert found is not None
    click.echo(found(root, {}, "taskloop", "_TASKLOOP_COMPLETE").source())

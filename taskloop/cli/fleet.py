"""Commands that run the fleet: worker (supervised), reconcile, demo, completion."""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import click

from taskloop import clock, config
from taskloop.cli.common import IMPORT_OPTION, JSON_OPTION, Seconds, console, import_modules
from taskloop.cli.display import print_result, render_run
from taskloop.errors import TaskLoopError


@click.command()
@IMPORT_OPTION
@click.option("-c", "--concurrency", type=click.IntRange(1), default=None,
              help="Pool processes (default: the number of CPUs).")
@click.option("-Q", "--queues", default=None, help="Comma-separated queues to consume (default: taskloop).")
@click.option("-n", "--hostname", default=None, help="Worker node name, e.g. w1@%h.")
@click.option("--loglevel", "-l", default="INFO", show_default=True, help="DEBUG, INFO, WARNING or ERROR.")
@click.option("--logfile", default=None, help="Write the log here instead of stderr.")
@click.option("--pool", "-P", default=None, help="Celery pool: prefork (default), threads or solo.")
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
        # when the supervisor exits
        atexit.register(shutil.rmtree, _metrics_dir(), True)
    if imports:
        os.environ["TASKLOOP_IMPORTS"] = ",".join([*imports, *config.settings().imports])
        config.reset()
    import_modules(())  # a wrong module name fails here, with a clear message
    argv = ["--loglevel", loglevel, "--without-gossip", "--without-mingle", "-O", "fair"]
    for flag, value in (("--concurrency", concurrency), ("-Q", queues), ("-n", hostname), ("--logfile", logfile),
                        ("--pool", pool)):
        if value:
            argv += [flag, str(value)]
    argv += ["--beat"] if beat else []
    argv += ["-E"] if events else []
    if not supervise:
        from taskloop.worker.app import run_worker

        sys.exit(run_worker(argv))
    from taskloop.worker.supervisor import Supervisor, exit_code

    logging.basicConfig(level=loglevel.upper(), filename=logfile,
                        format="[%(asctime)s: %(levelname)s/Supervisor] %(message)s")
    if metrics_port is not None:
        _serve_worker_metrics(metrics_host, metrics_port)
    sys.exit(exit_code(Supervisor(argv).run()))


def _metrics_dir() -> str:
    """prometheus-client's multiprocess mode: a fresh directory that the worker's processes share."""
    directory = tempfile.mkdtemp(prefix="taskloop-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    os.environ["TASKLOOP_METRICS"] = "1"
    return directory


def _serve_worker_metrics(host: str, port: int) -> None:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    start_http_server(port, addr=host, registry=registry)
    logging.getLogger("taskloop.supervisor").info("metrics on http://%s:%s/metrics", host, port)


@click.command(name="metrics")
@click.option("--port", type=click.IntRange(1, 65535), required=True, help="Serve the fleet's metrics on this port.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="The address to bind (keep it local unless a proxy guards it).")
@click.option("--queue", "queues", multiple=True, help="Broker queues to report (default: taskloop's default queue).")
def metrics_command(port: int, host: str, queues: tuple[str, ...]) -> None:
    """Serve the fleet's Prometheus metrics, read from Redis at each scrape: runs live, phases
    queued, expired leases, the reconciler's last pass, runs started and finished."""
    from prometheus_client import start_http_server

    from taskloop.app import make_app
    from taskloop.metrics import fleet_registry
    from taskloop.store import RedisStore

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
@click.option("--timeout", type=Seconds(positive=True), default=2.0, show_default=True,
              help="Seconds to wait for workers to answer.")
def status(as_json: bool, timeout: float) -> None:
    """The fleet at a glance: workers online with their queues and processes, queue lengths, live
    runs by status, expired leases, and the reconciler's last pass."""
    from taskloop.app import make_app
    from taskloop.cli.display import ago
    from taskloop.store import RedisStore, RunMeta
    from taskloop.store import keys as k

    settings = config.settings()
    app = make_app(settings)
    store = RedisStore(settings.redis_url)
    inspector = app.control.inspect(timeout=timeout)
    stats = inspector.stats() or {}
    consumed = inspector.active_queues() or {}
    workers = {
        node: {"processes": len(info.get("pool", {}).get("processes", [])), "pid": info.get("pid"),
               "queues": sorted(q["name"] for q in consumed.get(node, []))}
        for node, info in sorted(stats.items())}
    queue_names = sorted({app.conf.task_default_queue, *(q for w in workers.values() for q in w["queues"])})
    broker = RedisStore(settings.broker_url).client
    queues = {name: int(broker.llen(name)) for name in queue_names}
    now = clock.now()
    view = store.fleet_view(now)
    live_ids = store.client.zrange(k.LIVE_INDEX, 0, 9999)
    by_status: dict[str, int] = {}
    for run_id, row in zip(live_ids, store.run_metas(live_ids), strict=True):
        if row[1] is not None:
            meta = RunMeta.from_fields(run_id, dict(zip(k.META_FIELDS, row, strict=True)))
            by_status[meta.status.value] = by_status.get(meta.status.value, 0) + 1
    last_raw = store.last_reconcile()
    last = json.loads(last_raw) if last_raw else None
    found = {"workers": workers, "queues": queues, "live_runs_by_status": by_status,
             "expired_leases": view["expired_leases"], "reconciler_last_pass": last}
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    console.print(f"[bold]{len(workers)} worker(s) online[/]" if workers else "[red]no worker online[/]")
    for node, info in workers.items():
        console.print(f"  {node}: {info['processes']} processes, queues {', '.join(info['queues']) or '-'}")
    console.print("queues: " + ", ".join(f"{name} {length}" for name, length in queues.items()))
    console.print("live runs: " + (", ".join(f"{n} {s}" for s, n in sorted(by_status.items())) or "none"))
    console.print(f"expired leases: {view['expired_leases']}")
    if last:
        console.print(f"reconciler: last pass {ago(last['at'], now)} ({last['examined']} leases examined, "
                      f"{last['redispatched']} redispatched, {last['replayed']} replayed)")
    else:
        console.print("reconciler: no pass recorded yet")


@click.command(name="reconcile")
@IMPORT_OPTION
@click.option("--every", type=Seconds(positive=True), default=None, help="Keep going: one pass every N seconds.")
def reconcile_command(imports: tuple[str, ...], every: float | None) -> None:
    """Re-dispatch phases whose lease expired (lost messages, dead or paused workers)."""
    from taskloop.app import PhaseSender, make_app
    from taskloop.store import RedisStore
    from taskloop.worker.reconciler import reconcile

    import_modules(imports)
    settings = config.settings()
    store = RedisStore(settings.redis_url)
    send = PhaseSender(make_app(settings), settings.redis_url)
    if every is None:
        click.echo(str(reconcile(store, settings, send)))  # one pass: its error is the command's
        return
    while True:  # a sidecar keeps going through Redis outages and refusals, as the worker thread does
        try:
            click.echo(str(reconcile(store, settings, send)))
        except TaskLoopError as exc:
            click.echo(f"reconcile pass failed: {exc}; next pass in {every:g} s", err=True)
        time.sleep(every)


@click.command()
@click.option("--workers", type=click.IntRange(1, 16), default=2, show_default=True, help="Worker processes to start.")
def demo(workers: int) -> None:
    """Run the README example end to end on a real Redis and a real worker.

    Uses TASKLOOP_REDIS_URL when set; otherwise starts an embedded redis-server."""
    from taskloop.cli.runs import wait_with_progress
    from taskloop.client import TaskLoop
    from taskloop.embedded import RedisServer, spawn_worker, wait_until_ready
    from taskloop.examples.demo import demo as workflow

    server = None
    url = os.environ.get("TASKLOOP_REDIS_URL")
    if not url:
        server = RedisServer().start()
        url = server.url
        console.print(f"embedded redis-server on {url}")
    os.environ["TASKLOOP_REDIS_URL"] = url
    config.reset()
    proc: subprocess.Popen[bytes] | None = None
    logfile = os.path.join(tempfile.mkdtemp(prefix="taskloop-demo-"), "worker.log")
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
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if server is not None:
            server.stop()


@click.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script, e.g. `eval "$(taskloop completion bash)"` in ~/.bashrc."""
    from click.shell_completion import get_completion_class

    from taskloop.cli import cli

    found = get_completion_class(shell)
    assert found is not None
    click.echo(found(cli, {}, "taskloop", "_TASKLOOP_COMPLETE").source())

"""Commands that run the fleet: worker (supervised), reconcile, demo, completion."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

import click

from taskloop import config
from taskloop.cli.common import IMPORT_OPTION, console, import_modules
from taskloop.cli.display import print_result, render_run


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
def worker(imports: tuple[str, ...], concurrency: int | None, queues: str | None, hostname: str | None,
           loglevel: str, logfile: str | None, pool: str | None, beat: bool, events: bool, supervise: bool) -> None:
    """Run a Celery worker that executes taskloop phases (supervised: restarted if it dies)."""
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
        from taskloop.worker.app import app

        app.worker_main(["worker", *argv])
        return
    from taskloop.worker.supervisor import Supervisor, exit_code

    logging.basicConfig(level=loglevel.upper(), filename=logfile,
                        format="[%(asctime)s: %(levelname)s/Supervisor] %(message)s")
    sys.exit(exit_code(Supervisor(argv).run()))


@click.command(name="reconcile")
@IMPORT_OPTION
@click.option("--every", type=float, default=None, help="Keep going: one pass every N seconds.")
def reconcile_command(imports: tuple[str, ...], every: float | None) -> None:
    """Re-dispatch phases whose lease expired (lost messages, dead or paused workers)."""
    from taskloop.app import PhaseSender, make_app
    from taskloop.store import RedisStore
    from taskloop.worker.reconciler import reconcile

    import_modules(imports)
    settings = config.settings()
    store = RedisStore(settings.redis_url)
    send = PhaseSender(make_app(settings), settings.redis_url)
    while True:
        click.echo(str(reconcile(store, settings, send)))
        if every is None:
            return
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

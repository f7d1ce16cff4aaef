"""The worker's Celery app: ``celery -A taskloop.worker.app worker`` works as well as ``taskloop worker``."""

from __future__ import annotations

from taskloop.app import make_app
from taskloop.worker import kombu_clients, kombu_fix, light_failures, pool_fix
from taskloop.worker.tasks import PhaseFailed, Refused, register

kombu_fix.install()  # a worker must survive Redis restarts (see kombu_fix.py)
pool_fix.install()  # ... and reconnects after pool processes died together (see pool_fix.py)
kombu_clients.install()  # one redis client per channel, not one per message (see kombu_clients.py)
light_failures.install(PhaseFailed, Refused)  # no frames for failures taskloop raises on purpose
app = make_app()
register(app)
celery = app


def run_worker(argv: list[str]) -> int:
    """Run ``celery worker`` on this app and return its exit code.

    Not ``app.worker_main()``: it runs Celery's click command with ``standalone_mode=False`` and
    drops the code, so a worker that stopped on an "Unrecoverable error" (a Redis ACL refusal, say)
    exited 0 and its supervisor took that for a clean stop instead of restarting it."""
    import click
    from celery.bin.celery import celery as celery_command

    celery_command.params[0].default = app  # what Celery.start() does: the -A option's default
    try:
        code = celery_command.main(args=["worker", *argv], standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    finally:
        celery_command.params[0].default = None
    return code if isinstance(code, int) else 0

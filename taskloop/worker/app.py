"""The worker's Celery app: ``celery -A taskloop.worker.app worker`` (or ``-A taskloop.worker``, or
``-A taskloop``) works as well as ``taskloop worker``.

Importing it patches nothing: the fixes to Celery and kombu are classes the app's settings name
(taskloop/celery_fixes/): the transport (``broker_transport``, set with the broker URL), the
consumer (``worker_consumer``), the prefork pool (``worker_pool``, unless the configuration asks
for another pool) and the app's ``amqp`` class.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

from taskloop.base.config import settings
from taskloop.celery_fixes import relied_on, unchecked_versions
from taskloop.celery_fixes.pool import POOL
from taskloop.runtime.celery_app import make_app
from taskloop.worker import pools
from taskloop.worker.tasks import register

log = logging.getLogger("taskloop.worker")

app = make_app()
if settings().pool:  # taskloop worker -P (or TASKLOOP_POOL): refused here when taskloop cannot run on it
    app.conf.worker_pool = pools.celery_pool(settings().pool)
elif app.conf.worker_pool in (None, "prefork"):
    app.conf.worker_pool = POOL  # Celery's prefork pool, with taskloop's fix (celery_fixes/pool.py)
register(app)
# Celery's built-in tasks (celery.chain, celery.group, celery.chord_unlock, celery.accumulate, ...)
# run whatever their arguments name; taskloop sends none of them, so a worker refuses them like any
# unknown task (worker/consumer.py logs and counts the refusal). TaskRegistry.unregister is public.
BUILTIN_TASKS = tuple(sorted(name for name in app.tasks if name.startswith("celery.")))
for _name in BUILTIN_TASKS:
    app.tasks.unregister(_name)
celery = app


def say_unchecked_versions(**_: Any) -> None:
    """A worker on a Celery, kombu, billiard or redis-py version the fixes were not checked against
    says so when it starts (``python -m taskloop.celery_fixes`` tells whether each is still needed)."""
    for line in unchecked_versions():
        log.warning("taskloop's fixes to Celery and kombu were not checked against %s; run `python -m "
                    "taskloop.celery_fixes` to see which are still needed", line)


def say_what_no_longer_holds(**_: Any) -> None:
    """A worker on a kombu that no longer does what the outbox relies on says so when it starts
    (celery_fixes/outbox.py: the messages the outbox's Builder does not build are then sent after
    each write)."""
    for what, holds in relied_on().items():
        if not holds:
            log.warning("no longer holds with the installed libraries: %s; run `python -m taskloop.celery_fixes`",
                        what)


signals.worker_init.connect(say_unchecked_versions, weak=False)
signals.worker_init.connect(say_what_no_longer_holds, weak=False)


def run_worker(argv: list[str]) -> int:
    """Run Celery's ``worker`` command on this app and return its exit code.

    The command alone, not the ``celery`` command group: importing the group loads every command
    and every ``celery.commands`` plugin installed (Flower, with tornado; click-repl), 12-14 MB in
    each of the worker's processes, for nothing the worker uses. What the group would do first is
    done here: the context object that names the app, and the app's own worker options.
    So the group's global options and their environment variables (``APP``, ``BROKER_URL``,
    ``CONFIG_MODULE``, ...) are not read: the worker's settings are taskloop's
    (``TASKLOOP_*``, docs/operations.md).

    Not ``app.worker_main()``: it runs the command with ``standalone_mode=False`` and drops the
    code, so a worker that stopped on an "Unrecoverable error" (a Redis ACL refusal, say) exited 0
    and its supervisor took that for a clean stop instead of restarting it."""
    import click
    from celery.bin.base import CLIContext
    from celery.bin.worker import worker as worker_command

    worker_command.params.extend(option for option in app.user_options.get("worker", ())
                                 if option not in worker_command.params)
    context = CLIContext(app=app, no_color=False, workdir=None, quiet=False)
    try:
        code = worker_command.main(args=argv, prog_name="celery worker", standalone_mode=False, obj=context)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    return code if isinstance(code, int) else 0

"""Celery settings of ``python -m bench.run --tracing``'s taskloop-traced workers: the repository's
(celeryconfig.py), on a queue of their own, so that a message of one taskloop system never waits
in a paused worker of the other (bench/run.py ``alone``)."""

from celeryconfig import *  # noqa: F403

task_default_queue = "taskloop-traced"

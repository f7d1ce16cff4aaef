"""Celery settings for `python -m bench.run --no-events`: taskloop's defaults without task events."""

from celeryconfig import *  # noqa: F403

worker_send_task_events = False
task_send_sent_event = False

"""The worker's Celery app: ``celery -A taskloop.worker.app worker`` works as well as ``taskloop worker``."""

from __future__ import annotations

from taskloop.app import make_app
from taskloop.worker import kombu_fix
from taskloop.worker.tasks import register

kombu_fix.install()  # a worker must survive Redis restarts (see kombu_fix.py)
app = make_app()
register(app)
celery = app

"""The worker's Celery app: ``celery -A taskloop.worker.app worker`` works as well as ``taskloop worker``."""

from __future__ import annotations

from taskloop.app import make_app
from taskloop.worker.tasks import register

app = make_app()
register(app)
celery = app

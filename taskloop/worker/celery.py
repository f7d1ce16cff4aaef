"""``celery -A taskloop.worker ...``: Celery finds the app here (``<package>.celery``). The same app
as ``taskloop.worker.app``."""

from __future__ import annotations

from taskloop.worker.app import app

__all__ = ["app"]

"""``celery -A taskloop ...`` (worker, flower, beat, inspect): Celery finds the app here, as its
convention asks of a package (``<package>.celery``). The same app as ``taskloop.worker.app``."""

from __future__ import annotations

from taskloop.worker.app import app

__all__ = ["app"]

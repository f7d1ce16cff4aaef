"""The Celery app of taskloop: configuration (celeryconfig.py + environment) and the message sender."""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from celery import Celery

from taskloop.config import Settings, settings
from taskloop.definitions import Workflow
from taskloop.scheduler import Dispatch

log = logging.getLogger("taskloop.app")

# Used when no celeryconfig module is importable (the same values as the repository's file).
DEFAULTS: dict[str, Any] = {
    "worker_prefetch_multiplier": 1,
    "task_ignore_result": True,
    "worker_send_task_events": True,
    "task_send_sent_event": True,
    "broker_transport_options": {"visibility_timeout": 3600},
    "task_default_queue": "taskloop",
    "broker_connection_retry_on_startup": True,
}
# taskloop's guarantees rest on these: they override any configuration.
REQUIRED: dict[str, Any] = {
    "task_serializer": "json",
    "accept_content": ["json"],
    "result_serializer": "json",
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
}


def _config_module() -> Any | None:
    name = os.environ.get("TASKLOOP_CELERY_CONFIG", "celeryconfig")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None


def make_app(config: Settings | None = None) -> Celery:
    config = config or settings()
    app = Celery("taskloop", set_as_current=False)
    module = _config_module()
    app.conf.update(DEFAULTS)
    if module is not None:
        app.config_from_object(module)
    env_broker = os.environ.get("TASKLOOP_BROKER_URL") or os.environ.get("TASKLOOP_REDIS_URL")
    if env_broker or module is None or not getattr(module, "broker_url", None):
        app.conf.broker_url = config.broker_url
    app.conf.update(REQUIRED)
    if config.imports:
        app.conf.imports = tuple(app.conf.imports or ()) + config.imports
    return app


def send_phase(app: Celery, workflow: Workflow, run_id: str, dispatch: Dispatch) -> None:
    """Send one phase message: ids only, named after the workflow for Flower."""
    task = workflow.by_key.get(dispatch.key)
    options: dict[str, Any] = {}
    if task is not None and task.queue:
        options["queue"] = task.queue
    if dispatch.countdown:
        options["countdown"] = dispatch.countdown
    app.send_task(
        f"taskloop.{dispatch.phase.value}",
        args=[run_id, dispatch.key, dispatch.round, dispatch.token],
        shadow=f"{workflow.name}.{dispatch.key}.{dispatch.phase.value}",
        argsrepr=f"{run_id} {dispatch.key} round={dispatch.round}",
        ignore_result=True,
        **options,
    )

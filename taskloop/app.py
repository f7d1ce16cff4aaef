"""The Celery app of taskloop: configuration (celeryconfig.py + environment) and the message sender."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

from celery import Celery

from taskloop.config import Settings, celery_config_module, settings
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


def make_app(config: Settings | None = None) -> Celery:
    config = config or settings()
    app = Celery("taskloop", set_as_current=False)
    module = celery_config_module()
    # DEFAULTS first, the user's module over them; conf.update would outrank the module.
    settings_ = dict(DEFAULTS)
    if module is not None:
        settings_.update({name: getattr(module, name) for name in dir(module) if not name.startswith("_")})
    app.config_from_object(SimpleNamespace(**settings_))
    app.conf.broker_url = config.broker_url  # already resolved: arguments > env > celeryconfig
    app.conf.update(REQUIRED)
    if config.imports:
        app.conf.imports = tuple(app.conf.imports or ()) + config.imports
    return app


def send_phase(app: Celery, workflow: Workflow, run_id: str, dispatch: Dispatch, producer: Any = None) -> None:
    """Send one phase message: ids only, named after the workflow for Flower."""
    task = workflow.by_key.get(dispatch.key)
    options: dict[str, Any] = {}
    if producer is not None:
        options["producer"] = producer
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


class PhaseSender:
    """Sends phase messages through one producer kept for the life of the process.

    A pool process sends one message per phase; taking a producer from the pool for each costs
    a noticeable share of the send. Broker errors are retried by Celery; if a send still fails,
    the producer is dropped and the next send takes a fresh one (the phase stays queued with its
    lease, and the reconciler re-sends it)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._producer: Any = None
        self._lock = threading.Lock()

    def __call__(self, workflow: Workflow, run_id: str, dispatch: Dispatch) -> None:
        with self._lock:
            if self._producer is None:
                self._producer = self.app.producer_pool.acquire(block=True)
            try:
                send_phase(self.app, workflow, run_id, dispatch, producer=self._producer)
            except Exception:
                self._release()
                raise

    def close(self) -> None:
        with self._lock:
            self._release()

    def _release(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.release()
            except Exception:
                log.debug("could not release a producer", exc_info=True)

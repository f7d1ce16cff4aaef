"""The shape of a workflow definition in Redis, by fingerprint: what a reader that never imported
the workflow (the UI) needs to draw a run's graph and show its limits. Whoever plans a run with
the definition publishes it (a client's ``start``, a worker planning a run started by name), at
most once per ``REPUBLISH_S`` per process; it expires twice the retention after its last
publication, so it outlives every run that pins it."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from taskloop.base.config import Settings
from taskloop.base.errors import StoreAccessDenied
from taskloop.define.workflow import Workflow
from taskloop.store.redis_store import RedisStore

REPUBLISH_S = 300.0
logger = logging.getLogger("taskloop.shapes")
_published: dict[tuple[str, str], float] = {}
_lock = threading.Lock()


def shape_of(workflow: Workflow) -> dict[str, Any]:
    """The definition as its fingerprint covers it (``Workflow.describe``), with what a page shows
    besides: each gate's prompt."""
    described = workflow.describe()
    for task in described["tasks"]:
        found = workflow.by_key[task["key"]]
        if found.prompt is not None:
            task["prompt"] = found.prompt
    return {**described, "fingerprint": workflow.fingerprint}


def publish(store: RedisStore, workflow: Workflow, settings: Settings) -> None:
    """Store the workflow's shape, unless this process did so less than REPUBLISH_S ago.

    A shape only helps the UI draw, so a Redis user without ``SET`` (a producer's ACL user that
    starts runs by definition) starts its runs all the same: the refusal is logged once per
    REPUBLISH_S and the UI draws such a run from its records."""
    key = (store.url, workflow.fingerprint)
    now = time.monotonic()
    with _lock:
        if now - _published.get(key, -REPUBLISH_S) < REPUBLISH_S:
            return
        _published[key] = now
    try:
        store.put_shape(workflow.fingerprint, json.dumps(shape_of(workflow), separators=(",", ":")),
                        2 * settings.retention_s)
    except StoreAccessDenied as exc:
        logger.warning("the shape of workflow %r is not published (the run UI draws its runs from their "
                       "records): %s; grant +set on tl:shape:* to publish it", workflow.name, exc)


def read(store: RedisStore, fingerprint: str | None) -> dict[str, Any] | None:
    """A published shape (None: not published, or expired)."""
    if not fingerprint:
        return None
    raw = store.shape(fingerprint)
    return json.loads(raw) if raw else None

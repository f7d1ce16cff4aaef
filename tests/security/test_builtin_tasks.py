"""Only taskloop's tasks run on a taskloop worker: Celery's built-in tasks (``celery.chain``,
``celery.group``, ``celery.accumulate``, ...) run whatever their arguments name, and taskloop sends
none of them, so a worker refuses them like any unknown task, logs the refusal escaped, and goes on
with its work (F "only registered task names run", issue Security III). The events a worker sends
are JSON whatever the configuration says (F10)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from taskloop.runtime.celery_app import make_app
from tests.security import flows
from tests.security.conftest import Stack
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def test_celery_built_in_tasks_are_refused_and_the_worker_goes_on(stack: Stack) -> None:
    app = stack.client.app
    for name, args in (("celery.accumulate", [1, 2]), ("celery.chain", [[]]), ("celery.group", [[]]),
                       ("celery.backend_cleanup", []), ("celery.chord_unlock", ["x", {}])):
        app.send_task(name, args=args, ignore_result=True)
    wait_until(lambda: stack.log().count("refused a task that is not taskloop's") >= 5, timeout=30,
               what="the worker refused the five built-in tasks")
    log = stack.log()
    for name in ("celery.accumulate", "celery.chain", "celery.group", "celery.backend_cleanup", "celery.chord_unlock"):
        assert f"refused a task that is not taskloop's: {name!r}" in log, log[-3000:]
    assert "Task celery.accumulate" not in log  # never executed (Celery logs "Task <name>[id] succeeded")
    result = stack.client.start(flows.small, input={}).wait(timeout=30)  # the worker still works
    assert result.status == "done"


def test_events_are_json_whatever_the_configuration_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pickly_config.py").write_text('event_serializer = "pickle"\nresult_serializer = "pickle"\n'
                                              'accept_content = ["pickle", "json"]\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TASKLOOP_CELERY_CONFIG", "pickly_config")
    importlib.invalidate_caches()
    try:
        conf = make_app().conf
        assert (conf.event_serializer, conf.result_serializer, conf.accept_content) == ("json", "json", ["json"])
    finally:
        sys.modules.pop("pickly_config", None)

"""F1 and F2 of Security III: names and versions are capped wherever they enter, and made-up
workflow names cannot grow the fleet counters (``tl:stats``) or the fleet exporter's labels.

Before the fix, ``client.start(name, version="v" * 5_000_000)`` stored the version in the run
hash and its event stream, and each made-up name that a producer started by name added a
``finished:<name>:failed:failed`` counter that never expired, and a label to every scrape."""

from __future__ import annotations

import uuid

import pytest

from taskloop.base import clock
from taskloop.base.config import settings
from taskloop.base.errors import InvalidInput
from taskloop.core import fields as fld
from taskloop.ops.metrics import fleet_registry
from taskloop.runtime.celery_app import PhaseSender
from taskloop.worker.recovery.reconciler import reconcile
from tests.security.conftest import Stack
from tests.waiting import wait_until


def _key_count(stack: Stack) -> int:
    return int(stack.probe.dbsize())


@pytest.mark.parametrize("call", [
    pytest.param(lambda c: c.start("sec-nowhere", {}, version="v" * 5_000_000), id="5 MB version"),
    pytest.param(lambda c: c.start("sec-nowhere", {}, version="v" * 201), id="201-character version"),
    pytest.param(lambda c: c.start("w" * 201, {}), id="201-character name"),
    pytest.param(lambda c: c.start("sec-nowhere", {}, version="1\n2"), id="line break in the version"),
])
def test_client_start_refuses_a_name_or_version_over_the_cap_and_writes_nothing(stack: Stack, call) -> None:
    before = _key_count(stack)
    with pytest.raises(InvalidInput) as raised:
        call(stack.client)
    message = str(raised.value)
    assert ("version must be None or a non-empty string of at most 200 printable characters" in message
            or "at most 200 characters long" in message), message
    assert len(message) < 1000, "the refusal quotes a cut value, not the 5 MB"
    assert _key_count(stack) == before


def test_a_200_character_version_is_accepted(stack: Stack) -> None:
    run = stack.client.start("sec-nowhere-" + uuid.uuid4().hex[:6], {}, version="v" * 200)
    wait_until(lambda: stack.client.inspect(run.run_id).status == "failed", timeout=30)


def test_made_up_workflow_names_count_under_one_label(stack: Stack) -> None:
    """30 runs started by 30 names no worker has: each fails (WorkflowNotRegistered); once the
    reconciler forgets them they add to one counter, ``(unplanned)``, and the exporter shows one
    label for them. A registered workflow's runs still count under its name."""
    def forget_finished() -> None:
        # a pass past the runs' lease: the reconciler forgets finished runs and counts them (no
        # other test has a run in flight now: the security tests run one at a time)
        reconcile(stack.client.store, settings(), PhaseSender(stack.client.app), now=clock.now() + 600)

    forget_finished()  # the runs of the tests before are counted first
    unplanned = f"finished:{fld.UNPLANNED}:failed:failed"
    before = int(stack.probe.hget("tl:stats", unplanned) or 0)
    tag = uuid.uuid4().hex[:8]
    made_up = [f"sec-made-up-{tag}-{i}" for i in range(30)]
    runs = [stack.client.start(name, {}) for name in made_up]
    known = stack.client.start("sec-big-output", {"size": 1})
    for run in [*runs, known]:
        wait_until(lambda run=run: stack.client.inspect(run.run_id).status in ("failed", "done"), timeout=60)
    assert {stack.client.inspect(run.run_id).status for run in runs} == {"failed"}
    forget_finished()

    stats = stack.probe.hgetall("tl:stats")
    assert not [name for name in stats if tag in name], "a made-up name became a fleet counter"
    assert int(stats[unplanned]) - before == 30
    assert [name for name in stats if name.startswith("finished:sec-big-output:done:")], stats

    registry = fleet_registry(stack.client.store, ["taskloop"])
    labels = {sample.labels["workflow"] for family in registry.collect()
              if family.name == "taskloop_fleet_runs_finished" for sample in family.samples}
    assert fld.UNPLANNED in labels and "sec-big-output" in labels
    assert not [label for label in labels if tag in label]


def test_the_exporter_cuts_a_label_value_written_before_names_were_capped(stack: Stack) -> None:
    """A counter left by an older version (F1: a 5 MB name) is exported with its label cut to
    the 200 characters of a name, not as a 5 MB label."""
    huge = "finished:" + "n" * 1_000_000 + ":failed:failed"
    stack.probe.hset("tl:stats", huge, 1)
    try:
        registry = fleet_registry(stack.client.store, ["taskloop"])
        longest = max(len(value) for family in registry.collect() for sample in family.samples
                      for value in sample.labels.values())
        assert longest == 200
    finally:
        stack.probe.hdel("tl:stats", huge)

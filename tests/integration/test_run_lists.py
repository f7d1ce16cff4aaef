"""The run lists (store/keys.py ``run_list``): sorted sets by creation time per workflow and per
workflow and status (a status across workflows merges them), written inside the run's own script,
that ``client.run_page`` and the UI page through in Redis. Real redis-server, real workers."""

from __future__ import annotations

import time

import pytest

import taskloop as tl
from taskloop.base.config import settings
from taskloop.core import fields as fld
from taskloop.runtime.celery_app import PhaseSender
from taskloop.store import keys as k
from taskloop.store.redis_store import RedisStore
from taskloop.worker.recovery.reconciler import reconcile
from tests.integration import control_flows as cf
from tests.integration import flows
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")


def _lists(probe, run_id: str, workflow: str) -> dict[str, float]:
    """Every run list that holds ``run_id``, with its score (the status lists across workflows of
    earlier versions included: none is written)."""
    keys = ["tl:runs", f"tl:runs:w:{workflow}",
            *(f"tl:runs:s:{s}" for s in ("pending", "running", "done", "failed", "cancelled", "rejected")),
            *(f"tl:runs:w:{workflow}:s:{s}" for s in ("pending", "running", "done", "failed", "cancelled", "rejected"))]
    found = {key: probe.zscore(key, run_id) for key in keys}
    return {key: score for key, score in found.items() if score is not None}


def _created(probe, run_id: str) -> float:
    return float(probe.hget(k.RunKeys.of(run_id).run, fld.F_CREATED))


def test_a_run_is_listed_by_status_and_workflow_as_it_moves(client, probe) -> None:
    # Given a run that is held in its attempt
    run_id = f"lists-{time.time_ns()}"
    handle = client.start(cf.cancellable, input={"hold": "attempt"}, run_id=run_id)
    created = _created(probe, run_id)
    # Then it is in the running lists, at its creation time
    assert _lists(probe, run_id, "cancellable") == {
        "tl:runs": created, "tl:runs:w:cancellable": created, "tl:runs:w:cancellable:s:running": created}
    page = client.run_page(status="running", workflow="cancellable")
    assert run_id in [r.run_id for r in page.runs] and page.total is not None and page.total >= 1
    # When it is cancelled, it moves to the cancelled lists in the write that ends it
    wait_until(lambda: probe.get(f"test:{run_id}:started") is not None, timeout=20, what="the attempt began")
    client.cancel(run_id)
    assert handle.wait(timeout=30).status == "cancelled"
    assert _lists(probe, run_id, "cancellable") == {
        "tl:runs": created, "tl:runs:w:cancellable": created, "tl:runs:w:cancellable:s:cancelled": created}
    assert run_id in [r.run_id for r in client.run_page(status="cancelled", workflow="cancellable", limit=500).runs]
    assert run_id not in [r.run_id for r in client.run_page(status="running", limit=500).runs]


def test_a_failed_run_resumed_moves_back_to_running_then_done(client, probe) -> None:
    run_id = f"lists-resume-{time.time_ns()}"
    probe.set(f"test:{run_id}:broken", "1")
    assert client.start(cf.resumable, input={}, run_id=run_id).wait(timeout=30).status == "failed"
    created = _created(probe, run_id)
    assert set(_lists(probe, run_id, "resumable")) == {
        "tl:runs", "tl:runs:w:resumable", "tl:runs:w:resumable:s:failed"}
    probe.delete(f"test:{run_id}:broken")
    result = client.resume(run_id).wait(timeout=30)
    assert result.status == "done"
    assert _lists(probe, run_id, "resumable") == {
        "tl:runs": created, "tl:runs:w:resumable": created, "tl:runs:w:resumable:s:done": created}


def test_a_run_started_by_an_unknown_name_is_listed_pending_then_failed(client, probe) -> None:
    run_id = f"lists-unknown-{time.time_ns()}"
    handle = client.start("no-such-workflow", input={}, run_id=run_id)
    assert handle.wait(timeout=30).status == "failed"
    assert set(_lists(probe, run_id, "no-such-workflow")) == {
        "tl:runs", "tl:runs:w:no-such-workflow", "tl:runs:w:no-such-workflow:s:failed"}


def test_a_run_deleted_as_it_succeeds_leaves_every_list(client, probe) -> None:
    run_id = f"lists-ephemeral-{time.time_ns()}"
    assert client.start(flows.ephemeral, input={}, run_id=run_id).wait(timeout=30).status == "done"
    assert _lists(probe, run_id, "ephemeral") == {}


def test_pages_cover_a_list_newest_first_without_gaps_or_repeats(client, probe) -> None:
    # Given 23 finished runs of one workflow, started one after the other
    prefix = f"lists-page-{time.time_ns()}"
    ids = [f"{prefix}-{n:02d}" for n in range(23)]
    handles = [client.start(flows.core, input={"target": 11}, run_id=run_id) for run_id in ids]
    assert all(handle.wait(timeout=30).status == "done" for handle in handles)
    # When the done runs of that workflow are read 10 at a time
    pages = []
    offset = 0
    while True:
        page = client.run_page(status="done", workflow="core", offset=offset, limit=10)
        pages.append(page)
        if not page.more:
            break
        offset += 10
    seen = [r.run_id for page in pages for r in page.runs]
    # Then every run appears once, newest first, and the total is the list's length
    assert len(seen) == len(set(seen)) == pages[0].total
    mine = [run_id for run_id in seen if run_id.startswith(prefix)]
    assert mine == list(reversed(ids))
    created = [r.created_at for page in pages for r in page.runs]
    assert created == sorted(created, reverse=True)
    # and a prefix search finds them by id
    found = client.run_page(prefix=f"{prefix}-1", limit=50)
    assert [r.run_id for r in found.runs] == [f"{prefix}-{n}" for n in range(10, 20)] and found.total is None


def test_a_status_across_workflows_is_a_merge_of_the_workflows_lists_newest_first(client, probe) -> None:
    # Given done runs of two workflows, started in turn
    prefix = f"lists-merge-{time.time_ns()}"
    ids = [f"{prefix}-{n:02d}" for n in range(8)]
    handles = [client.start(flows.core, input={"target": 11}, run_id=run_id) if n % 2 else
               client.start(flows.sleeper, input={"seconds": 0}, run_id=run_id) for n, run_id in enumerate(ids)]
    assert all(handle.wait(timeout=30).status == "done" for handle in handles)
    # When the done runs of every workflow are read 3 at a time
    seen, offset, totals = [], 0, set()
    while True:
        page = client.run_page(status="done", offset=offset, limit=3)
        seen += [r.run_id for r in page.runs]
        totals.add(page.total)
        if not page.more:
            break
        offset += 3
    # Then the pages hold every done run once, newest first across both workflows, and the total
    # is the sum of the workflows' lists (a page leaves out a listed run whose keys are gone)
    assert len(seen) == len(set(seen))
    assert [run_id for run_id in seen if run_id.startswith(prefix)] == list(reversed(ids))
    lengths = [probe.zcard(f"tl:runs:w:{wf}:s:done") for wf in sorted(probe.smembers(k.LISTED_WORKFLOWS))]
    assert totals == {sum(lengths)} and len(seen) <= sum(lengths)
    assert client.store.list_lengths(["done"]) == {"done": sum(lengths)}


def test_the_reconciler_deletes_the_status_lists_across_workflows_of_earlier_versions(client, probe) -> None:
    # Given lists an earlier version wrote
    probe.zadd("tl:runs:s:done", {"an-old-run": 1.0})
    probe.zadd("tl:runs:s:running", {"an-old-run": 1.0})
    # When a reconciler of this version makes a pass
    fresh = RedisStore(client.store.url)  # a process of its own: it has not deleted them yet
    try:
        reconcile(fresh, settings(), PhaseSender(client.app))
    finally:
        fresh.close()
    # Then they are gone (nothing reads them: a status's page merges the workflows' lists)
    assert probe.exists("tl:runs:s:done", "tl:runs:s:running") == 0


def test_bad_page_arguments_name_the_argument(client) -> None:
    with pytest.raises(tl.InvalidInput, match="status must be one of"):
        client.run_page(status="finished")
    with pytest.raises(tl.InvalidInput, match="workflow must be a workflow name"):
        client.run_page(workflow="a:b")
    with pytest.raises(tl.InvalidInput, match="limit must be an integer from 1 to 500"):
        client.run_page(limit=0)
    with pytest.raises(tl.InvalidInput, match="offset must be an integer >= 0"):
        client.run_page(offset=-1)
    with pytest.raises(tl.InvalidInput, match="prefix must be the start of a run id"):
        client.run_page(prefix="<script>")


def test_on_one_redis_the_finishing_write_lists_the_run_and_the_reconciler_leaves_the_lists(
        client, probe, redis_server) -> None:
    # Given a run that finished on one Redis, where its finishing write moved it between the lists
    # in the same script call (a Cluster's repair, ``relist``, is tested in tests/connections/test_cluster.py)
    run_id = f"lists-one-redis-{time.time_ns()}"
    assert client.start(flows.core, input={"target": 11}, run_id=run_id).wait(timeout=30).status == "done"
    created = _created(probe, run_id)
    listed = {"tl:runs": created, "tl:runs:w:core": created, "tl:runs:w:core:s:done": created}
    assert _lists(probe, run_id, "core") == listed
    # When the reconciler takes it off the live index (a list left wrong on purpose shows whether
    # the pass rewrites the lists)
    probe.zadd("tl:runs:w:core:s:running", {run_id: created})
    probe.zadd(k.LIVE_INDEX, {run_id: 0})
    reconcile(client.store, settings(), PhaseSender(client.app))
    # Then it writes no list of the run (no per-run list commands on one Redis), it still names the
    # workflow for trimming, and the run is off the live index
    assert _lists(probe, run_id, "core") == {**listed, "tl:runs:w:core:s:running": created}
    assert "core" in probe.smembers(k.LISTED_WORKFLOWS)
    assert probe.zscore(k.LIVE_INDEX, run_id) is None

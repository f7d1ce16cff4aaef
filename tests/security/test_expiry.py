"""Expiry policy: cache entries always expire (TASKLOOP_CACHE_TTL_S when the Cache has no
max_age_ms), and the global runs index and finished runs are bounded by the retention period."""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest

from taskloop.base.config import min_lease_s
from taskloop.store import keys as k
from taskloop.worker.execution import cache as caching
from taskloop.worker.recovery.reconciler import reconcile
from tests.security import flows
from tests.security.conftest import Stack

pytestmark = pytest.mark.timeout(120)

DAY_MS = 24 * 3600 * 1000


def test_a_cache_entry_without_max_age_expires_after_the_default_ttl(stack: Stack) -> None:
    n = uuid.uuid4().int % 10**9
    result = stack.client.start(flows.cached, input={"n": n}).wait(timeout=30)
    assert (result.status, result.values) == ("done", {"lookup": {"n": n}})
    entry = k.cache_key(caching.fingerprint("sec-cached", "lookup", "1", n))
    ttl = stack.probe.pttl(entry)
    assert 29 * DAY_MS < ttl <= 30 * DAY_MS, f"cache entry TTL {ttl} ms (-1: never expires)"
    again = stack.client.start(flows.cached, input={"n": n}).wait(timeout=30)
    assert again.values == {"lookup": {"n": n}} and again.usage["attempts"] == 0  # still a hit


def test_the_runs_index_and_finished_runs_are_bounded_by_retention(stack: Stack) -> None:
    handles = [stack.client.start(flows.small) for _ in range(20)]
    ids = [h.run_id for h in handles]
    for handle in handles:
        assert handle.wait(timeout=30).status == "done"
    retention = stack.client.settings.retention_s
    for run_id in ids:
        assert stack.probe.zscore(k.RUNS_INDEX, run_id) is not None  # listed by `taskloop runs`
        assert 0 < stack.probe.ttl(k.RunKeys.of(run_id).run) <= retention  # the run expires
        assert stack.probe.ttl(k.RunKeys.of(run_id).events) <= retention
    # a reconcile pass drops index entries older than the retention period (here 1 s)
    time.sleep(1.1)
    short = dataclasses.replace(stack.client.settings, retention_s=1)
    reconcile(stack.client.store, short, stack.client.send)
    assert [run_id for run_id in ids if stack.probe.zscore(k.RUNS_INDEX, run_id) is not None] == []
    # a finished run leaves the live index at the first pass after its last lease could have expired
    horizon = time.time() + min_lease_s(stack.client.settings)
    assert all((stack.probe.zscore(k.LIVE_INDEX, run_id) or 0) <= horizon for run_id in ids)

"""A run that ends is listed in the live index below every time (core/batch.py ``ended_score``):
the next reconcile pass reads it whole at once, takes its meta from that read, forgets, counts and
compacts it, with no read of its meta fields first. The score is a hint: the run's own status
decides. Against a redis-server of its own (a pass looks at every due run of its Redis)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taskloop.base.config import Settings
from taskloop.core import fields as fld
from taskloop.core.batch import ended_score, is_ended_score
from taskloop.core.records import ErrorRecord
from taskloop.ops.embedded import RedisServer
from taskloop.runtime import starting
from taskloop.store import keys as k
from taskloop.store.redis_store import RedisStore
from taskloop.worker.recovery.reconciler import reconcile


def _no_send(*args: Any) -> None:
    raise AssertionError("nothing is sent for a run that ended")


@pytest.fixture()
def own(tmp_path: Path) -> Iterator[tuple[RedisStore, Settings]]:
    with RedisServer(tmp_path) as server:
        store = RedisStore(server.url)
        try:
            yield store, Settings(redis_url=server.url)
        finally:
            store.close()


def _ended_run(store: RedisStore, settings: Settings, run_id: str) -> None:
    starting.record_pending(store, "somewhere", None, {"n": 1}, run_id, settings)
    snap = store.snapshot(run_id, starting.START_FIELDS)
    starting.fail_pending(store, snap, ErrorRecord(type="Boom", message="could not plan"), settings)


def test_the_scores_rule() -> None:
    assert is_ended_score(ended_score(1_796_000_000.5)) and not is_ended_score(1_796_000_000.5)
    assert not is_ended_score(0.0)


def test_a_pass_reads_an_ended_run_whole_and_forgets_counts_and_compacts_it(
        own: tuple[RedisStore, Settings], monkeypatch: pytest.MonkeyPatch) -> None:
    store, settings = own
    # Given a run that ended, and a live one due at the same pass
    _ended_run(store, settings, "ended-1")
    starting.record_pending(store, "somewhere", None, {"n": 2}, "live-1", settings)
    store.client.zadd(k.LIVE_INDEX, {"live-1": 1.0})
    assert is_ended_score(store.client.zscore(k.LIVE_INDEX, "ended-1"))
    metas_read: list[str] = []
    run_metas = store.run_metas

    def recorded(run_ids: Any) -> Any:
        ids = list(run_ids)
        metas_read.extend(ids)
        return run_metas(ids)

    monkeypatch.setattr(store, "run_metas", recorded)
    # When a pass runs
    report = reconcile(store, settings, _no_send)
    # Then the ended run was read whole, not through its meta fields; it is forgotten, counted and
    # compacted; the live run had its meta read and stays live
    assert metas_read == ["live-1"]
    assert report.forgotten == 1 and report.compacted == 1
    assert store.client.zscore(k.LIVE_INDEX, "ended-1") is None
    assert store.client.hget(k.RunKeys.of("ended-1").run, fld.F_COMPACT) == "1"
    assert store.stats().get(fld.finished_stat("somewhere", "failed", "failed", False)) == "1"
    assert store.client.zscore(k.LIVE_INDEX, "live-1") is not None
    assert store.snapshot("ended-1").meta().status.value == "failed"  # read through the compact record


def test_a_run_listed_ended_but_live_again_is_looked_at_as_live(own: tuple[RedisStore, Settings]) -> None:
    store, settings = own
    # Given a run listed as ended whose status says it is live (resumed since, say)
    _ended_run(store, settings, "again-1")
    store.client.hset(k.RunKeys.of("again-1").run, fld.F_STATUS, "pending")
    # When a pass runs
    report = reconcile(store, settings, _no_send)
    # Then it is not forgotten nor compacted: the status decides, not the score
    assert report.forgotten == 0 and report.compacted == 0
    assert store.client.zscore(k.LIVE_INDEX, "again-1") is not None
    assert store.client.hget(k.RunKeys.of("again-1").run, fld.F_COMPACT) is None


def test_a_run_that_ended_with_leases_left_is_compacted_and_its_leases_go(own: tuple[RedisStore, Settings]) -> None:
    store, settings = own
    # Given a run that ended with a phase's lease left (an abort with phases still queued)
    _ended_run(store, settings, "aborted-1")
    store.client.zadd(k.RunKeys.of("aborted-1").leases, {"a": 1e12})
    # When a pass runs
    report = reconcile(store, settings, _no_send)
    # Then it is compacted all the same, and the lease set is deleted with the rest
    assert report.compacted == 1
    assert store.client.exists(k.RunKeys.of("aborted-1").leases) == 0

"""Finished runs, compacted (issue 24, point 5; taskloop/store/compacted.py), on real workers: a
run that ends is rewritten as one compact record at the next reconcile pass, holds a fraction of
the memory it held, and reads the same through every reader: inspect, events, result, wait (with
and without observers), the run lists, fork, resume, and a repeated start."""

from __future__ import annotations

import time

import pytest

import taskloop as tl
from taskloop.base.errors import RunExists
from taskloop.core import fields as fld
from taskloop.runtime import views
from taskloop.store import keys as k
from tests.integration import control_flows as cf
from tests.integration import fork_flows as ff
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")

COMPACT_WITHIN_S = 20.0  # a reconcile pass (every 5 s) after the end, with room for a busy machine


def compacted(probe, run_id: str) -> bool:  # type: ignore[no-untyped-def]
    return bool(probe.hexists(k.RunKeys.of(run_id).run, fld.F_COMPACT))


def held_bytes(probe, run_id: str) -> int:  # type: ignore[no-untyped-def]
    keys = k.RunKeys.of(run_id)
    return sum(probe.memory_usage(key, samples=0) or 0 for key in [*keys.all(), keys.compact])


def test_a_finished_run_is_compacted_and_reads_the_same(client, probe) -> None:
    # Given a finished 3-round loop, read through every reader before it is compacted
    handle = client.start(ff.essay, input={"accept_at": 3}, run_id=f"compact-{time.time_ns()}")
    result = handle.wait(timeout=30)
    assert result.status == "done"
    run_id = handle.run_id
    before = (client.inspect(run_id), client.events(run_id), client.result(run_id), held_bytes(probe, run_id))
    assert not compacted(probe, run_id)
    meta = client._meta(run_id)
    assert views.meta_and_result(client.store, run_id) == (meta, before[2])  # wait's read once woken
    # When the reconciler has looked at it once since it ended
    wait_until(lambda: compacted(probe, run_id), timeout=COMPACT_WITHIN_S, what="the run compacted")
    # Then it holds a fraction of what it held: no stream, no lease set, its data in one record
    after_bytes = held_bytes(probe, run_id)
    assert not probe.exists(k.RunKeys.of(run_id).events)
    assert after_bytes < before[3] / 2, (before[3], after_bytes)
    assert 0 < probe.pttl(k.RunKeys.of(run_id).compact) <= probe.pttl(k.RunKeys.of(run_id).run) + 1000
    # and every reader sees what it saw
    after_view = client.inspect(run_id)
    a, b = after_view.model_dump(), before[0].model_dump()
    for t in a['tasks']:
        ta, tb = a['tasks'][t], b['tasks'][t]
        assert ta == tb, {f: (ta[f], tb[f]) for f in ta if ta[f] != tb[f]}
    assert a == b
    assert client.events(run_id) == before[1]
    assert client.result(run_id) == before[2]
    assert views.meta_and_result(client.store, run_id) == (meta, before[2])
    assert client.events(run_id, after=before[1][2].id) == before[1][3:]
    assert client.wait(run_id, timeout=5) == before[2]
    waited = time.monotonic()
    assert handle.wait(timeout=30) == before[2]  # a handle knows its run: it still reads the status first
    assert time.monotonic() - waited < 1.0  # (a compacted run has no end marker to block on)
    heard: list[tl.Event] = []
    assert client.wait(run_id, timeout=5, on_event=heard.append).status == "done"
    assert [e.id for e in heard] == [e.id for e in before[1]]
    listed = client.runs(limit=500)
    assert any(summary.run_id == run_id and summary.status == "done" for summary in listed)


def test_a_compacted_run_can_be_forked_and_started_again_with_its_id(client, probe) -> None:
    run_id = f"compact-fork-{time.time_ns()}"
    assert client.start(ff.essay, input={"accept_at": 3}, run_id=run_id).wait(timeout=30).status == "done"
    wait_until(lambda: compacted(probe, run_id), timeout=COMPACT_WITHIN_S, what="the run compacted")
    # a fork reads the compacted original
    fork = client.fork(run_id, "draft", 2, "shorter, and cite a source")
    assert fork.wait(timeout=30).status == "done"
    assert client.inspect(fork.run_id).forked_from == {"run_id": run_id, "task": "draft", "round": 2}
    # the same run id again is the same run (nothing restarted), or RunExists with another input
    again = client.start(ff.essay, input={"accept_at": 3}, run_id=run_id)
    assert again.run_id == run_id and client.status(run_id) == "done" and compacted(probe, run_id)
    with pytest.raises(RunExists):
        client.start(ff.essay, input={"accept_at": 2}, run_id=run_id)


def test_a_failed_run_compacted_is_resumed(client, probe) -> None:
    # Given a run that failed on a callback error, then was compacted
    run_id = f"compact-resume-{time.time_ns()}"
    probe.set(f"test:{run_id}:broken", "1")
    assert client.start(cf.resumable, input={}, run_id=run_id).wait(timeout=30).status == "failed"
    wait_until(lambda: compacted(probe, run_id), timeout=COMPACT_WITHIN_S, what="the run compacted")
    failed_events = client.events(run_id)
    # When it is resumed
    probe.delete(f"test:{run_id}:broken")
    result = client.resume(run_id).wait(timeout=30)
    # Then it goes on from where it failed, with its history whole, and is compacted again once done
    assert result.status == "done" and result.values == {"fix": 2, "report": "fixed in 2"}
    events = client.events(run_id)
    assert [e.id for e in events[:len(failed_events)]] == [e.id for e in failed_events]
    assert [e.type for e in events].count("run.resumed") == 1
    wait_until(lambda: compacted(probe, run_id), timeout=COMPACT_WITHIN_S, what="the run compacted again")
    assert client.result(run_id) == result


def test_a_resume_that_meets_the_reconciler_compacting_the_run_goes_on(client, probe, monkeypatch) -> None:
    # Given a failed run that the reconciler compacts again right after the resume expanded it (the
    # resume read the live-shaped run; the reconciler, which had just forgotten it, rewrote its hash)
    run_id = f"compact-race-{time.time_ns()}"
    probe.set(f"test:{run_id}:broken", "1")
    assert client.start(cf.resumable, input={}, run_id=run_id).wait(timeout=30).status == "failed"
    wait_until(lambda: compacted(probe, run_id), timeout=COMPACT_WITHIN_S, what="the run compacted")
    probe.delete(f"test:{run_id}:broken")
    expand = client.store.expand
    calls: list[bool] = []

    def expand_then_compacted(run: str) -> bool:
        expanded = expand(run)
        if not calls:
            assert client.store.compact(run), "the run was not compacted again"
        calls.append(expanded)
        return expanded

    monkeypatch.setattr(client.store, "expand", expand_then_compacted)
    # When it is resumed
    handle = client.resume(run_id)
    # Then the write that met the compacted hash expanded the run again and went on
    assert calls == [True, True]
    assert handle.wait(timeout=30).status == "done"
    assert [e.type for e in client.events(run_id)].count("run.resumed") == 1

"""Resume rules (SPEC §3-4): explicit resume, what a replay keeps, what is refused."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import taskloop as tl
from taskloop.base.config import settings
from taskloop.core import fields as fld
from taskloop.core.begin import Dispatch
from taskloop.core.states import Phase, Slot, TaskStatus
from taskloop.runtime.celery_app import PhaseSender, send_phase
from taskloop.store import keys as k
from taskloop.worker.recovery.reconciler import reconcile
from tests.integration import control_flows as cf
from tests.integration import flows
from tests.integration.flows import recorded
from tests.ledger import assert_balanced
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")


def _broken_run(client, probe) -> str:
    run_id = f"resume-{time.time_ns()}"
    probe.set(f"test:{run_id}:broken", "1")
    result = client.start(cf.resumable, input={}, run_id=run_id).wait(timeout=30)
    assert result.status == "failed" and result.errors[0].message == "reviewer crashed"
    return run_id


def test_resume_replays_the_failed_check_without_rerunning_the_attempt(client, probe) -> None:
    run_id = _broken_run(client, probe)
    probe.delete(f"test:{run_id}:broken")
    result = client.resume(run_id).wait(timeout=30)
    assert result.status == "done" and result.termination_code is None
    assert result.values == {"fix": 2, "report": "fixed in 2"}
    assert recorded(probe, run_id, "attempt_calls") == [1, 2]  # the saved candidate went straight to check
    checks = recorded(probe, run_id, "check_calls")
    assert [c["round"] for c in checks] == [1, 2, 2]
    assert checks[1]["key"] == checks[2]["key"]  # a replay keeps its round and idempotency key
    assert checks[2]["attempt"] == checks[1]["attempt"] + 1  # and consumes one attempt
    assert result.usage["attempts"] == 4  # fix: 2 rounds + 1 replay; report: 1
    assert recorded(probe, run_id, "condition_calls") == [0, 0]  # condition again on resume
    events = client.events(run_id)
    assert [e.type for e in events].count("run.resumed") == 1
    assert_balanced(events)


def test_an_observer_wait_on_a_resumed_run_waits_for_its_second_ending(client, probe) -> None:
    # Given a run that failed once (its stream holds a run.finished) and was resumed
    run_id = _broken_run(client, probe)
    probe.delete(f"test:{run_id}:broken")
    client.resume(run_id)
    heard: list[tl.Event] = []
    # When a client waits for it with an observer, reading the stream from its start
    result = client.wait(run_id, timeout=30, on_event=heard.append)
    # Then the wait does not stop at the first run.finished: it returns the resumed run's result
    assert result.status == "done" and result.values["fix"] == 2
    assert [e.type for e in heard].count("run.finished") == 2 and heard[-1].type == "run.finished"


def test_resume_from_the_command_line(client, probe) -> None:
    run_id = _broken_run(client, probe)
    probe.delete(f"test:{run_id}:broken")
    done = subprocess.run([sys.executable, "-m", "taskloop", "resume", run_id, "--wait", "--import",
                           "tests.integration.control_flows"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"run {run_id} resumed" in done.stdout and "status done" in done.stdout


def test_an_exhausted_loop_stays_exhausted(client) -> None:
    result = client.start(flows.core, input={"target": 99}).wait(timeout=30)
    with pytest.raises(tl.TaskLoopError, match=r"nothing to resume.*an exhausted loop stays exhausted"):
        client.resume(result.run_id)
    with pytest.raises(tl.TaskLoopError, match="only a failed run can be resumed"):
        client.resume(client.start(flows.core, input={}).wait(timeout=30).run_id)


def test_resume_under_a_changed_definition_is_refused(client, probe) -> None:
    from taskloop.define.workflow import REGISTRY

    run_id = _broken_run(client, probe)
    original = cf.resumable
    REGISTRY.unregister("resumable", "1")  # as if this process had deployed a changed definition
    try:
        tl.define_workflow("resumable", version="1", tasks=[  # same name and version, max_rounds changed
            tl.define_loop_task("fix", max_rounds=4, attempt=cf.fragile_attempt, check=cf.fragile_check),
            tl.define_task("report", run=lambda ctx: "x", after=["fix"]),
        ])
        with pytest.raises(tl.IncompatibleDefinition, match="resumes only under the definition it started with"):
            client.resume(run_id)
    finally:
        REGISTRY.unregister("resumable", "1")
        REGISTRY.register(original)


def test_corrupt_records_are_refused_before_any_callback(client, probe) -> None:
    # A failed run with a corrupt record: resume refuses it
    run_id = _broken_run(client, probe)
    probe.hset(k.RunKeys.of(run_id).run, fld.task_field("fix"), '{"key": "fix", "kind": "loop", "status": "exploded"')
    with pytest.raises(tl.TaskLoopError, match="corrupt or inconsistent"):
        client.resume(run_id)
    # A live run whose check lost its candidate: the worker fails the task without calling check
    run = client.start(flows.spread, input={"rounds": 2}, run_id=f"corrupt-{time.time_ns()}")
    run.wait(timeout=30)
    record = client.store.snapshot(run.run_id).record("grind").model_copy(update={
        "status": TaskStatus.ACTIVE, "phase": Phase.CHECK, "slot": Slot.QUEUED, "round": 3, "token": 100,
        "error": None})
    probe.hset(k.RunKeys.of(run.run_id).run, mapping={fld.task_field("grind"): record.dump(), fld.F_STATUS: "running",
                                                      fld.F_OPEN: "1", fld.F_ACTIVE: "1"})
    before = len(recorded(probe, run.run_id, "where"))
    send_phase(client.app, flows.spread, run.run_id, Dispatch("grind", Phase.CHECK, 3, 100))
    wait_until(lambda: client.inspect(run.run_id).tasks["grind"].status != "active", what="the check to be refused")
    view = client.inspect(run.run_id)
    assert view.tasks["grind"].status == "failed"
    assert view.tasks["grind"].error.type == "CorruptRecord"
    assert "round 3 is in check but has no recorded candidate" in view.tasks["grind"].error.message
    assert len(recorded(probe, run.run_id, "where")) == before  # no callback ran


def test_a_lease_kept_from_an_earlier_queueing_is_moved_not_taken_for_a_lost_message(client, monkeypatch) -> None:
    """A loop's next phase keeps the lease its first phase got, and its record says so
    (core/draft.py _kept_leases): when that lease expires, the phase's own is still ahead. The
    reconciler moves the lease there; it sends the message again only once that one expires too.
    (A lease written for the phase's own queueing is taken at its word: the next test.)"""
    import redis

    import taskloop.runtime.celery_app
    from taskloop.store import keys as k

    monkeypatch.setattr(taskloop.runtime.celery_app, "messages_of", lambda *a, **kw: [])
    run = client.start(flows.core, input={})
    monkeypatch.undo()
    record = client.store.snapshot(run.run_id, fld.record_fields("source")).record("source")
    assert record is not None and record.queued_at is not None and record.lease_kept is None
    # Given a phase queued moments ago (its own lease: +300 s) under a lease kept from an earlier
    # queueing, which expired a second ago
    r = redis.Redis.from_url(settings().redis_url)
    keys = k.RunKeys.of(run.run_id)
    earlier = time.time() - 1.0
    r.hset(keys.run, fld.task_field("source"), record.model_copy(update={"lease_kept": earlier}).dump())
    r.zadd(keys.leases, {"source": earlier})
    r.zadd(k.LIVE_INDEX, {run.run_id: earlier})  # the reconciler looks when the first lease expires
    now = time.time()
    # When a reconcile pass looks: the lease moves to the phase's own, and nothing is sent
    report = reconcile(client.store, settings(), PhaseSender(client.app), now=now)
    assert (report.moved, report.redispatched) == (1, 0)
    assert r.zscore(keys.leases, "source") == pytest.approx(record.queued_at + settings().queued_lease_s)
    assert client.store.snapshot(run.run_id, fld.record_fields("source")).record("source").token == record.token
    # And once that one has expired too, the message is sent again and the run finishes
    later = reconcile(client.store, settings(), PhaseSender(client.app), now=now + settings().queued_lease_s + 1)
    assert later.redispatched >= 1
    assert run.wait(timeout=30).status == "done"
    r.close()


def test_the_reconciler_resends_a_lost_message(client, monkeypatch) -> None:
    import taskloop.runtime.celery_app

    # Given a run whose first message was recorded but never sent (the client died in between)
    monkeypatch.setattr(taskloop.runtime.celery_app, "messages_of", lambda *a, **kw: [])
    run = client.start(flows.core, input={})
    assert client.inspect(run.run_id).tasks["source"].status == "active"
    monkeypatch.undo()
    # When a reconcile pass runs after the queued lease (300 s by default) has expired
    report = reconcile(client.store, settings(), PhaseSender(client.app),
                       now=time.time() + settings().queued_lease_s + 1)
    # Then it re-sends the phase with a new token and the run finishes
    assert report.redispatched >= 1
    assert run.wait(timeout=30).status == "done"
    commits = [e for e in client.events(run.run_id) if e.type == "phase" and e.key == "source"]
    assert len(commits) == 1  # re-sending is not a second commit


def test_a_phase_begun_on_its_start_note_and_lost_past_its_queued_lease_is_replayed_and_counted(
        client, monkeypatch) -> None:
    import taskloop.runtime.celery_app

    # Given a queued phase whose message a worker took and began on its start note (the one-call
    # step: its begin is written with its outcome), and the worker died before anything else
    monkeypatch.setattr(taskloop.runtime.celery_app, "messages_of", lambda *a, **kw: [])
    run = client.start(flows.core, input={})
    monkeypatch.undo()
    record = client.store.snapshot(run.run_id, fld.record_fields("source")).record("source")
    assert record is not None and record.slot is Slot.QUEUED
    client.store.client.hset(k.RunKeys.of(run.run_id).run, fld.started_field("source"),
                             f"{record.token} gone@nowhere/999 {time.time()!r}")
    # When a reconcile pass finds its queued lease expired
    report = reconcile(client.store, settings(), PhaseSender(client.app),
                       now=time.time() + settings().queued_lease_s + 1)
    # Then the execution counts as lost (a replay, not a resend of a message that never ran)
    assert (report.replayed, report.redispatched) == (1, 0)
    assert run.wait(timeout=30).status == "done"
    execs = client.inspect(run.run_id).tasks["source"].execs
    assert (execs[0].worker, execs[0].lost) == ("gone@nowhere/999", True)
    assert len(execs) == 2 and not execs[1].lost


def test_reconcile_command_runs_a_pass() -> None:
    done = subprocess.run([sys.executable, "-m", "taskloop", "reconcile", "--import", "tests.integration.flows"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "examined" in done.stdout and "redispatched" in done.stdout


def test_several_reconcilers_at_once_redispatch_a_phase_once(client, monkeypatch, caplog) -> None:
    import logging
    import threading

    import taskloop.runtime.celery_app

    monkeypatch.setattr(taskloop.runtime.celery_app, "messages_of", lambda *a, **kw: [])
    run = client.start(flows.core, input={})
    monkeypatch.undo()
    later = time.time() + settings().queued_lease_s + 1
    caplog.set_level(logging.WARNING, logger="taskloop.reconciler")
    reports = []
    barrier = threading.Barrier(4)

    def one_pass() -> None:
        barrier.wait()
        reports.append(reconcile(client.store, settings(), PhaseSender(client.app), now=later))

    threads = [threading.Thread(target=one_pass) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    # every pass saw the expired lease of `source`; exactly one won it, the others found it handled.
    # (A pass that starts late may find the next task, queued since by the worker that ran
    # `source`, due too at `later`, which is past every queued lease: only `source` counts here.)
    won = [r for r in caplog.records
           if r.getMessage().startswith("reconcile: redispatched") and f" of {run.run_id}/source " in r.getMessage()]
    assert len(won) == 1, [r.getMessage() for r in won]
    assert sum(r.redispatched for r in reports) >= 1
    assert run.wait(timeout=30).status == "done"
    assert len([e for e in client.events(run.run_id) if e.type == "phase" and e.key == "source"]) == 1

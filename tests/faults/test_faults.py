"""Fault injection on real processes at the shipped defaults: the smoke subset runs in CI, the
full one with `-m slow` (with a second, short-lease profile for the full sizes).

Reproduce a run with its seed: TASKLOOP_FAULT_SEED=<seed> python -m pytest tests/faults -m slow
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskloop.base.errors import StoreUnavailable
from taskloop.core import fields as fld
from taskloop.runtime.models import executions
from taskloop.worker.execution.deferred import started
from tests.faults import flows
from tests.faults.harness import FAULT_ENV, RESULTS, Cluster, Fault, Outcome, stale_rejections, timer

SEED = int(os.environ.get("TASKLOOP_FAULT_SEED", "0")) or int(time.time()) % 100_000

SMOKE = pytest.param({"runs": 4, "faults": 2}, id="smoke")
FULL = pytest.param({"runs": 20, "faults": 10}, id="full", marks=pytest.mark.slow)
SIZES = [SMOKE, FULL]
# The shipped defaults are the profile users run, and every scenario runs with them. The short
# timers (2 s leases) are a second profile of the full sizes: more recoveries in the same time.
PROFILES = [pytest.param({}, id="defaults"), pytest.param(FAULT_ENV, id="short-leases", marks=pytest.mark.slow)]
pytestmark = pytest.mark.timeout(420)


@pytest.fixture(params=PROFILES)
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(tmp_path, SEED, timers=request.param).start()
    try:
        yield c
    finally:
        c.stop()


def running_lease_s(cluster: Cluster) -> float:
    return timer(cluster.timers, "TASKLOOP_LEASE_S")


def reconcile_interval_s(cluster: Cluster) -> float:
    return timer(cluster.timers, "TASKLOOP_RECONCILE_INTERVAL_S")


def finish(cluster: Cluster, scenario: str, run_ids: list[str], faults: list[Fault]) -> Outcome:
    cluster.wait_all(run_ids)
    outcome = cluster.check(scenario, run_ids, faults, flows.MAX_ROUNDS)
    RESULTS.append(outcome)
    assert outcome.lost == 0 and outcome.duplicate_commits == 0, outcome.problems
    assert not outcome.problems, "\n".join(outcome.problems)
    assert cluster.client is not None
    results = [cluster.client.result(rid) for rid in run_ids]
    assert all(r is not None and r.status == "done" and r.values["work"]["round"] == 3 for r in results), results
    cluster.assert_fleet_whole()  # and every worker that was not killed on purpose still runs and consumes
    return outcome


def _target(what: dict) -> tuple[str, str, int, str]:
    return (what["run"], what["key"], what["round"], what["phase"])


@pytest.mark.parametrize("size", SIZES)
def test_sigkill_pool_process_mid_attempt_and_mid_check(cluster: Cluster, size: dict) -> None:
    run_ids = cluster.start_runs(size["runs"])
    faults = []
    for n in range(size["faults"]):
        time.sleep(cluster.rng.uniform(0.05, 0.4))
        pid, what = cluster.pick_running("attempt" if n % 2 == 0 else "check")
        os.kill(pid, signal.SIGKILL)
        faults.append(Fault("sigkill-child", time.time(), [_target(what)]))
    outcome = finish(cluster, f"SIGKILL pool process ({size['faults']}x, attempt and check)", run_ids, faults)
    assert outcome.replays >= 1  # the killed executions were replayed, not lost


@pytest.mark.parametrize("size", SIZES)
def test_sigkill_whole_worker(cluster: Cluster, size: dict) -> None:
    # twice as many runs as pool processes: each worker also holds prefetched phases when it dies
    run_ids = cluster.start_runs(2 * size["runs"])
    time.sleep(cluster.rng.uniform(0.3, 0.8))
    supervisor, main, *pool = cluster.tree("f1")
    cluster.pick_running(pids=set(pool))  # make sure it is in the middle of something
    hit = [_target(what) for pid, what in cluster.running().items() if pid in pool]
    cluster.killed.add("f1")
    for pid in [supervisor, main, *pool]:  # the whole machine goes: supervisor, worker and pool
        os.kill(pid, signal.SIGKILL)
    # what it ran, as the store says: a phase may have begun after `running()` was read, before the
    # kill: its begin written (the record names the worker), or only its start note (the one-call
    # step writes the begin with the outcome, taskloop/worker/execution/deferred.py)
    assert cluster.client is not None
    for run_id in run_ids:
        snap = cluster.client.store.snapshot(run_id, [fld.started_field("work")])
        record = snap.record("work")
        if record is None or record.phase is None:
            continue
        note = started(snap.get(fld.started_field("work")))
        on_f1 = bool(record.worker and record.worker.startswith("f1@")) or (
            note is not None and note.token == record.token and note.worker.startswith("f1@"))
        if on_f1:
            target = (run_id, "work", record.round, record.phase.value)
            hit += [] if target in hit else [target]
    faults = [Fault("sigkill-worker", time.time(), hit)]
    cluster.start_worker("f3")  # capacity comes back under another name
    outcome = finish(cluster, "SIGKILL whole worker (main + pool)", run_ids, faults)
    assert outcome.replays >= len(hit) >= 1
    if not cluster.timers:  # at the defaults: back when the worker falls silent, not after a lease
        assert outcome.max_recovery_s < running_lease_s(cluster), outcome


@pytest.mark.parametrize("size", SIZES)
def test_sigstop_past_the_lease_then_sigcont(cluster: Cluster, size: dict) -> None:
    run_ids = cluster.start_runs(size["runs"])
    faults = []
    for _ in range(max(1, size["faults"] // 5)):
        pid, what = cluster.pick_running()
        os.kill(pid, signal.SIGSTOP)
        faults.append(Fault("sigstop", time.time(), [_target(what)]))
        # past TASKLOOP_LEASE_S and a reconcile pass: the reconciler replays the phase elsewhere (a
        # paused process is told from a slow one only by its lease: 30 s by default)
        time.sleep(running_lease_s(cluster) + 2 * reconcile_interval_s(cluster) + 1.0)
        os.kill(pid, signal.SIGCONT)
    # the woken process goes on with the callback it was stopped in, then tries to commit: give it
    # that time (the replay may have ended every run before the SIGCONT, and the check reads the
    # refusal counters as soon as the runs are over)
    assert cluster.client is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not stale_rejections(cluster.client.store.stats()):
        time.sleep(0.1)
    outcome = finish(cluster, "SIGSTOP past the lease, SIGCONT", run_ids, faults)
    assert outcome.stale_rejections > 0  # the woken process could not commit
    assert outcome.replays >= 1


@pytest.mark.parametrize("size", SIZES)
def test_duplicate_delivery_and_replay_after_commit(cluster: Cluster, size: dict) -> None:
    from taskloop.core.begin import Dispatch
    from taskloop.core.states import QUEUED_STATES, RUNNING_STATES
    from taskloop.runtime.celery_app import send_phase

    assert cluster.client is not None
    client = cluster.client
    run_ids = cluster.start_runs(size["runs"])
    sent: list[Dispatch] = []
    faults = []
    deadline = time.monotonic() + 30
    while len(sent) < size["faults"] * 2 and time.monotonic() < deadline:
        run_id = cluster.rng.choice(run_ids)
        record = client.store.snapshot(run_id).record("work")
        if record is None or record.phase is None or record.state not in (*QUEUED_STATES, *RUNNING_STATES):
            continue
        token = record.token if record.state in QUEUED_STATES else record.token - 1
        dispatch = Dispatch("work", record.phase, record.round, token)
        send_phase(client.app, flows.grind, run_id, dispatch)  # a second copy of the live message
        sent.append(dispatch)
        faults.append(Fault("duplicate", time.time(), []))
        time.sleep(0.1)
    cluster.wait_all(run_ids)
    for run_id, dispatch in zip(run_ids, sent, strict=False):  # replays of messages long committed
        send_phase(client.app, flows.grind, run_id, dispatch)
        faults.append(Fault("replay-after-commit", time.time(), []))
    time.sleep(2.0)
    outcome = finish(cluster, "duplicate delivery, replay after commit", run_ids, faults)
    assert outcome.stale_rejections > 0


@pytest.mark.parametrize("size", SIZES)
def test_kill_redis_and_restart_from_aof(cluster: Cluster, size: dict) -> None:
    assert cluster.client is not None
    # Given workers busy with phases
    run_ids = cluster.start_runs(size["runs"])
    faults = []
    # When Redis is killed with SIGKILL and restarted from its AOF, three times in a row
    for _ in range(max(3, size["faults"] // 3)):
        cluster.pick_running()
        in_flight = []
        for run_id in run_ids:
            record = cluster.client.store.snapshot(run_id).record("work")
            if record is not None and record.phase is not None and not record.terminal:
                in_flight.append((run_id, "work", record.round, record.phase.value))
        cluster.redis.kill()
        faults.append(Fault("redis-kill", time.time(), in_flight))
        # while Redis is away, client calls fail with a clear error
        with pytest.raises(StoreUnavailable, match=r"cannot reach Redis at redis://127\.0\.0\.1:.*TASKLOOP_REDIS_URL"):
            cluster.client.inspect(run_ids[0])
        time.sleep(1.0)
        cluster.redis.start()
        time.sleep(1.0)
    # Then every run ends correctly, and the fleet is whole: every worker process that was started
    # still runs, with its pool, and consumes new work (finish checks both)
    finish(cluster, "kill -9 redis-server, restart from AOF (3x in a row)", run_ids, faults)


@pytest.mark.parametrize("outage_s", [pytest.param(10, id="10s"), pytest.param(60, id="60s", marks=pytest.mark.slow)])
def test_redis_away_for_a_long_time(cluster: Cluster, outage_s: int) -> None:
    assert cluster.client is not None
    # Given workers busy with phases
    run_ids = cluster.start_runs(4, hold_s=0.3)
    cluster.pick_running()
    in_flight = []
    for run_id in run_ids:
        record = cluster.client.store.snapshot(run_id).record("work")
        if record is not None and record.phase is not None and not record.terminal:
            in_flight.append((run_id, "work", record.round, record.phase.value))
    # When Redis is unreachable for outage_s (killed, then restarted from its AOF)
    cluster.redis.kill()
    down_at = time.time()
    time.sleep(outage_s)
    cluster.redis.start()
    back_at = time.time()
    # Then the workers reconnect by themselves, every run ends correctly, and nothing is lost
    finish(cluster, f"Redis unreachable for {outage_s} s, then back", run_ids,
           [Fault("redis-outage", down_at, in_flight)])  # the same worker processes, still consuming
    took = [e.began_at - back_at for run_id in run_ids for es in executions(cluster.client.events(run_id)).values()
            for e in es if e.began_at and e.began_at > back_at]
    print(f"\nRedis away {outage_s} s: first phase began {min(took):.2f} s after it was back")


def test_a_phase_that_keeps_killing_its_worker_ends_failed(cluster: Cluster) -> None:
    assert cluster.client is not None
    run = cluster.client.start(flows.grind, input={"suicide": "attempt", "hold_s": 0.1})
    result = run.wait(timeout=90)
    assert result.status == "failed"
    [error] = result.errors
    assert error.type == "PhaseAbandoned"
    assert "was started 5 times and every execution was lost" in error.message
    execs = executions(cluster.client.events(run.run_id))["work"]
    assert len(execs) == 5 and all(e.round == 1 and e.phase == "attempt" for e in execs)
    assert all(e.lost for e in execs)
    assert [e.attempt for e in execs] == [1, 2, 3, 4, 5]  # each replay consumed one attempt
    RESULTS.append(Outcome("redelivery cap: an attempt that kills its process (ends PhaseAbandoned)", None,
                           1, len(execs)))
    cluster.assert_fleet_whole()  # the pools replaced the five killed processes and still consume


# A message lost between the write that records its phase and its send (possible with a broker of
# its own; at the defaults the outbox sends a phase's message inside the write that queues it) is
# found by the reconciler's census (worker/recovery/census.py): queued before the tail of its queue, and in
# no unacked entry. It used to wait for the queued lease (TASKLOOP_QUEUED_LEASE_S, 300 s).
@pytest.mark.parametrize("size", [SMOKE])
def test_crash_between_record_and_send(cluster: Cluster, size: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import taskloop.runtime.celery_app
    from taskloop.worker.recovery.census import CENSUS_S, MARGIN_S

    # Given a client that records the first phase of each run and dies before sending its message
    monkeypatch.setattr(taskloop.runtime.celery_app, "messages_of", lambda *args, **kwargs: [])
    started = time.time()
    run_ids = cluster.start_runs(size["runs"])
    monkeypatch.undo()  # the client "restarts": what it sends from now on (the fleet check's runs) goes out
    faults = [Fault("message never sent", started, [(rid, "work", 1, "attempt") for rid in run_ids])]
    # Then the reconciler sends each again: by its census, or by the queued lease if that is sooner
    bound = min(MARGIN_S + CENSUS_S + 2 * reconcile_interval_s(cluster),
                timer(cluster.timers, "TASKLOOP_QUEUED_LEASE_S") + 2 * reconcile_interval_s(cluster)) + 5.0
    outcome = finish(cluster, "crash between record and send (lost message)", run_ids, faults)
    assert outcome.max_recovery_s < bound, (outcome.max_recovery_s, bound)

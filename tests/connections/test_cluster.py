"""Redis Cluster as the store: a real three-master cluster started by the test, a plain Redis as
the broker, a real worker, workflows end to end, and every store method on the cluster."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator

import pytest
import redis

from taskloop.base import config
from taskloop.base.config import Settings
from taskloop.base.errors import ConnectionConfigError
from taskloop.connections import clients
from taskloop.core import fields as fld
from taskloop.core.batch import Batch, Index
from taskloop.ops.embedded import RedisServer
from taskloop.runtime.celery_app import PhaseSender
from taskloop.runtime.client import TaskLoop
from taskloop.store import keys as k
from taskloop.store.redis_store import RedisStore
from tests.ledger import ledger_problems
from tests.servers import Cluster
from tests.waiting import wait_until
from tests.workers import WorkerProcess


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = time.monotonic()
    nodes = Cluster(tmp_path_factory.mktemp("cluster")).start()
    print(f"\ncluster up in {time.monotonic() - started:.1f} s: {nodes.url}")
    yield nodes
    nodes.stop()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("broker"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def settings(cluster: Cluster, broker: RedisServer) -> Settings:
    config.reset()
    return Settings(redis_url=cluster.url, broker_url=broker.url, reconcile_interval_s=1.0)


@pytest.fixture(scope="module")
def worker(cluster: Cluster, broker: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    logfile = tmp_path_factory.mktemp("cluster-workers") / "w1.log"
    proc = WorkerProcess(cluster.url, ["tests.connections.flows"], logfile, broker_url=broker.url,
                         env={"TASKLOOP_RECONCILE_INTERVAL_S": "1"})
    try:
        yield proc.ready()
    finally:
        proc.stop()


@pytest.fixture()
def client(settings: Settings) -> Iterator[TaskLoop]:
    c = TaskLoop(config=settings)
    yield c
    c.close()


def test_the_store_client_is_a_cluster_client(cluster: Cluster) -> None:
    store = RedisStore(cluster.url)
    try:
        assert isinstance(store.client, redis.cluster.RedisCluster)
        assert len(store.client.get_primaries()) == 3
        assert clients.client_timeout(store.client) == 5.0
    finally:
        store.close()


def test_a_cluster_cannot_be_the_broker(cluster: Cluster) -> None:
    with pytest.raises(ConnectionConfigError, match="cannot be a Redis Cluster"):
        TaskLoop(config=Settings(redis_url=cluster.url, broker_url=cluster.url)).app  # noqa: B018


def test_every_store_method_on_the_cluster(cluster: Cluster) -> None:
    """The run's keys share a slot; the global indexes live elsewhere: every method must route."""
    store = RedisStore(cluster.url)
    try:
        run_ids = [f"cl-{i}" for i in range(12)]
        slots = {store.client.keyslot(k.RunKeys.of(r).run) for r in run_ids}
        owners = {store.client.nodes_manager.get_node_from_slot(slot).name for slot in slots}
        assert len(owners) == 3, "the test runs should spread over the three masters"
        assert store.client.keyslot(k.RUNS_INDEX) != store.client.keyslot(k.RunKeys.of(run_ids[0]).run)
        store.client.script_flush()  # the first cas.lua call must load it on the node that owns the slot
        for n, run_id in enumerate(run_ids):
            batch = Batch(run_id)
            batch.expect(fld.F_STATUS, None, "new run").set(fld.F_STATUS, "running").set(fld.F_WORKFLOW, "probe")
            batch.set(fld.F_CREATED, str(1000 + n)).lease("a", 5000.0 + n)
            batch.indexes += [(Index.LIVE, run_id, 2000.0 + n)]
            batch.list_run("probe", "running", 1000.0 + n, new=True)
            assert store.apply(batch).__class__.__name__ == "Applied"
            again = Batch(run_id)
            again.expect(fld.F_STATUS, None, "new run").set(fld.F_STATUS, "x")
            assert store.apply(again).__class__.__name__ == "Conflict"
        first = run_ids[0]
        assert store.hmget(first, [fld.F_STATUS, fld.F_WORKFLOW]) == ["running", "probe"]
        assert store.scan_fields(first, "st") == {"status": "running"}
        assert store.all_fields(first)[fld.F_WORKFLOW] == "probe"
        assert store.leases(first, 10_000.0) == [("a", 5000.0)]
        assert store.lease_of(first, "a") == 5000.0 and store.first_lease(first) == 5000.0
        assert store.run_ids(100) == list(reversed(run_ids))  # the lists, written after the script
        assert store.list_page("running", "probe", 0, 5) == (list(reversed(run_ids))[:5], len(run_ids))
        assert sorted(store.run_ids_with_prefix("cl-1", limit=10)) == ["cl-1", "cl-10", "cl-11"]
        assert [meta[1] for meta in store.run_metas(run_ids)] == ["probe"] * len(run_ids)
        assert [run_id for run_id, _ in store.due_entries(2005.0, 100)] == run_ids[:6]
        # a status across workflows: each workflow's list, merged (the lists live on other nodes)
        assert store.list_page("running", None, 0, 5) == (list(reversed(run_ids))[:5], len(run_ids))
        assert store.read_whole([first])[first].fields[fld.F_WORKFLOW] == "probe"  # the reconciler's read
        store.look_again(first, 9999.0)
        assert store.live_count() == len(run_ids)
        store.unlive(run_ids[:2])
        assert store.live_count() == len(run_ids) - 2
        store.incr_usage(first, {"attempts": 2})
        assert store.hmget(first, [fld.usage_field("attempts")]) == ["2"]
        store.incr_stat("cluster_probe")
        assert store.stats()["cluster_probe"] == "1"
        store.note_reconcile(json.dumps({"ok": True}))
        assert store.last_reconcile() == '{"ok": true}'
        store.relist([(run_ids[5], "probe", "done", 1005.0)])  # the reconciler's repair of a finished run
        assert store.list_page("done", "probe", 0, 5) == ([run_ids[5]], 1)
        assert store.list_page("running", None, 0, 100)[1] == len(run_ids) - 1
        assert store.listed_workflows() == ["probe"]
        assert store.trim_runs_index(1003.0) == 4
        assert store.list_page("running", "probe", 0, 100)[1] == len(run_ids) - 5  # trimmed with the index
        assert len(store.run_ids(100)) == len(run_ids) - 4
        # blocking reads on the node of the run's slot
        assert store.block_end(first, 50) is False
        store.client.rpush(k.RunKeys.of(first).end, "done")
        assert store.block_end(first, 50) is True and store.block_end(first, 50) is True
        assert store.block_events(first, "0-0", 50) == []
        clients.disconnect(store._blocking)  # what _block does after a read outlived its timeout
        assert store.block_end(first, 50) is True
        # the begin script (begin.lua): nothing prepared, so it only reads the asked-for fields
        reply = store.begin(first, "a", 1, "attempt", 0, '"w"', 1.0, [fld.F_STATUS])
        assert not reply.began and reply.fields[fld.F_STATUS] == "running"
    finally:
        store.close()


def test_workflows_end_to_end(worker: WorkerProcess, client: TaskLoop) -> None:
    from tests.integration import flows

    started = time.monotonic()
    core = [client.start(flows.core, input={}) for _ in range(3)]
    spread = [client.start(flows.spread, input={"rounds": 20}) for _ in range(3)]
    for handle in core:
        result = handle.wait(timeout=30)
        assert (result.status, result.values["fix"], result.values["publish"]) == ("done", 12, 24), result
    for handle in spread:
        result = handle.wait(timeout=30)
        assert (result.status, result.values["grind"]) == ("done", 20), result
    for handle in core + spread:
        assert ledger_problems(client.events(handle.run_id)) == []
    view = client.inspect(core[0].run_id)
    assert [r.output for r in view.tasks["fix"].rounds] == [11, 12]
    assert view.tasks["fix"].rounds[0].check["feedback"] == "Try again"
    listed = {summary.run_id for summary in client.runs(workflow="core")}
    assert {h.run_id for h in core} <= listed
    assert {h.run_id for h in spread} <= {s.run_id for s in client.runs(status="done", workflow="spread")}
    events: list[str] = []
    client.start(flows.core, input={}).wait(timeout=30, on_event=lambda e: events.append(e.type))
    assert "task" in events
    print(f"\ncluster: 7 runs end to end in {time.monotonic() - started:.2f} s")
    assert worker.alive()


def test_fleet_limits_hold_on_a_cluster(worker: WorkerProcess, client: TaskLoop) -> None:
    """SPEC §10 on a Cluster: the limits live in slots of their own, so a phase takes its room and
    gives it back in calls of their own (limit_store.py), not inside the run's scripts; a
    concurrency limit of 1, with and without a key, never lets two phases overlap, and nothing is
    left held or waiting. On a Cluster the last phase gives its slot back in a call after the write
    of its outcome (the write that ends the run and wakes wait()), so the slot is looked for until
    it is back, within a few seconds, not at the very moment wait() returns."""
    from tests.connections import flows as cf

    for workflow, given in ((cf.held_unkeyed, {}), (cf.held_keyed, {"doc": "A"})):
        handles = [client.start(workflow, input={"hold_s": 0.3, **given}) for _ in range(4)]
        results = [h.wait(timeout=60) for h in handles]
        assert [r.status for r in results] == ["done"] * 4, results
        spans = sorted(tuple(r.values["hold"]) for r in results)
        overlapping = [(a, b) for a, b in itertools.pairwise(spans) if a[1] > b[0]]
        assert overlapping == [], f"{workflow.name}: phases overlapped: {overlapping}"
    def held() -> list[object]:
        return [u for u in client.store.limit_uses(time.time()) if u.used or u.waiting]

    wait_until(lambda: not held(), timeout=5, what=f"every limit slot given back (held: {held()})")
    assert held() == []
    assert worker.alive()


def test_cancel(worker: WorkerProcess, client: TaskLoop) -> None:
    from tests.integration import flows

    handle = client.start(flows.sleeper, input={"seconds": 30})
    deadline = time.monotonic() + 20
    while client.inspect(handle.run_id).tasks["nap"].status != "active":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.cancel(handle.run_id, "enough")
    result = handle.wait(timeout=30)
    assert result.status == "cancelled", result
    assert ledger_problems(client.events(handle.run_id)) == []


def test_gate_decided(worker: WorkerProcess, client: TaskLoop) -> None:
    from tests.integration import control_flows as cf

    handle = client.start(cf.gated_flow, input={})
    deadline = time.monotonic() + 20
    while client.inspect(handle.run_id).status != "waiting":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    client.decide(handle.run_id, "approval", "approve", actor="alice", reason="looks good")
    result = handle.wait(timeout=30)
    assert result.status == "done" and result.values["publish"] == "published first draft"


def test_reconcile_pass(worker: WorkerProcess, client: TaskLoop, settings: Settings) -> None:
    from taskloop.worker.recovery.reconciler import reconcile

    store = RedisStore(settings.redis_url)
    sender = PhaseSender(client.app, settings.redis_url)
    try:
        assert not sender.folds  # the outbox never runs across a cluster and another broker
        report = reconcile(store, settings, sender)
        assert report is not None
        assert json.loads(store.last_reconcile() or "{}")["at"] > 0
    finally:
        sender.close()
        store.close()

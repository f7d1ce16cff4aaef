"""Redis Sentinel for the store and the broker: a master, a replica and three sentinels started by
the test; a real worker rides out `SENTINEL FAILOVER` in the middle of its runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from taskloop.base import config
from taskloop.base.config import Settings
from taskloop.base.errors import StoreUnavailable
from taskloop.connections import errors, sentinel
from taskloop.runtime.client import TaskLoop
from taskloop.store import keys as k
from taskloop.store.redis_store import RedisStore
from tests.connections.test_tls import broker_round_trip, settings_for
from tests.ledger import ledger_problems
from tests.servers import SentinelGroup
from tests.workers import WorkerProcess


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    started = time.monotonic()
    sentinels = SentinelGroup(tmp_path_factory.mktemp("sentinel")).start()
    print(f"\nsentinel group up in {time.monotonic() - started:.1f} s: {sentinels.url}")
    yield sentinels
    sentinels.stop()


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TASKLOOP_SENTINEL_MASTER", raising=False)
    config.reset()
    yield
    config.reset()


def test_store_through_sentinel(group: SentinelGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    store = RedisStore(group.url)
    try:
        store.incr_stat("sentinel_probe")
        assert store.stats()["sentinel_probe"] == "1"
        assert store.block_end("no-such-run", 50) is False
        assert store.client.connection_pool.get_master_address() == ("127.0.0.1", group.master_port())
    finally:
        store.close()
    # the master's name from TASKLOOP_SENTINEL_MASTER
    monkeypatch.setenv("TASKLOOP_SENTINEL_MASTER", group.name)
    config.reset()
    store = RedisStore(group.url.split("?")[0])
    try:
        assert store.stats()["sentinel_probe"] == "1"
    finally:
        store.close()


@pytest.mark.parametrize("fixed", [False, True])
def test_redis_py_sentinel_reconnect_gap(group: SentinelGroup, fixed: bool) -> None:
    """Why sentinel.SentinelConnection exists: redis-py's SentinelManagedConnection, once
    dropped, reconnects (send_packed_command -> connect_check_health) to the address it had, without
    asking Sentinel. Simulated here by a cached address that is no longer the master's (the
    replica's). If the unfixed case starts to pass, redis-py has closed the gap: drop the class."""
    connection_class = sentinel.SentinelConnection if fixed else redis.sentinel.SentinelManagedConnection
    manager = redis.sentinel.Sentinel([("127.0.0.1", s.port) for s in group.sentinels])
    pool = redis.sentinel.SentinelConnectionPool(group.name, manager, connection_class=connection_class,
                                                 decode_responses=True)
    client = redis.Redis(connection_pool=pool, single_connection_client=True)
    try:
        assert client.execute_command("ROLE")[0] == "master"
        client.connection.disconnect()
        client.connection.port = group.replica.port  # what a demoted master looks like to it
        role = client.execute_command("ROLE")[0]
        assert role == ("master" if fixed else "slave")
    finally:
        client.close()
        pool.disconnect()


def test_unknown_master_is_described(group: SentinelGroup) -> None:
    url = group.url.replace(f"master={group.name}", "master=nosuch")
    store = RedisStore(url, retries=0)
    try:
        with pytest.raises(StoreUnavailable) as info:
            store.stats()
        described = errors.describe(info.value.__cause__ or info.value, url)
        assert "no Redis Sentinel at sentinel://" in str(described) and "'nosuch'" in str(described)
    finally:
        store.close()


def test_broker_through_sentinel(group: SentinelGroup) -> None:
    broker_round_trip(settings_for(group.url))


def _role(port: int) -> str:
    with redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=2) as r:
        return str(r.execute_command("ROLE")[0])


def _stream_ids(port: int, run_ids: list[str]) -> dict[str, set[str]]:
    with redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=2) as r:
        return {run_id: {entry for entry, _ in r.xrange(k.RunKeys.of(run_id).events)} for run_id in run_ids}


def test_worker_rides_out_a_failover(group: SentinelGroup, tmp_path: Path) -> None:
    """SENTINEL FAILOVER mid-run. Every run must finish on the new master with a balanced ledger
    (nothing committed twice) and the worker must live on. Also measured: how long the old master
    keeps taking writes after the switch (until Sentinel turns it into a replica) and how many
    acknowledged commits that split brain loses."""
    from tests.connections import flows as connection_flows
    from tests.integration import flows

    env = {"TASKLOOP_RECONCILE_INTERVAL_S": "1", "TASKLOOP_QUEUED_LEASE_S": "3", "TASKLOOP_LEASE_S": "3"}
    worker = WorkerProcess(group.url, ["tests.connections.flows"], tmp_path / "w1.log", broker_url=group.url, env=env)
    client = TaskLoop(config=Settings(redis_url=group.url, broker_url=group.url, reconcile_interval_s=1.0,
                                      queued_lease_s=3.0, running_lease_s=3.0))  # the worker's settings
    try:
        worker.ready()
        handles = [client.start(flows.spread, input={"rounds": 20}) for _ in range(4)]
        handles += [client.start(connection_flows.slow_loop, input={"rounds": 20, "pause_s": 0.05})
                    for _ in range(2)]
        run_ids = [h.run_id for h in handles]
        deadline = time.monotonic() + 20
        while sum(len(client.events(r)) for r in run_ids) < 40:
            assert time.monotonic() < deadline, "the runs do not progress"
            time.sleep(0.05)
        old = group.master_port()
        asked = time.time()
        group.failover()
        while group.master_port() == old:
            assert time.time() < asked + 30, "the sentinels did not switch the master"
            time.sleep(0.01)
        switched = time.time()
        last_seen_on_old: dict[str, set[str]] = {}
        while _role(old) == "master":  # split brain: the old master still takes writes
            assert time.time() < switched + 30, "Sentinel never turned the old master into a replica"
            last_seen_on_old = _stream_ids(old, run_ids)
            time.sleep(0.05)
        converted = time.time()
        results = [h.wait(timeout=40) for h in handles]
        finished = time.time()

        for run_id, result in zip(run_ids, results, strict=True):
            assert result.status == "done", (run_id, result)
            assert result.values.get("grind", result.values.get("crawl")) == 20, result.values
            events = client.events(run_id)
            assert ledger_problems(events) == [], (run_id, ledger_problems(events))
        assert worker.alive(), worker.log()[-3000:]
        assert "Unrecoverable error" not in worker.log()
        final = _stream_ids(group.master_port(), run_ids)
        lost = {r: last_seen_on_old.get(r, set()) - final[r] for r in run_ids}
        stamps = sorted(e.at for r in run_ids for e in client.events(r))
        resumed = next((t for t in stamps if t > converted), finished)
        print(f"\nSENTINEL FAILOVER: sentinels switched the master {switched - asked:.2f} s after the request; the "
              f"old master took writes {converted - switched:.2f} s more (split brain) until Sentinel made it a "
              f"replica; {sum(map(len, lost.values()))} acknowledged events of {sum(1 for v in lost.values() if v)} "
              f"runs were lost with it; first commit after that {resumed - converted:.2f} s later; all "
              f"{len(run_ids)} runs done {finished - asked:.2f} s after the request")
        group.wait_settled(group.master_port())
    finally:
        client.close()
        worker.stop()


def test_cost_of_wait_for_one_replica(group: SentinelGroup) -> None:
    """What `WAIT 1 <timeout>` adds to a write when it must reach the replica (local replica)."""
    master = RedisStore(group.url).client
    try:
        assert master.execute_command("WAIT", 1, 1000) == 1

        def timed(op: str, n: int = 1000) -> list[float]:
            out = []
            for i in range(n):
                start = time.perf_counter()
                if op == "write":
                    master.hset("tl:wait-probe", str(i), "x")
                elif op == "write+wait":
                    master.hset("tl:wait-probe", str(i), "x")
                    assert master.execute_command("WAIT", 1, 1000) == 1
                else:  # one round trip
                    pipe = master.pipeline(transaction=False)
                    pipe.hset("tl:wait-probe", str(i), "x")
                    pipe.execute_command("WAIT", 1, 1000)
                    assert pipe.execute()[1] == 1
                out.append((time.perf_counter() - start) * 1e6)
            return out

        rows = {op: timed(op) for op in ("write", "write+wait", "pipelined write+wait")}
        base = statistics.median(rows["write"])
        print()
        for op, samples in rows.items():
            samples.sort()
            median, p99 = statistics.median(samples), samples[int(len(samples) * 0.99)]
            print(f"WAIT cost: {op:22s} median {median:7.0f} us  p99 {p99:7.0f} us  (+{median - base:.0f} us)")
        master.delete("tl:wait-probe")
    finally:
        master.close()

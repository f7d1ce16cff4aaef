"""`rediss+sentinel://` and `rediss+cluster://` against real TLS servers (issue 21, point 4).

- A Sentinel group where every process speaks TLS only: the master and its replica
  (``tls-replication yes``) and three sentinels on ``tls-port`` (which reach the master over TLS
  too). The store and the broker both take the ``rediss+sentinel://`` URL.
- A three-master Redis Cluster that speaks TLS only, the cluster bus included (``tls-cluster
  yes``): the store takes ``rediss+cluster://``; the broker, which cannot be a cluster, a TLS
  Redis of its own (``rediss://``).

Each runs a workflow end to end through a real `taskloop worker` given only the URLs and
``TASKLOOP_TLS_CA``, and is refused with a clear StoreUnavailable when the CA is the wrong one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from taskloop.base import config
from taskloop.base.config import Settings
from taskloop.base.errors import StoreUnavailable
from taskloop.connections import clients
from taskloop.runtime.client import TaskLoop
from taskloop.store.redis_store import RedisStore
from tests.connections.test_tls import broker_round_trip, settings_for
from tests.ledger import ledger_problems
from tests.servers import Cluster, Node, SentinelGroup, TLSFiles, make_tls_files, tls_node
from tests.workers import WorkerProcess

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def group(tls_files: TLSFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelGroup]:
    started = time.monotonic()
    sentinels = SentinelGroup(tmp_path_factory.mktemp("tls-sentinel"), tls=tls_files).start()
    print(f"\nTLS sentinel group up in {time.monotonic() - started:.1f} s: {sentinels.url}")
    yield sentinels
    sentinels.stop()


@pytest.fixture(scope="module")
def cluster(tls_files: TLSFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = time.monotonic()
    nodes = Cluster(tmp_path_factory.mktemp("tls-cluster"), tls=tls_files).start()
    print(f"\nTLS cluster up in {time.monotonic() - started:.1f} s: {nodes.url}")
    yield nodes
    nodes.stop()


@pytest.fixture(scope="module")
def broker(tls_files: TLSFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """The cluster's broker: one TLS Redis."""
    node = tls_node(tmp_path_factory.mktemp("tls-broker"), tls_files).start()
    yield node
    node.stop()


@pytest.fixture(autouse=True)
def clean_tls_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("TASKLOOP_TLS_CA", "TASKLOOP_TLS_CERT", "TASKLOOP_TLS_KEY", "TASKLOOP_TLS_INSECURE",
                 "TASKLOOP_SENTINEL_MASTER"):
        monkeypatch.delenv(name, raising=False)
    config.reset()
    yield
    config.reset()


def bare(url: str) -> str:
    """The URL without ``ssl_ca_certs`` (the CA then comes from TASKLOOP_TLS_CA)."""
    base, _, query = url.partition("?")
    kept = [part for part in query.split("&") if part and not part.startswith("ssl_ca_certs=")]
    return base + ("?" + "&".join(kept) if kept else "")


def with_ca(url: str, ca: Path) -> str:
    return f"{bare(url)}{'&' if '?' in bare(url) else '?'}ssl_ca_certs={ca}"


def run_end_to_end(store_url: str, broker_url: str, ca: Path, logfile: Path,
                   monkeypatch: pytest.MonkeyPatch) -> float:
    """A worker given only the URLs and TASKLOOP_TLS_CA runs workflows; every run ends done, with a
    balanced ledger. Returns the seconds the runs took."""
    from tests.integration import flows

    monkeypatch.setenv("TASKLOOP_TLS_CA", str(ca))
    config.reset()
    worker = WorkerProcess(store_url, ["tests.connections.flows"], logfile, broker_url=broker_url,
                           env={"TASKLOOP_TLS_CA": str(ca)})
    client = TaskLoop(store_url, broker_url)
    try:
        worker.ready()
        started = time.monotonic()
        core = [client.start(flows.core, input={}) for _ in range(3)]
        spread = client.start(flows.spread, input={"rounds": 10})
        for handle in core:
            result = handle.wait(timeout=30)
            assert (result.status, result.values["fix"], result.values["publish"]) == ("done", 12, 24), result
        result = spread.wait(timeout=30)
        assert (result.status, result.values["grind"]) == ("done", 10), result
        took = time.monotonic() - started
        for handle in [*core, spread]:
            assert ledger_problems(client.events(handle.run_id)) == []
        assert [r.output for r in client.inspect(core[0].run_id).tasks["fix"].rounds] == [11, 12]
        assert worker.alive(), worker.log()[-3000:]
        assert "verification is OFF" not in worker.log()
        return took
    finally:
        client.close()
        worker.stop()


def refused(url: str) -> str:
    """The message of the StoreUnavailable a store with this URL meets (at creation or first call)."""
    with pytest.raises(StoreUnavailable) as info:
        store = RedisStore(url, retries=0)
        try:
            store.stats()
        finally:
            store.close()
    return str(info.value)


# --- rediss+sentinel:// -------------------------------------------------------------------------

def test_tls_sentinel_store_and_broker(group: SentinelGroup, tls_files: TLSFiles) -> None:
    assert group.url.startswith("rediss+sentinel://")
    store = RedisStore(group.url)
    try:
        store.incr_stat("tls_sentinel_probe")
        assert store.stats()["tls_sentinel_probe"] == "1"
        assert store.block_end("no-such-run", 50) is False  # the blocking client speaks TLS too
        assert store.client.connection_pool.get_master_address() == ("127.0.0.1", group.master_port())
        connection = store.client.connection_pool.get_connection()
        try:
            assert connection.__class__.__name__ == "SentinelSSLConnection"
        finally:
            store.client.connection_pool.release(connection)
    finally:
        store.close()
    broker_round_trip(settings_for(group.url))


def test_tls_sentinel_wrong_ca_is_refused_clearly(group: SentinelGroup, tls_files: TLSFiles) -> None:
    message = refused(with_ca(group.url, tls_files.other_ca))
    assert "cannot verify the TLS certificate" in message, message
    assert "rediss+sentinel://" in message and "TASKLOOP_TLS_CA" in message, message
    # no CA at all: the system's trust store does not know the test CA either
    message = refused(bare(group.url))
    assert "cannot verify the TLS certificate" in message, message


def test_tls_sentinel_worker_end_to_end(group: SentinelGroup, tls_files: TLSFiles, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    url = bare(group.url)
    took = run_end_to_end(url, url, tls_files.ca, tmp_path / "w1.log", monkeypatch)
    print(f"\nrediss+sentinel:// (store and broker): 4 runs end to end in {took:.2f} s")


# --- rediss+cluster:// --------------------------------------------------------------------------

def test_tls_cluster_store(cluster: Cluster, tls_files: TLSFiles) -> None:
    assert cluster.url.startswith("rediss+cluster://")
    store = RedisStore(cluster.url)
    try:
        assert isinstance(store.client, redis.cluster.RedisCluster)
        primaries: Any = store.client.get_primaries()  # type: ignore[no-untyped-call]
        assert len(primaries) == 3
        store.client.script_flush()  # the scripts are loaded again over TLS, on the node of each slot
        store.incr_stat("tls_cluster_probe")
        assert store.stats()["tls_cluster_probe"] == "1"
        assert store.block_end("no-such-run", 50) is False
        assert all(node.redis_connection.connection_pool.connection_class is redis.SSLConnection
                   for node in primaries)
        assert clients.client_timeout(store.client) == 5.0
    finally:
        store.close()


def test_tls_cluster_wrong_ca_is_refused_clearly(cluster: Cluster, tls_files: TLSFiles) -> None:
    message = refused(with_ca(cluster.url, tls_files.other_ca))
    assert "cannot verify the TLS certificate" in message, message
    assert "rediss+cluster://" in message and "TASKLOOP_TLS_CA" in message, message
    message = refused(bare(cluster.url))
    assert "cannot verify the TLS certificate" in message, message


def test_tls_cluster_worker_end_to_end(cluster: Cluster, broker: Node, tls_files: TLSFiles, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    took = run_end_to_end(bare(cluster.url), f"rediss://127.0.0.1:{broker.port}/0", tls_files.ca,
                          tmp_path / "w1.log", monkeypatch)
    print(f"\nrediss+cluster:// store, rediss:// broker: 4 runs end to end in {took:.2f} s")


def test_tls_settings_from_one_settings_object(cluster: Cluster, tls_files: TLSFiles) -> None:
    """A TaskLoop given Settings (not the environment) with the CA reaches the TLS cluster too."""
    settings = Settings(redis_url=bare(cluster.url), broker_url="redis://127.0.0.1:1/0", tls_ca=str(tls_files.ca))
    store = RedisStore(settings.redis_url, client=clients.store_client(settings.redis_url, config=settings))
    try:
        assert isinstance(store.stats(), dict)
    finally:
        store.close()

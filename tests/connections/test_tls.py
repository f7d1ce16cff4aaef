"""TLS against a real redis-server that speaks TLS only (--port 0 --tls-port P), with a CA made
by the test: the store and the broker are verified with the CA, refused without it, accepted
with the explicit opt-out (which logs a warning), and a worker runs a workflow over TLS."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import kombu.exceptions
import pytest
import redis

from taskloop.base import config
from taskloop.base.config import Settings
from taskloop.base.errors import StoreUnavailable
from taskloop.connections import errors
from taskloop.runtime.celery_app import make_app
from taskloop.runtime.client import TaskLoop
from taskloop.store.redis_store import RedisStore
from tests.servers import Node, TLSFiles, make_tls_files, tls_node
from tests.workers import WorkerProcess


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(tls_files: TLSFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = tls_node(tmp_path_factory.mktemp("tls-redis"), tls_files).start()
    yield node
    node.stop()


@pytest.fixture(scope="module")
def mutual(tls_files: TLSFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A server that also requires a client certificate signed by the CA."""
    node = tls_node(tmp_path_factory.mktemp("tls-redis-mutual"), tls_files, auth_clients=True).start()
    yield node
    node.stop()


@pytest.fixture(autouse=True)
def clean_tls_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("TASKLOOP_TLS_CA", "TASKLOOP_TLS_CERT", "TASKLOOP_TLS_KEY", "TASKLOOP_TLS_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    config.reset()
    yield
    config.reset()


def settings_for(url: str, **kwargs: object) -> Settings:
    fields: dict[str, object] = {"redis_url": url, "broker_url": url, "tls_ca": "", "tls_cert": "", "tls_key": "",
                                 "tls_insecure": False, "sentinel_master": ""}
    fields.update(kwargs)
    return Settings(**fields)  # type: ignore[arg-type]


def broker_round_trip(settings: Settings) -> None:
    """Publish one message through Celery's broker connection and read it back."""
    app = make_app(settings)
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=5)
        queue = conn.SimpleQueue("taskloop-tls-probe")
        try:
            queue.put({"hello": "tls"})
            message = queue.get(timeout=5)
            assert message.payload == {"hello": "tls"}
            message.ack()
        finally:
            queue.close()


def warnings_in(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "verification is OFF" in r.getMessage()]


# --- the store ------------------------------------------------------------------------------------

def test_store_verified_with_the_ca_in_the_url(server: Node, tls_files: TLSFiles) -> None:
    store = RedisStore(f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={tls_files.ca}")
    try:
        store.incr_stat("tls_probe")
        assert store.stats()["tls_probe"] == "1"
        assert store.client.connection_pool.connection_class is redis.SSLConnection
    finally:
        store.close()


def test_store_verified_with_the_ca_from_the_environment(server: Node, tls_files: TLSFiles,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKLOOP_TLS_CA", str(tls_files.ca))
    config.reset()
    store = RedisStore(f"rediss://127.0.0.1:{server.port}/0")
    try:
        assert isinstance(store.stats(), dict)
        assert store.block_end("no-such-run", 50) is False  # the blocking client verifies too
    finally:
        store.close()


@pytest.mark.parametrize("ca", ["none", "other"])
def test_store_refuses_an_unverified_certificate(server: Node, tls_files: TLSFiles, ca: str) -> None:
    url = f"rediss://:s3cret@127.0.0.1:{server.port}/0"
    if ca == "other":
        url += f"?ssl_ca_certs={tls_files.other_ca}"
    store = RedisStore(url, retries=0)
    try:
        with pytest.raises(StoreUnavailable, match="CERTIFICATE_VERIFY_FAILED") as info:
            store.stats()
        assert "s3cret" not in str(info.value)
        described = errors.describe(info.value.__cause__ or info.value, url)
        assert "cannot verify the TLS certificate" in str(described) and "TASKLOOP_TLS_CA" in str(described)
    finally:
        store.close()


@pytest.mark.parametrize("how", ["env", "url"])
def test_store_opt_out_is_accepted_and_logged(server: Node, how: str, caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="taskloop.connections")
    url = f"rediss://127.0.0.1:{server.port}/0"
    if how == "env":
        monkeypatch.setenv("TASKLOOP_TLS_INSECURE", "1")
        config.reset()
    else:
        url += "?ssl_cert_reqs=none"
    store = RedisStore(url, retries=0)
    try:
        assert isinstance(store.stats(), dict)
        store.block_end("no-such-run", 50)
    finally:
        store.close()
    logged = warnings_in(caplog)
    assert len(logged) == 2  # the store's client, then its blocking client
    assert ("TASKLOOP_TLS_INSECURE=1" if how == "env" else "ssl_cert_reqs=none") in logged[0]


def test_store_client_certificate(mutual: Node, tls_files: TLSFiles) -> None:
    base = f"rediss://127.0.0.1:{mutual.port}/0?ssl_ca_certs={tls_files.ca}"
    store = RedisStore(f"{base}&ssl_certfile={tls_files.client_cert}&ssl_keyfile={tls_files.client_key}")
    try:
        assert isinstance(store.stats(), dict)
    finally:
        store.close()
    without = RedisStore(base, retries=0)
    try:
        with pytest.raises(StoreUnavailable):
            without.stats()
    finally:
        without.close()


# --- the broker -----------------------------------------------------------------------------------

def test_broker_verified_with_the_ca(server: Node, tls_files: TLSFiles) -> None:
    broker_round_trip(settings_for(f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={tls_files.ca}"))
    broker_round_trip(settings_for(f"rediss://127.0.0.1:{server.port}/0", tls_ca=str(tls_files.ca)))


def test_broker_refuses_an_unverified_certificate(server: Node, tls_files: TLSFiles,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A bare rediss:// broker URL used to accept any certificate (kombu's default is CERT_NONE)."""
    caplog.set_level(logging.WARNING)
    with pytest.raises((kombu.exceptions.OperationalError, redis.exceptions.ConnectionError),
                       match="CERTIFICATE_VERIFY_FAILED"):
        broker_round_trip(settings_for(f"rediss://127.0.0.1:{server.port}/0"))
    with pytest.raises((kombu.exceptions.OperationalError, redis.exceptions.ConnectionError),
                       match="CERTIFICATE_VERIFY_FAILED"):
        broker_round_trip(settings_for(f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={tls_files.other_ca}"))
    assert "defaulting to insecure SSL behaviour" not in caplog.text


def test_broker_opt_out_is_accepted_and_logged(server: Node, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="taskloop.connections")
    broker_round_trip(settings_for(f"rediss://127.0.0.1:{server.port}/0", tls_insecure=True))
    broker_round_trip(settings_for(f"rediss://127.0.0.1:{server.port}/0?ssl_cert_reqs=none"))
    logged = warnings_in(caplog)
    assert len(logged) == 2 and all("Celery broker" in m for m in logged)


def test_broker_client_certificate(mutual: Node, tls_files: TLSFiles) -> None:
    broker_round_trip(settings_for(f"rediss://127.0.0.1:{mutual.port}/0", tls_ca=str(tls_files.ca),
                                   tls_cert=str(tls_files.client_cert), tls_key=str(tls_files.client_key)))


# --- a worker over TLS ----------------------------------------------------------------------------

def test_worker_runs_a_workflow_over_tls(server: Node, tls_files: TLSFiles, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker gets only TASKLOOP_TLS_CA and a bare rediss:// URL, for its store and its broker."""
    from tests.integration import flows

    url = f"rediss://127.0.0.1:{server.port}/0"
    monkeypatch.setenv("TASKLOOP_TLS_CA", str(tls_files.ca))
    config.reset()
    worker = WorkerProcess(url, ["tests.connections.flows"], tmp_path / "w1.log", broker_url=url,
                           env={"TASKLOOP_TLS_CA": str(tls_files.ca)})
    client = TaskLoop(url, url)
    try:
        worker.ready()
        started = time.monotonic()
        result = client.start(flows.core, input={}).wait(timeout=30)
        assert (result.status, result.values["publish"]) == ("done", 24), result
        print(f"\ncore over TLS: {time.monotonic() - started:.2f} s")
        assert worker.alive()
    finally:
        client.close()
        worker.stop()

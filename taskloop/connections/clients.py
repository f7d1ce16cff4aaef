"""The store's redis-py client for a URL: ``redis.Redis`` (one Redis, or the Sentinel master) or
``redis.cluster.RedisCluster``, with taskloop's timeouts, retries, TLS and credentials."""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import parse_qsl, urlencode

import redis
import redis.cluster
import redis.exceptions as rex
import redis.sentinel
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from taskloop.base.config import Settings
from taskloop.connections.errors import describe
from taskloop.connections.sentinel import SentinelConnection, SentinelManager, SentinelSSLConnection
from taskloop.connections.urls import SOCKET_CONNECT_TIMEOUT_S, Target, parse, warn_if_insecure

# redis-py's Sentinel and cluster classes are untyped: called through Any.
_sentinel: Any = redis.sentinel
_cluster: Any = redis.cluster

HEALTH_CHECK_INTERVAL_S = 15

# TCP keepalive that notices a dead peer within about a minute of silence (the kernel's default
# waits two hours before its first probe): an idle connection whose Redis went away without a
# FIN or RST (a failover to another address, a NAT or firewall that forgot it) fails instead of
# hanging. Linux names; elsewhere the kernel's own settings apply.
KEEPALIVE_OPTIONS: dict[int, int] = {
    option: value for option, value in ((getattr(socket, "TCP_KEEPIDLE", None), 30),
                                        (getattr(socket, "TCP_KEEPINTVL", None), 10),
                                        (getattr(socket, "TCP_KEEPCNT", None), 3))
    if option is not None}

# Every node a cluster client of this process has seen, per URL: the seeds of the next client made
# for that URL (the URL's own come first), so that a client made after a failover (a blocking
# reader, a new pool process) still finds the cluster when the seeds in the URL are down.
_CLUSTER_NODES: dict[str, list[tuple[str, int]]] = {}


def _common_kwargs(target: Target, socket_timeout: float) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
        "socket_keepalive_options": dict(KEEPALIVE_OPTIONS),
    }
    kwargs.update(target.auth_kwargs())
    return kwargs


def _retry(retries: int) -> Retry:
    return Retry(ExponentialBackoff(cap=2.0, base=0.05), retries) if retries > 0 else Retry(NoBackoff(), 0)


def sentinel_manager(target: Target, socket_timeout: float) -> Any:
    """A redis-py Sentinel over the URL's sentinels (their own auth and TLS as the URL says)."""
    sentinel_kwargs: dict[str, Any] = {"socket_timeout": socket_timeout,
                                       "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S, **target.sentinel_kwargs()}
    return SentinelManager(list(target.hosts), sentinel_kwargs=sentinel_kwargs)


def store_client(url: str, *, retries: int = 3, single_connection: bool = False,
                 socket_timeout: float = 5.0, health_check: bool = True,
                 config: Settings | None = None, shared_by: int | None = None) -> Any:
    """The redis-py client of the store for ``url``: ``redis.Redis`` (one Redis, or the Sentinel
    master through a SentinelConnectionPool) or ``redis.cluster.RedisCluster``.

    ``retries``: connection and timeout errors are retried with exponential backoff (0: never).
    ``single_connection``: one connection for the whole client (not for a cluster, which keeps
    one pool per node). ``shared_by``: the client serves this many threads or greenlets at once (a
    worker on a threads, gevent or asyncio pool): one Redis, by TLS or a unix socket, gets a
    blocking pool of ``pool_size(shared_by)`` connections, which a caller waits for instead of
    failing with redis-py's "Too many connections" (its pools stop at 100 by default); a Sentinel
    master's pool and a cluster's node pools are allowed as many connections as callers.
    ``health_check``: PING a connection idle for 15 s before using it."""
    target = parse(url, config)
    warn_if_insecure(target, "the taskloop store")
    kwargs = _common_kwargs(target, socket_timeout)
    if target.kind == "cluster":
        seeds = list(dict.fromkeys([*target.hosts, *_CLUSTER_NODES.get(url, ())]))
        if shared_by:
            kwargs["max_connections"] = max(shared_by, 100)
        try:  # RedisCluster reads the slot map from a seed node at once (not lazily like redis.Redis)
            client = _cluster.RedisCluster(startup_nodes=[_cluster.ClusterNode(host, port) for host, port in seeds],
                                           retry=_retry(retries), **kwargs)
        except (rex.RedisError, rex.RedisClusterException) as exc:
            raise describe(exc, url) from exc
        _CLUSTER_NODES[url] = [(node.host, node.port) for node in client.get_nodes()]  # replicas too
        return client
    kwargs["db"] = target.db
    kwargs["retry"] = _retry(retries)
    kwargs["retry_on_error"] = [rex.ConnectionError, rex.TimeoutError]
    if health_check:
        kwargs["health_check_interval"] = HEALTH_CHECK_INTERVAL_S
    if target.kind == "sentinel":
        assert target.master is not None
        kwargs.pop("ssl", None)
        kwargs["connection_class"] = SentinelSSLConnection if target.tls else SentinelConnection
        if shared_by:
            kwargs["max_connections"] = max(shared_by, 100)
        sentinel_pool = _sentinel.SentinelConnectionPool(target.master, sentinel_manager(target, socket_timeout),
                                                         **kwargs)
        client = redis.Redis(connection_pool=sentinel_pool, single_connection_client=single_connection)
        client.auto_close_connection_pool = True  # the client owns its pool (as from_url's does)
        return client
    if target.kind == "unix":  # redis-py reads the socket path and ?db= itself
        kwargs.pop("socket_connect_timeout", None)
        kwargs.pop("socket_keepalive", None)
        kwargs.pop("socket_keepalive_options", None)
        kwargs.pop("db", None)
        unix_url = _strip_query(url, keep=("db",))
        if shared_by:
            shared = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
                unix_url, max_connections=pool_size(shared_by), timeout=socket_timeout, **kwargs))
            shared.auto_close_connection_pool = True
            return shared
        return redis.Redis.from_url(unix_url, single_connection_client=single_connection, **kwargs)
    host, port = target.hosts[0]
    pool_class = redis.BlockingConnectionPool if shared_by else redis.ConnectionPool
    sizing: dict[str, Any] = {"max_connections": pool_size(shared_by), "timeout": socket_timeout} if shared_by else {}
    pool = pool_class(
        host=host, port=port, connection_class=redis.SSLConnection if target.tls else redis.Connection, **sizing,
        **{name: value for name, value in kwargs.items() if name != "ssl"})
    client = redis.Redis(connection_pool=pool, single_connection_client=single_connection)
    client.auto_close_connection_pool = True
    return client


# an event loop's calls wait for one of these connections: a round trip holds one for well under a
# millisecond, and more connections would only queue the calls inside Redis instead
ASYNC_CONNECTIONS = 32


def async_store_client(url: str, *, socket_timeout: float = 5.0, config: Settings | None = None) -> Any | None:
    """An asyncio client (``redis.asyncio.Redis``) of one Redis for the store's URL, with the same
    credentials, TLS, database and timeouts as ``store_client``'s: what an event loop makes a
    phase's begin and commit with (store/aio.py). None for a Sentinel or a Cluster, whose calls the
    event loop makes on the sync client instead."""
    import redis.asyncio

    target = parse(url, config)
    if target.kind not in ("redis", "unix"):
        return None
    kwargs = _common_kwargs(target, socket_timeout)
    kwargs["retry"] = _async_retry()
    kwargs["retry_on_error"] = [rex.ConnectionError, rex.TimeoutError]
    kwargs["health_check_interval"] = HEALTH_CHECK_INTERVAL_S
    pool: Any
    if target.kind == "unix":
        for name in ("socket_connect_timeout", "socket_keepalive", "socket_keepalive_options"):
            kwargs.pop(name, None)
        pool = redis.asyncio.BlockingConnectionPool.from_url(_strip_query(url, keep=("db",)),
                                                             max_connections=ASYNC_CONNECTIONS, **kwargs)
    else:
        host, port = target.hosts[0]
        kwargs.pop("ssl", None)
        pool = redis.asyncio.BlockingConnectionPool(
            host=host, port=port, db=target.db, max_connections=ASYNC_CONNECTIONS,
            connection_class=redis.asyncio.SSLConnection if target.tls else redis.asyncio.Connection, **kwargs)
    client = redis.asyncio.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True
    return client


def _async_retry() -> Any:
    from redis.asyncio.retry import Retry as AsyncRetry

    return AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), 3)


def pool_size(callers: int) -> int:
    """The connections a store client shared by ``callers`` threads or greenlets keeps: a phase holds
    one for a round trip of well under a millisecond, then waits seconds on its callback, so a few
    dozen serve a thousand phases in flight."""
    return max(4, min(callers, 64))


def is_cluster(client: Any) -> bool:
    """Whether a store client is a RedisCluster (no EVALSHA in its pipelines, one pool per node)."""
    return isinstance(client, _cluster.RedisCluster)


def client_timeout(client: Any) -> float | None:
    """The socket timeout a store client was made with (redis.Redis or RedisCluster)."""
    value = client.get_connection_kwargs().get("socket_timeout")
    return None if value is None else float(value)


def disconnect(client: Any) -> None:
    """Drop every connection of a store client (a late reply must not be read by the next command)."""
    if isinstance(client, _cluster.RedisCluster):
        client.disconnect_connection_pools()
    else:
        client.connection_pool.disconnect()


def _strip_query(url: str, keep: tuple[str, ...] = ()) -> str:
    base, _, query = url.partition("?")
    kept = [(n, v) for n, v in parse_qsl(query, keep_blank_values=True) if n in keep]
    return base + ("?" + urlencode(kept) if kept else "")

"""The Celery broker: its settings for a URL (password, TLS, Sentinel as kombu expects them, and
taskloop's fixed kombu transport: taskloop/celery_fixes/transport.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from taskloop.base.errors import ConnectionConfigError
from taskloop.celery_fixes.transport import SENTINEL_TRANSPORT, TRANSPORT
from taskloop.connections.clients import KEEPALIVE_OPTIONS
from taskloop.connections.urls import SCHEMES, SOCKET_CONNECT_TIMEOUT_S, parse, warn_if_insecure

if TYPE_CHECKING:
    from taskloop.base.config import Settings


# How kombu's Redis transport notices a broker connection that hangs instead of failing (a
# black-holed network, a failover to another address): the user's broker_transport_options win.
# Without them a worker's main process waited forever in a synchronous command (an ack, a publish
# of its heartbeat) on a dead connection, consuming nothing, with every pool process idle, and
# kombu's own BRPOP check waited up to 51 s (docs/reliability.md, *Connections that hang*).
SOCKET_TIMEOUT_S = 5.0  # a command without a reply for this long fails: kombu reconnects
BROKER_HEALTH_CHECK_S = 5  # kombu: PING idle connections; drop a BRPOP or pub/sub connection silent this long


def hang_defaults(url: str) -> dict[str, Any]:
    """The transport options that make a dead Redis broker connection fail (none for other brokers)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES or SCHEMES[scheme][0] == "cluster":
        return {}
    options: dict[str, Any] = {"socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S,
                               "health_check_interval": BROKER_HEALTH_CHECK_S}
    if SCHEMES[scheme][0] != "unix":
        options.update(socket_keepalive=True, socket_keepalive_options=dict(KEEPALIVE_OPTIONS))
    return options


def _userinfo(username: str | None, password: str | None) -> str:
    if not username and not password:
        return ""
    return f"{quote(username or '', safe='')}:{quote(password or '', safe='')}@"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def broker_settings(url: str, config: Settings | None = None,
                    transport_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Celery settings for the broker at ``url``: ``broker_url`` (password in the user part,
    where kombu reads it), ``broker_use_ssl`` (verified unless opted out) and
    ``broker_transport_options`` (``transport_options`` plus Sentinel's ``master_name``).

    A URL of another broker (amqp://, sqs:// ...) is passed through untouched. A Redis Cluster
    URL is refused: kombu's Redis transport needs one Redis (or a Sentinel-managed master)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    options = dict(transport_options or {})
    if scheme not in SCHEMES or scheme == "unix":
        return {"broker_url": url, "broker_transport_options": options}
    target = parse(url, config)
    if target.kind == "cluster":
        raise ConnectionConfigError(
            f"the Celery broker cannot be a Redis Cluster ({target.redacted}): kombu's Redis transport "
            "needs one Redis. Set TASKLOOP_BROKER_URL to a plain Redis (redis://...) or a Sentinel "
            "(sentinel://...); the store (TASKLOOP_REDIS_URL) may stay on the cluster")
    warn_if_insecure(target, "the Celery broker")
    # kombu keeps no copy of a message a worker took (no unacked hash, no visibility timeout): the
    # store's records, leases and start notes are what keep a phase, and a worker gone silent has
    # what it held sent again from them (worker/recovery/orphans.py). Saves kombu's two transactions per message.
    options["ack_emulation"] = False
    out: dict[str, Any] = {"broker_transport_options": options}
    auth = _userinfo(target.username, target.password)
    if target.kind == "redis":
        host, port = target.hosts[0]
        out["broker_url"] = f"{'rediss' if target.tls else 'redis'}://{auth}{_host(host)}:{port}/{target.db}"
        out["broker_transport"] = TRANSPORT
    else:
        out["broker_transport"] = SENTINEL_TRANSPORT
        out["broker_url"] = ";".join(f"sentinel://{auth}{_host(host)}:{port}/{target.db}"
                                     for host, port in target.hosts)
        options["master_name"] = target.master
        sentinel_kwargs: dict[str, Any] = {**(options.get("sentinel_kwargs") or {}), **target.sentinel_kwargs()}
        if sentinel_kwargs:
            options["sentinel_kwargs"] = sentinel_kwargs
    if target.tls is not None:
        out["broker_use_ssl"] = target.tls.broker_use_ssl()
    return out

"""The one place that turns a URL into a Redis connection: the store's redis-py client and the
Celery broker's settings.

URLs (``user:password@`` and ``?password=`` are both accepted; passwords are percent-decoded)::

    redis://[[user]:password@]host[:port][/db]        one Redis
    rediss://...                                      one Redis over TLS (verified)
    sentinel://[[user]:password@]host:port[,host2:port2...][/db]?master=NAME
    redis+sentinel://...   rediss+sentinel://...      the same (rediss: TLS to master and sentinels)
    redis+cluster://[[user]:password@]host:port[,...] Redis Cluster (seed nodes), the store only
    rediss+cluster://...                              Redis Cluster over TLS
    unix:///path/to/redis.sock[?db=N]                 a local socket (passed to redis-py as is)

Query options: ``password``, ``username``, ``db``, ``ssl_ca_certs``, ``ssl_certfile``,
``ssl_keyfile``, ``ssl_cert_reqs`` (``required`` | ``none``), ``ssl_check_hostname``
(``true`` | ``false``), ``master`` (Sentinel; or ``TASKLOOP_SENTINEL_MASTER``),
``sentinel_username`` / ``sentinel_password`` (when the sentinels themselves require auth).
Anything else is refused, so that a misspelt option is not silently ignored.

TLS is verified by default, for the store and the broker alike: against ``ssl_ca_certs`` (or
``TASKLOOP_TLS_CA``), else the system's trust store. ``ssl_cert_reqs=none`` in the URL, or
``TASKLOOP_TLS_INSECURE=1``, turns verification off; every client made so logs a warning.

``redact(url)`` is the URL without its passwords, for logs and errors; ``describe(exc, url)``
turns a redis-py exception into taskloop's error with a message that says what to do.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl, quote, unquote, urlencode

import redis
import redis.cluster
import redis.exceptions as rex
import redis.sentinel
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from taskloop.errors import ConnectionConfigError, StoreAccessDenied, StoreUnavailable, TaskLoopError

if TYPE_CHECKING:
    from taskloop.config import Settings

log = logging.getLogger("taskloop.connections")

# redis-py's Sentinel and cluster classes are untyped: called through Any.
_sentinel: Any = redis.sentinel
_cluster: Any = redis.cluster

Kind = Literal["redis", "sentinel", "cluster", "unix"]

DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
SOCKET_CONNECT_TIMEOUT_S = 2.0
HEALTH_CHECK_INTERVAL_S = 15

_SCHEMES: dict[str, tuple[Kind, bool]] = {
    "redis": ("redis", False),
    "rediss": ("redis", True),
    "sentinel": ("sentinel", False),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "unix": ("unix", False),
}
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
_OPTIONS = frozenset({"password", "username", "db", "master", "master_name", "sentinel_username",
                      "sentinel_password", *_TLS_OPTIONS})
_SECRET_WORDS = ("password", "pass", "secret", "token")
_VERIFY = {"required": True, "cert_required": True, "optional": True, "cert_optional": True,
           "none": False, "cert_none": False}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


# --- parsed URLs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLS:
    """How to talk TLS to Redis. ``verify`` False is the explicit, logged opt-out."""

    verify: bool = True
    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    check_hostname: bool = True
    insecure_because: str = ""  # which setting turned verification off (for the warning)

    def redis_kwargs(self) -> dict[str, Any]:
        """redis-py connection arguments (Redis, ConnectionPool, Sentinel, RedisCluster)."""
        kwargs: dict[str, Any] = {
            "ssl_cert_reqs": "required" if self.verify else "none",
            "ssl_check_hostname": self.verify and self.check_hostname,
        }
        for name, value in (("ssl_ca_certs", self.ca_certs), ("ssl_certfile", self.certfile),
                            ("ssl_keyfile", self.keyfile)):
            if value:
                kwargs[name] = value
        return kwargs

    def broker_use_ssl(self) -> dict[str, Any]:
        """Celery's ``broker_use_ssl`` for kombu's Redis transport (the same redis-py arguments)."""
        kwargs = self.redis_kwargs()
        kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED if self.verify else ssl.CERT_NONE
        return kwargs


@dataclass(frozen=True)
class Target:
    """A parsed Redis URL. ``str()`` and ``repr()`` never show a password."""

    kind: Kind
    url: str = field(repr=False)
    hosts: tuple[tuple[str, int], ...] = ()
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: TLS | None = None
    master: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)

    @property
    def redacted(self) -> str:
        return redact(self.url)

    def __str__(self) -> str:
        return self.redacted

    def secrets(self) -> list[str]:
        return [s for s in (self.password, self.sentinel_password) if s]


def _flag(value: str | None) -> bool | None:
    if value is None or value.strip() == "":
        return None
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConnectionConfigError(f"expected true or false, got {value!r}")


def _split_host(text: str, default_port: int, url: str) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [::1]:6379
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = text.rpartition(":") if text.count(":") == 1 else (text, "", "")
    if not host:
        raise ConnectionConfigError(f"no host in {redact(url)}: use host:port")
    if not port_text:
        return unquote(host), default_port
    try:
        port = int(port_text)
    except ValueError:
        raise ConnectionConfigError(f"port {port_text!r} in {redact(url)} is not a number") from None
    if not 0 < port < 65536:
        raise ConnectionConfigError(f"port {port} in {redact(url)} is out of range")
    return unquote(host), port


def _parse_db(text: str, url: str) -> int:
    text = text.strip().strip("/")
    if text == "":
        return 0
    try:
        db = int(text)
    except ValueError:
        raise ConnectionConfigError(f"database {text!r} in {redact(url)} is not a number (use /0 ... /15)") from None
    if db < 0:
        raise ConnectionConfigError(f"database {db} in {redact(url)} must not be negative")
    return db


def _settings(config: Settings | None) -> Settings:
    if config is not None:
        return config
    from taskloop.config import settings

    return settings()


def parse(url: str, config: Settings | None = None) -> Target:
    """Parse a store or broker URL (see the module docstring); TLS and Sentinel defaults come
    from ``config`` (TASKLOOP_TLS_CA, TASKLOOP_TLS_INSECURE, TASKLOOP_SENTINEL_MASTER ...)."""
    if not isinstance(url, str) or "://" not in url:
        raise ConnectionConfigError(
            f"{redact(str(url))!r} is not a Redis URL: use redis://host:port/db, rediss://..., "
            "sentinel://host:port,host2:port2/db?master=NAME or redis+cluster://host:port")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme not in _SCHEMES:
        raise ConnectionConfigError(
            f"unsupported scheme {scheme!r} in {redact(url)}: use one of {', '.join(s + '://' for s in _SCHEMES)}")
    kind, tls_on = _SCHEMES[scheme]
    rest = rest.partition("#")[0]
    rest, _, query_text = rest.partition("?")
    query = dict(parse_qsl(query_text, keep_blank_values=True))
    unknown = sorted(set(query) - _OPTIONS)
    if unknown:
        raise ConnectionConfigError(
            f"unknown option(s) {', '.join(unknown)} in {redact(url)}; taskloop understands "
            f"{', '.join(sorted(_OPTIONS))}")
    if kind == "unix":
        if any(name in query for name in _TLS_OPTIONS):
            raise ConnectionConfigError(f"TLS options make no sense on a unix socket URL ({redact(url)})")
        return Target(kind="unix", url=url, db=_parse_db(query.get("db", ""), url),
                      password=query.get("password") or None)
    netloc, _, path = rest.partition("/")
    userinfo, _, hostlist = netloc.rpartition("@")
    username: str | None = None
    password: str | None = None
    if userinfo:
        user_text, has_password, password_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(password_text) if has_password else None
    if "password" in query:
        if password is not None and password != query["password"]:
            raise ConnectionConfigError(f"{redact(url)} has two different passwords (user part and ?password=)")
        password = query["password"]
    if "username" in query:
        if username is not None and username != query["username"]:
            raise ConnectionConfigError(f"{redact(url)} has two different user names")
        username = query["username"] or None
    default_port = DEFAULT_SENTINEL_PORT if kind == "sentinel" else DEFAULT_PORT
    hosts = tuple(_split_host(h, default_port, url) for h in hostlist.split(",") if h.strip())
    if not hosts:
        hosts = (("127.0.0.1", default_port),) if kind == "redis" else ()
    if not hosts:
        raise ConnectionConfigError(f"no host in {redact(url)}")
    if kind == "redis" and len(hosts) > 1:
        raise ConnectionConfigError(
            f"{redact(url)} names several hosts: use sentinel://... for Sentinel or redis+cluster://... for a cluster")
    db = _parse_db(query.get("db") or path, url)
    if kind == "cluster" and db != 0:
        raise ConnectionConfigError(f"Redis Cluster has only database 0; {redact(url)} asks for {db}")
    cfg = _settings(config)
    tls = _tls(url, query, cfg) if tls_on else None
    if not tls_on and any(name in query for name in _TLS_OPTIONS):
        raise ConnectionConfigError(
            f"TLS options given for a plain-text URL ({redact(url)}): use rediss://, rediss+sentinel:// "
            "or rediss+cluster://")
    master = None
    if kind == "sentinel":
        master = query.get("master") or query.get("master_name") or cfg.sentinel_master or None
        if not master:
            raise ConnectionConfigError(
                f"{redact(url)} does not name the Sentinel master: add ?master=NAME (the name in the "
                "sentinels' `sentinel monitor NAME ...`) or set TASKLOOP_SENTINEL_MASTER")
    elif any(name in query for name in ("master", "master_name", "sentinel_username", "sentinel_password")):
        raise ConnectionConfigError(f"Sentinel options in a URL that is not sentinel:// ({redact(url)})")
    return Target(kind=kind, url=url, hosts=hosts, db=db, username=username, password=password, tls=tls,
                  master=master, sentinel_username=query.get("sentinel_username") or None,
                  sentinel_password=query.get("sentinel_password") or None)


def _tls(url: str, query: Mapping[str, str], cfg: Settings) -> TLS:
    verify, because = True, ""
    if "ssl_cert_reqs" in query:  # the URL's own choice wins over the environment
        name = query["ssl_cert_reqs"].strip().lower()
        if name not in _VERIFY:
            raise ConnectionConfigError(
                f"ssl_cert_reqs={query['ssl_cert_reqs']!r} in {redact(url)}: use required or none")
        verify = _VERIFY[name]
        because = "" if verify else "ssl_cert_reqs=none in the URL"
    elif cfg.tls_insecure:
        verify, because = False, "TASKLOOP_TLS_INSECURE=1"
    try:
        check_hostname = _flag(query.get("ssl_check_hostname"))
    except ConnectionConfigError as exc:
        raise ConnectionConfigError(f"ssl_check_hostname in {redact(url)}: {exc}") from None
    return TLS(verify=verify, ca_certs=query.get("ssl_ca_certs") or cfg.tls_ca or None,
               certfile=query.get("ssl_certfile") or cfg.tls_cert or None,
               keyfile=query.get("ssl_keyfile") or cfg.tls_key or None,
               check_hostname=True if check_hostname is None else check_hostname, insecure_because=because)


def _warn_if_insecure(target: Target, what: str) -> None:
    if target.tls is not None and not target.tls.verify:
        log.warning("TLS certificate verification is OFF for %s at %s (%s): anything on the network path can "
                    "impersonate this Redis; use it only for tests, and give the CA instead (?ssl_ca_certs= or "
                    "TASKLOOP_TLS_CA)", what, target.redacted, target.tls.insecure_because)


# --- redaction --------------------------------------------------------------------------------------


def _is_secret(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def _redact_one(url: str) -> str:
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    rest, hash_, fragment = rest.partition("#")
    rest, question, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        # A lone userinfo (redis://word@host) is masked too: it is often a password written there.
        netloc = f"{user}:***@{hostlist}" if colon else f"***@{hostlist}"
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(name, "***" if _is_secret(name) else value) for name, value in pairs], safe="*/:,")
    return f"{scheme}://{netloc}{slash}{path}{question}{query}{hash_}{fragment}"


def redact(url: str) -> str:
    """The URL without its passwords (user part and query string), for errors and logs. Works on
    kombu's ``;``-separated failover lists, multi-host URLs and unparseable text; never raises."""
    try:
        return ";".join(_redact_one(part) for part in str(url).split(";"))
    except Exception:  # never let redaction itself leak or fail
        return "<unparseable URL>"


def _scrub(text: str, target: Target | None) -> str:
    for secret in (target.secrets() if target else ()):
        text = text.replace(secret, "***")
    return text


# --- the store's client -----------------------------------------------------------------------------


def _common_kwargs(target: Target, socket_timeout: float) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S,
        "socket_keepalive": True,
    }
    if target.username:
        kwargs["username"] = target.username
    if target.password:
        kwargs["password"] = target.password
    if target.tls is not None:
        kwargs["ssl"] = True
        kwargs.update(target.tls.redis_kwargs())
    return kwargs


def _retry(retries: int) -> Retry:
    return Retry(ExponentialBackoff(cap=2.0, base=0.05), retries) if retries > 0 else Retry(NoBackoff(), 0)


_DEMOTED = ("READONLY You can't write against a read only replica", "NOREPLICAS ")


def _demoted(exc: BaseException) -> bool:
    """A write refused because this Redis is (no longer) a master that may take it."""
    return any(text in str(exc) for text in _DEMOTED)


class SentinelConnection(redis.sentinel.SentinelManagedConnection):
    """redis-py's Sentinel-managed connection, with two gaps of redis-py 8.1 closed.

    1. A connection that was dropped (Sentinel kills the old master's clients when it turns it
       into a replica; a retry disconnects too) reconnects from ``send_packed_command`` through
       ``connect_check_health``, straight to its cached host and port: the old master. Only
       ``connect()`` asks Sentinel. A single-connection client (a worker's pool process) then
       stays on the demoted master for good. Here every reconnect asks Sentinel first.
    2. A write inside a script on a demoted master fails with ``ResponseError: Error running
       script ... -READONLY ...``, which is not the ReadOnlyError that makes redis-py re-ask
       Sentinel. Here it does, and the command is retried on the new master. So does NOREPLICAS
       (a master with ``min-replicas-to-write`` that lost its replicas: after a failover, the
       old master until Sentinel demotes it).
    (Checked by tests/connections/test_sentinel.py::test_redis_py_sentinel_reconnect_gap.)"""

    _address_fresh = False

    def connect_to(self, address: Any) -> None:
        self._address_fresh = True  # connect() just asked Sentinel
        try:
            super().connect_to(address)  # type: ignore[no-untyped-call]
        finally:
            self._address_fresh = False

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock is None and not self._address_fresh and self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health=check_health, retry_socket_connect=retry_socket_connect)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except rex.ResponseError as exc:
            if self.connection_pool.is_master and not isinstance(exc, rex.ReadOnlyError) and _demoted(exc):
                self.disconnect()  # type: ignore[no-untyped-call]
                raise rex.ConnectionError(f"this is no longer the master Sentinel gives ({exc})") from exc
            raise


class SentinelSSLConnection(SentinelConnection, redis.SSLConnection):
    """SentinelConnection over TLS."""


def sentinel_manager(target: Target, socket_timeout: float) -> Any:
    """A redis-py Sentinel over the URL's sentinels (their own auth and TLS as the URL says)."""
    sentinel_kwargs: dict[str, Any] = {"socket_timeout": socket_timeout,
                                       "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S}
    if target.sentinel_username:
        sentinel_kwargs["username"] = target.sentinel_username
    if target.sentinel_password:
        sentinel_kwargs["password"] = target.sentinel_password
    if target.tls is not None:
        sentinel_kwargs["ssl"] = True
        sentinel_kwargs.update(target.tls.redis_kwargs())
    return _sentinel.Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs)


def store_client(url: str, *, retries: int = 3, single_connection: bool = False,
                 socket_timeout: float = 5.0, health_check: bool = True,
                 config: Settings | None = None) -> Any:
    """The redis-py client of the store for ``url``: ``redis.Redis`` (one Redis, or the Sentinel
    master through a SentinelConnectionPool) or ``redis.cluster.RedisCluster``.

    ``retries``: connection and timeout errors are retried with exponential backoff (0: never).
    ``single_connection``: one connection for the whole client (not for a cluster, which keeps
    one pool per node). ``health_check``: PING a connection idle for 15 s before using it."""
    target = parse(url, config)
    _warn_if_insecure(target, "the taskloop store")
    kwargs = _common_kwargs(target, socket_timeout)
    if target.kind == "cluster":
        try:  # RedisCluster reads the slot map from a seed node at once (not lazily like redis.Redis)
            return _cluster.RedisCluster(
                startup_nodes=[_cluster.ClusterNode(host, port) for host, port in target.hosts],
                retry=_retry(retries), **kwargs)
        except (rex.RedisError, rex.RedisClusterException) as exc:
            raise describe(exc, url) from exc
    kwargs["db"] = target.db
    kwargs["retry"] = _retry(retries)
    kwargs["retry_on_error"] = [rex.ConnectionError, rex.TimeoutError]
    if health_check:
        kwargs["health_check_interval"] = HEALTH_CHECK_INTERVAL_S
    if target.kind == "sentinel":
        assert target.master is not None
        kwargs.pop("ssl", None)
        kwargs["connection_class"] = SentinelSSLConnection if target.tls else SentinelConnection
        sentinel_pool = _sentinel.SentinelConnectionPool(target.master, sentinel_manager(target, socket_timeout),
                                                         **kwargs)
        client = redis.Redis(connection_pool=sentinel_pool, single_connection_client=single_connection)
        client.auto_close_connection_pool = True  # the client owns its pool (as from_url's does)
        return client
    if target.kind == "unix":  # redis-py reads the socket path and ?db= itself
        kwargs.pop("socket_connect_timeout", None)
        kwargs.pop("socket_keepalive", None)
        kwargs.pop("db", None)
        return redis.Redis.from_url(_strip_query(url, keep=("db",)), single_connection_client=single_connection,
                                    **kwargs)
    host, port = target.hosts[0]
    pool = redis.ConnectionPool(
        host=host, port=port, connection_class=redis.SSLConnection if target.tls else redis.Connection,
        **{name: value for name, value in kwargs.items() if name != "ssl"})
    client = redis.Redis(connection_pool=pool, single_connection_client=single_connection)
    client.auto_close_connection_pool = True
    return client


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


# --- the broker's settings --------------------------------------------------------------------------


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
    if scheme not in _SCHEMES or scheme == "unix":
        return {"broker_url": url, "broker_transport_options": options}
    target = parse(url, config)
    if target.kind == "cluster":
        raise ConnectionConfigError(
            f"the Celery broker cannot be a Redis Cluster ({target.redacted}): kombu's Redis transport "
            "needs one Redis. Set TASKLOOP_BROKER_URL to a plain Redis (redis://...) or a Sentinel "
            "(sentinel://...); the store (TASKLOOP_REDIS_URL) may stay on the cluster")
    _warn_if_insecure(target, "the Celery broker")
    out: dict[str, Any] = {"broker_transport_options": options}
    auth = _userinfo(target.username, target.password)
    if target.kind == "redis":
        host, port = target.hosts[0]
        out["broker_url"] = f"{'rediss' if target.tls else 'redis'}://{auth}{_host(host)}:{port}/{target.db}"
    else:
        out["broker_url"] = ";".join(f"sentinel://{auth}{_host(host)}:{port}/{target.db}"
                                     for host, port in target.hosts)
        options["master_name"] = target.master
        sentinel_kwargs: dict[str, Any] = dict(options.get("sentinel_kwargs") or {})
        if target.sentinel_username:
            sentinel_kwargs["username"] = target.sentinel_username
        if target.sentinel_password:
            sentinel_kwargs["password"] = target.sentinel_password
        if target.tls is not None:
            sentinel_kwargs["ssl"] = True
            sentinel_kwargs.update(target.tls.redis_kwargs())
        if sentinel_kwargs:
            options["sentinel_kwargs"] = sentinel_kwargs
    if target.tls is not None:
        out["broker_use_ssl"] = target.tls.broker_use_ssl()
    return out


def same_redis(broker_url: str, store_url: str) -> bool:
    """Whether the broker is the very Redis (host, port, db, TLS or not) the store writes to, as
    the same ACL user (the outbox pushes the broker's messages with the store's connection).
    Never for Sentinel or Cluster, nor for a URL that does not parse."""
    try:
        broker, store = parse(broker_url), parse(store_url)
    except (ConnectionConfigError, ValueError):
        return False
    if broker.kind != "redis" or store.kind != "redis":
        return False
    def where(t: Target) -> tuple[Any, ...]:
        return (t.hosts, t.db, t.tls is None, t.username or "default")
    return where(broker) == where(store)


# --- errors -----------------------------------------------------------------------------------------

# What RedisStore should turn into taskloop errors (through describe). Not ResponseError at large
# (a script's own error is a bug to see), nor RedisClusterException at large (redis-py raises it
# for misuse too, such as a blocked pipeline command).
STORE_ERRORS: tuple[type[BaseException], ...] = (
    rex.ConnectionError, rex.TimeoutError, rex.NoPermissionError, rex.ReadOnlyError, rex.ClusterDownError,
    rex.TryAgainError, rex.SlotNotCoveredError, rex.AuthenticationWrongNumberOfArgsError,
)

_UNREACHABLE_HINT = "check that redis-server is running and that TASKLOOP_REDIS_URL points at it"


# How Redis refuses a command to an ACL user inside a script (a plain ResponseError, not NOPERM).
_SCRIPT_DENIED = ("can't run this command", "no permissions to access")


def denied_in_script(exc: BaseException) -> bool:
    """A script stopped because its ACL user may not run one of its commands or touch one of its keys."""
    return isinstance(exc, rex.ResponseError) and any(text in str(exc) for text in _SCRIPT_DENIED)


def _tls_failure(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            break
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def describe(exc: BaseException, url: str, variable: str = "TASKLOOP_REDIS_URL") -> TaskLoopError:
    """The taskloop error for a redis-py exception met while talking to ``url`` (redacted, and
    any password scrubbed from the exception's own text).

    StoreAccessDenied: wrong password, unknown or disabled user, NOPERM. StoreUnavailable:
    unreachable, timed out, loading, TLS certificate not verified, Sentinel without that master,
    cluster down, read-only replica."""
    try:
        target: Target | None = parse(url)
    except (ConnectionConfigError, ValueError):
        target = None
    where = redact(url)
    detail = _scrub(str(exc), target) or type(exc).__name__
    user = (target.username if target else None) or "default"
    if isinstance(exc, (rex.AuthenticationError, rex.AuthorizationError, rex.AuthenticationWrongNumberOfArgsError)):
        return StoreAccessDenied(
            f"Redis at {where} refused taskloop's credentials ({detail}); check the user name and password in "
            f"{variable} (redis://USER:PASSWORD@host:port/db, or ?password=) and that the ACL user exists and is on")
    if isinstance(exc, rex.NoPermissionError) or denied_in_script(exc):
        return StoreAccessDenied(
            f"Redis at {where} does not let ACL user {user!r} do this ({detail}); grant it taskloop's "
            "commands and keys (see docs/operations.md, 'ACL'), e.g. ACL SETUSER "
            f"{user} ~tl:* +@read +@write +@scripting +@connection +@transaction")
    if isinstance(exc, rex.ConnectionError) and _tls_failure(exc):
        return StoreUnavailable(
            f"cannot verify the TLS certificate of Redis at {where} ({detail}); give the CA that signed it "
            "with ?ssl_ca_certs=/path/ca.pem in the URL or TASKLOOP_TLS_CA (a test setup may opt out with "
            "TASKLOOP_TLS_INSECURE=1)")
    if isinstance(exc, rex.ResponseError) and "NOREPLICAS" in str(exc):
        return StoreUnavailable(
            f"Redis at {where} refuses writes: it has fewer replicas in sync than its min-replicas-to-write "
            f"({detail}); check the replicas, or a failover in progress")
    if isinstance(exc, rex.ReadOnlyError) or (isinstance(exc, rex.ResponseError) and _demoted(exc)):
        return StoreUnavailable(
            f"Redis at {where} is a read-only replica ({detail}); point {variable} at the master, or use "
            "sentinel://...?master=NAME so that taskloop follows failovers")
    if target is not None and target.kind == "sentinel" and isinstance(exc, rex.ConnectionError) \
            and type(exc).__name__ in ("MasterNotFoundError", "SlaveNotFoundError"):
        return StoreUnavailable(
            f"no Redis Sentinel at {where} gives a master named {target.master!r} ({detail}); check the "
            "master name (?master= or TASKLOOP_SENTINEL_MASTER) and that the sentinels are running")
    if isinstance(exc, rex.RedisClusterException) and "cannot be connected" in str(exc):
        return StoreUnavailable(
            f"cannot reach the Redis Cluster at {where} ({detail}); check that its nodes are running and that "
            f"{variable} names at least one of them")
    if isinstance(exc, (rex.ClusterDownError, rex.TryAgainError, rex.RedisClusterException)):
        return StoreUnavailable(
            f"the Redis Cluster at {where} cannot serve taskloop now ({detail}); check that every slot is "
            f"covered (redis-cli --cluster check) and that {variable} names reachable nodes")
    if isinstance(exc, (rex.ConnectionError, rex.TimeoutError)):
        return StoreUnavailable(f"cannot reach Redis at {where} ({detail}); {_UNREACHABLE_HINT}")
    return StoreUnavailable(f"Redis at {where} answered with an error ({detail})")

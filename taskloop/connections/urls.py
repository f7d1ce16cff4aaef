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
from urllib.parse import parse_qsl, unquote, urlencode

from taskloop.base.errors import ConnectionConfigError

if TYPE_CHECKING:
    from taskloop.base.config import Settings

log = logging.getLogger("taskloop.connections")

Kind = Literal["redis", "sentinel", "cluster", "unix"]

DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
SOCKET_CONNECT_TIMEOUT_S = 2.0
HEALTH_CHECK_INTERVAL_S = 15

SCHEMES: dict[str, tuple[Kind, bool]] = {
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

    def auth_kwargs(self) -> dict[str, Any]:
        """redis-py's arguments for the Redis itself: user, password and TLS."""
        return credentials(self.username, self.password, self.tls)

    def sentinel_kwargs(self) -> dict[str, Any]:
        """How to talk to the sentinels themselves: their own user, password, and the URL's TLS."""
        return credentials(self.sentinel_username, self.sentinel_password, self.tls)


def credentials(username: str | None, password: str | None, tls: TLS | None) -> dict[str, Any]:
    """redis-py connection arguments for a user, a password and TLS (each only when given)."""
    found: dict[str, Any] = {}
    if username:
        found["username"] = username
    if password:
        found["password"] = password
    if tls is not None:
        found["ssl"] = True
        found.update(tls.redis_kwargs())
    return found


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
    from taskloop.base.config import settings

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
    if scheme not in SCHEMES:
        raise ConnectionConfigError(
            f"unsupported scheme {scheme!r} in {redact(url)}: use one of {', '.join(s + '://' for s in SCHEMES)}")
    kind, tls_on = SCHEMES[scheme]
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


def warn_if_insecure(target: Target, what: str) -> None:
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


def scrub(text: str, target: Target | None) -> str:
    for secret in (target.secrets() if target else ()):
        text = text.replace(secret, "***")
    return text


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

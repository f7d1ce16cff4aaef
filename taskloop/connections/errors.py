"""redis-py's exceptions as taskloop's errors, with messages that say what to do."""

from __future__ import annotations

import ssl

import redis.exceptions as rex

from taskloop.base.errors import ConnectionConfigError, StoreAccessDenied, StoreUnavailable, TaskLoopError
from taskloop.connections.urls import Target, parse, redact, scrub

_DEMOTED = ("READONLY You can't write against a read only replica", "NOREPLICAS ")


def demoted(exc: BaseException) -> bool:
    """A write refused because this Redis is (no longer) a master that may take it."""
    return any(text in str(exc) for text in _DEMOTED)


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
    detail = scrub(str(exc), target) or type(exc).__name__
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
    # (RedisClusterException: no seed of a cluster could be reached, here because of its certificate)
    if isinstance(exc, (rex.ConnectionError, rex.RedisClusterException)) and _tls_failure(exc):
        return StoreUnavailable(
            f"cannot verify the TLS certificate of Redis at {where} ({detail}); give the CA that signed it "
            "with ?ssl_ca_certs=/path/ca.pem in the URL or TASKLOOP_TLS_CA (a test setup may opt out with "
            "TASKLOOP_TLS_INSECURE=1)")
    if isinstance(exc, rex.ResponseError) and "NOREPLICAS" in str(exc):
        return StoreUnavailable(
            f"Redis at {where} refuses writes: it has fewer replicas in sync than its min-replicas-to-write "
            f"({detail}); check the replicas, or a failover in progress")
    if isinstance(exc, rex.ReadOnlyError) or (isinstance(exc, rex.ResponseError) and demoted(exc)):
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

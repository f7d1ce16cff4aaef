"""How every store method meets a failure to reach Redis: ``wrap`` turns it into StoreUnavailable,
a refusal of the credentials or the ACL into StoreAccessDenied (connections/errors.py), with the
URL redacted. A script's own error is a bug and is raised as it is.

On a Redis Cluster, ``wrap`` also gives a call the time a single Redis gives it: redis-py 8.1's
RedisCluster retries a command or pipeline refused by a dead node (ConnectionError, CLUSTERDOWN)
at once, with no backoff, so its retries are spent in milliseconds while the cluster is still
promoting the dead master's replica (seconds: ``cluster-node-timeout`` plus an election). ``wrap``
retries such a call with the store's own backoff (the client's retry count, 0.1 s doubling to
2 s: about 13 s for a worker's 10 retries), so that a failover is ridden out as a Redis restart is."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import redis

from taskloop.connections import clients, errors

P = ParamSpec("P")
T = TypeVar("T")

# What wrap looks at: the errors of reaching Redis, and script errors (only an ACL refusal is turned
# into a taskloop error; any other script error is a bug, raised as it is).
_WRAPPED: tuple[type[BaseException], ...] = (*errors.STORE_ERRORS, redis.exceptions.ResponseError)
# What a cluster call is retried on with backoff (what redis-py's RedisCluster retries without any).
_CLUSTER_RETRY: tuple[type[BaseException], ...] = redis.cluster.RedisCluster.ERRORS_ALLOW_RETRY
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.05, 2.0  # as the store's single-Redis client (connections/clients.py)


def _cluster_retries(store: Any) -> int:
    """How many more times to try a store call that failed on a cluster (0: not a cluster)."""
    client = getattr(store, "client", None)
    if client is None or not clients.is_cluster(client):
        return 0
    return int(client.retry.get_retries())


def wrap(fn: Callable[P, T]) -> Callable[P, T]:
    """For a method of an object with a ``url`` (the store)."""
    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return _with_cluster_backoff(fn, args, kwargs)
        except _WRAPPED as exc:
            if isinstance(exc, redis.exceptions.ResponseError) and not isinstance(exc, errors.STORE_ERRORS) \
                    and not errors.denied_in_script(exc):
                raise  # a script's own error: a bug to see as it is
            url = getattr(args[0], "url")  # noqa: B009 - the store's, whichever class it is
            # StoreUnavailable (unreachable, timeout, TLS not verified, ...) or StoreAccessDenied
            # (wrong password, unknown ACL user, NOPERM, a command the ACL user may not run in a
            # script), with the URL redacted.
            raise errors.describe(exc, url) from exc
    return call


def _with_cluster_backoff(fn: Callable[P, T], args: Any, kwargs: Any) -> T:
    retries = _cluster_retries(args[0]) if args else 0
    failures = 0
    while True:
        try:
            return fn(*args, **kwargs)
        except _CLUSTER_RETRY:
            failures += 1
            if failures > retries:
                raise
            time.sleep(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** failures))

"""redis-py's Sentinel-managed connection, with two gaps of redis-py closed (a subclass, given to
redis-py's SentinelConnectionPool as its ``connection_class``: redis-py's own extension point).

Checked against redis-py 8.1.0 (``tests/connections/test_sentinel.py`` shows both gaps on the
plain class). The upstream report is in docs/upstream.md."""

from __future__ import annotations

from typing import Any

import redis
import redis.exceptions as rex
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

from taskloop.connections.errors import demoted


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
            if self.connection_pool.is_master and not isinstance(exc, rex.ReadOnlyError) and demoted(exc):
                self.disconnect()  # type: ignore[no-untyped-call]
                raise rex.ConnectionError(f"this is no longer the master Sentinel gives ({exc})") from exc
            raise


class SentinelSSLConnection(SentinelConnection, redis.SSLConnection):
    """SentinelConnection over TLS."""


class SentinelManager(redis.sentinel.Sentinel):
    """redis-py's Sentinel, whose "no master found" keeps why each sentinel could not be asked.

    redis-py 8.1's ``discover_master`` reports an unreachable sentinel as the repr of its client
    and ``ConnectionError()``, dropping the reason: a sentinel whose TLS certificate is not
    verified (a wrong CA) read as "no master named ...", and only after redis-py's default retries
    of every sentinel (seconds each). Here the error says, per sentinel,
    ``host:port - reason``, and is raised from the last sentinel's error, so that a TLS failure
    is described as one (connections/errors.py looks at the cause)."""

    def __init__(self, sentinels: list[tuple[str, int]], **kwargs: Any) -> None:
        # A sentinel that cannot be reached is not retried (redis-py's default for a client is 3
        # retries with a backoff from 1 s, seconds per dead sentinel): the next one is asked at once.
        kwargs["sentinel_kwargs"] = {"retry": Retry(NoBackoff(), 0), **(kwargs.get("sentinel_kwargs") or {})}
        super().__init__(sentinels, **kwargs)  # type: ignore[no-untyped-call]

    def discover_master(self, service_name: str) -> tuple[str, int]:
        collected: list[str] = []
        last: BaseException | None = None
        for number, sentinel in enumerate(self.sentinels):
            try:
                masters: Any = sentinel.sentinel_masters()
            except (rex.ConnectionError, rex.TimeoutError) as exc:
                where = sentinel.connection_pool.connection_kwargs
                collected.append(f"{where.get('host')}:{where.get('port')} - {exc}")
                last = exc
                continue
            state = masters.get(service_name)
            if state and self.check_master_state(state, service_name):  # type: ignore[no-untyped-call]
                self.sentinels[0], self.sentinels[number] = sentinel, self.sentinels[0]
                ip = self._force_master_ip if self._force_master_ip is not None else state["ip"]
                return ip, state["port"]
        info = f" : {', '.join(collected)}" if collected else ""
        raise redis.sentinel.MasterNotFoundError(f"No master found for {service_name!r}{info}") from last

"""The Redis store: snapshots of a run, guarded batch writes (cas.lua), events and indexes."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, ParamSpec, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from taskloop.errors import CorruptRecord, StoreUnavailable
from taskloop.events import Event
from taskloop.phases import TaskRecord
from taskloop.store import keys as k
from taskloop.store.batch import Batch

P = ParamSpec("P")
T = TypeVar("T")


def redact(url: str) -> str:
    """The URL without its password, for error messages and logs."""
    parts = urlsplit(url)
    if parts.password:
        host = parts.hostname or ""
        netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def load_script(name: str) -> str:
    return resources.files("taskloop.store").joinpath("lua", f"{name}.lua").read_text()


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


@dataclass
class Snapshot:
    """What one read of a run returns: the run hash, the raw task records and some data fields."""

    run_id: str
    run: dict[str, str]
    raw_tasks: dict[str, str]
    data: dict[str, str | None] = field(default_factory=dict)
    _tasks: dict[str, TaskRecord] = field(default_factory=dict)

    def task(self, key: str) -> TaskRecord:
        record = self._tasks.get(key)
        if record is None:
            try:
                record = self._tasks[key] = TaskRecord.load(self.raw_tasks[key])
            except ValueError as exc:  # pydantic's ValidationError is a ValueError
                raise CorruptRecord(self.run_id, key, str(exc).splitlines()[0]) from None
        return record

    def tasks(self) -> dict[str, TaskRecord]:
        return {key: self.task(key) for key in self.raw_tasks}

    @property
    def control(self) -> str | None:
        """None while the run may progress; "cancel:<reason>" or "stop:<reason>" once it may not."""
        return self.run.get("ctl")


@dataclass(frozen=True)
class Conflict:
    """A batch was refused: guard ``label`` no longer held (``current`` is what the store has)."""

    index: int
    label: str
    current: str | None


# A blocking read (BLMOVE, XREAD BLOCK) gets this much more socket time than it blocks for, so a
# reply that arrives a moment late is never mistaken for Redis being down.
BLOCK_MARGIN_S = 10.0
SOCKET_TIMEOUT_S = 5.0


class RedisStore:
    """Talks to Redis for one process. Every failure to reach Redis becomes StoreUnavailable."""

    def __init__(self, url: str, *, retries: int = 3, client: redis.Redis | None = None,
                 single_connection: bool = False) -> None:
        """``single_connection``: one connection for the whole process (a worker's pool process,
        which makes its calls one after another) instead of a connection pool."""
        self.url = url
        # Any: redis-py types every reply as a sync/async union; the shapes are checked by the tests.
        self.client: Any = client or redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=2,
            socket_keepalive=True,
            health_check_interval=15,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
            retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
            single_connection_client=single_connection,
        )
        self._blocking: Any = None  # a client for blocking reads, made on first use
        self._cas = self.client.register_script(load_script("cas"))
        self._snapshot = self.client.register_script(load_script("snapshot"))
        self._begin = self.client.register_script(load_script("begin"))

    @staticmethod
    def _wrap(fn: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return fn(*args, **kwargs)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                    redis.exceptions.BusyLoadingError) as exc:
                self = args[0]
                assert isinstance(self, RedisStore)
                raise StoreUnavailable(
                    f"cannot reach Redis at {redact(self.url)} ({exc}); check that redis-server is "
                    "running and that TASKLOOP_REDIS_URL points at it"
                ) from exc
        return call

    # reads ----------------------------------------------------------------------------------
    @_wrap
    def snapshot(self, run_id: str, data_fields: Sequence[str] = ()) -> Snapshot | None:
        keys = k.RunKeys.of(run_id)
        run, tasks, data = self._snapshot(keys=[keys.run, keys.tasks, keys.data], args=list(data_fields))
        if not run:
            return None
        return Snapshot(run_id, _pairs(run), _pairs(tasks), dict(zip(data_fields, data, strict=True)))

    @_wrap
    def snapshot_with_values(self, run_id: str) -> Snapshot | None:
        """A snapshot whose data holds every task's value field (what a result needs)."""
        keys = k.RunKeys.of(run_id)
        run, tasks, data = self._snapshot(keys=[keys.run, keys.tasks, keys.data], args=["*values"])
        if not run:
            return None
        fields = [k.value_field(key) for key in tasks[::2]]
        return Snapshot(run_id, _pairs(run), _pairs(tasks), dict(zip(fields, data, strict=True)))

    @_wrap
    def snapshot_with_lease(self, run_id: str, key: str) -> tuple[Snapshot | None, float | None]:
        """A snapshot and the lease of one task, read together (their versions agree)."""
        keys = k.RunKeys.of(run_id)
        reply = self._snapshot(keys=[keys.run, keys.tasks, keys.data, keys.leases],
                               args=["*lease", k.lease_member(run_id, key)])
        if not reply[0]:
            return None, None
        lease = float(reply[3]) if reply[3] is not None else None
        return Snapshot(run_id, _pairs(reply[0]), _pairs(reply[1])), lease

    @_wrap
    def begin(self, run_id: str, key: str, round: int, phase: str, token: int, worker: str, now: float,
              lease_s: float, data_fields: Sequence[str] = ()) -> tuple[bool, Snapshot | None]:
        """Read the run and, if the scheduler prepared this phase's begin, begin it (begin.lua)."""
        keys = k.RunKeys.of(run_id)
        began, run, tasks, data = self._begin(
            keys=[keys.run, keys.tasks, keys.data, keys.events, keys.leases],
            args=[key, token, round, phase, worker, repr(now), lease_s, *data_fields],
        )
        if not run:
            return False, None
        return bool(began), Snapshot(run_id, _pairs(run), _pairs(tasks), dict(zip(data_fields, data, strict=True)))

    @_wrap
    def data(self, run_id: str, fields: Sequence[str]) -> list[str | None]:
        if not fields:
            return []
        return list(self.client.hmget(k.RunKeys.of(run_id).data, list(fields)))

    @_wrap
    def data_matching(self, run_id: str, prefix: str) -> dict[str, str]:
        """All data fields that start with ``prefix`` (HSCAN; used by inspect, not the hot path)."""
        return dict(self.client.hscan_iter(k.RunKeys.of(run_id).data, match=f"{prefix}*", count=500))

    @_wrap
    def run_fields(self, run_id: str, *fields: str) -> list[str | None]:
        return list(self.client.hmget(k.RunKeys.of(run_id).run, list(fields)))

    @_wrap
    def events(self, run_id: str, after: str | None = None, count: int | None = None) -> list[Event]:
        start = f"({after}" if after else "-"
        entries = self.client.xrange(k.RunKeys.of(run_id).events, start, "+", count=count)
        return [Event.from_stream(run_id, entry_id, fields) for entry_id, fields in entries]

    def _blocking_client(self, block_s: float) -> Any:
        """The client for blocking reads: its socket timeout outlasts the block by BLOCK_MARGIN_S, and
        it does not retry (a blocking read that timed out is answered by the caller, see below)."""
        needed = block_s + BLOCK_MARGIN_S
        if self._blocking is None or self._blocking.connection_pool.connection_kwargs["socket_timeout"] < needed:
            if self._blocking is not None:
                self._blocking.close()
            self._blocking = redis.Redis(connection_pool=redis.ConnectionPool.from_url(
                self.url, decode_responses=True, socket_timeout=needed, socket_connect_timeout=2,
                socket_keepalive=True))
        return self._blocking

    def _block(self, block_s: float, call: Callable[[Any], T], nothing: T) -> T:
        """Run one blocking read. A read that outlives its socket timeout is not Redis being down: the
        connection is dropped (a late reply must not be read by the next command) and the caller sees
        "nothing yet", then checks the run with an ordinary read."""
        client = self._blocking_client(block_s)
        try:
            return call(client)
        except redis.exceptions.TimeoutError:
            client.connection_pool.disconnect()
            return nothing

    @_wrap
    def block_events(self, run_id: str, last_id: str, block_ms: int) -> list[Event]:
        """Events after ``last_id``, waiting up to ``block_ms`` for the first one (XREAD BLOCK)."""
        stream = k.RunKeys.of(run_id).events
        reply: Any = self._block(block_ms / 1000.0, lambda c: c.xread({stream: last_id}, block=max(block_ms, 1)), [])
        if not reply:
            return []
        return [Event.from_stream(run_id, entry_id, fields) for entry_id, fields in reply[0][1]]

    @_wrap
    def block_end(self, run_id: str, block_ms: int) -> bool:
        """Wait up to ``block_ms`` for the run's end marker; True once the run has ended.

        The marker is a one-element list that BLMOVE rotates onto itself, so any number of
        waiters see it without taking it away."""
        end = k.RunKeys.of(run_id).end
        timeout = max(block_ms, 1) / 1000.0
        return self._block(timeout, lambda c: c.blmove(end, end, timeout, "LEFT", "RIGHT"), None) is not None

    @_wrap
    def run_ids(self, limit: int, offset: int = 0) -> list[str]:
        return list(self.client.zrevrange(k.RUNS_INDEX, offset, offset + limit - 1))

    @_wrap
    def run_hashes(self, run_ids: Iterable[str]) -> list[dict[str, str]]:
        pipe = self.client.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.hgetall(k.RunKeys.of(run_id).run)
        return list(pipe.execute())

    @_wrap
    def forget_runs(self, run_ids: Sequence[str]) -> None:
        if run_ids:
            self.client.zrem(k.RUNS_INDEX, *run_ids)

    @_wrap
    def expired_leases(self, now: float, limit: int = 500) -> list[tuple[str, str, float]]:
        rows = self.client.zrangebyscore(k.LEASES, "-inf", now, start=0, num=limit, withscores=True)
        return [(*k.parse_lease_member(member), score) for member, score in rows]

    @_wrap
    def lease_expiry(self, run_id: str, key: str) -> float | None:
        score = self.client.zscore(k.LEASES, k.lease_member(run_id, key))
        return None if score is None else float(score)

    @_wrap
    def stats(self) -> dict[str, str]:
        return dict(self.client.hgetall(k.STATS))

    # writes ---------------------------------------------------------------------------------
    @_wrap
    def apply(self, batch: Batch) -> Conflict | None:
        """Run the batch atomically. None when it was applied, else the first guard that failed."""
        reply = self._cas(keys=batch.keys.all(), args=batch.argv())
        if reply[0] == 1:
            return None
        index = int(reply[1])
        return Conflict(index, batch.labels[index - 1], reply[2] if len(reply) > 2 else None)

    @_wrap
    def incr_stat(self, name: str, amount: int = 1, run_id: str | None = None) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hincrby(k.STATS, name, amount)
        if run_id is not None:
            pipe.hincrby(k.RunKeys.of(run_id).run, f"stat:{name}", amount)
        pipe.execute()

    @_wrap
    def incr_usage(self, run_id: str, counts: dict[str, int]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, amount in counts.items():
            if amount:
                pipe.hincrby(k.RunKeys.of(run_id).run, f"u:{name}", amount)
        pipe.execute()

    def close(self) -> None:
        self.client.close()
        if self._blocking is not None:
            self._blocking.close()

    @staticmethod
    def decode_usage(run: dict[str, str]) -> dict[str, Any]:
        def n(name: str) -> int:
            return int(run.get(f"u:{name}", 0))
        return {"attempts": n("attempts"),
                "tokens": {"input": n("input"), "cached": n("cached"), "output": n("output")}}

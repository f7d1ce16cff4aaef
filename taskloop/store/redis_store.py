"""The Redis store: field reads of a run, the guarded batch write (cas.lua), the prepared begin
(begin.lua), events, the end marker, and the global indexes (written outside the run scripts)."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, ParamSpec, TypeVar

import redis

from taskloop import connections
from taskloop.connections import redact as redact  # re-exported: it used to live here
from taskloop.events import Event, from_entry, split_id
from taskloop.store import keys as k
from taskloop.store.batch import Batch
from taskloop.store.meta import Snapshot

P = ParamSpec("P")
T = TypeVar("T")

# A blocking read (BLMOVE, XREAD BLOCK) gets this much more socket time than it blocks for, so a
# reply that arrives a moment late is never mistaken for Redis being down.
BLOCK_MARGIN_S = 10.0
SOCKET_TIMEOUT_S = 5.0
EVENTS_MAXLEN = 100_000  # per run; XADD MAXLEN ~ trims beyond it (TASKLOOP_EVENTS_MAXLEN)


def load_script(name: str) -> str:
    return resources.files("taskloop.store").joinpath("lua", f"{name}.lua").read_text()


class _Script:
    """A Lua script by the name Redis gives it (the SHA-1 of its source)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


@dataclass(frozen=True)
class Conflict:
    """A batch was refused: guard ``label`` no longer held (``current`` is what the store has)."""

    index: int
    label: str
    field: str
    current: str | None


@dataclass(frozen=True)
class Applied:
    """A batch was applied; ``finished``: it ended the run (n:open reached 0)."""

    finished: bool


@dataclass(frozen=True)
class BeginReply:
    """What begin.lua did: ``began`` the prepared phase (values[0] is then the running record), or
    only read the asked-for fields for the caller to decide on."""

    began: bool
    fields: dict[str, str | None]


# What _wrap looks at: the errors of reaching Redis, and script errors (only an ACL refusal is turned
# into a taskloop error; any other script error is a bug, raised as it is).
_WRAPPED: tuple[type[BaseException], ...] = (*connections.STORE_ERRORS, redis.exceptions.ResponseError)


class RedisStore:
    """Talks to Redis for one process. Every failure to reach Redis becomes StoreUnavailable, a refusal
    of its credentials or ACL StoreAccessDenied (connections.describe)."""

    def __init__(self, url: str, *, retries: int = 3, client: redis.Redis | None = None,
                 single_connection: bool = False, events_maxlen: int = EVENTS_MAXLEN) -> None:
        """``single_connection``: one connection for the whole process (a worker's pool process,
        which makes its calls one after another) instead of a connection pool."""
        self.url = url
        self.events_maxlen = events_maxlen
        # Any: redis-py types every reply as a sync/async union; the shapes are checked by the tests.
        # redis.Redis (one Redis, or the Sentinel master) or redis.cluster.RedisCluster: see connections.py.
        self.client: Any = client or connections.store_client(
            url, retries=retries, single_connection=single_connection, socket_timeout=SOCKET_TIMEOUT_S)
        self._blocking: Any = None  # a client for blocking reads, made on first use
        self._scripts = {name: _Script(load_script(name)) for name in ("cas", "begin")}

    @staticmethod
    def _wrap(fn: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(fn)
        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            try:
                return fn(*args, **kwargs)
            except _WRAPPED as exc:
                if isinstance(exc, redis.exceptions.ResponseError) and not isinstance(exc, connections.STORE_ERRORS) \
                        and not connections.denied_in_script(exc):
                    raise  # a script's own error: a bug to see as it is
                self = args[0]
                assert isinstance(self, RedisStore)
                # StoreUnavailable (unreachable, timeout, TLS not verified, ...) or StoreAccessDenied
                # (wrong password, unknown ACL user, NOPERM, a command the ACL user may not run in a
                # script), with the URL redacted.
                raise connections.describe(exc, self.url) from exc
        return call

    # reads of one run -----------------------------------------------------------------------
    @_wrap
    def hmget(self, run_id: str, fields: Sequence[str]) -> list[str | None]:
        if not fields:
            return []
        return list(self.client.hmget(k.RunKeys.of(run_id).run, list(fields)))

    def snapshot(self, run_id: str, fields: Iterable[str] = ()) -> Snapshot:
        """A snapshot of the run that loads further fields on demand (check ``.exists``)."""
        snap = Snapshot(run_id, loader=lambda names: self.hmget(run_id, names))
        snap.ensure([k.F_WORKFLOW, *fields])
        return snap

    @_wrap
    def scan_fields(self, run_id: str, prefix: str) -> dict[str, str]:
        """Every hash field that starts with ``prefix`` (HSCAN: inspect and results, not the hot path)."""
        return dict(self.client.hscan_iter(k.RunKeys.of(run_id).run, match=f"{prefix}*", count=1000))

    @_wrap
    def all_fields(self, run_id: str) -> dict[str, str]:
        """The whole run hash (inspect of one run)."""
        return dict(self.client.hgetall(k.RunKeys.of(run_id).run))

    @_wrap
    def begin(self, run_id: str, key: str, round: int, phase: str, token: int, worker_json: str, now: float,
              fields: Sequence[str]) -> BeginReply:
        """Begin the phase the scheduler prepared (begin.lua), or read ``fields`` for the caller."""
        keys = k.RunKeys.of(run_id)
        began, values, more_names, more = self._call("begin", [keys.run, keys.leases],
                                                     [key, token, round, phase, worker_json, repr(now), *fields])
        found = dict(zip(more_names, more, strict=True))
        found.update(zip(fields, values, strict=True))
        return BeginReply(bool(began), found)

    @_wrap
    def leases(self, run_id: str, until: float, limit: int = 100) -> list[tuple[str, float]]:
        """The run's leases that expire by ``until``, earliest first."""
        rows = self.client.zrangebyscore(k.RunKeys.of(run_id).leases, "-inf", until, start=0, num=limit,
                                         withscores=True)
        return [(member, float(score)) for member, score in rows]

    @_wrap
    def lease_of(self, run_id: str, key: str) -> float | None:
        score = self.client.zscore(k.RunKeys.of(run_id).leases, key)
        return None if score is None else float(score)

    @_wrap
    def first_lease(self, run_id: str) -> float | None:
        rows = self.client.zrange(k.RunKeys.of(run_id).leases, 0, 0, withscores=True)
        return float(rows[0][1]) if rows else None

    @_wrap
    def events(self, run_id: str, after: str | None = None) -> list[Event]:
        """The run's events in order; with ``after`` (an event id), only the later ones."""
        if after is None:
            entries = self.client.xrange(k.RunKeys.of(run_id).events, "-", "+")
            return [e for entry_id, fields in entries for e in from_entry(run_id, entry_id, fields)]
        entry, index = split_id(after)
        entries = self.client.xrange(k.RunKeys.of(run_id).events, entry, "+")
        found = [e for entry_id, fields in entries for e in from_entry(run_id, entry_id, fields)]
        return [e for e in found if e.entry_id != entry or split_id(e.id or "")[1] > index]

    def _blocking_client(self, block_s: float) -> Any:
        """The client for blocking reads: its socket timeout outlasts the block by BLOCK_MARGIN_S, and
        it does not retry (a blocking read that timed out is answered by the caller, see below)."""
        needed = block_s + BLOCK_MARGIN_S
        if self._blocking is None or (connections.client_timeout(self._blocking) or 0.0) < needed:
            if self._blocking is not None:
                self._blocking.close()
            self._blocking = connections.store_client(self.url, retries=0, socket_timeout=needed, health_check=False)
        return self._blocking

    def _block(self, block_s: float, call: Callable[[Any], T], nothing: T) -> T:
        """Run one blocking read. A read that outlives its socket timeout is not Redis being down: the
        connection is dropped (a late reply must not be read by the next command) and the caller sees
        "nothing yet", then checks the run with an ordinary read."""
        client = self._blocking_client(block_s)
        try:
            return call(client)
        except redis.exceptions.TimeoutError:
            connections.disconnect(client)  # redis.Redis or RedisCluster
            return nothing

    @_wrap
    def block_events(self, run_id: str, last_entry: str, block_ms: int) -> list[Event]:
        """Events of the entries after stream entry ``last_entry`` ("0-0": from the start), waiting
        up to ``block_ms`` for the first one (XREAD BLOCK)."""
        stream = k.RunKeys.of(run_id).events
        reply: Any = self._block(block_ms / 1000.0,
                                 lambda c: c.xread({stream: last_entry}, block=max(block_ms, 1)), [])
        if not reply:
            return []
        return [e for entry_id, fields in reply[0][1] for e in from_entry(run_id, entry_id, fields)]

    @_wrap
    def block_end(self, run_id: str, block_ms: int) -> bool:
        """Wait up to ``block_ms`` for the run's end marker; True once the run has ended.

        The marker is a one-element list that BLMOVE rotates onto itself, so any number of
        waiters see it without taking it away."""
        end = k.RunKeys.of(run_id).end
        timeout = max(block_ms, 1) / 1000.0
        return self._block(timeout, lambda c: c.blmove(end, end, timeout, "LEFT", "RIGHT"), None) is not None

    # writes of one run ----------------------------------------------------------------------
    @_wrap
    def apply(self, batch: Batch) -> Conflict | Applied:
        """Run the batch atomically: Applied, or the first guard that failed (nothing written)."""
        args: list[str | int] = [*batch.argv(), self.events_maxlen]
        if batch.indexes or batch.stats:
            pipe = self.client.pipeline(transaction=False)
            for key, member, score in batch.indexes:
                pipe.zadd(key, {member: score}, nx=key == k.RUNS_INDEX)  # a run keeps its creation time
            for name, amount in batch.stats.items():  # (counted before the write: a repeated start counts too)
                pipe.hincrby(k.STATS, name, amount)
            keys = batch.all_keys()
            if connections.is_cluster(self.client):
                # Redis Cluster: these keys live in other slots (other nodes), and redis-py's cluster
                # pipeline refuses EVALSHA: send them first, then run the script on the run's slot.
                pipe.execute()
                reply = self._call("cas", keys, args)
            else:
                pipe.evalsha(self._scripts["cas"].sha, len(keys), *keys, *args)
                reply = pipe.execute(raise_on_error=False)[-1]
                if isinstance(reply, redis.exceptions.NoScriptError):
                    reply = self._call("cas", keys, args)
                elif isinstance(reply, Exception):
                    raise reply
        else:
            reply = self._call("cas", batch.all_keys(), args)
        if reply[0] == 1:
            return Applied(finished=batch.finishes or (reply[1] == 0 and batch.open_delta != 0))
        index = int(reply[1])
        guard = batch.guards[index - 1]
        return Conflict(index, batch.labels[index - 1], guard[1], reply[2] if len(reply) > 2 else None)

    @_wrap
    def incr_usage(self, run_id: str, counts: dict[str, int]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, amount in counts.items():
            if amount:
                pipe.hincrby(k.RunKeys.of(run_id).run, k.usage_field(name), amount)
        pipe.execute()

    # fleet counters and indexes (outside the run scripts: a run keeps to one slot) -------------
    @_wrap
    def incr_stat(self, name: str, amount: int = 1) -> None:
        self.client.hincrby(k.STATS, name, amount)

    @_wrap
    def stats(self) -> dict[str, str]:
        return dict(self.client.hgetall(k.STATS))

    @_wrap
    def count_finished(self, metas: Sequence[Any]) -> None:
        """Count finished runs in the fleet counters (as the reconciler forgets them)."""
        if not metas:
            return
        pipe = self.client.pipeline(transaction=False)
        for meta in metas:
            pipe.hincrby(k.STATS, k.finished_stat(meta.workflow, meta.stored_status,
                                                  meta.termination.value if meta.termination else ""), 1)
        pipe.execute()

    @_wrap
    def fleet_view(self, now: float, sample: int = 1000) -> dict[str, Any]:
        """What the fleet exporter reports: live runs, expired leases (over at most ``sample`` due
        runs), the last reconcile pass, the fleet counters."""
        due = list(self.client.zrangebyscore(k.LIVE_INDEX, "-inf", now, start=0, num=sample))
        pipe = self.client.pipeline(transaction=False)
        pipe.zcard(k.LIVE_INDEX)
        pipe.get(k.RECONCILER_LAST)
        pipe.hgetall(k.STATS)
        for run_id in due:
            pipe.zcount(k.RunKeys.of(run_id).leases, "-inf", now)
        live, last, stats, *expired = pipe.execute()
        return {"live": int(live), "expired_leases": sum(int(n) for n in expired),
                "last_pass_at": json.loads(last)["at"] if last else None,
                "stats": {name: int(value) for name, value in stats.items() if value.lstrip("-").isdigit()}}

    @_wrap
    def unlive(self, run_ids: Sequence[str]) -> None:
        if run_ids:
            self.client.zrem(k.LIVE_INDEX, *run_ids)

    @_wrap
    def due_runs(self, now: float, limit: int) -> list[str]:
        """Live runs the reconciler should look at now."""
        return list(self.client.zrangebyscore(k.LIVE_INDEX, "-inf", now, start=0, num=limit))

    @_wrap
    def look_again(self, run_id: str, at: float) -> None:
        """When the reconciler should look at a live run next (only if it is still listed)."""
        self.client.zadd(k.LIVE_INDEX, {run_id: at}, xx=True)

    @_wrap
    def live_count(self) -> int:
        return int(self.client.zcard(k.LIVE_INDEX))

    @_wrap
    def note_reconcile(self, report_json: str) -> None:
        """What the last reconcile pass did (read by ``taskloop status``)."""
        self.client.set(k.RECONCILER_LAST, report_json)

    @_wrap
    def last_reconcile(self) -> str | None:
        found: str | None = self.client.get(k.RECONCILER_LAST)
        return found

    @_wrap
    def run_ids(self, limit: int, offset: int = 0) -> list[str]:
        return list(self.client.zrevrange(k.RUNS_INDEX, offset, offset + limit - 1))

    @_wrap
    def run_ids_with_prefix(self, prefix: str, limit: int = 2) -> list[str]:
        """Run ids that start with ``prefix`` (lexicographic ZSCAN of the runs index)."""
        found: list[str] = []
        for member, _ in self.client.zscan_iter(k.RUNS_INDEX, match=f"{_glob_escape(prefix)}*", count=1000):
            found.append(member)
            if len(found) >= limit:
                break
        return found

    @_wrap
    def run_metas(self, run_ids: Iterable[str]) -> list[list[str | None]]:
        pipe = self.client.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.hmget(k.RunKeys.of(run_id).run, list(k.META_FIELDS))
        return list(pipe.execute())

    @_wrap
    def forget_runs(self, run_ids: Sequence[str]) -> None:
        if run_ids:
            self.client.zrem(k.RUNS_INDEX, *run_ids)

    @_wrap
    def trim_runs_index(self, before: float) -> int:
        """Drop index entries of runs created before ``before`` (their records have expired)."""
        return int(self.client.zremrangebyscore(k.RUNS_INDEX, "-inf", before))

    def _call(self, name: str, keys: Sequence[str], args: Sequence[str | int | float]) -> Any:
        """EVALSHA a script of ours (loading it first if this Redis does not have it yet)."""
        script = self._scripts[name]
        try:
            return self.client.evalsha(script.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            self.client.script_load(script.source)
            return self.client.evalsha(script.sha, len(keys), *keys, *args)

    def close(self) -> None:
        self.client.close()
        if self._blocking is not None:
            self._blocking.close()


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


def dumps_worker(worker: str) -> str:
    """A worker name as the JSON string begin.lua splices into a record."""
    return json.dumps(worker, ensure_ascii=False)

"""The Redis store: field reads of a run, the guarded batch write (cas.lua), the prepared begin
(begin.lua), events, the end marker, the global indexes (written outside the run scripts), and
reads of a run's live text (store/streams.py)."""

from __future__ import annotations

import fnmatch
import hashlib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, ParamSpec, TypeVar

import redis

from taskloop.connections import clients
from taskloop.connections.urls import redact as redact
from taskloop.core import fields as fld
from taskloop.core.batch import Batch, Listed, ListKey
from taskloop.core.events import Event, from_entry, split_id
from taskloop.core.snapshot import Snapshot
from taskloop.store import keys as k
from taskloop.store.calls import wrap
from taskloop.store.compacted import Compacted
from taskloop.store.indexes import Indexes
from taskloop.store.limit_store import Admission, Limits, as_number, limit_argv, limit_keys
from taskloop.store.requests import Requests
from taskloop.store.running import BeginReply as BeginReply
from taskloop.store.running import Running
from taskloop.store.side import Side
from taskloop.store.streams import Streams

P = ParamSpec("P")
T = TypeVar("T")

# A blocking read (BLMOVE, XREAD BLOCK) gets this much more socket time than it blocks for, so a
# reply that arrives a moment late is never mistaken for Redis being down.
BLOCK_MARGIN_S = 10.0
SOCKET_TIMEOUT_S = 5.0
EVENTS_MAXLEN = 100_000  # per run; XADD MAXLEN ~ trims beyond it (TASKLOOP_EVENTS_MAXLEN)


def load_script(name: str) -> str:
    """A script's source, preceded by the libraries its ``-- uses:`` line names (lib_*.lua: Lua
    functions that several scripts call, so that each rule is written once)."""
    source = resources.files("taskloop.store").joinpath("lua", f"{name}.lua").read_text()
    found = re.search(r"^-- uses: (.+)$", source, re.MULTILINE)
    libraries = [load_script(lib.strip()) for lib in found.group(1).split(",")] if found else []
    return "\n".join([*libraries, source])


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
class ScriptCall:
    """One call of a write script (RedisStore.script_call)."""

    script: str
    keys: list[str]
    args: list[str | int | float]
    named: list[str]  # workflows named in the set of listed workflows with it
    cluster: bool
    alone: bool  # it is the whole write: nothing before or after it


@dataclass(frozen=True)
class Applied:
    """A batch was applied; ``finished``: it ended the run (n:open reached 0)."""

    finished: bool
    picked: tuple[str, ...] = ()  # with a "wake": the waiters the released slots let start (to send again)


def _entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id as the stream orders them."""
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq or 0)


def _first_scan_step(pipe: Any, run: str, match: str, also: Sequence[str]) -> None:
    """Queue scan_with's first step on ``pipe``: the ``also`` fields with the compaction marker,
    then one HSCAN step of ``match`` (RedisStore._scanned reads their replies)."""
    pipe.hmget(run, [*also, fld.F_COMPACT])
    pipe.hscan(run, 0, match=match, count=1000)


class RedisStore(Compacted, Indexes, Limits, Requests, Running, Streams):
    """Talks to Redis for one process. Every failure to reach Redis becomes StoreUnavailable, a refusal
    of its credentials or ACL StoreAccessDenied (errors.describe)."""

    def __init__(self, url: str, *, retries: int = 3, client: redis.Redis | None = None,
                 single_connection: bool = False, events_maxlen: int = EVENTS_MAXLEN,
                 shared_by: int | None = None) -> None:
        """``single_connection``: one connection for the whole process (a worker's pool process,
        which makes its calls one after another) instead of a connection pool; ``shared_by``: the
        store serves that many threads or greenlets at once (connections/clients.py)."""
        self.url = url
        self.events_maxlen = events_maxlen
        # Any: redis-py types every reply as a sync/async union; the shapes are checked by the tests.
        # redis.Redis (one Redis, or the Sentinel master) or redis.cluster.RedisCluster: see connections.py.
        self.client: Any = client or self._connect(retries, single_connection, shared_by)
        self._blocking: Any = None  # a client for blocking reads, made on first use
        self._named: dict[str, float] = {}
        self._legacy_deleted = False
        self._side: Side | None = None  # for writes whose replies are read later (note_later)
        self._scripts = {name: _Script(load_script(name))
                         for name in ("cas", "cas_limits", "begin", "limits", "compact", "expand", "unnote",
                                                                 "renew", "request")}


    @wrap
    def _connect(self, retries: int, single_connection: bool, shared_by: int | None) -> Any:
        """The store's client (a single-connection client connects here, and fails here as any call)."""
        return clients.store_client(self.url, retries=retries, single_connection=single_connection,
                                    socket_timeout=SOCKET_TIMEOUT_S, shared_by=shared_by)

    # reads of one run -----------------------------------------------------------------------
    @wrap
    def hmget(self, run_id: str, fields: Sequence[str]) -> list[str | None]:
        """Fields of a run's hash, or of its compact record once it was compacted (store/compacted.py)."""
        if not fields:
            return []
        *values, marker = self.client.hmget(k.RunKeys.of(run_id).run, [*fields, fld.F_COMPACT])
        if marker is None:
            return list(values)
        record = self.compact_record(run_id)
        moved = record.fields if record is not None else {}
        return [value if value is not None else moved.get(name) for name, value in zip(fields, values, strict=True)]

    @wrap
    def read_noting(self, run_id: str, fields: Sequence[str], note_field: str, note: str) -> Snapshot:
        """A snapshot of ``fields`` (the run's workflow first), read in the same round trip as an
        unguarded write of one field (worker/execution/deferred.py: a phase noting that it starts). The write
        comes after the read: the snapshot holds the field's value before it. The caller takes the
        note back when the read shows it does not belong (see ``unnote``)."""
        names = [fld.F_WORKFLOW, *fields, fld.F_COMPACT]
        run = k.RunKeys.of(run_id).run
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(run, names)
        pipe.hset(run, note_field, note)
        values, _ = pipe.execute()
        snap = Snapshot(run_id, loader=lambda more: self.hmget(run_id, more))
        if values[-1] is None:
            snap.fields.update(zip(names[:-1], values[:-1], strict=True))
        else:  # compacted: read as hmget reads a compacted run
            snap.fields.update(zip(names[:-1], self.hmget(run_id, names[:-1]), strict=True))
        return snap

    @wrap
    def note_later(self, run_id: str, note_field: str, note: str) -> Side:
        """Write one field of a run without waiting (a phase that runs on the fields its message
        carried, noting that it starts: worker/execution/deferred.py). The write goes on a connection of its
        own; the returned Side's ``landed()`` reads its reply. Not on a Cluster (no message carries
        fields there)."""
        if self._side is None:
            self._side = Side(self.client)
        self._side.send("HSET", k.RunKeys.of(run_id).run, note_field, note)
        return self._side

    @wrap
    def unnote(self, run_id: str, note_field: str, note: str, before: str | None) -> None:
        """Take back the note ``read_noting`` wrote, unless another one replaced it since: the field
        as it was before (deleted when it was absent, or when the run does not exist: unnote.lua)."""
        self._call("unnote", [k.RunKeys.of(run_id).run], [note_field, note, before or "", fld.F_WORKFLOW])

    def snapshot(self, run_id: str, fields: Iterable[str] = ()) -> Snapshot:
        """A snapshot of the run that loads further fields on demand (check ``.exists``)."""
        snap = Snapshot(run_id, loader=lambda names: self.hmget(run_id, names))
        snap.ensure([fld.F_WORKFLOW, *fields])
        return snap

    @wrap
    def scan_fields(self, run_id: str, prefix: str) -> dict[str, str]:
        """Every field that starts with ``prefix`` (HSCAN: inspect and results, not the hot path)."""
        return {name: value for name, value in self.scan_with(run_id, f"{prefix}*").items() if value is not None}

    @wrap
    def scan_with(self, run_id: str, match: str, also: Sequence[str] = ()) -> dict[str, str | None]:
        """Every field whose name matches the glob ``match``, and the ``also`` fields (None: absent),
        read in one round trip with the first scan step (wait's read of a run that ended: its meta
        and its tasks at once). A field that matches and is not in the answer is not in the run."""
        pipe = self.client.pipeline(transaction=False)
        _first_scan_step(pipe, k.RunKeys.of(run_id).run, match, also)
        (*values, marker), (cursor, found) = pipe.execute()
        return self._scanned(run_id, match, also, values, marker, cursor, dict(found))

    def _scanned(self, run_id: str, match: str, also: Sequence[str], values: list[str | None], marker: str | None,
                 cursor: int | str, found: dict[str, str]) -> dict[str, str | None]:
        """scan_with's answer from its first step's replies (the ``also`` values, the compaction
        marker, the scan's cursor and fields): the rest of the scan, or the compact record."""
        run = k.RunKeys.of(run_id).run
        steps = 1
        while int(cursor) and marker is None:
            cursor, more = self.client.hscan(run, cursor, match=match, count=1000)
            found.update(more)
            steps += 1
        if steps > 1 and marker is None:  # compacted while it was scanned: its fields moved
            marker = self.client.hget(run, fld.F_COMPACT)
        if marker is not None:
            moved = self.compacted_fields(run_id)
            return {**{name: moved.get(name) for name in also},
                    **{name: value for name, value in moved.items() if fnmatch.fnmatchcase(name, match)}}
        return {**dict(zip(also, values, strict=True)), **found}

    @wrap
    def all_fields(self, run_id: str) -> dict[str, str]:
        """The whole run (inspect of one run): its hash, or everything a compacted run holds."""
        found = dict(self.client.hgetall(k.RunKeys.of(run_id).run))
        return self.compacted_fields(run_id) if fld.F_COMPACT in found else found

    @wrap
    def leases(self, run_id: str, until: float, limit: int = 100) -> list[tuple[str, float]]:
        """The run's leases that expire by ``until``, earliest first."""
        rows = self.client.zrangebyscore(k.RunKeys.of(run_id).leases, "-inf", until, start=0, num=limit,
                                         withscores=True)
        return [(member, float(score)) for member, score in rows]

    @wrap
    def leases_of_runs(self, run_ids: Sequence[str], until: float, limit: int = 100) -> list[list[str]]:
        """For each run, the task keys whose lease expires by ``until`` (one pipelined read; a
        census of many runs, worker/recovery/census.py)."""
        pipe = self.client.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.zrangebyscore(k.RunKeys.of(run_id).leases, "-inf", until, start=0, num=limit)
        return [list(found) for found in pipe.execute()]

    @wrap
    def lease_of(self, run_id: str, key: str) -> float | None:
        score = self.client.zscore(k.RunKeys.of(run_id).leases, key)
        return None if score is None else float(score)

    @wrap
    def first_lease(self, run_id: str) -> float | None:
        rows = self.client.zrange(k.RunKeys.of(run_id).leases, 0, 0, withscores=True)
        return float(rows[0][1]) if rows else None

    @wrap
    def events(self, run_id: str, after: str | None = None) -> list[Event]:
        """The run's events in order; with ``after`` (an event id), only the later ones."""
        if after is None:
            entries = self.client.xrange(k.RunKeys.of(run_id).events, "-", "+") or self._compacted_entries(run_id)
            return [e for entry_id, fields in entries for e in from_entry(run_id, entry_id, fields)]
        entry, index = split_id(after)
        entries = self.client.xrange(k.RunKeys.of(run_id).events, entry, "+") \
            or self._compacted_entries(run_id, after=entry, inclusive=True)
        found = [e for entry_id, fields in entries for e in from_entry(run_id, entry_id, fields)]
        return [e for e in found if e.entry_id != entry or split_id(e.id or "")[1] > index]

    def _compacted_entries(self, run_id: str, after: str | None = None,
                           inclusive: bool = False) -> list[tuple[str, dict[str, str]]]:
        """The stream entries of a compacted run (after entry ``after``); none for any other run."""
        if self.client.hmget(k.RunKeys.of(run_id).run, [fld.F_COMPACT])[0] is None:
            return []
        record = self.compact_record(run_id)
        entries = record.entries if record is not None else []
        if after is None or after in ("0", "0-0"):
            return entries
        bound = _entry_order(after)
        return [(i, f) for i, f in entries if _entry_order(i) > bound or (inclusive and _entry_order(i) == bound)]

    def _blocking_client(self, block_s: float) -> Any:
        """The client for blocking reads: its socket timeout outlasts the block by BLOCK_MARGIN_S, and
        it does not retry (a blocking read that timed out is answered by the caller, see below)."""
        needed = block_s + BLOCK_MARGIN_S
        if self._blocking is None or (clients.client_timeout(self._blocking) or 0.0) < needed:
            if self._blocking is not None:
                self._blocking.close()
            self._blocking = clients.store_client(self.url, retries=0, socket_timeout=needed, health_check=False)
        return self._blocking

    def _block(self, block_s: float, call: Callable[[Any], T], nothing: T) -> T:
        """Run one blocking read. A read that outlives its socket timeout is not Redis being down: the
        connection is dropped (a late reply must not be read by the next command) and the caller sees
        "nothing yet", then checks the run with an ordinary read."""
        client = self._blocking_client(block_s)
        try:
            return call(client)
        except redis.exceptions.TimeoutError:
            clients.disconnect(client)  # redis.Redis or RedisCluster
            return nothing

    @wrap
    def block_events(self, run_id: str, last_entry: str, block_ms: int) -> list[Event]:
        """Events of the entries after stream entry ``last_entry`` ("0-0": from the start), waiting
        up to ``block_ms`` for the first one (XREAD BLOCK)."""
        stream = k.RunKeys.of(run_id).events
        reply: Any = self._block(block_ms / 1000.0,
                                 lambda c: c.xread({stream: last_entry}, block=max(block_ms, 1)), [])
        entries = reply[0][1] if reply else self._compacted_entries(run_id, after=last_entry)
        return [e for entry_id, fields in entries for e in from_entry(run_id, entry_id, fields)]

    @wrap
    def block_end(self, run_id: str, block_ms: int) -> bool:
        """Wait up to ``block_ms`` for the run's end marker; True once the run has ended.

        The marker is a one-element list that BLMOVE rotates onto itself, so any number of
        waiters see it without taking it away."""
        end = k.RunKeys.of(run_id).end
        timeout = max(block_ms, 1) / 1000.0
        return self._block(timeout, lambda c: c.blmove(end, end, timeout, "LEFT", "RIGHT"), None) is not None

    @wrap
    def block_end_scan(self, run_id: str, block_ms: int, match: str,
                       also: Sequence[str] = ()) -> dict[str, str | None] | None:
        """``block_end``, and once the end marker wakes it, ``scan_with``'s read in the same round
        trip: the reads are pipelined behind the blocking BLMOVE, and Redis runs them as soon as the
        marker is pushed, on the run as the write that ended it left it. None: the block timed out
        (the reads' answers are dropped: a caller that waits again reads what it needs). On a
        Cluster, where a pipeline takes no blocking command, the read follows the wake."""
        if clients.is_cluster(self.client):
            return self.scan_with(run_id, match, also) if self.block_end(run_id, block_ms) else None
        keys = k.RunKeys.of(run_id)
        timeout = max(block_ms, 1) / 1000.0

        def call(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            pipe.blmove(keys.end, keys.end, timeout, "LEFT", "RIGHT")
            _first_scan_step(pipe, keys.run, match, also)
            return list(pipe.execute())

        replies = self._block(timeout, call, None)
        if replies is None or replies[0] is None:
            return None
        _, (*values, marker), (cursor, found) = replies
        return self._scanned(run_id, match, also, values, marker, cursor, dict(found))

    # writes of one run ----------------------------------------------------------------------
    def script_call(self, batch: Batch) -> ScriptCall:
        """The script call that applies ``batch`` (cas.lua, or cas_limits.lua with its limits
        operation): its keys and arguments, and whether it is the whole write (``alone``: one Redis,
        nothing written around it), which an event loop may then make on a connection of its own
        (store/aio.py) and read with ``applied``."""
        cluster = clients.is_cluster(self.client)
        key_of = None if cluster else k.run_list  # a Cluster's run lists are in other slots: written after
        args: list[str | int | float] = [*batch.argv(key_of), self.events_maxlen, batch.run_id]
        keys = self._keys(batch, key_of)
        script = "cas"
        op = batch.limits
        if op is not None and not cluster:
            script = "cas_limits"
            args = [len(keys), *args, *limit_argv(op.op, op.specs, op.now, op.member, op.holder, op.expiry)]
            keys = [*keys, *limit_keys(op.specs)]
        # the workflows whose lists this write enters the run in, named in the set of listed
        # workflows (store/indexes.py: at most once a minute per process)
        named = self.workflows_to_name(entry.workflow for entry in batch.all_listed()
                                       if entry.workflow is not None and entry.score is not None)
        alone = not (cluster or batch.indexes or batch.stats or named or batch.sets_control)
        return ScriptCall(script, keys, args, named, cluster, alone)

    @wrap
    def apply(self, batch: Batch) -> Conflict | Applied | Admission:
        """Run the batch atomically: Applied, or the first guard that failed (nothing written). A
        batch with a limits operation makes it in the same call (cas_limits.lua; on a Cluster, where
        the limits live in other slots, in calls of their own): ``wake`` releases the phase's slots
        once the write is applied; ``acquire`` takes the room of the phase the write begins, after
        the guards and before the writes, and a refusal (the Admission) writes nothing."""
        call = self.script_call(batch)
        script, keys, args, named, cluster = call.script, call.keys, call.args, call.named, call.cluster
        op = batch.limits
        if cluster and op is not None and op.op == "acquire":  # a Cluster: the room first, in the limits' own slots
            admission = self.acquire(op.specs, op.member, op.holder, op.expiry, op.now)
            if not admission.admitted:
                return admission
        if batch.indexes or batch.stats or named:
            pipe = self.client.pipeline(transaction=False)
            for index, member, score in batch.indexes:
                pipe.zadd(k.INDEX_KEYS[index], {member: score})
            for name, amount in batch.stats.items():  # (counted before the write: a repeated start counts too)
                pipe.hincrby(k.STATS, name, amount)
            if named:
                pipe.sadd(k.LISTED_WORKFLOWS, *named)
            if cluster:
                # Redis Cluster: these keys live in other slots (other nodes), and redis-py's cluster
                # pipeline refuses EVALSHA: send them first, then run the script on the run's slot.
                pipe.execute()
                self.workflows_named(named)
                reply = self._call(script, keys, args)
            else:
                pipe.evalsha(self._scripts[script].sha, len(keys), *keys, *args)
                reply = pipe.execute(raise_on_error=False)[-1]
                self.workflows_named(named)
                if isinstance(reply, redis.exceptions.NoScriptError):
                    reply = self._call(script, keys, args)
                elif isinstance(reply, Exception):
                    raise reply
        else:
            reply = self._call(script, keys, args)
        return self.applied(batch, call, reply)

    def applied(self, batch: Batch, call: ScriptCall, reply: Any) -> Conflict | Applied | Admission:
        """What the script call of ``batch`` came to (its reply), with what follows it on a Cluster
        (the run lists, the slots given back) and a cancel's announcement."""
        op, cluster = batch.limits, call.cluster
        if reply[0] == 2:  # cas_limits.lua: a limit refused the phase; nothing was written
            assert op is not None
            refused = op.specs[int(reply[1]) - 1]
            return Admission(False, refused.name, refused.value, float(reply[2]), as_number(reply[3]),
                             as_number(reply[4]))
        if reply[0] == 1:
            if batch.sets_control:  # a cancel or a stop: the watchers of the run's phases are told
                self.announce_control(batch.run_id)
            finished = batch.finishes or (reply[1] == 0 and batch.open_delta != 0)
            picked: tuple[str, ...] = tuple(reply[2]) if call.script == "cas_limits" and op and op.op == "wake" \
                else ()
            if cluster:
                self._write_lists(batch.run_id, batch.all_listed(finished))
                if op is not None and op.op == "wake":
                    picked = tuple(self.wake(op.specs, op.now, op.holder))
            return Applied(finished=finished, picked=picked)
        if cluster and op is not None and op.op == "acquire":  # the write was refused: the room goes back
            self.wake(op.specs, op.now, op.holder)
        failed = int(reply[1])
        guard = batch.guards[failed - 1]
        return Conflict(failed, batch.labels[failed - 1], guard[1], reply[2] if len(reply) > 2 else None)

    @staticmethod
    def _keys(batch: Batch, key_of: ListKey | None) -> list[str]:
        """cas.lua's KEYS: the run's four keys, the broker lists the write pushes to, then (on a single
        Redis) the run lists it writes."""
        return [*k.RunKeys.of(batch.run_id).all(), *batch.broker_keys,
                *(batch.list_keys(key_of) if key_of is not None else ())]

    def _write_lists(self, run_id: str, listed: Sequence[Listed]) -> None:
        """A Cluster's run lists, after the script that wrote the run (a crash in between leaves the
        lists behind the run until the reconciler looks at it: ``relist``)."""
        if not listed:
            return
        pipe = self.client.pipeline(transaction=False)
        for entry in listed:
            if entry.score is None:
                pipe.zrem(k.run_list(entry), run_id)
            else:
                pipe.zadd(k.run_list(entry), {run_id: entry.score})
        pipe.execute()

    @wrap
    def incr_usage(self, run_id: str, counts: dict[str, int]) -> None:
        self.incr_fields(run_id, {fld.usage_field(name): amount for name, amount in counts.items() if amount})

    @wrap
    def incr_fields(self, run_id: str, amounts: dict[str, int]) -> None:
        """HINCRBY counters of a run's hash (one round trip)."""
        pipe = self.client.pipeline(transaction=False)
        for field, amount in amounts.items():
            pipe.hincrby(k.RunKeys.of(run_id).run, field, amount)
        pipe.execute()

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
        if self._side is not None:
            self._side.close()
        if self._blocking is not None:
            self._blocking.close()

"""The fleet at a glance (``taskloop status``, the UI's ``/fleet``): workers online with their
processes and queues (their heartbeats, taskloop/worker/liveness/presence.py), queue depths (the broker),
live runs by status, runs by stored status (the run lists), expired leases and the reconciler's
last pass (the store). All of it is read with plain reads: the read-only ``monitor`` user does."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from taskloop.base import clock
from taskloop.core import fields as fld
from taskloop.core.snapshot import RunMeta
from taskloop.store.indexes import STORED_STATUSES
from taskloop.store.redis_store import RedisStore

LIVE_SAMPLE = 10_000  # live runs read to count them by status
HEARTBEAT_S = 2.0  # a worker writes its heartbeat this often
ONLINE_WITHIN_S = 10.0  # a worker is online while its last heartbeat is younger than this (5 beats)
FORGET_AFTER_S = 3600.0  # a worker gone without a word leaves tl:workers after this
HOLD_MARGIN_S = 1.0  # a message taken this long before a heartbeat is in that heartbeat's ``held``


@dataclass(frozen=True)
class Held:
    """A taskloop message a worker held at a heartbeat (prefetched, waiting for a countdown or
    running): its task and what it names, and since when its pool has run it (by the worker's
    clock; None while it waits). The broker keeps no copy of a message a worker took (kombu's ack
    emulation is off): when the worker falls silent, these are what the reconciler sends again
    (taskloop/worker/recovery/orphans.py)."""

    task: str
    run_id: str
    key: str | None = None  # a phase message's task key
    token: int | None = None  # ... and its token
    keys: list[str] = field(default_factory=list)  # a taskloop.dispatch message's task keys
    since: float | None = None
    pid: int | None = None  # the pool process that runs it


# a held message's task, one letter in the holdings record
_CODES = {"taskloop.attempt": "a", "taskloop.check": "c", "taskloop.run": "r", "taskloop.dispatch": "d",
          "taskloop.start": "s", "taskloop.settle": "x"}
_TASKS = {code: task for task, code in _CODES.items()}


def encode_held(messages: list[Held]) -> str:
    """What a worker holds, as the store keeps it beside its heartbeat (``tl:held``): one JSON list
    per message, ``[task, run, key, token, keys, since, pid]``, with the task as one letter. A worker
    with ten thousand phases in flight writes it every heartbeat, and each reconcile pass reads
    it once: plain lists, not objects, keep both cheap."""
    return json.dumps([[_CODES[m.task], m.run_id, m.key, m.token, m.keys or 0, m.since, m.pid] for m in messages
                       if m.task in _CODES], separators=(",", ":"))


def decode_held(raw: str | None) -> list[Held]:
    """The messages of a holdings record (what does not parse is left out)."""
    try:
        rows = json.loads(raw) if raw else []
    except ValueError:
        return []
    found = []
    for row in rows if isinstance(rows, list) else []:
        try:
            code, run_id, key, token, keys, since, pid = row
            found.append(Held(_TASKS[code], run_id, key, token, list(keys) if keys else [], since, pid))
        except (ValueError, TypeError, KeyError):
            continue
    return found


class WorkerInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    node: str
    processes: int
    pid: int | None = None
    queues: list[str] = Field(default_factory=list)
    active: int = 0  # tasks running on it at its last heartbeat
    at: float | None = None  # when it wrote that heartbeat
    # the taskloop messages it held then (prefetched, waiting for a countdown or running), and what
    # they name: what the reconciler sends again when it falls silent
    # (taskloop/worker/recovery/orphans.py), what a census must not take for lost
    # (taskloop/worker/recovery/census.py), and which phases it has run how long
    # (taskloop/worker/recovery/unbegun.py). Kept apart from the heartbeat (``encode_held``):
    # only ``heartbeats(..., held=...)`` reads them in.
    messages: list[Held] = Field(default_factory=list, exclude=True)


class LimitInfo(BaseModel):
    """One fleet limit (for one key value of a concurrency limit) as it stands now."""

    model_config = ConfigDict(frozen=True)
    name: str
    kind: str  # "rate" | "concurrency"
    value: str = ""  # a concurrency limit's key value ("" without key)
    used: int  # slots held, or starts (tokens) in the window
    allowed: float  # slots, or the rate per window, as it applies now
    per_s: float | None = None  # a rate limit's window
    unit: str = "starts"
    waiting: int
    overridden: dict[str, str] = Field(default_factory=dict)  # the operator's numbers (taskloop limits set)


class FleetView(BaseModel):
    model_config = ConfigDict(frozen=True)
    at: float
    workers: list[WorkerInfo]
    queues: dict[str, int]
    live_runs_by_status: dict[str, int]
    runs_by_status: dict[str, int]  # every run still kept, by stored status (the run lists)
    live_runs: int
    expired_leases: int
    reconciler_last_pass: dict[str, Any] | None = None
    limits: list[LimitInfo] = Field(default_factory=list)


def fleet_view(store: RedisStore, broker: RedisStore, default_queue: str) -> FleetView:
    """Read the workers' heartbeats and the store, and the queue lengths from the broker (the
    default queue and every queue a worker consumes)."""
    now = clock.now()
    workers = online_workers(store.workers_seen(), now)
    queue_names = sorted({default_queue, *(q for w in workers for q in w.queues)})
    queues = broker.queue_lengths(queue_names)  # StoreUnavailable or StoreAccessDenied name the broker's URL
    view = store.fleet_view(now)
    live_ids = store.live_page(0, LIVE_SAMPLE)
    by_status: dict[str, int] = {}
    for run_id, row in zip(live_ids, store.run_metas(live_ids), strict=True):
        if row[1] is not None:
            meta = RunMeta.from_fields(run_id, dict(zip(fld.META_FIELDS, row, strict=True)))
            by_status[meta.status.value] = by_status.get(meta.status.value, 0) + 1
    counts = store.list_lengths(list(STORED_STATUSES))
    last_raw = store.last_reconcile()
    return FleetView(at=now, workers=workers, queues=queues, live_runs_by_status=by_status,
                     runs_by_status={s: n for s, n in counts.items() if n}, live_runs=view["live"],
                     expired_leases=view["expired_leases"],
                     reconciler_last_pass=json.loads(last_raw) if last_raw else None,
                     limits=limits_view(store, now))


def limits_view(store: RedisStore, now: float) -> list[LimitInfo]:
    """Every fleet limit phases have started or waited under, with its use and queue."""
    found = []
    for use in store.limit_uses(now):
        numbers = {**use.declared, **use.override}
        conc = use.declared.get("kind") == "conc"
        found.append(LimitInfo(name=use.name, kind="concurrency" if conc else "rate", value=use.value, used=use.used,
                               allowed=use.allowed, per_s=None if conc else float(numbers.get("per_s") or 0),
                               unit="starts" if conc else use.declared.get("unit", "starts"), waiting=use.waiting,
                               overridden=use.override))
    return found


def heartbeat(raw: str) -> WorkerInfo | None:
    """A worker's heartbeat as tl:workers holds it (None for one that does not parse)."""
    try:
        return WorkerInfo.model_validate_json(raw)
    except ValueError:
        return None


def heartbeats(seen: dict[str, str], held: dict[str, str] | None = None) -> dict[str, WorkerInfo]:
    """Every heartbeat that parses and has a time, by node; with ``held`` (store.holdings_seen), each
    with the messages it held."""
    beats = {}
    for node, raw in seen.items():
        info = heartbeat(raw)
        if info is not None and info.at is not None:
            update: dict[str, Any] = {"node": node}
            if held is not None:
                update["messages"] = decode_held(held.get(node))
            beats[node] = info.model_copy(update=update)
    return beats


def read_holdings(store: RedisStore) -> dict[str, WorkerInfo]:
    """Every worker's last heartbeat with the messages it held: what a reconcile pass reads once."""
    return heartbeats(*store.holdings_seen())


@dataclass(frozen=True)
class Holdings:
    """What the live workers hold, as their heartbeats say: a message a worker took before ``before``
    (by its own clock) and still holds is in its heartbeat. ``before`` is None when no worker is
    live, or when the fleet's heartbeats are not settled yet (all of them are older than a
    heartbeat period: the fleet is coming back from an outage of the store, and a worker that has
    not written since then is not known to be gone)."""

    before: float | None
    phases: frozenset[tuple[str, str, int]]  # (run, key, token) of the phase messages held
    dispatching: frozenset[str]  # runs with a taskloop.dispatch message held
    silent: frozenset[str]  # nodes that fell silent while the others went on

    @property
    def tasks(self) -> frozenset[tuple[str, str]]:
        """(run, key) of the phase messages held, whatever their token."""
        return frozenset((run_id, key) for run_id, key, _ in self.phases)


def holdings(beats: dict[str, WorkerInfo], now: float) -> Holdings:
    """Who is live and what they hold. A worker is taken for gone when its last heartbeat is more
    than ``ONLINE_WITHIN_S`` behind the freshest heartbeat of the fleet (not behind this reader's
    clock): after an outage of the store every heartbeat is old, and none of them is gone for
    that. ``before`` is the oldest live heartbeat, less a margin for a message taken just before a
    heartbeat was read from Celery's state."""
    if not beats:
        return Holdings(None, frozenset(), frozenset(), frozenset())
    freshest = max(info.at or 0.0 for info in beats.values())
    silent = frozenset(node for node, info in beats.items() if (info.at or 0.0) < freshest - ONLINE_WITHIN_S)
    live = [info for node, info in beats.items() if node not in silent]
    settled = now - freshest <= 2 * HEARTBEAT_S
    before = min(info.at or 0.0 for info in live) - HOLD_MARGIN_S if settled and live else None
    held = [m for info in live for m in info.messages]
    return Holdings(before, frozenset((m.run_id, m.key, m.token) for m in held if m.key is not None
                                      and m.token is not None),
                    frozenset(m.run_id for m in held if m.keys), silent)


def node_of(worker: str | None) -> str | None:
    """The node of an execution's worker ("node@host/pid"), as its heartbeat names it."""
    if not worker:
        return None
    return worker.rpartition("/")[0] or worker


def online_workers(seen: dict[str, str], now: float) -> list[WorkerInfo]:
    """The workers whose last heartbeat is younger than ``ONLINE_WITHIN_S``, by node name (a
    heartbeat that does not parse is left out)."""
    workers = []
    for node, raw in sorted(seen.items()):
        info = heartbeat(raw)
        if info is not None and info.at is not None and now - info.at <= ONLINE_WITHIN_S:
            workers.append(info.model_copy(update={"node": node}))
    return workers


def gone_workers(seen: dict[str, str], now: float) -> list[str]:
    """The workers whose last heartbeat is older than ``FORGET_AFTER_S`` (or does not parse):
    they stopped without saying so (SIGKILL, a lost host)."""
    stale = []
    for node, raw in seen.items():
        info = heartbeat(raw)
        if info is None or info.at is None or now - info.at > FORGET_AFTER_S:
            stale.append(node)
    return stale

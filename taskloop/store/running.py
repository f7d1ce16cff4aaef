"""The store's side of phases that run: beginning a prepared phase (begin.lua), one at a time or
many in one round trip; renewing the leases of many running phases in one call (renew.lua); and
the controls feed, a stream of the runs whose control flag was set (a cancel, a stop), which a
worker process's watcher reads once per interval instead of polling every run it has a phase of
(taskloop/worker/liveness/watcher.py). Mixed into RedisStore, whose client and scripts it uses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from taskloop.base import clock
from taskloop.connections import clients
from taskloop.core import fields as fld
from taskloop.core.limits import LimitOp
from taskloop.store import keys as k
from taskloop.store.calls import wrap
from taskloop.store.limit_store import Admission, as_number, limit_keys

# The feed keeps about this many entries (XADD MAXLEN ~): a watcher that fell further behind (a long
# outage) reads the control flag of every run it watches once instead.
CONTROLS_MAXLEN = 10_000
# A watcher that starts following the feed reads this far back, so that a cancel which landed while
# a phase was being prepared (its read up to CARRY_FRESH_S old) is not missed.
CONTROLS_LOOKBACK_S = 10.0


@dataclass(frozen=True)
class BeginReply:
    """What begin.lua did: ``began`` the prepared phase (values[0] is then the running record), or
    only read the asked-for fields for the caller to decide on."""

    began: bool
    fields: dict[str, str | None]
    refused: Admission | None = None  # a fleet limit refused the phase (it joined that limit's wait queue)


@dataclass(frozen=True)
class Begin:
    """One prepared phase to begin (begin.lua's arguments), with the fields to read back."""

    run_id: str
    key: str
    round: int
    phase: str
    token: int
    worker: str
    now: float
    fields: Sequence[str]
    limits: LimitOp | None = None


@dataclass(frozen=True)
class Renewal:
    """A running phase's lease to renew, guarded by the fencing token of the record its execution
    began (every transition of the record changes it)."""

    run_id: str
    key: str
    token: int
    until: float


@dataclass(frozen=True)
class Renewed:
    """What renew.lua found: the lease was renewed (False: the record moved on), and the run's control flag."""

    renewed: bool
    control: str | None


class Running:
    """The running-phase methods of RedisStore."""

    client: Any
    url: str
    _call: Callable[[str, Sequence[str], Sequence[str | int | float]], Any]
    _scripts: dict[str, Any]

    # begins ---------------------------------------------------------------------------------
    @wrap
    def begin(self, run_id: str, key: str, round: int, phase: str, token: int, worker: str, now: float,
              fields: Sequence[str], limits: LimitOp | None = None) -> BeginReply:
        """Begin the phase the scheduler prepared (begin.lua), or read ``fields`` for the caller:
        ``fields`` starts with the task's record fields (fld.record_fields) and the control flag.
        ``limits`` (an ``acquire``, single Redis only): the fleet limits the worker expects the
        prepared begin to name, whose room is then taken in the same call."""
        one = Begin(run_id, key, round, phase, token, worker, now, fields, limits)
        keys, argv = begin_call(one)
        return begin_reply(one, self._call("begin", keys, argv))

    @wrap
    def begin_many(self, begins: Sequence[Begin]) -> list[BeginReply]:
        """``begin`` for several prepared phases (without limits) in one round trip: a pipeline of
        begin.lua calls on one Redis, one call after another on a Cluster."""
        if not begins:
            return []
        if clients.is_cluster(self.client) or len(begins) == 1:
            return [self.begin(b.run_id, b.key, b.round, b.phase, b.token, b.worker, b.now, b.fields)
                    for b in begins]
        calls = [begin_call(b) for b in begins]
        sha = self._scripts["begin"].sha
        pipe = self.client.pipeline(transaction=False)
        for keys, argv in calls:
            pipe.evalsha(sha, len(keys), *keys, *argv)
        replies = pipe.execute(raise_on_error=False)
        out = []
        for b, (keys, argv), reply in zip(begins, calls, replies, strict=True):
            if isinstance(reply, redis.exceptions.NoScriptError):
                reply = self._call("begin", keys, argv)
            elif isinstance(reply, Exception):
                raise reply
            out.append(begin_reply(b, reply))
        return out

    # leases ---------------------------------------------------------------------------------
    @wrap
    def renew_leases(self, renewals: Sequence[Renewal]) -> list[Renewed]:
        """Renew the leases of running phases, each guarded by its record (renew.lua): one call on
        one Redis, a call per phase on a Cluster (each run on its own slot)."""
        if not renewals:
            return []
        groups = [[r] for r in renewals] if clients.is_cluster(self.client) else [list(renewals)]
        out: list[Renewed] = []
        for group in groups:
            keys: list[str] = []
            argv: list[str | int | float] = [fld.F_CONTROL]
            for r in group:
                run = k.RunKeys.of(r.run_id)
                keys += [run.run, run.leases]
                argv += [fld.task_field(r.key), str(r.token), r.key, f"{r.until:.6f}"]
            out += [Renewed(bool(ok), control or None) for ok, control in self._call("renew", keys, argv)]
        return out

    # the controls feed ----------------------------------------------------------------------
    @wrap
    def announce_control(self, run_id: str) -> None:
        """A run's control flag was set: its running phases' watchers learn it from the feed."""
        self.client.xadd(k.CONTROLS, {"r": run_id}, maxlen=CONTROLS_MAXLEN, approximate=True)

    @wrap
    def controls_after(self, entry: str | None) -> tuple[str, list[str]]:
        """The runs announced after feed entry ``entry`` (None: the last CONTROLS_LOOKBACK_S), and the
        entry to read after next time."""
        start = entry if entry is not None else f"{int((clock.now() - CONTROLS_LOOKBACK_S) * 1000)}-0"
        reply = self.client.xread({k.CONTROLS: start}, count=CONTROLS_MAXLEN)
        entries = reply[0][1] if reply else []
        last = entries[-1][0] if entries else start
        return last, [fields.get("r", "") for _, fields in entries if fields.get("r")]

    @wrap
    def controls_of(self, run_ids: Sequence[str]) -> dict[str, str | None]:
        """The control flag of each run (one round trip): what a watcher reads when the feed may have
        missed something."""
        if not run_ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.hget(k.RunKeys.of(run_id).run, fld.F_CONTROL)
        return dict(zip(run_ids, pipe.execute(), strict=True))


def begin_call(b: Begin) -> tuple[list[str], list[str | int | float]]:
    """begin.lua's keys and arguments for ``b``."""
    keys = k.RunKeys.of(b.run_id)
    script_keys = [keys.run, keys.leases]
    presented: list[str] = ["", "", "", ""]
    if b.limits is not None:
        script_keys += limit_keys(b.limits.specs)
        presented = [b.limits.tag, b.limits.member, b.limits.holder, fld.throttle_field(b.key)]
    argv: list[str | int | float] = [fld.begin_field(b.key), *fld.record_fields(b.key), fld.usage_field("attempts"),
                                     b.key, b.token, b.round, b.phase, b.worker, repr(b.now), *presented, *b.fields]
    return script_keys, argv


def begin_reply(b: Begin, reply: Any) -> BeginReply:
    """What begin.lua's reply to ``b`` says."""
    began, values, more_names, more = reply[:4]
    found = dict(zip(more_names, more, strict=True))
    found.update(zip(b.fields, values, strict=True))
    if began == 2:
        assert b.limits is not None
        index, retry, used, allowed = reply[4]
        spec = b.limits.specs[int(index) - 1]
        return BeginReply(False, found, Admission(False, spec.name, spec.value, float(retry), as_number(used),
                                                  as_number(allowed)))
    return BeginReply(bool(began), found)

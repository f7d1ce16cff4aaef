"""The store's fleet limits (limits.lua, store/keys.py ``LimitKeys``): take room for a phase or
put it in a wait queue, release a slot and pick the waiters to send again, renew slots, count
tokens, and what ``taskloop limits`` / ``status`` / the UI read. Mixed into RedisStore.

On a single Redis one script call covers every limit of a phase and the global due set; on a
Cluster each limit lives in its own slot, so each gets its own call (a refusal by a later limit
undoes what the earlier ones took) and the due set is written after them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from taskloop.connections import clients
from taskloop.core.limits import Spec
from taskloop.store import keys as k
from taskloop.store.calls import wrap

OVERRIDABLE = ("rate", "per_s", "limit")


@dataclass(frozen=True)
class Admission:
    """What limits.lua said to a phase: ``admitted``, or held back by ``limit`` until about ``retry_at``."""

    admitted: bool
    limit: str | None = None
    value: str = ""
    retry_at: float | None = None
    used: float | None = None
    allowed: float | None = None


@dataclass(frozen=True)
class LimitUse:
    """One limit's state for one key value (``taskloop limits``, status, the UI, metrics)."""

    name: str
    value: str
    used: int  # starts or tokens in the window, or slots held
    waiting: int
    override: dict[str, str]  # the operator's numbers (taskloop limits set)
    declared: dict[str, str]  # the numbers the limit was last declared with

    @property
    def allowed(self) -> float:
        """The limit's rate (starts or tokens per window) or slots, as it applies now."""
        numbers = {**self.declared, **self.override}
        return float(numbers.get("limit" if self.declared.get("kind") == "conc" else "rate") or 0)


class Limits:
    """The limit methods of RedisStore."""

    client: Any
    url: str
    _call: Callable[[str, Sequence[str], Sequence[str | int | float]], Any]

    def _groups(self, specs: Sequence[Spec]) -> tuple[bool, list[list[Spec]]]:
        if clients.is_cluster(self.client):
            return True, [[spec] for spec in specs]
        return False, [list(specs)]

    def _limit_call(self, op: str, specs: Sequence[Spec], now: float, member: str = "", holder: str = "",
                    expiry: float = 0.0, amount: int = 0, globals_: bool = True) -> Any:
        return self._call("limits", limit_keys(specs, globals_), limit_argv(op, specs, now, member, holder, expiry,
                                                                            amount))

    @wrap
    def acquire(self, specs: Sequence[Spec], member: str, holder: str, expiry: float, now: float) -> Admission:
        """Room for a phase under every one of ``specs``, or its place in a wait queue."""
        cluster, groups = self._groups(specs)
        done: list[Spec] = []
        for group in groups:
            reply = self._limit_call("acquire", group, now, member, holder, expiry, globals_=not cluster)
            if reply[0] != 1:
                refused = group[int(reply[1]) - 1]
                if done:  # a Cluster: give back what the limits before this one took
                    self._limit_call("undo", done, now, member, holder, globals_=False)
                if cluster:
                    self._due(refused, float(reply[2]), lower_only=True)
                    self.client.sadd(k.LIMIT_NAMES, refused.name)
                return Admission(False, refused.name, refused.value, float(reply[2]), as_number(reply[3]),
                                 as_number(reply[4]))
            done += group
            if cluster:
                self.client.sadd(k.LIMIT_NAMES, group[0].name)
                for spec, at in zip(group, reply[1], strict=True):
                    if at:
                        self._due(spec, float(at), lower_only=True)
        return Admission(True)

    @wrap
    def wake(self, specs: Sequence[Spec], now: float, holder: str = "") -> list[str]:
        """Release ``holder``'s slots (if any) and pick the oldest waiters there is room for: their
        wait members, to send again."""
        cluster, groups = self._groups(specs)
        picked: list[str] = []
        for group in groups:
            members, dues = self._limit_call("wake", group, now, "", holder, globals_=not cluster)
            picked += members
            if cluster:
                for spec, at in zip(group, dues, strict=True):
                    if at:
                        self._due(spec, float(at), lower_only=False)
                    else:
                        self.client.zrem(k.LIMITS_DUE, k.LimitKeys.of(spec.name, spec.value).due_member)
        return picked

    @wrap
    def leave(self, name: str, value: str, member: str) -> None:
        """A waiting phase leaves the wait queue of limit ``name`` (key value ``value``)."""
        self._limit_call("leave", [Spec("rate", name, value)], 0.0, member, globals_=False)

    @wrap
    def renew_slots(self, specs: Sequence[Spec], holder: str, expiry: float, now: float) -> None:
        for group in self._groups(specs)[1]:
            self._limit_call("renew", group, now, "", holder, expiry, globals_=False)

    @wrap
    def count_tokens(self, specs: Sequence[Spec], member: str, amount: int, now: float) -> None:
        for group in self._groups(specs)[1]:
            self._limit_call("tokens", group, now, member, amount=amount, globals_=False)

    def _due(self, spec: Spec, at: float, lower_only: bool) -> None:
        member = k.LimitKeys.of(spec.name, spec.value).due_member
        if lower_only:
            self.client.zadd(k.LIMITS_DUE, {member: at}, lt=True)
        else:
            self.client.zadd(k.LIMITS_DUE, {member: at})

    @wrap
    def due_limits(self, now: float, count: int = 32) -> list[tuple[str, str]]:
        """The wait queues to look at now: (limit name, key value)."""
        rows = self.client.zrangebyscore(k.LIMITS_DUE, "-inf", now, start=0, num=count)
        return [(found.name, found.value) for found in map(k.LimitKeys.of_due, rows)]

    @wrap
    def declared(self, name: str, value: str) -> Spec:
        """A limit's spec as it was last declared (what limits.lua noted), for a wait queue's key value."""
        meta = self.client.hgetall(k.LimitKeys.of(name).meta)
        return Spec(meta.get("kind", "rate"), name, value, rate=int(float(meta.get("rate") or 0)),
                    per_s=float(meta.get("per_s") or 0), unit=meta.get("unit", "starts"),
                    limit=int(float(meta.get("limit") or 0)))

    @wrap
    def next_due(self) -> float | None:
        rows = self.client.zrange(k.LIMITS_DUE, 0, 0, withscores=True)
        return float(rows[0][1]) if rows else None

    # operators ------------------------------------------------------------------------------------
    @wrap
    def set_limit(self, name: str, values: dict[str, float | int | None]) -> dict[str, str]:
        """Override a limit's numbers fleet-wide (None removes that override); the overrides after."""
        cfg = k.LimitKeys.of(name).cfg
        pipe = self.client.pipeline(transaction=True)
        for field, value in values.items():
            if field not in OVERRIDABLE:
                raise ValueError(f"limit field {field!r} is not one of {OVERRIDABLE}")
            if value is None:
                pipe.hdel(cfg, field)
            else:
                pipe.hset(cfg, field, repr(value) if isinstance(value, float) else str(value))
        pipe.sadd(k.LIMIT_NAMES, name)
        pipe.execute()
        # the waiting phases are looked at again with the new numbers
        for member in self.client.zrange(k.LIMITS_DUE, 0, -1):
            if member.partition("|")[0] == name:
                self.client.zadd(k.LIMITS_DUE, {member: 0})
        return dict(self.client.hgetall(cfg))

    @wrap
    def limit_uses(self, now: float, per_limit: int = 50) -> list[LimitUse]:
        """Every known limit's use and queue, per key value (at most ``per_limit`` values each)."""
        found: list[LimitUse] = []
        for name in sorted(self.client.smembers(k.LIMIT_NAMES)):
            tag = k.LimitKeys.of(name)
            override = dict(self.client.hgetall(tag.cfg))
            meta = dict(self.client.hgetall(tag.meta))
            declared = {**meta, **override}
            values = ["", *sorted(self.client.smembers(tag.values))[:per_limit]]
            per_s = float(declared.get("per_s") or 0)
            for value in values[:per_limit + 1]:
                keys = k.LimitKeys.of(name, value)
                pipe = self.client.pipeline(transaction=False)
                conc = meta.get("kind") == "conc"
                # slots not expired yet, or the window's uses (ZRANGEBYSCORE: the reads every role may run)
                pipe.zrangebyscore(keys.use, repr(now) if conc else f"({now - per_s!r}", "+inf")
                pipe.zcard(keys.wait)
                use, waiting = pipe.execute()
                used = len(use) if conc else _window_use(use, meta.get("unit", "starts"))
                if not used and not waiting and value:
                    continue
                found.append(LimitUse(name, value, used, int(waiting), override, meta))
        return found


def _window_use(members: list[str], unit: str) -> int:
    """A window's starts, or its tokens (members "<wait member>|<tokens>")."""
    if unit != "tokens":
        return len(members)
    return sum(int(m.rpartition("|")[2]) for m in members if m.rpartition("|")[2].isdigit())


def limit_keys(specs: Sequence[Spec], globals_: bool = True) -> list[str]:
    """limits.lua's KEYS for ``specs`` (six per limit), then, with ``globals_`` (a single Redis),
    the due set and the names set."""
    keys = [key for spec in specs for key in k.LimitKeys.of(spec.name, spec.value).all()]
    return [*keys, k.LIMITS_DUE, k.LIMIT_NAMES] if globals_ else keys


def limit_argv(op: str, specs: Sequence[Spec], now: float, member: str = "", holder: str = "",
               expiry: float = 0.0, amount: int = 0) -> list[str | int | float]:
    """limits.lua's ARGV (lib_limits.lua)."""
    return [op, repr(now), member, holder, repr(expiry),
            json.dumps([spec.dump() for spec in specs], separators=(",", ":")), amount]


def as_number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None

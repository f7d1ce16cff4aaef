"""Fleet flow control, the pure part: what a phase asks of limits.lua (``Spec``), how a waiting
phase is named in a wait queue (``Waiter``), and a plain-Python model of the script's window
arithmetic (``Model``), which the property test holds the script to.

The rules (SPEC §10): a rate limit admits a phase when fewer than ``rate`` starts (or, in
tokens, fewer than ``rate`` tokens reported) fall in the last ``per_s`` seconds; a concurrency
limit when fewer than ``limit`` slots of its key value are held (a slot expires with its phase's
lease); and in both only when no phase that waits longer could take that room first (oldest
first). A refused phase waits in the queue of the first limit that refused it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from taskloop.define.limits import Concurrency, Limit, RateLimit

MAX_VALUE_CHARS = 100  # a longer key value is stored as its digest (it names Redis keys)
RESENT_S = 5.0  # limits.lua: a waiter sent again less than this long ago is on its way
WAKE_SCAN = 2000  # limits.lua: how far into its wait queue a wake looks
GONE_S = 120.0  # limits.lua: a waiter sent again this long ago that never came back is gone


@dataclass(frozen=True)
class Spec:
    """One limit as one phase meets it: the declared numbers (an operator's override in Redis wins
    over them, inside the script) and, for a concurrency limit, the key value."""

    kind: str  # "rate" | "conc"
    name: str
    value: str = ""
    rate: int = 0
    per_s: float = 0.0
    unit: str = "starts"
    limit: int = 0

    def dump(self) -> dict[str, Any]:
        return {"k": self.kind, "n": self.name, "v": self.value, "r": self.rate, "p": self.per_s, "u": self.unit,
                "l": self.limit}

    @property
    def tokens(self) -> bool:
        return self.kind == "rate" and self.unit == "tokens"


def spec_of(limit: Limit, value: object = None) -> Spec:
    """The spec of a declared limit; ``value``: what a Concurrency's ``key(ctx)`` returned."""
    if isinstance(limit, RateLimit):
        return Spec("rate", limit.name, rate=limit.rate, per_s=limit.per_s, unit=limit.unit)
    assert isinstance(limit, Concurrency)
    return Spec("conc", limit.name, value=key_value(limit, value), limit=limit.limit)


def key_value(limit: Concurrency, value: object) -> str:
    """A concurrency key value as it names its slots: a string or an integer; a long one by digest."""
    if limit.key is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise ValueError(f"Concurrency {limit.name}: key(ctx) must return a non-empty string or an integer, "
                         f"got {type(value).__name__} {value!r:.80}")
    text = str(value)
    if len(text) > MAX_VALUE_CHARS or not text.isprintable():
        return "sha1-" + hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()
    return text


@dataclass(frozen=True)
class Waiter:
    """A phase in a wait queue: enough to send its message again without reading its run."""

    run_id: str
    key: str
    phase: str
    round: int
    token: int
    workflow: str
    queue: str = ""

    def member(self) -> str:
        # run ids, task keys and workflow names hold no '|' (base/names.py); the queue comes last
        return "|".join((self.run_id, self.key, self.phase, str(self.round), str(self.token), self.workflow,
                         self.queue))

    @property
    def holder(self) -> str:
        """The member of a concurrency limit's slots: the phase's task in its run."""
        return f"{self.run_id}|{self.key}"

    @classmethod
    def parse(cls, member: str) -> Waiter | None:
        parts = member.split("|", 6)
        if len(parts) != 7 or not parts[3].isdigit() or not parts[4].isdigit():
            return None
        return cls(parts[0], parts[1], parts[2], int(parts[3]), int(parts[4]), parts[5], parts[6])


def unkeyed_specs(limits: Sequence[Limit]) -> tuple[Spec, ...] | None:
    """The specs of limits that need no ``key(ctx)`` (rate limits, concurrency without a key): the
    scheduler can name them when it queues the phase, so its begin takes the room (begin.lua).
    None when a concurrency limit has a key: the worker computes it before it takes the room."""
    if any(isinstance(limit, Concurrency) and limit.key is not None for limit in limits):
        return None
    return tuple(spec_of(limit) for limit in limits)


def limits_tag(specs: Sequence[Spec], workflow: str, queue: str) -> str:
    """What a prepared begin says of the phase's limits, and what a worker that takes its room in
    begin.lua must present the same of: the specs and what names the phase's wait member."""
    return json.dumps({"s": [spec.dump() for spec in specs], "w": workflow, "q": queue},
                      separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class LimitOp:
    """A limits.lua operation made in the same call as a run's write: ``acquire`` in the begin of a
    phase (begin.lua, ``tag``: the limits as limits_tag names them; or the full path's write that
    begins it, cas_limits.lua), ``wake`` (release ``holder``'s slots) with the outcome that ends the
    phase (cas_limits.lua)."""

    op: str
    specs: tuple[Spec, ...]
    member: str = ""
    holder: str = ""
    tag: str = ""
    now: float = 0.0
    expiry: float = 0.0  # acquire: when the slots expire (the phase's lease)


# --- the model of limits.lua's arithmetic ---------------------------------------------------------


@dataclass
class Model:
    """One limit (one key value) as limits.lua keeps it, in plain Python: the window's uses (time,
    amount), the held slots (holder -> expiry) and the queue (member -> since)."""

    spec: Spec
    uses: list[tuple[float, int, str]] = field(default_factory=list)  # (time, starts or tokens, member)
    held: dict[str, float] = field(default_factory=dict)
    queue: dict[str, float] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)  # waiters a wake picked -> when
    clock: float = 0.0  # the latest time a call gave: time only moves forward within a limit

    def _now(self, now: float) -> float:
        self.clock = max(self.clock, now)
        return self.clock

    def _room(self, now: float) -> tuple[float, float | None]:
        spec = self.spec
        if spec.kind == "conc":
            self.held = {h: until for h, until in self.held.items() if until >= now}
            first = min(self.held.values(), default=None)
            return spec.limit - len(self.held), first
        self.uses = sorted((t, n, m) for t, n, m in self.uses if t > now - spec.per_s)
        if spec.unit == "tokens":
            total = sum(n for _, n, _ in self.uses)
            again, left = None, total
            for t, n, _ in self.uses:
                if left < spec.rate:
                    break
                left -= n
                again = t + spec.per_s
            return (float("inf") if total < spec.rate else 0.0), again
        used = len(self.uses)
        again = self.uses[used - spec.rate][0] + spec.per_s if used >= spec.rate else None
        return spec.rate - used, again

    def acquire(self, now: float, member: str, holder: str, expiry: float) -> bool:
        now = self._now(now)
        spec = self.spec
        if spec.kind == "conc" and self.held.get(holder, now - 1) >= now:
            self.held[holder] = expiry  # its replay: the slot is its own, until the new lease
            self.queue.pop(member, None)
            return True
        if spec.kind == "rate" and not spec.tokens and any(m == member and t > now - spec.per_s
                                                           for t, _, m in self.uses):
            self.queue.pop(member, None)
            self.sent.pop(member, None)
            # its start is in the window already (a wake reserved it, or its message came twice): it
            # counts from now on (limits.lua acquire)
            self.uses = [(max(t, now), n, m) if m == member else (t, n, m) for t, n, m in self.uses]
            return True
        room, _ = self._room(now)
        order = self._order()
        rank = order.index(member) if member in self.queue else None
        ahead = rank if rank is not None else len(order)
        picked = rank is not None and member in self.sent
        ok = room > 0 and ((rank is not None or ahead == 0) if spec.tokens else (picked or ahead < room))
        self.sent.pop(member, None)
        if not ok:
            self.queue.setdefault(member, now)
            return False
        if spec.kind == "conc":
            self.held[holder] = expiry
        elif not spec.tokens:
            self.uses.append((now, 1, member))
        self.queue.pop(member, None)
        return True

    def _order(self) -> list[str]:
        return sorted(self.queue, key=lambda m: (self.queue[m], m))

    def wake(self, now: float, holder: str = "") -> list[str]:
        """Release ``holder``'s slot and pick the oldest waiters there is room for (limits.lua wake)."""
        now = self._now(now)
        if self.spec.kind == "conc" and holder:
            self.held.pop(holder, None)
        room, _ = self._room(now)
        starts = self.spec.kind == "rate" and not self.spec.tokens
        picked: list[str] = []
        for member in self._order()[:WAKE_SCAN]:
            if room <= 0:
                break
            last = self.sent.get(member)
            if last is not None and now - last > GONE_S:
                del self.queue[member], self.sent[member]
                continue
            if last is None or now - last >= RESENT_S:
                picked.append(member)
                self.sent[member] = now
                if starts and not any(m == member for _, _, m in self.uses):
                    self.uses.append((now, 1, member))  # its start counts now (limits.lua wake)
                room -= 1
            elif not (starts and any(m == member and t > now - self.spec.per_s for t, _, m in self.uses)):
                room -= 1  # on its way, and what it will take is not counted yet
        return picked

    def report(self, now: float, tokens: int, member: str = "") -> None:
        now = self._now(now)
        if tokens > 0:  # limits.lua keeps one entry per report ("<member>|<tokens>": the same one again moves it)
            entry = f"{member}|{tokens}"
            self.uses = [use for use in self.uses if use[2] != entry] + [(now, tokens, entry)]

    def retry_at(self, now: float) -> float | None:
        """When the window reopens or the first slot expires (None: it has room, or nothing to wait for)."""
        room, again = self._room(now)
        return None if room > 0 else again

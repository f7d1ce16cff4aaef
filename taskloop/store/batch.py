"""Build the program of ``cas.lua``: guards first, then writes (see the script's header)."""

from __future__ import annotations

import json
from typing import Any

from taskloop.events import Event, entry_fields
from taskloop.store import keys as k


class Writes:
    """The writes of a batch (or of its finishing part): one HSET, HDEL, ... per kind."""

    def __init__(self) -> None:
        self.hset: dict[str, str] = {}
        self.hdel: list[str] = []
        self.hincr: dict[str, int] = {}
        self.events: list[Event] = []
        self.leases: dict[str, float] = {}
        self.unlease: list[str] = []
        self.end_marker: str | None = None
        self.ttl: int | None = None
        self.ttl_leases = False  # the run ends with leases left (an abort): they expire too
        self.revive = False

    def program(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.hset:
            out["h"] = [item for pair in self.hset.items() for item in pair]
        if self.hdel:
            out["d"] = self.hdel
        if self.hincr:
            out["i"] = [[name, amount] for name, amount in self.hincr.items() if amount]
        if self.events:
            out["x"] = [entry_fields(self.events)]
        if self.leases:
            out["l"] = [item for member, until in self.leases.items() for item in (until, member)]
        if self.unlease:
            out["r"] = self.unlease
        if self.end_marker is not None:
            out["e"] = self.end_marker
        if self.ttl is not None:
            out["t"] = self.ttl
            if self.ttl_leases:
                out["tl"] = True
        if self.revive:
            out["p"] = True
        return out


class Batch(Writes):
    """A guarded batch write against the keys of one run. Nothing is sent until the store applies it."""

    def __init__(self, run_id: str) -> None:
        super().__init__()
        self.run_id = run_id
        self.keys = k.RunKeys.of(run_id)
        self.guards: list[list[Any]] = []
        self.labels: list[str] = []  # what each guard protects, for conflict reports
        self.open_delta = 0  # added to n:open; when it reaches 0, `final` is applied too
        self.final = Writes()
        self.finishes = False  # the batch ends the run whatever n:open says (an abort)
        self.pushes: list[list[Any]] = []  # broker commands run with the writes (outbox.py)
        self.broker_keys: list[str] = []
        self.indexes: list[tuple[str, str, float]] = []  # (index key, member, score) before the write
        self.stats: dict[str, int] = {}  # fleet counters (tl:stats) added in the same round trip

    # guards ---------------------------------------------------------------------------------
    def expect(self, field: str, value: str | None, label: str = "") -> Batch:
        """The field must still hold ``value`` (None: must be absent)."""
        self.guards.append(["nx", field] if value is None else ["eq", field, value])
        self.labels.append(label or field)
        return self

    def exists(self, field: str, label: str = "") -> Batch:
        self.guards.append(["ex", field])
        self.labels.append(label or field)
        return self

    def one_of(self, field: str, values: list[str], label: str = "") -> Batch:
        self.guards.append(["in", field, values])
        self.labels.append(label or field)
        return self

    def cap(self, field: str, limit: int, add: int, label: str) -> Batch:
        self.guards.append(["cap", field, limit, add])
        self.labels.append(label)
        return self

    # writes ---------------------------------------------------------------------------------
    def set(self, field: str, value: str) -> Batch:
        self.hset[field] = value
        return self

    def delete(self, field: str) -> Batch:
        self.hdel.append(field)
        return self

    def incr(self, field: str, amount: int) -> Batch:
        if amount:
            self.hincr[field] = self.hincr.get(field, 0) + amount
        return self

    def event(self, event: Event) -> Batch:
        self.events.append(event)
        return self

    def lease(self, key: str, until: float | None) -> Batch:
        if until is None:
            self.leases.pop(key, None)
            self.unlease.append(key)
        else:
            self.leases[key] = until
        return self

    def push(self, name: str, key: str, *args: Any) -> Batch:
        """A broker command (LPUSH of a Celery message) to run if the guards hold."""
        if key not in self.broker_keys:
            self.broker_keys.append(key)
        self.pushes.append([name, len(k.RunKeys.of(self.run_id).all()) + self.broker_keys.index(key) + 1,
                            *[a.decode() if isinstance(a, bytes) else a for a in args]])
        return self

    def index(self, key: str, member: str, score: float) -> Batch:
        """A global index entry, written in the same round trip just before the script (outside it,
        so that the script touches one run's slot only)."""
        self.indexes.append((key, member, score))
        return self

    def all_keys(self) -> list[str]:
        return [*self.keys.all(), *self.broker_keys]

    def argv(self) -> list[str]:
        program: dict[str, Any] = {"g": self.guards, "w": self.program()}
        if self.pushes:
            program["q"] = self.pushes
        if self.open_delta:
            program["z"] = {"n": self.open_delta, "w": self.final.program()}
        return [json.dumps(program, separators=(",", ":"), ensure_ascii=False)]

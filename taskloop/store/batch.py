"""Build the program of ``cas.lua``: guards first, then writes (see the script's header)."""

from __future__ import annotations

import json
from typing import Any

from taskloop.events import Event
from taskloop.store import keys as k


class Batch:
    """A guarded batch write against the keys of one run. Nothing is sent until the store applies it."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.keys = k.RunKeys.of(run_id)
        self.guards: list[list[Any]] = []
        self.writes: list[list[Any]] = []
        self.events: list[Event] = []
        self.labels: list[str] = []  # what each guard protects, for conflict reports

    # guards ---------------------------------------------------------------------------------
    def expect(self, key_index: int, field: str, value: str | None, label: str = "") -> Batch:
        self.guards.append(["nx", key_index, field] if value is None else ["eq", key_index, field, value])
        self.labels.append(label or field)
        return self

    def expect_task(self, key: str, raw: str | None) -> Batch:
        return self.expect(k.K_TASKS, key, raw, f"task:{key}")

    def cap(self, key_index: int, field: str, limit: int, add: int, label: str) -> Batch:
        self.guards.append(["cap", key_index, field, limit, add])
        self.labels.append(label)
        return self

    # writes ---------------------------------------------------------------------------------
    def hset(self, key_index: int, field: str, value: str) -> Batch:
        self.writes.append(["hset", key_index, field, value])
        return self

    def hdel(self, key_index: int, field: str) -> Batch:
        self.writes.append(["hdel", key_index, field])
        return self

    def hincr(self, key_index: int, field: str, amount: int) -> Batch:
        if amount:
            self.writes.append(["hincr", key_index, field, amount])
        return self

    def event(self, event: Event) -> Batch:
        self.writes.append(["xadd", k.K_EVENTS, *event.to_fields()])
        self.events.append(event)
        return self

    def lease(self, key: str, until: float | None) -> Batch:
        member = k.lease_member(self.run_id, key)
        if until is None:
            self.writes.append(["zrem", k.K_LEASES, member])
        else:
            self.writes.append(["zadd", k.K_LEASES, until, member])
        return self

    def index(self, created_at: float) -> Batch:
        self.writes.append(["zadd", k.K_INDEX, created_at, self.run_id])
        return self

    def end(self, status: str) -> Batch:
        """Mark the run as ended on its end stream (what wait() blocks on)."""
        self.writes.append(["rpush", k.K_END, status])
        return self

    def expire_run(self, seconds: int) -> Batch:
        for index in k.RUN_SCOPED:
            self.writes.append(["expire", index, seconds])
        return self

    def persist_run(self) -> Batch:
        """Undo expire_run and end: a resumed run is live again."""
        for index in k.RUN_SCOPED:
            self.writes.append(["persist", index])
        self.writes.append(["del", k.K_END])
        return self

    def argv(self) -> list[str]:
        program = {"g": self.guards, "w": self.writes}
        return [json.dumps(program, separators=(",", ":"), ensure_ascii=False)]

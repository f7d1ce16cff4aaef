"""Build the ARGV program of ``cas.lua``: guards first, then writes (see the script's header)."""

from __future__ import annotations

from taskloop.events import Event
from taskloop.phases import TaskRecord
from taskloop.store import keys as k


class Batch:
    """A guarded batch write against the keys of one run. Nothing is sent until the store applies it."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.keys = k.RunKeys.of(run_id)
        self.guards: list[str | int | float] = []
        self.n_guards = 0
        self.writes: list[str | int | float] = []
        self.events: list[Event] = []
        self.labels: list[str] = []  # what each guard protects, for conflict reports

    # guards ---------------------------------------------------------------------------------
    def expect(self, key_index: int, field: str, value: str | None, label: str = "") -> Batch:
        if value is None:
            self.guards += ["nx", key_index, field]
        else:
            self.guards += ["eq", key_index, field, value]
        self.n_guards += 1
        self.labels.append(label or field)
        return self

    def expect_task(self, key: str, raw: str | None) -> Batch:
        return self.expect(k.K_TASKS, key, raw, f"task:{key}")

    def cap(self, key_index: int, field: str, limit: int, add: int, label: str) -> Batch:
        self.guards += ["cap", key_index, field, limit, add]
        self.n_guards += 1
        self.labels.append(label)
        return self

    # writes ---------------------------------------------------------------------------------
    def hset(self, key_index: int, field: str, value: str | int | float) -> Batch:
        self.writes += ["hset", key_index, field, value]
        return self

    def put_task(self, record: TaskRecord) -> Batch:
        return self.hset(k.K_TASKS, record.key, record.dump())

    def hdel(self, key_index: int, field: str) -> Batch:
        self.writes += ["hdel", key_index, field]
        return self

    def hincr(self, key_index: int, field: str, amount: int) -> Batch:
        if amount:
            self.writes += ["hincr", key_index, field, amount]
        return self

    def event(self, event: Event) -> Batch:
        fields = event.to_fields()
        self.writes += ["xadd", k.K_EVENTS, len(fields) // 2, *fields]
        self.events.append(event)
        return self

    def lease(self, key: str, until: float | None) -> Batch:
        member = k.lease_member(self.run_id, key)
        if until is None:
            self.writes += ["zrem", k.K_LEASES, member]
        else:
            self.writes += ["zadd", k.K_LEASES, repr(until), member]
        return self

    def index(self, created_at: float) -> Batch:
        self.writes += ["zadd", k.K_INDEX, repr(created_at), self.run_id]
        return self

    def expire_run(self, seconds: int) -> Batch:
        for index in (k.K_RUN, k.K_TASKS, k.K_DATA, k.K_EVENTS):
            self.writes += ["expire", index, seconds]
        return self

    def persist_run(self) -> Batch:
        """Undo expire_run: a resumed run is live again."""
        for index in (k.K_RUN, k.K_TASKS, k.K_DATA, k.K_EVENTS):
            self.writes += ["persist", index]
        return self

    def argv(self) -> list[str | int | float]:
        return [self.n_guards, *self.guards, *self.writes]

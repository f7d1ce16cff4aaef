"""Typed reads of a run hash: ``RunMeta`` (the run's own fields) and ``Snapshot`` (what a decision
has read of a run, loaded field by field as it is needed)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from taskloop.base.errors import CorruptRecord
from taskloop.core import fields as fld
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.states import RunStatus, Termination

Loader = Callable[[list[str]], list[str | None]]
_TERMINAL = {RunStatus.DONE.value, RunStatus.FAILED.value, RunStatus.CANCELLED.value, RunStatus.REJECTED.value}


def _int(value: str | None) -> int:
    return int(value) if value else 0


def _float(value: str | None) -> float | None:
    return float(value) if value else None


@dataclass(frozen=True)
class RunMeta:
    """The run's own fields, typed. ``status`` is derived: a live run whose only unfinished work is
    paused gates is ``waiting``."""

    run_id: str
    workflow: str
    version: str
    fingerprint: str | None
    format: str | None
    created: float
    finished: float | None
    stored_status: str
    control: str | None
    termination: Termination | None
    rejected: bool
    open: int
    active: int
    paused: int
    error: ErrorRecord | None

    @classmethod
    def from_fields(cls, run_id: str, fields: dict[str, str | None]) -> RunMeta:
        term = fields.get(fld.F_TERMINATION)
        error = fields.get(fld.F_ERROR)
        return cls(
            run_id=run_id,
            workflow=fields.get(fld.F_WORKFLOW) or "?",
            version=fields.get(fld.F_VERSION) or "",
            fingerprint=fields.get(fld.F_FINGERPRINT),
            format=fields.get(fld.F_FORMAT),
            created=_float(fields.get(fld.F_CREATED)) or 0.0,
            finished=_float(fields.get(fld.F_FINISHED)),
            stored_status=fields.get(fld.F_STATUS) or RunStatus.RUNNING.value,
            control=fields.get(fld.F_CONTROL),
            termination=Termination(term) if term else None,
            rejected=bool(fields.get(fld.F_REJECTED)),
            open=_int(fields.get(fld.F_OPEN)),
            active=_int(fields.get(fld.F_ACTIVE)),
            paused=_int(fields.get(fld.F_PAUSED)),
            error=ErrorRecord.model_validate_json(error) if error else None,
        )

    @property
    def status(self) -> RunStatus:
        if self.stored_status in _TERMINAL or self.stored_status == RunStatus.PENDING.value:
            return RunStatus(self.stored_status)
        if self.paused and not self.active:
            return RunStatus.WAITING
        return RunStatus.RUNNING

    @property
    def terminal(self) -> bool:
        return self.stored_status in _TERMINAL


def decode_usage(fields: Mapping[str, str | None], records: Iterable[TaskRecord]) -> dict[str, Any]:
    """A run's usage: the attempts its tasks consumed (each record counts its own, replays and
    resumes included) and the tokens its callbacks reported."""
    def n(name: str) -> int:
        return _int(fields.get(fld.usage_field(name)))
    return {"attempts": sum(r.attempts for r in records),
            "tokens": {"input": n("input"), "cached": n("cached"), "output": n("output")}}


class Snapshot:
    """What has been read of one run: raw hash fields (None = absent). A field not read yet is
    loaded on first use, together with any others asked for at the same time (one HMGET)."""

    def __init__(self, run_id: str, fields: Mapping[str, str | None] | None = None,
                 loader: Loader | None = None) -> None:
        self.run_id = run_id
        self.fields: dict[str, str | None] = dict(fields or {})
        self._loader = loader
        self._records: dict[str, TaskRecord] = {}

    def ensure(self, names: Iterable[str]) -> None:
        missing = [name for name in dict.fromkeys(names) if name not in self.fields]
        if not missing:
            return
        if self._loader is None:
            self.fields.update(dict.fromkeys(missing))
            return
        self.fields.update(zip(missing, self._loader(missing), strict=True))

    def get(self, name: str) -> str | None:
        self.ensure([name])
        return self.fields[name]

    def forget(self, names: Iterable[str]) -> None:
        """Drop fields so that the next use reads them again (after a conflict)."""
        for name in names:
            self.fields.pop(name, None)
            if name.startswith(fld.TASK_PREFIX):
                self._records.pop(fld.key_of_task_field(name), None)

    @property
    def exists(self) -> bool:
        return self.get(fld.F_WORKFLOW) is not None

    @property
    def control(self) -> str | None:
        return self.get(fld.F_CONTROL)

    def meta(self) -> RunMeta:
        self.ensure(fld.META_FIELDS)
        return RunMeta.from_fields(self.run_id, self.fields)

    def raw_record(self, key: str) -> str | None:
        return self.get(fld.task_field(key))

    def record(self, key: str) -> TaskRecord | None:
        """The task's record, or None when the run has no such task."""
        found = self._records.get(key)
        if found is not None:
            return found
        self.ensure(fld.record_fields(key))
        raw = self.raw_record(key)
        if raw is None:
            return None
        try:
            found = self._records[key] = TaskRecord.load(raw, *(self.fields[f] for f in fld.record_fields(key)[1:]))
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            raise CorruptRecord(self.run_id, key, str(exc).splitlines()[0]) from None
        return found

    def put_record(self, key: str, record: TaskRecord) -> None:
        """A stand-in record for a field that does not parse (the raw bytes stay for the guard)."""
        self._records[key] = record

    def json(self, name: str) -> Any:
        raw = self.get(name)
        return None if raw is None else json.loads(raw)

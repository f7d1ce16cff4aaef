"""Build the program of ``cas.lua``: guards first, then writes (see the script's header)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from taskloop.core import fields as fld
from taskloop.core.events import Event, entry_fields
from taskloop.core.limits import LimitOp


class Index(str, Enum):
    """The global indexes a write may add a run to outside its script (their Redis keys:
    taskloop/store/keys.py). The lists of runs by creation time are ``Listed`` entries."""

    LIVE = "live"  # live runs, by when the reconciler should look at them next


def ended_score(at: float) -> float:
    """The live-index score of a run that ended at ``at``: below every time, so the reconciler's
    next pass takes it, and knows before it reads the run that the run ended (it reads the run
    whole then, to forget and compact it, instead of reading its meta fields first)."""
    return -at


def is_ended_score(score: float) -> bool:
    """Whether a live-index score says the run ended (a hint: the run's own status decides, as a
    run resumed since is listed again at a time)."""
    return score < 0


@dataclass(frozen=True)
class Listed:
    """A run's entry in one of the run lists that ``runs()`` and the UI page through (each a sorted
    set by creation time; their keys: store/keys.py ``run_list``): the runs of one workflow and
    one stored status or every status (``status`` None), or the runs index (both None: every run).
    There is no list of one status across workflows: its pages merge the workflows' lists.
    ``score`` None removes the entry."""

    workflow: str | None
    status: str | None
    score: float | None
    index: Index | None = None  # instead of a run list, a global index (by the index's own score)


ListKey = Callable[[Listed], str]


class Writes:
    """The writes of a batch (or of its finishing part): one HSET, HDEL, ... per kind."""

    def __init__(self, part: str = "e") -> None:
        self.part = part  # the field of the stream entry its events go into (core/events.py)
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
        self.listed: list[Listed] = []

    def list_run(self, workflow: str, status: str, score: float, *, new: bool = False,
                 was: str | None = None) -> None:
        """Enter the run in ``workflow``'s list of ``status`` (a status's runs across workflows are
        those lists merged: store/indexes.py ``list_page``); ``new``: also in the lists of every
        status (the runs index, and the workflow's); ``was``: leave the list of that status."""
        if was is not None and was != status:
            self.listed.append(Listed(workflow, was, None))
        self.listed.append(Listed(workflow, status, score))
        if new:
            self.listed += [Listed(None, None, score), Listed(workflow, None, score)]

    def look_at(self, score: float) -> None:
        """Put the run in the live index at ``score``: the reconciler looks at it then (a run that
        ends is looked at, forgotten and compacted at the next pass)."""
        self.listed.append(Listed(None, None, score, Index.LIVE))

    def unlist_run(self, workflow: str, status: str) -> None:
        """Leave every run list (a run deleted as it ends)."""
        self.listed += [Listed(workflow, status, None), Listed(None, None, None), Listed(workflow, None, None)]

    def program(self, list_keys: dict[str, int] | None = None, key_of: ListKey | None = None) -> dict[str, Any]:
        """The writes as cas.lua takes them; ``list_keys`` gives each run list's position among
        the script's extra KEYS (None: the store writes the lists itself, after the script)."""
        out: dict[str, Any] = {}
        if self.hset:
            out["h"] = [item for pair in self.hset.items() for item in pair]
        if self.hdel:
            out["d"] = self.hdel
        if self.hincr:
            out["i"] = [[name, amount] for name, amount in self.hincr.items() if amount]
        if self.events:
            out["x"] = [entry_fields(self.events, self.part)]
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
        if self.listed and list_keys is not None and key_of is not None:
            out["k"] = [[list_keys[key_of(entry)], entry.score if entry.score is not None else False]
                        for entry in self.listed]
        return out


class Batch(Writes):
    """A guarded batch write against the keys of one run. Nothing is sent until the store applies it."""

    def __init__(self, run_id: str) -> None:
        super().__init__()
        self.run_id = run_id
        self.guards: list[list[Any]] = []
        self.labels: list[str] = []  # what each guard protects, for conflict reports
        self.open_delta = 0  # added to n:open; when it reaches 0, `final` is applied too
        self.final = Writes(part="z")
        self.finishes = False  # the batch ends the run whatever n:open says (an abort)
        self.pushes: list[list[Any]] = []  # broker commands run with the writes (outbox.py)
        self.broker_keys: list[str] = []  # cas.lua's KEYS[5..]: the broker lists, then the run lists
        self.indexes: list[tuple[Index, str, float]] = []  # (index, member, score) before the write
        self.stats: dict[str, int] = {}  # fleet counters (tl:stats) added in the same round trip
        self.limits: LimitOp | None = None  # a fleet-limits operation made in the same call (a slot's release)

    @property
    def sets_control(self) -> bool:
        """Whether the write sets the run's control flag (a cancel, a stop): the store then tells the
        watchers of the run's running phases (store/running.py, the controls feed)."""
        return fld.F_CONTROL in self.hset or fld.F_CONTROL in self.final.hset

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
            if key in self.unlease:  # the last word on a key wins (cas.lua adds leases, then removes)
                self.unlease.remove(key)
        return self

    def push(self, name: str, key: str, *args: Any) -> Batch:
        """A broker command (LPUSH of a Celery message) to run if the guards hold; it names its list by
        position among the write's broker keys (cas.lua: KEYS[4 + n])."""
        if key not in self.broker_keys:
            self.broker_keys.append(key)
        self.pushes.append([name, self.broker_keys.index(key) + 1,
                            *[a.decode() if isinstance(a, bytes) else a for a in args]])
        return self

    def all_listed(self, finished: bool = True) -> list[Listed]:
        """The run-list writes of the batch (with the finishing part's when ``finished``)."""
        return [*self.listed, *(self.final.listed if finished else ())]

    def index(self, key: Index, member: str, score: float) -> Batch:
        """A global index entry, written in the same round trip just before the script (outside it,
        so that the script touches one run's slot only)."""
        self.indexes.append((key, member, score))
        return self

    def list_keys(self, key_of: ListKey) -> list[str]:
        """The run lists the batch writes, each once, in first-use order."""
        return list(dict.fromkeys(key_of(entry) for entry in self.all_listed()))

    def argv(self, key_of: ListKey | None = None) -> list[str]:
        """ARGV[1] of cas.lua. With ``key_of``, the run-list writes go into the script, their keys
        after the broker lists among its KEYS (``[*broker_keys, *list_keys(key_of)]``)."""
        positions: dict[str, int] | None = None
        if key_of is not None:
            start = len(self.broker_keys) + 1
            positions = {key: start + i for i, key in enumerate(self.list_keys(key_of))}
        program: dict[str, Any] = {"g": self.guards, "w": self.program(positions, key_of)}
        if self.pushes:
            program["q"] = self.pushes
        if self.open_delta:
            program["z"] = {"n": self.open_delta, "f": fld.F_OPEN, "w": self.final.program(positions, key_of)}
        return [json.dumps(program, separators=(",", ":"), ensure_ascii=False)]

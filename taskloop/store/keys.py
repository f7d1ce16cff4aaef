"""Every Redis key name taskloop uses. Nothing else builds key names.

Run-scoped keys carry the run id as a hash tag (``{run_id}``) so that one run lives in one
cluster slot and every compare-and-set of a run touches a single slot. The two global indexes
(runs by creation time, leases by expiry) are the only keys outside a run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from taskloop.errors import InvalidInput

PREFIX = "tl"
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}\Z")

RUNS_INDEX = f"{PREFIX}:runs"  # ZSET run_id -> created_at (epoch seconds)
LEASES = f"{PREFIX}:leases"  # ZSET "<run_id> <task key>" -> lease expiry (epoch seconds)
STATS = f"{PREFIX}:stats"  # HASH of global counters (stale-token rejections, ...)
RECONCILER_LOCK = f"{PREFIX}:reconciler"  # STRING: which worker runs this reconcile pass


def check_run_id(run_id: object) -> str:
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id):
        raise InvalidInput(
            f"run_id {run_id!r} is invalid: use 1-200 characters from [A-Za-z0-9._:-], starting "
            "with a letter or digit (or pass run_id=None for a generated one)"
        )
    return run_id


@dataclass(frozen=True)
class RunKeys:
    """The keys of one run, in the order the Lua scripts expect them (KEYS[1..8])."""

    run: str  # HASH: workflow, version, fingerprint, input, status, control, usage counters
    tasks: str  # HASH: task key -> TaskRecord JSON
    data: str  # HASH: values, round candidates and checks, errors' tracebacks, usage receipts
    events: str  # STREAM: the run's event history
    end: str  # LIST: one element once the run has ended (what wait() blocks on)
    leases: str = LEASES
    index: str = RUNS_INDEX
    stats: str = STATS

    @classmethod
    def of(cls, run_id: str) -> RunKeys:
        tag = f"{PREFIX}:{{{run_id}}}"
        return cls(run=f"{tag}:run", tasks=f"{tag}:tasks", data=f"{tag}:data", events=f"{tag}:events",
                   end=f"{tag}:end")

    def all(self) -> list[str]:
        return [self.run, self.tasks, self.data, self.events, self.leases, self.index, self.stats, self.end]


# Indexes into RunKeys.all() as the Lua scripts see them (1-based).
K_RUN, K_TASKS, K_DATA, K_EVENTS, K_LEASES, K_INDEX, K_STATS, K_END = range(1, 9)
RUN_SCOPED = (K_RUN, K_TASKS, K_DATA, K_EVENTS, K_END)


def lease_member(run_id: str, key: str) -> str:
    return f"{run_id} {key}"


def parse_lease_member(member: str) -> tuple[str, str]:
    run_id, _, key = member.partition(" ")
    return run_id, key


# Field names inside the data hash.
def value_field(key: str) -> str:
    return f"v:{key}"


def candidate_field(key: str, round: int) -> str:
    return f"o:{key}:{round}"


def check_field(key: str, round: int) -> str:
    return f"c:{key}:{round}"


def begin_field(key: str) -> str:
    """The begin that the scheduler prepared for a queued phase (read by begin.lua)."""
    return f"b:{key}"


def receipt_field(receipt: str) -> str:
    return f"rcpt:{receipt}"


def cache_fingerprint_field(key: str) -> str:
    """The cache fingerprint a task computed before its first attempt (written back on success)."""
    return f"fp:{key}"


def cache_key(fingerprint: str) -> str:
    """The default cache store's entry (global: shared by runs)."""
    return f"{PREFIX}:cache:{fingerprint}"

"""Every Redis key and hash-field name taskloop uses. Nothing else builds them.

A run owns four keys, all hash-tagged with ``{run_id}`` so that they share one cluster slot and
every script of a run touches a single slot:

``tl:{R}``          HASH    the run: its meta fields, one field per task record, and the data
                            (input, values, candidates, checks, prepared begins, receipts)
``tl:{R}:events``   STREAM  the run's events
``tl:{R}:end``      LIST    one element once the run has ended (what ``wait()`` blocks on)
``tl:{R}:leases``   ZSET    task key -> lease expiry (epoch seconds)

A phase reads and writes only the fields it needs (``HMGET``), never the whole hash, so its
cost does not depend on the size of its run.

The global keys are indexes, written outside the run scripts (so a run never needs a second
slot): ``tl:runs`` (runs by creation time, for ``taskloop runs``), ``tl:live`` (live runs by
the time the reconciler should next look at them), ``tl:stats`` (fleet counters).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from taskloop.errors import InvalidInput

PREFIX = "tl"
FORMAT = "2"  # the record layout below; a run written in another layout is refused
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}\Z")

RUNS_INDEX = f"{PREFIX}:runs"  # ZSET run_id -> created_at
LIVE_INDEX = f"{PREFIX}:live"  # ZSET run_id -> when the reconciler should look at the run next
STATS = f"{PREFIX}:stats"  # HASH of fleet counters (stale deliveries, ...)
RECONCILER_LOCK = f"{PREFIX}:reconciler"  # STRING: which process runs this reconcile pass
RECONCILER_LAST = f"{PREFIX}:reconciler:last"  # STRING: JSON report of the last reconcile pass


def started_stat(workflow: str) -> str:
    """The fleet counter of runs started (start requests) of a workflow."""
    return f"started:{workflow}"


def finished_stat(workflow: str, status: str, termination: str) -> str:
    """The fleet counter of runs that ended so (counted as the reconciler forgets them)."""
    return f"finished:{workflow}:{status}:{termination}"


def check_run_id(run_id: object) -> str:
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id):
        raise InvalidInput(
            f"run_id {str(run_id)[:80]!r} is invalid: use 1-200 characters from [A-Za-z0-9._:-], starting "
            "with a letter or digit (or pass run_id=None for a generated one)"
        )
    return run_id


@dataclass(frozen=True)
class RunKeys:
    """The keys of one run, in the order the Lua scripts take them (KEYS[1..4])."""

    run: str
    events: str
    end: str
    leases: str

    @classmethod
    def of(cls, run_id: str) -> RunKeys:
        tag = f"{PREFIX}:{{{run_id}}}"
        return cls(run=tag, events=f"{tag}:events", end=f"{tag}:end", leases=f"{tag}:leases")

    def all(self) -> list[str]:
        return [self.run, self.events, self.end, self.leases]


# --- fields of the run hash ----------------------------------------------------------------------
# Run meta (short names: they are stored once per run and read by most calls).
F_FORMAT = "fmt"
F_WORKFLOW = "wf"
F_VERSION = "ver"
F_FINGERPRINT = "fp"
F_CREATED = "created"
F_FINISHED = "finished"
F_STATUS = "status"  # "pending" | "running" | a terminal status ("waiting" is derived, see RunMeta)
F_CONTROL = "ctl"  # absent while the run may progress; "cancel:<reason>" or "stop:<reason>"
F_TERMINATION = "term"  # the termination of the first failure (set once)
F_REJECTED = "rej"  # set once a gate was rejected
F_INPUT = "input"  # the run input (JSON), read only when a callback asks for ctx.input
F_INPUT_DIGEST = "idem"  # sha256 of the canonical input: a second start with the same run_id compares it
F_GATES = "gates"  # JSON list of the run's gate keys (what a cancel must settle without the definition)
F_ERROR = "err"  # JSON ErrorRecord of a run that failed before any task ran (unknown workflow, ...)
F_STATE = "state"  # a graph run's business state (JSON)
F_ACTIVATIONS = "n:acts"  # a graph run's activations dispatched so far (what max_transitions bounds)
F_OPEN = "n:open"  # tasks not terminal yet: the run ends when it reaches 0
F_ACTIVE = "n:active"  # tasks with a phase queued or running
F_PAUSED = "n:paused"  # gates waiting for a decision
META_FIELDS = (F_FORMAT, F_WORKFLOW, F_VERSION, F_FINGERPRINT, F_CREATED, F_FINISHED, F_STATUS, F_CONTROL,
               F_TERMINATION, F_REJECTED, F_OPEN, F_ACTIVE, F_PAUSED, F_ERROR)

USAGE_NAMES = ("attempts", "input", "cached", "output")


def usage_field(name: str) -> str:
    """A usage counter: attempts consumed, tokens reported (what a Budget caps)."""
    return f"u:{name}"


USAGE_FIELDS = tuple(usage_field(name) for name in USAGE_NAMES)


def stat_field(name: str) -> str:
    """A per-run counter of what happened to it (stale deliveries, observer errors, ...)."""
    return f"s:{name}"


# Task fields. Task keys match [A-Za-z0-9][A-Za-z0-9._-]*, so the ':' after a prefix is unambiguous.
def task_field(key: str) -> str:
    """The task's TaskRecord (JSON)."""
    return f"t:{key}"


def value_field(key: str) -> str:
    """The task's value once done (JSON)."""
    return f"v:{key}"


def candidate_field(key: str, round: int) -> str:
    """What round ``round``'s attempt returned (JSON)."""
    return f"o:{key}:{round}"


def check_field(key: str, round: int) -> str:
    """What round ``round``'s check said (JSON LoopCheck)."""
    return f"c:{key}:{round}"


def notes_field(key: str, round: int, phase: str) -> str:
    """What a phase's callback noted about it (JSON: a model's prompt, reply and usage, ...)."""
    return f"n:{key}:{round}:{phase}"


def begin_field(key: str) -> str:
    """The begin that the scheduler prepared for a queued phase (read by begin.lua)."""
    return f"b:{key}"


def fingerprint_field(key: str) -> str:
    """The cache fingerprint a task computed before its first attempt (written back on success)."""
    return f"f:{key}"


def activation_count_field(step: str) -> str:
    """How many activations of graph step ``step`` the run has had (actions are numbered per step)."""
    return f"a#:{step}"


def activation_field(key: str) -> str:
    """The input of a graph action's activation (JSON; what ``ctx.activation`` reads)."""
    return f"a:{key}"


def receipt_field(receipt: str) -> str:
    return f"r:{receipt}"


TASK_PREFIX = "t:"


def key_of_task_field(field: str) -> str:
    return field[len(TASK_PREFIX):]


def cache_key(fingerprint: str) -> str:
    """The default cache store's entry (global: shared by runs)."""
    return f"{PREFIX}:cache:{fingerprint}"

"""Every field of a run's hash (``tl:{R}``, see taskloop/store/keys.py): the run's own meta fields,
one record per task, and the data. Nothing else names them; the Lua scripts get the ones they
touch from here, through their arguments (taskloop/store/scripts.py).

A phase reads and writes only the fields it needs (``HMGET``), never the whole hash, so its
cost does not depend on the size of its run.
"""

from __future__ import annotations

FORMAT = "2"  # the record layout below; a run written in another layout is refused

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
F_FORKED_FROM = "forked"  # a fork: JSON {"run_id", "task", "round"} of the run and round it was forked from
F_COPIED = "copied"  # a fork: JSON {"tasks": [kept keys], "rounds": {task: rounds copied}, "usage": {...}}
F_TRACE = "tc"  # the W3C trace context a run was started in (a traceparent; ops/otel.py), when tracing was on
META_FIELDS = (F_FORMAT, F_WORKFLOW, F_VERSION, F_FINGERPRINT, F_CREATED, F_FINISHED, F_STATUS, F_CONTROL,
               F_TERMINATION, F_REJECTED, F_OPEN, F_ACTIVE, F_PAUSED, F_ERROR, F_FORKED_FROM)
F_COMPACT = "z"  # present ("1") once the finished run was compacted: its data is in the run's compact record

# A finished run, compacted (taskloop/store/compacted.py), keeps these in its hash, where the run
# lists, wait() and a repeated start read them; everything else moves into its compact record, but
# what only a live run needs: the counters of open, active and paused tasks, and per task its
# prepared begin, its throttle note and its start note.
COMPACT_KEEP = (*META_FIELDS, F_INPUT_DIGEST)
LIVE_ONLY = frozenset({F_OPEN, F_ACTIVE, F_PAUSED})
LIVE_ONLY_PREFIXES = ("b:", "th:", "x:")

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


def worker_field(key: str) -> str:
    """Which worker process runs the task's current phase (a plain string; absent or "" when none does)."""
    return f"w:{key}"


def began_field(key: str) -> str:
    """When the current execution began (epoch seconds as text)."""
    return f"bt:{key}"


def deadline_field(key: str) -> str:
    """When the current round (or try) must end (epoch seconds as text; absent or "" without a timeout)."""
    return f"dl:{key}"


def record_fields(key: str) -> tuple[str, str, str, str]:
    """What makes up a task's record: its JSON (the state machine's part) and its execution: who
    runs it, since when, until when. The execution is written apart because begin.lua writes it as
    plain values, never assembling JSON (store/lua/begin.lua)."""
    return task_field(key), worker_field(key), began_field(key), deadline_field(key)


def throttle_field(key: str) -> str:
    """A queued phase that a fleet limit holds back (JSON: the limit, its wait queue, since when);
    absent once it starts or ends (taskloop/worker/limits/limiter.py)."""
    return f"th:{key}"


THROTTLE_PREFIX = "th:"


def begin_field(key: str) -> str:
    """The begin that the scheduler prepared for a queued phase (read by begin.lua)."""
    return f"b:{key}"


def started_field(key: str) -> str:
    """A phase that a worker began to run before its begin was written (worker/execution/deferred.py): "<token>
    <worker> <started at>", written with the read that precedes its callback. It names the token of
    the message it ran: a note whose token is not the record's is an earlier phase's."""
    return f"x:{key}"


def fingerprint_field(key: str) -> str:
    """The cache fingerprint a task computed before its first attempt (written back on success)."""
    return f"f:{key}"


def activation_count_field(step: str) -> str:
    """How many activations of graph step ``step`` the run has had (actions are numbered per step)."""
    return f"a#:{step}"


def activation_field(key: str) -> str:
    """The input of a graph action's activation (JSON; what ``ctx.activation`` reads)."""
    return f"a:{key}"


def feedback_field(key: str, round: int) -> str:
    """The feedback a fork gave round ``round``'s attempt (JSON str), in place of round - 1's."""
    return f"fb:{key}:{round}"


def task_usage_field(key: str, round: int, name: str) -> str:
    """Tokens a task's callbacks reported in one round (what a fork carries over with the round)."""
    return f"ut:{key}:{round}:{name}"


_ROUND_DATA = ("o", "c", "n", "ut", "fb")  # per round: candidate, check, notes, token usage, fork feedback
_TASK_DATA = ("v", "f", "a", "ai")  # per task: value, cache fingerprint, a graph action's activation input and batch


def data_of_task(field: str, key: str) -> tuple[bool, int | None]:
    """Whether ``field`` is a data field of task ``key`` (its value, a round's candidate, check,
    notes, token usage or fork feedback, its cache fingerprint, its activation input), and the
    round it belongs to (None for a per-task field). Task keys hold no ':'."""
    kind, _, rest = field.partition(":")
    if kind in _TASK_DATA:
        return rest == key, None
    if kind in _ROUND_DATA and rest.startswith(f"{key}:"):
        number = rest[len(key) + 1:].split(":", 1)[0]
        return number.isdigit(), int(number) if number.isdigit() else None
    return False, None


def activation_batch_field(key: str) -> str:
    """Which batch of activations a graph action came in (the run's activation count before it):
    what a fork keeps before it."""
    return f"ai:{key}"


def batch_state_field(batch: int) -> str:
    """A graph run's business state when the batch of activations ``batch`` was made (JSON): what a
    fork at one of them starts from."""
    return f"sa:{batch}"


def receipt_field(receipt: str) -> str:
    return f"r:{receipt}"


TASK_PREFIX = "t:"

# What a finished run's result reads of each task, as one HSCAN pattern (Redis glob, fnmatch's
# syntax too): the fields whose names start with t, v, w, b or d, which are the record (t:), the
# value (v:), the execution (w:, bt:, dl:), the prepared begin (b:), the throttle note (th:) and
# three short meta fields (term, wf, ver); never the rounds' candidates, checks, feedback and notes
# (o:, c:, fb:, n:), the input or the state, which are the long texts. tests/unit/test_keys.py
# holds it to the field names above.
RESULT_SCAN = "[tvwbd]*"


def key_of_task_field(field: str) -> str:
    return field[len(TASK_PREFIX):]


# --- fields of the fleet counters (tl:stats, see taskloop/store/keys.py) ---------------------------------

def started_stat(workflow: str) -> str:
    """The fleet counter of runs started (start requests) of a workflow."""
    return f"started:{workflow}"


UNPLANNED = "(unplanned)"  # the workflow label of runs that ended before a worker planned them


def finished_stat(workflow: str, status: str, termination: str, planned: bool = True) -> str:
    """The fleet counter of runs that ended so (counted as the reconciler forgets them). A run
    that ended before any worker planned it (its workflow was registered nowhere, or it was
    cancelled while pending) counts under ``UNPLANNED``, not under its name: anyone who may start
    runs by name would otherwise add a counter, and a metric label, per made-up name, for good."""
    return f"finished:{workflow if planned else UNPLANNED}:{status}:{termination}"

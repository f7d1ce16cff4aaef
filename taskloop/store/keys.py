"""Every Redis key taskloop uses. Nothing else builds them. (The fields inside a run's hash are
named in taskloop/core/fields.py.)

A run owns four keys, and a fifth once compacted, all hash-tagged with ``{run_id}`` so that they
share one cluster slot and every script of a run touches a single slot:

``tl:{R}``          HASH    the run: its meta fields, one field per task record, and the data
                            (input, values, candidates, checks, prepared begins, receipts)
``tl:{R}:events``   STREAM  the run's events
``tl:{R}:end``      LIST    one element once the run has ended (what ``wait()`` blocks on)
``tl:{R}:leases``   ZSET    task key -> lease expiry (epoch seconds)
``tl:{R}:z``        STRING  a finished run, compacted: its data and events in one record (the
                            hash then keeps only its meta fields; taskloop/store/compacted.py)
``tl:{R}:stream``   STREAM  the live text its phases stream (``ctx.stream``; taskloop/store/streams.py),
                            written by workers outside the run scripts, and expiring
                            ``TASKLOOP_STREAM_GRACE_S`` after its last write

An action asked of a worker by run id has two short-lived keys of its own, tagged with its
request id: ``tl:act:{Q}`` (HASH: the request, who took it, the verdict) and ``tl:act:{Q}:reply``
(LIST: the verdict, for its caller's BLPOP); taskloop/store/requests.py.

The global keys are indexes: ``tl:runs`` (runs by creation time, for ``taskloop runs``),
``tl:live`` (live runs by the time the reconciler should next look at them), ``tl:stats`` (fleet
counters), ``tl:workers`` (each worker's last heartbeat), and the reconciler's lock, last report
and the identity of the Redis it last saw;
they are written outside the run scripts (so a run never needs a second slot). The run lists
(``run_list``: runs by creation time per workflow, and per workflow and stored status, what
``runs()`` and the UI page through; a status's runs across workflows are those lists merged) are
written inside the run's script on a single Redis, and after it on a Cluster;
``tl:runs:workflows`` names the workflows that have lists (a write that lists a run names its
workflow, once a minute per process; the reconciler trims the lists). Earlier versions also kept
each status's list across workflows (``tl:runs:s:<status>``): no longer written, and deleted by
the reconciler.
"""

from __future__ import annotations

from dataclasses import dataclass

from taskloop.core.batch import Index, Listed
from taskloop.core.states import RunStatus

PREFIX = "tl"

RUNS_INDEX = f"{PREFIX}:runs"  # ZSET run_id -> created_at
LIVE_INDEX = f"{PREFIX}:live"  # ZSET run_id -> when the reconciler should look at the run next (< 0: it ended)
STATS = f"{PREFIX}:stats"  # HASH of fleet counters (stale deliveries, ...)
RECONCILER_LOCK = f"{PREFIX}:reconciler"  # STRING: which process runs this reconcile pass
RECONCILER_LAST = f"{PREFIX}:reconciler:last"  # STRING: JSON report of the last reconcile pass
SERVER_SEEN = f"{PREFIX}:server"  # STRING: the identity (INFO run_id) of the Redis the reconciler last saw
LISTED_WORKFLOWS = f"{PREFIX}:runs:workflows"  # SET of the workflow names that have run lists
LEGACY_STATUS_LISTS = tuple(f"{PREFIX}:runs:s:{status.value}" for status in RunStatus)  # no longer written
CONTROLS = f"{PREFIX}:controls"  # STREAM of the runs whose control flag was set (store/running.py)
HELD = f"{PREFIX}:held"  # HASH node -> the messages a worker held at its last heartbeat (compact JSON)
WORKERS = f"{PREFIX}:workers"  # HASH node -> JSON of the worker as it last said (taskloop/worker/liveness/presence.py)


def run_list(entry: Listed) -> str:
    """The run list an entry belongs to (ZSET run_id -> created_at); the list of every run is the
    runs index. Workflow names hold no ':' (taskloop/base/names.py), so the shapes cannot collide.
    An entry of a global index (``entry.index``) is that index's key."""
    if entry.index is not None:
        return INDEX_KEYS[entry.index]
    if entry.workflow is None:
        if entry.status is not None:
            raise ValueError("a status's runs across workflows are not one list: merge the workflows' lists")
        return RUNS_INDEX
    if entry.status is None:
        return f"{PREFIX}:runs:w:{entry.workflow}"
    return f"{PREFIX}:runs:w:{entry.workflow}:s:{entry.status}"


@dataclass(frozen=True)
class RunKeys:
    """The keys of one run, in the order the Lua scripts take them (KEYS[1..4])."""

    run: str
    events: str
    end: str
    leases: str
    compact: str
    stream: str  # the live text of its phases (written outside the scripts)

    @classmethod
    def of(cls, run_id: str) -> RunKeys:
        tag = f"{PREFIX}:{{{run_id}}}"
        return cls(run=tag, events=f"{tag}:events", end=f"{tag}:end", leases=f"{tag}:leases", compact=f"{tag}:z",
                   stream=f"{tag}:stream")

    def all(self) -> list[str]:
        """cas.lua's four keys (a compacted run is not written by cas.lua)."""
        return [self.run, self.events, self.end, self.leases]

    def with_compact(self) -> list[str]:
        """compact.lua's and expand.lua's five keys."""
        return [*self.all(), self.compact]


def request_keys(request_id: str) -> tuple[str, str]:
    """An action asked of a worker by run id (runtime/acting.py): its HASH (the request's body, who
    took it, the verdict) and the LIST its caller blocks on for the verdict; one slot."""
    tag = f"{PREFIX}:act:{{{request_id}}}"
    return tag, f"{tag}:reply"


INDEX_KEYS = {Index.LIVE: LIVE_INDEX}  # the global indexes a write adds runs to


LIMIT_NAMES = f"{PREFIX}:limits"  # SET of the limit names that phases have started or waited under
LIMITS_DUE = f"{PREFIX}:limits:due"  # ZSET "<limit>|<key value>" wait queue -> when to look at it next


@dataclass(frozen=True)
class LimitKeys:
    """The keys of one fleet limit for one key value (``value`` "" for a rate limit and for a
    concurrency limit without key), all hash-tagged with ``{limit:<name>}``: one cluster slot per
    limit, so each limit's script touches a single slot (taskloop/store/lua/limits.lua).

    ``cfg``   HASH   the operator's override of the declared numbers (rate, per_s, limit)
    ``use``   ZSET   a rate limit's window: one member per start (or per token report,
                     "<id>|<tokens>"), by time; a concurrency limit's held slots, "<run>|<task>"
                     -> when the slot expires (the phase's lease)
    ``wait``  ZSET   the phases waiting: "<run>|<task>|<phase>|<round>|<token>" -> since when
    ``sent``  HASH   wait member -> when its message was last sent again (limits.lua ``wake``)
    ``meta``  HASH   the numbers the limit was last declared with (what ``taskloop limits`` shows)
    ``values`` SET   the key values with slots held or phases waiting (what ``taskloop limits`` lists)
    """

    name: str
    value: str
    cfg: str
    use: str
    wait: str
    sent: str
    meta: str
    values: str

    @classmethod
    def of(cls, name: str, value: str = "") -> LimitKeys:
        tag = f"{PREFIX}:{{limit:{name}}}"
        part = f":{value}" if value else ""
        return cls(name=name, value=value, cfg=f"{tag}:cfg", use=f"{tag}:use{part}", wait=f"{tag}:wait{part}",
                   sent=f"{tag}:sent{part}", meta=f"{tag}:meta", values=f"{tag}:values")

    @property
    def due_member(self) -> str:
        """The member of LIMITS_DUE that names this wait queue (limit names hold no '|')."""
        return f"{self.name}|{self.value}"

    @classmethod
    def of_due(cls, member: str) -> LimitKeys:
        name, _, value = member.partition("|")
        return cls.of(name, value)

    def all(self) -> list[str]:
        return [self.cfg, self.use, self.wait, self.sent, self.meta, self.values]


def shape_key(fingerprint: str) -> str:
    """The shape of a workflow definition (its tasks, edges, limits; JSON), by the fingerprint its
    runs pin: what the UI draws a run's graph from without importing its code."""
    return f"{PREFIX}:shape:{fingerprint}"


def cache_key(fingerprint: str) -> str:
    """The default cache store's entry (global: shared by runs)."""
    return f"{PREFIX}:cache:{fingerprint}"

"""Fleet flow control on a worker (SPEC §10): a phase under limits takes room in limits.lua before
it begins, or is recorded throttled and its message acknowledged, so it holds no pool process and
no prefetch slot while it waits. It is sent again when there is room: by the release of a slot
(the process that releases it sends the oldest waiters at once), and by the ``Drainer`` thread of
every worker's main process for rate windows that reopen and as the backstop for every queue.

The pure part (specs, wait members, the model of the window arithmetic) is taskloop/core/limits.py;
the script is taskloop/store/lua/limits.lua; the store's side is taskloop/store/limit_store.py.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from taskloop.base import clock
from taskloop.base.config import Settings
from taskloop.base.errors import TaskLoopError
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.batch import Batch
from taskloop.core.events import Event
from taskloop.core.limits import Spec, Waiter, spec_of
from taskloop.core.phases import Slot, TaskRecord, lease_until
from taskloop.core.snapshot import Snapshot
from taskloop.define.context import TaskContext
from taskloop.define.limits import Concurrency
from taskloop.define.tasks import Task
from taskloop.define.workflow import Workflow
from taskloop.ops import metrics
from taskloop.runtime.commit import write
from taskloop.store.limit_store import Admission
from taskloop.store.redis_store import RedisStore

log = logging.getLogger("taskloop.limits")

Resend = Callable[[Sequence[Waiter]], None]


@dataclass(frozen=True)
class Held:
    """What a phase took under its limits: what its end gives back."""

    specs: tuple[Spec, ...]
    waiter: Waiter

    @property
    def slots(self) -> tuple[Spec, ...]:
        return tuple(spec for spec in self.specs if spec.kind == "conc")

    @property
    def tokens(self) -> tuple[Spec, ...]:
        return tuple(spec for spec in self.specs if spec.tokens)


@dataclass(frozen=True)
class KeyFailed:
    """A Concurrency's ``key(ctx)`` raised, or returned what cannot name a slot: the task fails."""

    error: BaseException


@dataclass(frozen=True)
class Waiting:
    """The phase waits for ``limit`` (noted throttled in its run)."""

    limit: str


def take_room(store: RedisStore, settings: Settings, workflow: Workflow, task: Task, snap: Snapshot,
              record: TaskRecord, ctx: TaskContext) -> Held | Waiting | KeyFailed:
    """Room for a queued phase under its limits (limits.lua), or its place in a wait queue: noted
    in the run (the throttle field, a ``throttled`` event the first time)."""
    assert record.phase is not None
    try:
        specs = specs_for(task, record.phase.value, ctx)
    except Exception as exc:
        return KeyFailed(exc)
    waiter = waiter_of(workflow, task, record, snap.run_id)
    now = clock.now()
    expiry = lease_until(now, record.deadline, settings.running_lease_s, settings.timeout_grace_s)
    admission = store.acquire(specs, waiter.member(), waiter.holder, expiry, now)
    note = snap.get(fld.throttle_field(task.key))
    if not admission.admitted:
        raw = snap.raw_record(task.key)
        assert raw is not None
        record_throttled(store, snap.run_id, task.key, raw, note, admission, waiter)
        return Waiting(admission.limit or "?")
    if note is not None:
        note_waited(note, now)
        if _member_of(note) != waiter.member():
            leave(store, note)  # it waited under an older token: that entry goes too
    return Held(specs, waiter)


def _member_of(note: str) -> str | None:
    try:
        return str(json.loads(note).get("member"))
    except (ValueError, AttributeError):
        return None


def left_waiting(store: RedisStore, snap: Snapshot, record: TaskRecord) -> None:
    """A phase that waited for a limit moved on without starting (its record changed): it leaves
    the wait queue, and its throttle note goes."""
    note = snap.get(fld.throttle_field(record.key))
    if note is None:
        return
    try:
        noted = Waiter.parse(str(json.loads(note).get("member", "")))
    except (ValueError, AttributeError):
        noted = None
    if noted is not None and record.slot is Slot.QUEUED and record.phase is not None and \
            (noted.phase, noted.round, noted.token) == (record.phase.value, record.round, record.token):
        return  # the note is the queued phase's own: it still waits (this message was another one)
    leave(store, note)
    write(store, Batch(snap.run_id).expect(fld.throttle_field(record.key), note, "throttle note")
          .delete(fld.throttle_field(record.key)))


def specs_for(task: Task, phase: str, ctx: TaskContext) -> tuple[Spec, ...]:
    """The limits a phase starts under, with each Concurrency's key value (``key(ctx)``; raises
    ValueError with the limit's name when it returns something that cannot name a slot)."""
    found = []
    for limit in task.limits_of(phase):
        value = None
        if isinstance(limit, Concurrency) and limit.key is not None:
            value = limit.key(ctx)
        found.append(spec_of(limit, value))
    return tuple(found)


def waiter_of(workflow: Workflow, task: Task, record: TaskRecord, run_id: str) -> Waiter:
    assert record.phase is not None
    return Waiter(run_id, task.key, record.phase.value, record.round, record.token, workflow.name, task.queue or "")


def throttled_note(admission: Admission, waiter: Waiter, since: float) -> str:
    """The run hash's throttle field of a waiting phase (JSON)."""
    return json.dumps({"limit": admission.limit, "value": admission.value, "since": since,
                       "member": waiter.member(), "retry_at": admission.retry_at}, separators=(",", ":"))


def record_throttled(store: RedisStore, run_id: str, key: str, raw_record: str, previous: str | None,
                     admission: Admission, waiter: Waiter) -> None:
    """Note that the phase waits (the throttle field, and a ``task.throttled`` event the first time it
    waits on this limit), guarded by its record: a phase that moved on meanwhile is not noted."""
    before = json.loads(previous) if previous else None
    if before is not None and before.get("limit") == admission.limit and before.get("member") == waiter.member():
        return  # noted already: waiting again costs no write
    earlier = Waiter.parse(str(before.get("member", ""))) if before is not None else None
    same_phase = earlier is not None and (earlier.run_id, earlier.key, earlier.phase, earlier.round) == \
        (waiter.run_id, waiter.key, waiter.phase, waiter.round)  # the reconciler may have sent it with a new token
    since = float(before["since"]) if before is not None and same_phase else clock.now()
    if previous is not None and before is not None and before.get("member") != waiter.member():
        leave(store, previous)  # the phase waited under an older token (the reconciler sent it again)
    batch = Batch(run_id).expect(fld.task_field(key), raw_record, "record")
    batch.set(fld.throttle_field(key), throttled_note(admission, waiter, since))
    batch.event(Event(type=ev.TASK_THROTTLED, at=clock.now(), key=key, round=waiter.round, phase=waiter.phase,
                      data={"limit": admission.limit, "phase": waiter.phase, "round": waiter.round,
                            **({"value": admission.value} if admission.value else {}),
                            **({"retry_at": admission.retry_at} if admission.retry_at is not None else {})}))
    write(store, batch)
    metrics.throttled(admission.limit or "?")


def note_waited(note: str, now: float) -> None:
    """A phase that waited starts now: how long it waited (metrics)."""
    try:
        found = json.loads(note)
        metrics.waited(str(found.get("limit")), now - float(found.get("since") or now))
    except (ValueError, TypeError):
        pass


def leave(store: RedisStore, note: str) -> None:
    """The phase of this throttle note will not start from it: out of the wait queue."""
    try:
        found = json.loads(note)
        store.leave(str(found["limit"]), str(found.get("value") or ""), str(found["member"]))
    except (ValueError, TypeError, KeyError):
        log.warning("a throttle note that does not parse: %.200r", note)
    except TaskLoopError as exc:  # the queue's GONE_S drop takes it out later
        log.warning("a phase that waited stays in its wait queue for now: %s", exc)


def token_counter(store: RedisStore, held: Held) -> Callable[[int], None] | None:
    """What counts the tokens a phase reports in its token rate limits (None: it has none)."""
    specs = held.tokens
    if not specs:
        return None
    member = held.waiter.member()

    def count(tokens: int) -> None:
        if tokens > 0:
            store.count_tokens(specs, member, tokens, clock.now())

    return count


def slot_renewer(store: RedisStore, held: Held) -> Callable[[float], None] | None:
    """What keeps a running phase's slots as long as its lease (None: it holds none)."""
    slots = held.slots
    if not slots:
        return None
    return lambda until: store.renew_slots(slots, held.waiter.holder, until, clock.now())


def release(store: RedisStore, held: Held, resend: Resend) -> None:
    """Give back the phase's slots and send the oldest waiters there is room for. A failure here
    leaks nothing: the slot expires with the phase's lease and the drainer wakes the queue then."""
    if not held.slots:
        return
    try:
        picked = store.wake(held.slots, clock.now(), held.waiter.holder)
    except TaskLoopError as exc:
        log.warning("run %s task %s: its slots under %s are left to expire with its lease: %s", held.waiter.run_id,
                    held.waiter.key, [s.name for s in held.slots], exc)
        return
    _resend(picked, resend)


def _resend(members: Sequence[str], resend: Resend) -> None:
    waiters = [w for w in map(Waiter.parse, members) if w is not None]
    if waiters:
        resend(waiters)


class Drainer:
    """A worker main process's thread: looks at the wait queues that are due (a rate window that
    reopens, a slot that expires, waiters sent again that did not come back) and sends the oldest
    waiters there is room for. Idle, it asks Redis once per ``IDLE_S``."""

    IDLE_S = 1.0  # nothing waits anywhere: one look per second
    WAITING_S = 0.01  # phases wait: look this often (a window that reopens is seen within it)

    def __init__(self, store: RedisStore, resend: Resend) -> None:
        self.store = store
        self.resend = resend
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="taskloop-limits", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def once(self) -> float:
        """One look; returns how long to sleep before the next."""
        now = clock.now()
        due = self.store.due_limits(now)
        for name, value in due:
            _resend(self.store.wake([self.store.declared(name, value)], now), self.resend)
        following = self.store.next_due()
        if following is None:
            return self.IDLE_S
        return max(0.001, min(self.WAITING_S, following - clock.now()))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                pause = self.once()
            except Exception as exc:  # Redis away, a broker error: look again later
                log.warning("limits drainer: %s: %s", type(exc).__name__, exc)
                pause = self.IDLE_S
            self._stop.wait(pause)

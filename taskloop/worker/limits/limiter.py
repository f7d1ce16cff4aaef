"""Fleet flow control on a worker (SPEC §10): a phase under limits takes room in limits.lua as it
begins, or is recorded throttled and its message acknowledged, so it holds no pool process and
no prefetch slot while it waits. It is sent again when there is room: by the release of a slot
(the process that releases it sends the oldest waiters at once), and by the ``Drainer`` thread of
every worker's main process for rate windows that reopen and as the backstop for every queue.

Where the room is taken:

- A phase whose limits need no key from the worker (rate limits, concurrency without ``key``) is
  prepared by the scheduler with its limits named (core/begin.py), and takes its room inside
  begin.lua, in the one call that begins it. The worker must present the same limits with their
  keys: it learns them per message name (``Hints``) the first time such a message takes the full
  path, and begin.lua gives the full path to a message whose limits differ.
- A concurrency limit with a ``key(ctx)``, a phase that is not prepared, and any phase on a Redis
  Cluster (the limits live in other slots) take the full path: after the read, the write that
  begins the phase takes the room in the same call (``room_for``; cas_limits.lua), or on a Cluster
  in a call of its own just before it.
- The slots a phase holds are released with the write of its outcome (cas_limits.lua), or in a
  call of their own when that write is not made (the phase was taken over; a Cluster).

The pure part (specs, wait members, the model of the window arithmetic) is taskloop/core/limits.py;
the Lua is taskloop/store/lua/lib_limits.lua (called by limits.lua, begin.lua and cas_limits.lua);
the store's side is taskloop/store/limit_store.py and RedisStore.begin / apply.
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
from taskloop.core.leases import lease_until
from taskloop.core.limits import LimitOp, Spec, Waiter, limits_tag, spec_of
from taskloop.core.records import TaskRecord
from taskloop.core.snapshot import Snapshot
from taskloop.core.states import Slot
from taskloop.define.context import TaskContext
from taskloop.define.limits import Concurrency
from taskloop.define.tasks import Task
from taskloop.define.workflow import Workflow
from taskloop.ops.hooks import LimitWaited, Throttled
from taskloop.runtime.instruments import hooks
from taskloop.runtime.writes import write
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


@dataclass
class Holding:
    """What a running phase took under its fleet limits, until it is given back (once)."""

    held: Held
    released: bool = False


@dataclass(frozen=True)
class KeyFailed:
    """A Concurrency's ``key(ctx)`` raised, or returned what cannot name a slot: the task fails."""

    error: BaseException


@dataclass(frozen=True)
class Room:
    """The acquire to make with the call that begins a phase, and the phase's wait member."""

    op: LimitOp
    waiter: Waiter

    @property
    def held(self) -> Held:
        """What the phase holds once the write is made."""
        return Held(self.op.specs, self.waiter)


@dataclass(frozen=True)
class Hint:
    """The limits the last message of one name began under, with what names its wait member."""

    tag: str
    specs: tuple[Spec, ...]
    workflow: str
    queue: str


class Hints:
    """What a worker process expects of the limits of a message by its Celery name
    (``<workflow>.<key>.<phase>``), so that it can present them to begin.lua with their keys. Only a
    hint: begin.lua compares it with what the scheduler prepared."""

    MAX = 1024

    def __init__(self) -> None:
        self._by_name: dict[str, Hint] = {}

    def presented(self, name: str | None, run_id: str, key: str, phase: str, round: int,
                  token: int) -> Room | None:
        """The room this message's begin would take (begin.lua compares ``op.tag`` with the prepared begin)."""
        hint = self._by_name.get(name) if name else None
        if hint is None:
            return None
        waiter = Waiter(run_id, key, phase, round, token, hint.workflow, hint.queue)
        return Room(LimitOp("acquire", hint.specs, waiter.member(), waiter.holder, hint.tag), waiter)

    def learn(self, name: str | None, workflow: Workflow, task: Task, specs: Sequence[Spec]) -> None:
        """What a message of this name took the full path with: its limits, when they need no key."""
        if not name:
            return
        if not specs or any(spec.value for spec in specs):
            self._by_name.pop(name, None)
            return
        if len(self._by_name) >= self.MAX:
            self._by_name.clear()
        self._by_name[name] = Hint(limits_tag(specs, workflow.name, task.queue or ""), tuple(specs),
                                   workflow.name, task.queue or "")

    def forget(self, name: str | None) -> None:
        if name:
            self._by_name.pop(name, None)


def started(store: RedisStore, note: str | None, waiter: Waiter) -> None:
    """A phase took its room (in begin.lua, or with the write that began it), and its throttle note
    was deleted with it: how long it waited (metrics), and the wait entry of an older token goes."""
    if note is None:
        return
    note_waited(note, clock.now())
    if _member_of(note) != waiter.member():
        leave(store, note)


def wake_op(held: Held) -> LimitOp | None:
    """The release of the phase's slots, to make with the write of its outcome (None: it holds none)."""
    if not held.slots:
        return None
    return LimitOp("wake", held.slots, holder=held.waiter.holder, now=clock.now())


def woken(members: Sequence[str], resend: Resend) -> None:
    """Send again the waiters a release made with an outcome's write picked."""
    _resend(members, resend)


def room_for(settings: Settings, workflow: Workflow, task: Task, snap: Snapshot, record: TaskRecord,
             ctx: TaskContext, learn: Callable[[Sequence[Spec]], None] | None = None) -> Room | KeyFailed:
    """What the write that begins a queued phase takes under its limits (the full path: the write
    and the acquire are one call, cas_limits.lua). ``learn`` is told the specs (Hints)."""
    assert record.phase is not None
    try:
        specs = specs_for(task, record.phase.value, ctx)
    except Exception as exc:
        return KeyFailed(exc)
    if learn is not None:
        learn(specs)
    waiter = waiter_of(workflow, task, record, snap.run_id)
    now = clock.now()
    expiry = lease_until(now, record.deadline, settings.running_lease_s, settings.timeout_grace_s)
    return Room(LimitOp("acquire", specs, waiter.member(), waiter.holder, now=now, expiry=expiry), waiter)


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
    hooks().limit_throttled(Throttled(run_id, key, waiter.round, waiter.phase, admission.limit or "?"))


def note_waited(note: str, now: float) -> None:
    """A phase that waited starts now: how long it waited (the hooks: metrics)."""
    try:
        found = json.loads(note)
        waited = LimitWaited(str(found.get("limit")), now - float(found.get("since") or now))
    except (ValueError, TypeError):
        return
    hooks().limit_waited(waited)


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
    """Send the picked waiters again. A send that fails loses nothing: the wake noted them sent, and
    a later wake (the drainer's, RESENT_S later in lib_limits.lua) picks them again."""
    waiters = [w for w in map(Waiter.parse, members) if w is not None]
    if not waiters:
        return
    try:
        resend(waiters)
    except Exception as exc:
        log.warning("%d phase(s) that waited for a fleet limit are sent again later: %s: %s", len(waiters),
                    type(exc).__name__, exc)


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

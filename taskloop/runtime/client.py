"""The client: start runs (by definition or by name), wait for them, inspect, list, cancel,
resume and decide gates. Reading a run needs only its id, never its definition."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

from celery import Celery

from taskloop.base import clock, names
from taskloop.base.config import Settings, settings
from taskloop.base.errors import (
    DefinitionError,
    InvalidInput,
    RunNotFound,
)
from taskloop.base.jsonvalue import text_problem
from taskloop.base.names import NAME_PATTERN
from taskloop.base.text import cut, shown
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.batch import Batch
from taskloop.core.events import Event, Observer
from taskloop.core.limits import Waiter
from taskloop.core.rules import CANCEL_PREFIX
from taskloop.core.snapshot import RunMeta
from taskloop.core.states import TERMINAL_RUN, RunStatus
from taskloop.core.streamed import StreamChunk
from taskloop.define.validate import is_text
from taskloop.define.workflow import REGISTRY, Workflow
from taskloop.runtime import acting, actions, forking, starting, streaming, views, waiting
from taskloop.runtime.celery_app import SETTLE_TASK, START_TASK, PhaseSender, make_app
from taskloop.runtime.gates import settle_gates
from taskloop.runtime.models import RunPage, RunResult, RunSummary, RunView
from taskloop.runtime.writes import write
from taskloop.store.redis_store import Applied, RedisStore

log = logging.getLogger("taskloop.runtime.client")
_TERMINAL = {s.value for s in TERMINAL_RUN}
_WAIT_SLICE_S = 5.0
_LIVE = [RunStatus.RUNNING.value, RunStatus.PENDING.value]


class RunHandle:
    """A started run. ``wait()`` blocks on the run's end marker until it ends."""

    def __init__(self, client: TaskLoop, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def __repr__(self) -> str:
        return f"<RunHandle {self.run_id}>"

    def wait(self, timeout: float | None = None, on_event: Observer | None = None) -> RunResult:
        return self.client.wait(self.run_id, timeout=timeout, on_event=on_event)

    def inspect(self) -> RunView:
        return self.client.inspect(self.run_id)

    def result(self) -> RunResult | None:
        return self.client.result(self.run_id)

    def cancel(self, reason: str = "cancelled", actor: str | None = None) -> CancelResult:
        return self.client.cancel(self.run_id, reason, actor)

    def stream(self, task: str | None = None) -> Iterator[StreamChunk]:
        return self.client.stream(self.run_id, task)


@dataclasses.dataclass(frozen=True)
class CancelResult:
    run_id: str
    cancelled: bool
    status: str
    message: str


class TaskLoop:
    """Entry point for services: ``TaskLoop()`` reads TASKLOOP_REDIS_URL / TASKLOOP_BROKER_URL
    (or celeryconfig.py); pass URLs to override."""

    def __init__(
        self,
        redis_url: str | None = None,
        broker_url: str | None = None,
        *,
        app: Celery | None = None,
        config: Settings | None = None,
    ) -> None:
        base = config or settings()
        if redis_url or broker_url:
            base = dataclasses.replace(
                base,
                redis_url=redis_url or base.redis_url,
                broker_url=broker_url or redis_url or base.broker_url,
            )
        self.settings = base
        self.store = RedisStore(base.redis_url, events_maxlen=base.events_maxlen)
        self._app = app
        self._sender: PhaseSender | None = None
        self._observers: list[Observer] = []

    @property
    def app(self) -> Celery:
        if self._app is None:
            self._app = make_app(self.settings)
        return self._app

    @property
    def send(self) -> PhaseSender:
        """The sender of phase messages (a producer from kombu's pool for each send)."""
        if self._sender is None:
            self._sender = PhaseSender(self.app, self.settings.redis_url, keep=False)
        return self._sender

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self.store.close()

    def observe(self, fn: Observer) -> None:
        """Call ``fn(event)`` for every event of the runs this client waits for."""
        if not callable(fn):
            raise DefinitionError("client.observe needs a callable (event) -> None")
        self._observers.append(fn)

    # starting -------------------------------------------------------------------------------
    def start(
        self,
        workflow: Workflow | str,
        input: Any = None,
        *,
        run_id: str | None = None,
        version: str | None = None,
    ) -> RunHandle:
        """Start a run. ``workflow`` is a definition, or a name: a workflow this process has not
        imported is recorded ``pending`` and planned by a worker that has it. The same ``run_id``
        with the same input returns the existing run; with another input it raises RunExists."""
        if isinstance(workflow, Workflow):
            started = starting.start_defined(self.store, self.send, workflow, input, run_id, self.settings)
            return RunHandle(self, started.run_id)
        if not isinstance(workflow, str) or not NAME_PATTERN.match(workflow):
            raise InvalidInput(f"start: workflow must be a workflow or its name, which must {names.NAME_RULE}; "
                               f"got {shown(workflow)}")
        problem = names.version_problem(version) if version is not None else None
        if problem is not None:
            raise InvalidInput(f"start: version must be None or {names.VERSION_RULE}, but {problem}; "
                               f"got {shown(version)}")
        if REGISTRY.has(workflow, version):
            defined = REGISTRY.get(workflow, version)
            started = starting.start_defined(self.store, self.send, defined, input, run_id, self.settings)
            return RunHandle(self, started.run_id)
        started = starting.record_pending(self.store, workflow, version, input, run_id, self.settings)
        if started.pending:
            self.app.send_task(START_TASK, args=[started.run_id], ignore_result=True,
                               shadow=f"{workflow}.start", argsrepr=started.run_id)
        return RunHandle(self, started.run_id)

    # reading --------------------------------------------------------------------------------
    def find(self, run_id: str) -> str:
        """The run id that ``run_id`` names: itself, or the one run whose id starts with it."""
        names.check_run_id(run_id)
        if self.store.hmget(run_id, [fld.F_WORKFLOW])[0] is not None:
            return run_id
        matches = self.store.run_ids_with_prefix(run_id, limit=6)
        if len(matches) == 1:
            return matches[0]
        if matches:
            shown = ", ".join(sorted(matches)[:5])
            raise RunNotFound(run_id, f"the prefix {run_id!r} matches several runs ({shown}, ...); give more of the id")
        raise RunNotFound(run_id)

    def _meta(self, run_id: str) -> RunMeta:
        names.check_run_id(run_id)  # an id no run can have: InvalidInput (it is never sent to Redis)
        snap = self.store.snapshot(run_id, fld.META_FIELDS)
        if not snap.exists:
            raise RunNotFound(run_id)
        return snap.meta()

    def status(self, run_id: str) -> str:
        """The run's status now: pending, running, waiting, or how it ended."""
        return self._meta(run_id).status.value

    def wait(self, run_id: str, timeout: float | None = None, on_event: Observer | None = None,
             on_notice: Callable[[str], None] | None = None) -> RunResult:
        """Block until the run ends and return its result. Without observers it blocks on the run's
        end marker (one wake-up); with observers it reads every event as it is appended.

        A Redis outage shorter than ``TASKLOOP_WAIT_OUTAGE_S`` (30 s) is ridden out with backoff
        (``on_notice`` hears about it); the wait keeps its place in the event stream."""
        return waiting.wait(self, run_id, timeout, on_event, on_notice)

    def result(self, run_id: str) -> RunResult | None:
        """The result of a finished run, or None while it is still going."""
        # the meta first: a run still going costs one HMGET (a poll), not a scan of its tasks
        return views.run_result(self.store, run_id, self._meta(run_id))

    def inspect(self, run_id: str) -> RunView:
        """Everything recorded about a run, including every round's output, check and executions."""
        return views.run_view(self.store, run_id)

    def runs(self, status: str | None = None, workflow: str | None = None, limit: int = 50) -> list[RunSummary]:
        """Recent runs, newest first, optionally filtered by status and workflow name: any ``limit``
        (paged inside, ``run_page`` takes at most 500 at a time)."""
        return views.run_summaries(self.store, status, workflow, limit)

    def run_page(self, status: str | None = None, workflow: str | None = None, offset: int = 0, limit: int = 50,
                 prefix: str | None = None) -> RunPage:
        """A page of runs, newest first, paged in Redis (views.run_page); ``prefix``: run ids that
        start with it."""
        return views.run_page(self.store, status, workflow, offset, limit, prefix)

    def events(self, run_id: str, after: str | None = None) -> list[Event]:
        """The run's events in order (optionally only those after the event id ``after``)."""
        names.check_run_id(run_id)
        if after is not None and not isinstance(after, str):
            raise InvalidInput(f"events: after must be the id of an event of this run, got {shown(after)}")
        try:
            found = self.store.events(run_id, after)
        except ValueError as exc:
            raise InvalidInput(f"events: after must be the id of an event of this run ({exc})") from None
        if not found and self.store.hmget(run_id, [fld.F_WORKFLOW])[0] is None:
            raise RunNotFound(run_id)
        return found

    def stream(self, run_id: str, task: str | None = None, after: str | None = None) -> Iterator[StreamChunk]:
        """The live text the run's phases stream (``ctx.stream``), as ``StreamChunk``s in order: from
        the start of what is kept, then as it comes, until the run ends (only ``task``'s, with a
        task; only what follows chunk id ``after``, with one). A phase executed again (a replay)
        starts a new segment. The run and the task are checked when the iteration starts."""
        return streaming.follow(self.store, run_id, task, after)

    # control --------------------------------------------------------------------------------
    def cancel(self, run_id: str, reason: str = "cancelled", actor: str | None = None) -> CancelResult:
        """Cancel a run: one small write sets its control flag. Running phases see ctx.signal,
        nothing new starts, queued phases end cancelled as their messages arrive, and the run ends
        ``cancelled`` (termination ``aborted``) once nothing runs. ``actor``: who cancelled it
        (recorded in the ``run.cancel`` event)."""
        if not is_text(reason):
            raise InvalidInput(f"cancel: reason must be a non-empty string, got {shown(reason)}")
        actor = _actor("cancel", actor)
        names.check_run_id(run_id)
        reason = reason[:500]
        control = CANCEL_PREFIX + reason
        batch = Batch(run_id).exists(fld.F_WORKFLOW, "run exists").expect(fld.F_CONTROL, None, "control")
        batch.one_of(fld.F_STATUS, _LIVE, "status")
        batch.set(fld.F_CONTROL, control)
        batch.event(Event(type=ev.RUN_CANCEL, at=clock.now(),
                          data={"reason": reason, **({"actor": actor} if actor else {})}))
        result = write(self.store, batch)
        if not isinstance(result, Applied):
            if result.label == "run exists":
                raise RunNotFound(run_id)
            meta = self._meta(run_id)
            if meta.terminal:
                return CancelResult(run_id, False, meta.status.value,
                                    f"run {run_id} already finished ({meta.status.value}); nothing to cancel")
            return CancelResult(run_id, False, meta.status.value, f"run {run_id} is already stopping ({meta.control})")
        meta = self._meta(run_id)
        if meta.stored_status == RunStatus.PENDING.value:
            self.app.send_task(START_TASK, args=[run_id], ignore_result=True)  # ends it cancelled
        elif meta.paused:
            self._settle_gates(run_id, meta)
        self._wake_throttled(run_id)
        return CancelResult(run_id, True, meta.status.value,
                            f"run {run_id} cancelling: running phases were signalled")

    def _wake_throttled(self, run_id: str) -> None:
        """The phases of a cancelled run that wait for a fleet limit have no message queued: send
        theirs again now, so that they end cancelled at once (a worker sees the control flag)."""
        waiters = [Waiter.parse(str(json.loads(note).get("member", ""))) for note in
                   self.store.scan_fields(run_id, fld.THROTTLE_PREFIX).values()]
        found = [w for w in waiters if w is not None]
        if found:
            self.send.resend(found)

    def _settle_gates(self, run_id: str, meta: RunMeta) -> None:
        """End the paused gates of a cancelled run here when this process has the definition;
        else ask a worker (and the reconciler does it too if both fail)."""
        if not REGISTRY.has(meta.workflow, meta.version or None):
            self.app.send_task(SETTLE_TASK, args=[run_id], ignore_result=True)
            return
        settle_gates(self.store, self.settings, self.send, REGISTRY.get(meta.workflow, meta.version or None), run_id)

    def fork(self, run_id: str, task: str, round: int, feedback: str | None = None, *,
             new_run_id: str | None = None, actor: str | None = None, request_id: str | None = None) -> RunHandle:
        """A new run of the same workflow, version and input, from ``round`` of ``task`` (SPEC §9):
        the tasks not downstream of ``task`` keep their values, ``task`` keeps rounds 1..round-1
        and starts round ``round`` with ``feedback`` (default: the feedback recorded for round - 1),
        and what is downstream runs again. The original is never changed. Only a finished run
        forks (NotForkable); the definition must be the one the run was started with. ``actor``:
        who forked it (in the new run's ``run.started`` event). Without the workflow's code here, a
        worker forks it (runtime/acting.py; ``request_id``: asked again, the same fork)."""
        actor = _actor("fork", actor)
        meta = self._meta(run_id)
        if REGISTRY.has(meta.workflow, meta.version or None):
            return RunHandle(self, forking.fork(self.store, self.send, self.settings, run_id, task, round, feedback,
                                                new_run_id, actor))
        request = acting.request_id_of("fork", request_id)
        forking.check_shape(task, round)  # what the worker checks with the code is its verdict
        forking.check_feedback(feedback, self.settings)
        if new_run_id is not None:
            starting.new_run_id(new_run_id)
        return RunHandle(self, self._ask(meta, request, action="fork", run_id=run_id, actor=actor, task=task,
                                         round=round, feedback=feedback,
                                         new_run_id=new_run_id or acting.fork_run_id(request)))

    def resume(self, run_id: str, actor: str | None = None, *, request_id: str | None = None) -> RunHandle:
        """Replay the interrupted phases of a run that failed on a callback error (or a timeout, or a
        lost worker). Exhausted loops stay exhausted; a changed definition is refused. ``actor``:
        who resumed it (recorded in the ``run.resumed`` event). Without the workflow's code here, a
        worker resumes it (runtime/acting.py; ``request_id``: asked again, the same verdict)."""
        actor = _actor("resume", actor)
        meta = self._meta(run_id)
        if REGISTRY.has(meta.workflow, meta.version or None):
            actions.resume(self.store, self.send, self.settings, run_id, actor)
            return RunHandle(self, run_id)
        request = acting.request_id_of("resume", request_id)
        return RunHandle(self, self._ask(meta, request, action="resume", run_id=run_id, actor=actor))

    def decide(self, run_id: str, key: str, action: str, actor: str, reason: str = "", value: Any = None, *,
               request_id: str | None = None) -> RunView:
        """Decide a gate: ``approve`` (continue), ``reject`` (run rejected), ``resume`` (pause/input).
        Without the workflow's code here, a worker decides it (runtime/acting.py; ``request_id``:
        asked again, the same verdict; a process with the code acts itself and does not use it)."""
        actor, reason, value_raw = actions.check_decision(self.settings, key, action, actor, reason, value)
        meta = self._meta(run_id)
        if REGISTRY.has(meta.workflow, meta.version or None):
            actions.decide(self.store, self.send, self.settings, run_id, key, action, actor, reason, value_raw)
        else:
            self._ask(meta, acting.request_id_of("decide", request_id), action="decide", run_id=run_id,
                      actor=actor, key=key, gate_action=action, reason=reason, value=value_raw)
        return self.inspect(run_id)

    def _ask(self, meta: RunMeta, request_id: str, **body: Any) -> str:
        """Ask a worker that has the workflow's code to act (runtime/acting.py): the run it acted on."""
        return acting.ask(self.store, self.app, self.settings, meta.workflow, body, request_id)


def _actor(action: str, actor: object) -> str | None:
    """Who asked for an action, as recorded (None: not given)."""
    if actor is None:
        return None
    if not isinstance(actor, str) or text_problem(actor):
        raise InvalidInput(f"{action}: actor must be None or a string (who asks), got {shown(actor)}")
    return cut(actor, 200)

"""``client.resume`` and ``client.decide`` where the workflow's code is: the checks, then one guarded
write through the one commit path. The client runs them in a process that imported the workflow,
and a worker runs them for a request by run id (runtime/acting.py); ``check_decision`` is what can
be checked without the code, in the caller."""

from __future__ import annotations

from typing import Any

from taskloop.base import clock, limits
from taskloop.base.config import Settings
from taskloop.base.errors import GateRefused, IncompatibleDefinition, InvalidInput, NotResumable, RunNotFound
from taskloop.base.jsonvalue import text_problem
from taskloop.base.text import cut, shown
from taskloop.core import fields as fld
from taskloop.core.events import Event
from taskloop.core.planner import Planner
from taskloop.core.snapshot import RunMeta, Snapshot
from taskloop.core.states import RunStatus, State, TaskStatus
from taskloop.define.workflow import REGISTRY
from taskloop.runtime.commit import Sender, commit
from taskloop.store.redis_store import Conflict, RedisStore

ACTIONS = ("approve", "reject", "resume")


def meta_of(store: RedisStore, run_id: str) -> RunMeta:
    snap = store.snapshot(run_id, fld.META_FIELDS)
    if not snap.exists:
        raise RunNotFound(run_id)
    return snap.meta()


def resume(store: RedisStore, send: Sender, settings: Settings, run_id: str, actor: str | None) -> None:
    """Replay the interrupted phases of a failed run (NotResumable, IncompatibleDefinition)."""
    meta = meta_of(store, run_id)
    if meta.stored_status != RunStatus.FAILED.value:
        raise NotResumable(f"run {run_id} is {meta.status.value}; only a failed run can be resumed")
    wf = REGISTRY.get(meta.workflow, meta.version or None)
    if meta.fingerprint != wf.fingerprint:
        raise IncompatibleDefinition(
            f"run {run_id} was started with another definition of workflow {wf.name} v{wf.version} "
            f"(fingerprint {meta.fingerprint}, this process has {wf.fingerprint}); a run resumes only "
            "under the definition it started with: restore it, or start a new run"
        )
    store.expand(run_id)  # a compacted run is written like a live one again (store/compacted.py)

    def plan(view: Snapshot) -> Planner:
        if view.get(fld.F_STATUS) != RunStatus.FAILED.value:
            raise NotResumable(f"run {run_id} is no longer failed")
        planner = Planner(wf, view, clock.now(), settings)
        keys = planner.record_keys()
        view.ensure([fld.task_field(key) for key in keys])
        failed = [r for r in (view.record(key) for key in keys) if r and r.status is TaskStatus.FAILED]
        replayable = {r.key for r in failed if r.error is None or r.error.resumable}
        if not replayable:
            why = "; ".join(f"task {r.key}: {r.error.message if r.error else 'failed'}" for r in failed)
            raise NotResumable(
                f"run {run_id} has nothing to resume ({why}): an exhausted loop stays exhausted and a "
                "spent budget stays spent; start a new run instead"
            )
        planner.resume(replayable, actor)
        return planner

    def expand_again(conflict: Conflict) -> bool:
        # the reconciler may compact the run between the expand above and this write (a failed run
        # it has just forgotten): every guard then fails on the hash it rewrote, so expand again
        store.expand(run_id)
        return True

    commit(store, plan, store.snapshot(run_id, [fld.F_STATUS, fld.F_CONTROL]), send, retry=expand_again)


def check_decision(settings: Settings, key: Any, action: Any, actor: Any, reason: Any,
                   value: Any) -> tuple[str, str, str | None]:
    """What a decision's arguments must be without the workflow's code: (actor, reason, the stored
    value), each cut to what is recorded."""
    if action not in ACTIONS:
        raise GateRefused(f"decide: action must be 'approve', 'reject' or 'resume', got {action!r}")
    if not isinstance(key, str):
        raise GateRefused(f"decide: key must be the key of a gate (a str), got {shown(key)}")
    for what, text in (("actor", actor), ("reason", reason)):
        if not isinstance(text, str) or text_problem(text):
            raise InvalidInput(f"decide: {what} must be a string, got {shown(text)}")
    value_raw = limits.require_storable(value, "gate value", settings.max_gate_value_bytes,
                                        limits.GATE_VALUE_ENV, "$.value", sized=f"the value for gate {key}")
    return cut(actor, 200), cut(reason, 500), value_raw  # recorded in the gate event


def decide(store: RedisStore, send: Sender, settings: Settings, run_id: str, key: str, action: str, actor: str,
           reason: str, value_raw: str | None) -> None:
    """Decide gate ``key`` (arguments as ``check_decision`` returns them): GateRefused when it is
    not a gate, not waiting, or the actor or action is not allowed."""
    meta = meta_of(store, run_id)
    wf = REGISTRY.get(meta.workflow, meta.version or None)
    gate = wf.lookup(key)
    if gate is None or not gate.is_gate:
        what = f"a {gate.kind.value}" if gate else "not a task of this workflow"
        raise GateRefused(f"decide: {key} is {what}, not a gate; gates: {list(wf.gates)}")
    if gate.actors and actor not in gate.actors:
        raise GateRefused(f"decide: actor {actor!r} may not decide gate {key}; allowed: {list(gate.actors)}")
    if action == "resume" and gate.gate_kind == "approval":
        raise GateRefused(f"decide: gate {key} is an approval gate; use approve or reject")

    def plan(view: Snapshot) -> Planner:
        record = view.record(key)
        if record is None or record.state is not State.PAUSED:
            status = record.status.value if record else "missing"
            raise GateRefused(f"decide: gate {key} is not waiting for a decision (status {status})")
        now = clock.now()
        planner = Planner(wf, view, now, settings)
        gate_event = Event(type="gate", key=key, phase=action, at=now, data={"actor": actor, "reason": reason})
        planner.decide(key, action != "reject", value_raw, gate_event)
        return planner

    commit(store, plan, store.snapshot(run_id, [fld.task_field(key), fld.F_CONTROL]), send)

"""What a phase message reads before its callback (pure): the fields a worker asks for, and the
same fields carried in the message itself.

A worker that takes a phase message needs the task's record, the run's control flag, the
definition's identity, the callback's data and, for a phase that may end its task, the run's
final-status fields and its dependents' records (``message_fields``). It reads them in one round
trip (worker/execution/deferred.py), or finds them in the message: when the broker is the store's Redis,
the write that queues a phase reads those fields right after its writes, inside the same script,
and puts their values into the message it pushes (``carried_fields``; runtime/outbox.py,
store/lua/lib_cas.lua). ``carried`` turns such values back into named fields, and tells a
message whose values do not match what the worker would read (then it reads).

The values are those of the moment the phase was queued. A worker uses them only for a message
that is fresh (``fresh``: queued less than ``CARRY_FRESH_S`` ago, and never delivered before), and
its commit is guarded on the queued record and the control flag as any commit is: a run that
moved meanwhile refuses the commit, and the outcome is planned again on a read of the run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from taskloop.core import checks
from taskloop.core import fields as fld
from taskloop.core.begin import outcome_fields
from taskloop.core.rules import ENDING_FIELDS
from taskloop.core.states import Phase
from taskloop.define.workflow import Workflow

# A message older than this (by the clocks of the host that queued it and the one that takes it)
# is read for, not run on the values it carries: this bounds how late a worker sees a cancel that
# landed while the phase waited in the queue (docs/semantics.md, "Cancellation").
CARRY_FRESH_S = 2.0
# The headers of a message that carries values: the one the outbox writes as null and cas.lua fills
# in (the values, in carried_fields' order; lib_cas.lua names it too, and leaves it null past 64 KB
# of values), and the time the message was queued.
CARRY_HEADER = "tl_carry"
QUEUED_AT_HEADER = "tl_at"


def phase_fields(phase: Phase, key: str, round: int) -> list[str]:
    """The data a phase's callback takes as an argument (read together with its record)."""
    if phase is Phase.CHECK:
        return [fld.candidate_field(key, round)]
    if phase is Phase.ATTEMPT:  # what its feedback is taken from (checks.attempt_feedback)
        return checks.feedback_fields(key, round)
    return []


def message_fields(phase: Phase, key: str, round: int) -> list[str]:
    """What a message reads first: the record's fields and the control flag (begin.lua's order),
    the definition's identity, the callback's data and, for a phase that may end its task, the
    fields of the run's final status."""
    fields = [*fld.record_fields(key), fld.F_CONTROL, fld.F_WORKFLOW, fld.F_VERSION, fld.F_FINGERPRINT,
              fld.throttle_field(key), *phase_fields(phase, key, round)]
    if phase is not Phase.ATTEMPT:  # a check or a plain task may end its task, and then the run
        fields += ENDING_FIELDS
    return fields


def read_fields(key: str, base: list[str], learned: tuple[str, ...] | list[str]) -> list[str]:
    """What the one read asks for: ``base`` (message_fields), the prepared begin, the start note,
    and the fields the outcome will read besides (its dependents' records)."""
    return [*base, fld.begin_field(key), fld.started_field(key), *(f for f in learned if f not in base)]


def context_fields(key: str, after: Sequence[str], loop: bool, round: int) -> list[str]:
    """What a callback's context may read while it runs (``ctx.input``, ``ctx.value(dep)``, a loop's
    ``ctx.previous``): read before an ``async def`` callback is awaited, with the phase's own read, so
    that the callback makes no blocking read on its event loop (worker/pools/asyncio_pool.py)."""
    return [fld.F_INPUT, *(fld.value_field(dep) for dep in after),
            *([fld.candidate_field(key, round - 1)] if loop and round > 1 else [])]


def carried_fields(workflow: Workflow, key: str, phase: Phase, round: int) -> list[str]:
    """The fields whose values the queuing write puts into a phase's message: the run's workflow,
    what ``read_fields`` asks for, the run's input (which the one read leaves for a callback that
    asks for it: carried, it costs no round trip), and the compaction marker (a compacted run
    carries nothing usable)."""
    return [*_named(key, phase, round, outcome_fields(workflow, key, phase)), fld.F_COMPACT]


def _named(key: str, phase: Phase, round: int, outcome_reads: list[str]) -> list[str]:
    return [fld.F_WORKFLOW, *read_fields(key, message_fields(phase, key, round), outcome_reads), fld.F_INPUT]


def carried(key: str, phase: Phase, round: int, values: list[str | None]) -> dict[str, str | None] | None:
    """The fields of carried ``values`` by name, or None when they are not what ``carried_fields``
    names for this message (another shape, a compacted run): the worker reads instead. The
    dependents' fields are named by the prepared begin among them (its ``rd``)."""
    begin_at = _named(key, phase, round, []).index(fld.begin_field(key))
    reads = _outcome_reads(values[begin_at]) if begin_at < len(values) else None
    if reads is None:
        return None
    names = _named(key, phase, round, reads)
    if len(names) + 1 != len(values) or values[-1] is not None:
        return None
    return dict(zip(names, values[:-1], strict=True))


def fresh(queued_at: float | None, redelivered: bool, now: float) -> bool:
    """Whether a message may run on the values it carries: queued less than CARRY_FRESH_S ago (a
    clock behind by as much counts as late too) and not marked as delivered before (the message of
    a pool process that died, which Celery puts back: worker/execution/replies.py)."""
    return queued_at is not None and not redelivered and abs(now - queued_at) < CARRY_FRESH_S


def _outcome_reads(raw: str | None) -> list[str] | None:
    """The ``rd`` of a prepared begin (its dependents' fields; [] without a prepared begin), None
    when it is not one."""
    if raw is None:
        return []
    try:
        prepared = json.loads(raw)
    except ValueError:
        return None
    reads = prepared.get("rd", []) if isinstance(prepared, dict) else None
    if not isinstance(reads, list) or not all(isinstance(name, str) for name in reads):
        return None
    return reads

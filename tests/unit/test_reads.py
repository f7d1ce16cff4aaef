"""What a phase message reads, and the same fields carried in the message (taskloop/core/reads.py),
with the carried header as a worker takes it (worker/execution/messages.py ``carried_of``). Pure."""

from __future__ import annotations

import json
from types import SimpleNamespace

import taskloop as tl
from taskloop.base.config import Settings
from taskloop.core import fields as fld
from taskloop.core import reads
from taskloop.core.begin import initial_record, prepared_begin
from taskloop.core.phases import EventKind, PhaseEvent, advance
from taskloop.core.states import Phase
from taskloop.worker.execution.messages import carried_of

SETTINGS = Settings(redis_url="redis://127.0.0.1:1/0", broker_url="redis://127.0.0.1:1/0")
CHAIN = tl.define_workflow("reads-unit", version="1", tasks=[
    tl.define_loop_task("l", max_rounds=3, attempt=lambda c, f: 1, check=lambda c, x: tl.LoopCheck(done=True)),
    tl.define_task("after", run=lambda c: 1, after=["l"]),
])


def _values(names: list[str], given: dict[str, str]) -> list[str | None]:
    return [given.get(name) for name in names]


def _queued_check() -> str:
    record = advance(advance(advance(initial_record(CHAIN.task("l")), PhaseEvent(EventKind.ACTIVATE, 1.0)),
                             PhaseEvent(EventKind.BEGIN, 1.0, worker="w")), PhaseEvent(EventKind.CANDIDATE, 2.0))
    assert record.phase is Phase.CHECK
    begin = prepared_begin(CHAIN, record, SETTINGS)
    assert begin is not None
    return begin


def test_the_carried_fields_are_what_the_one_read_asks_for_with_the_input() -> None:
    names = reads.carried_fields(CHAIN, "l", Phase.CHECK, 1)
    one_read = reads.read_fields("l", reads.message_fields(Phase.CHECK, "l", 1),
                                 [f for d in ("after",) for f in fld.record_fields(d)])
    assert names == [fld.F_WORKFLOW, *one_read, fld.F_INPUT, fld.F_COMPACT]
    # an attempt's outcome never ends its task: it reads no dependents
    assert not set(fld.record_fields("after")) & set(reads.carried_fields(CHAIN, "l", Phase.ATTEMPT, 2))
    assert fld.check_field("l", 1) in reads.carried_fields(CHAIN, "l", Phase.ATTEMPT, 2)


def test_carried_values_come_back_by_name() -> None:
    names = reads.carried_fields(CHAIN, "l", Phase.CHECK, 1)
    given = {fld.F_WORKFLOW: "reads-unit", fld.begin_field("l"): _queued_check(), fld.F_INPUT: '{"x": 1}',
             fld.candidate_field("l", 1): "1"}
    found = reads.carried("l", Phase.CHECK, 1, _values(names, given))
    assert found is not None
    assert found == {name: given.get(name) for name in names[:-1]}
    assert fld.F_COMPACT not in found


def test_values_that_do_not_fit_the_message_are_not_used() -> None:
    names = reads.carried_fields(CHAIN, "l", Phase.CHECK, 1)
    given = {fld.F_WORKFLOW: "reads-unit", fld.begin_field("l"): _queued_check()}
    values = _values(names, given)
    assert reads.carried("l", Phase.CHECK, 1, values[:-1]) is None  # one short
    assert reads.carried("l", Phase.CHECK, 1, [*values, None]) is None  # one too many
    assert reads.carried("l", Phase.CHECK, 1, [*values[:-1], "1"]) is None  # the run was compacted
    broken = dict(given)
    broken[fld.begin_field("l")] = "{not json"
    assert reads.carried("l", Phase.CHECK, 1, _values(names, broken)) is None
    # without a prepared begin nothing names the dependents: the values of the carried shape do not fit
    assert reads.carried("l", Phase.CHECK, 1, _values(names, {fld.F_WORKFLOW: "reads-unit"})) is None


def test_only_a_fresh_first_delivery_runs_on_what_it_carries() -> None:
    assert reads.fresh(100.0, False, 100.5)
    assert not reads.fresh(100.0, True, 100.5)  # kombu put it back into its queue: a redelivery
    assert not reads.fresh(100.0, False, 100.0 + reads.CARRY_FRESH_S)  # waited too long
    assert not reads.fresh(100.0 + reads.CARRY_FRESH_S, False, 100.0)  # a clock too far ahead
    assert not reads.fresh(None, False, 100.0)


def test_the_carried_header_of_a_request() -> None:
    names = reads.carried_fields(CHAIN, "l", Phase.ATTEMPT, 1)
    values = [None] * len(names)
    request = SimpleNamespace(tl_carry=values, tl_at=5.0, delivery_info={"redelivered": False})
    found = carried_of(request)
    assert found is not None and found.values == values and found.queued_at == 5.0 and not found.redelivered
    # the mark of a message delivered before, in the headers or the delivery info
    assert carried_of(SimpleNamespace(tl_carry=values, tl_at=5.0, redelivered=True)).redelivered  # type: ignore[union-attr]
    assert carried_of(SimpleNamespace(tl_carry=values, tl_at=5.0, delivery_info={"redelivered": True})).redelivered  # type: ignore[union-attr]
    # no header, or one taskloop does not write: the worker reads
    assert carried_of(SimpleNamespace(tl_at=5.0)) is None
    assert carried_of(SimpleNamespace(tl_carry=None)) is None
    assert carried_of(SimpleNamespace(tl_carry=[1, 2], tl_at=5.0)) is None
    assert carried_of(SimpleNamespace(tl_carry="x", tl_at="soon")) is None
    assert json.dumps(values)  # the header is plain JSON

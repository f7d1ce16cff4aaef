"""The pure phase state machine (taskloop/core/phases.py): the transition table, round and attempt
accounting (SPEC section 3, points 5 and 9) and a stateful property test of its invariants."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from taskloop.base.errors import IllegalTransition
from taskloop.core.phases import TABLE, EventKind, PhaseEvent, advance, exhausted_error
from taskloop.core.records import ErrorRecord, TaskRecord
from taskloop.core.states import Phase, Slot, State, TaskStatus, active_state

AT = 1_000.0
BOOM = ErrorRecord(type="ValueError", message="boom")
TERMINAL_NO_EVENTS = frozenset({State.DONE, State.REJECTED})
# Terminal states that only client.resume (RESUME) may reopen.
RESUMABLE_TERMINAL = frozenset({State.FAILED, State.SKIPPED, State.CANCELLED})
# Events that move a loop forward (or replay it) without ending it.
PROGRESS = frozenset({EventKind.ACTIVATE, EventKind.BEGIN, EventKind.CANDIDATE, EventKind.REJECT,
                      EventKind.EXPIRE, EventKind.HAND_BACK, EventKind.REDISPATCH, EventKind.RESUME})


def active(kind: str, phase: Phase, slot: Slot, **fields: Any) -> TaskRecord:
    base: dict[str, Any] = {"key": "fix", "kind": kind, "status": TaskStatus.ACTIVE,
                            "phase": phase, "slot": slot, "round": 1, "token": 5,
                            "started_at": AT - 100}
    if kind == "loop":
        base["limit"] = 3
    if slot is Slot.RUNNING:
        base.update(execs=1, attempts=1, worker="w1", prepared=True, deadline=AT + 60)
    base.update(fields)
    return TaskRecord(**base)


def finished(kind: str, status: TaskStatus, **fields: Any) -> TaskRecord:
    base: dict[str, Any] = {"key": "fix", "kind": kind, "status": status, "round": 1,
                            "token": 7, "attempts": 1, "execs": 1, "started_at": AT - 100,
                            "finished_at": AT - 1}
    base.update(fields)
    return TaskRecord(**base)


# Representative records for every State. RUNNING_CHECK has one record below the limit and one
# at it, so both outcomes of REJECT are exercised; FAILED has one record per resumable phase.
RECORDS: dict[State, list[tuple[str, TaskRecord]]] = {
    State.WAITING: [
        ("loop", TaskRecord(key="fix", kind="loop", limit=3, token=1)),
        ("task", TaskRecord(key="fix", kind="task", limit=2, token=1)),
        ("gate", TaskRecord(key="fix", kind="gate", token=1)),
        ("loop-blocked", TaskRecord(key="fix", kind="loop", limit=3, token=1, waiting_on=2)),
    ],
    State.QUEUED_ATTEMPT: [("loop", active("loop", Phase.ATTEMPT, Slot.QUEUED))],
    State.RUNNING_ATTEMPT: [("loop", active("loop", Phase.ATTEMPT, Slot.RUNNING))],
    State.QUEUED_CHECK: [("loop", active("loop", Phase.CHECK, Slot.QUEUED, attempts=1))],
    State.RUNNING_CHECK: [
        ("loop-round1of3", active("loop", Phase.CHECK, Slot.RUNNING, round=1, limit=3)),
        ("loop-round3of3", active("loop", Phase.CHECK, Slot.RUNNING, round=3, limit=3,
                                  attempts=3)),
    ],
    State.QUEUED_RUN: [("task", active("task", Phase.RUN, Slot.QUEUED, limit=2))],
    State.RUNNING_RUN: [("task", active("task", Phase.RUN, Slot.RUNNING, limit=2))],
    State.PAUSED: [("gate", TaskRecord(key="fix", kind="gate", status=TaskStatus.PAUSED,
                                       token=2, started_at=AT - 100))],
    State.DONE: [
        ("loop", finished("loop", TaskStatus.DONE, phase=Phase.COMPLETE, limit=3)),
        ("task", finished("task", TaskStatus.DONE)),
    ],
    State.FAILED: [
        ("loop-attempt", finished("loop", TaskStatus.FAILED, phase=Phase.ATTEMPT, limit=3,
                                  error=BOOM)),
        ("loop-check", finished("loop", TaskStatus.FAILED, phase=Phase.CHECK, limit=3,
                                error=BOOM)),
        ("task-run", finished("task", TaskStatus.FAILED, phase=Phase.RUN, error=BOOM)),
    ],
    State.SKIPPED: [("loop", TaskRecord(key="fix", kind="loop", limit=3,
                                        status=TaskStatus.SKIPPED, token=2))],
    State.CANCELLED: [
        ("loop", finished("loop", TaskStatus.CANCELLED, phase=Phase.ATTEMPT, limit=3)),
        ("loop-check", finished("loop", TaskStatus.CANCELLED, phase=Phase.CHECK, limit=3)),
        ("task-run", finished("task", TaskStatus.CANCELLED, phase=Phase.RUN)),
        ("never-started", TaskRecord(key="fix", kind="task", status=TaskStatus.CANCELLED, token=1)),
    ],
    State.REJECTED: [("gate", TaskRecord(key="fix", kind="gate", status=TaskStatus.REJECTED,
                                         token=3))],
}


def event(kind: EventKind, at: float = AT, **fields: Any) -> PhaseEvent:
    """An event with the payload its kind normally carries."""
    defaults: dict[EventKind, dict[str, Any]] = {
        EventKind.BEGIN: {"worker": "w2", "timeout_ms": 30_000},
        EventKind.REJECT: {"feedback": "Try again"},
        EventKind.FAIL: {"error": BOOM},
        EventKind.RETRY: {"not_before": at + 5},
    }
    return PhaseEvent(kind, at=at, **{**defaults.get(kind, {}), **fields})


CASES = [
    pytest.param(record, kind, id=f"{state.value}[{label}]-{kind.value}")
    for state, records in RECORDS.items()
    for label, record in records
    for kind in EventKind
]


def test_every_state_has_a_representative_record() -> None:
    assert set(RECORDS) == set(State)
    for state, records in RECORDS.items():
        for _, record in records:
            assert record.state is state


def test_table_only_mentions_known_states_and_events() -> None:
    for (state, kind), targets in TABLE.items():
        assert isinstance(state, State) and isinstance(kind, EventKind)
        assert targets and all(isinstance(t, State) for t in targets)
    # Terminal states accept nothing except FAILED + RESUME.
    for state in TERMINAL_NO_EVENTS:
        assert not [kind for (s, kind) in TABLE if s is state]
    for state in RESUMABLE_TERMINAL:
        assert [kind for (s, kind) in TABLE if s is state] == [EventKind.RESUME]


def event_for(record: TaskRecord, kind: EventKind) -> PhaseEvent:
    """SUCCEED finishes a queued phase only as a cache hit, a running one only as a real success."""
    if kind is EventKind.SUCCEED:
        return event(kind, cache_hit=record.slot is Slot.QUEUED)
    return event(kind)


def refused_by_its_payload(record: TaskRecord, kind: EventKind) -> bool:
    """Listed pairs that the record's own counts refuse: a task activates only once it waits for
    nothing, DEP_DONE needs a dependency still waited for, and FORK takes only a fork's new record
    (never started) with a round left."""
    forked_wrong = kind is EventKind.FORK and (record.started_at is not None or
                                               (record.kind == "loop" and record.round >= record.limit))
    waits = kind in (EventKind.ACTIVATE, EventKind.FORK) and record.waiting_on > 0
    return forked_wrong or waits or (kind is EventKind.DEP_DONE and record.waiting_on == 0)


@pytest.mark.parametrize(("record", "kind"), CASES)
def test_every_state_and_event_pair(record: TaskRecord, kind: EventKind) -> None:
    before = record.dump()
    allowed = TABLE.get((record.state, kind))
    if allowed is not None and refused_by_its_payload(record, kind):
        with pytest.raises(IllegalTransition, match="dependenc"):
            advance(record, event(kind))
        assert record.dump() == before
        return
    if allowed is None:
        with pytest.raises(IllegalTransition, match=f"event '{kind.value}' is not allowed"):
            advance(record, event(kind))
        assert record.dump() == before
        return
    new = advance(record, event_for(record, kind))
    assert new.state in allowed
    assert new.token == record.token + 1
    assert record.dump() == before  # the old record is a value: untouched
    assert TaskRecord.load(new.dump(), *new.execution()) == new  # and the new one survives a store round trip


def test_the_representative_records_reach_every_target_of_the_table() -> None:
    reached: dict[tuple[State, EventKind], set[State]] = {}
    for records in RECORDS.values():
        for (_, record), kind in itertools.product(records, EventKind):
            if (record.state, kind) in TABLE and not refused_by_its_payload(record, kind):
                reached.setdefault((record.state, kind), set()).add(advance(record, event_for(record, kind)).state)
                if kind is EventKind.REJECT:  # a best-of loop: exhausted ends it done
                    reached[(record.state, kind)].add(advance(record, event(kind, keep_best=True)).state)
    # ACTIVATE: loop, plain and gate; REJECT: next round, exhausted, best-of; RESUME: every phase.
    assert reached == {pair: set(targets) for pair, targets in TABLE.items()}


# --- specific semantics --------------------------------------------------------------------


def test_activate_queues_round_one_or_pauses_a_gate() -> None:
    loop = advance(RECORDS[State.WAITING][0][1], event(EventKind.ACTIVATE))
    assert (loop.state, loop.round, loop.execs, loop.started_at) == (State.QUEUED_ATTEMPT, 1, 0, AT)
    plain = advance(RECORDS[State.WAITING][1][1], event(EventKind.ACTIVATE))
    assert (plain.state, plain.round) == (State.QUEUED_RUN, 1)
    gate = advance(RECORDS[State.WAITING][2][1], event(EventKind.ACTIVATE))
    assert gate.state is State.PAUSED
    assert gate.status is TaskStatus.PAUSED


def test_a_task_activates_once_each_dependency_is_done() -> None:
    blocked = RECORDS[State.WAITING][3][1]
    with pytest.raises(IllegalTransition, match="still waits for 2 dependencies"):
        advance(blocked, event(EventKind.ACTIVATE))
    one = advance(blocked, event(EventKind.DEP_DONE))
    ready = advance(one, event(EventKind.DEP_DONE))
    assert (one.waiting_on, ready.waiting_on, ready.state, ready.token) == (1, 0, State.WAITING, blocked.token + 2)
    assert advance(ready, event(EventKind.ACTIVATE)).state is State.QUEUED_ATTEMPT
    with pytest.raises(IllegalTransition, match="waits for no dependency"):
        advance(ready, event(EventKind.DEP_DONE))


def test_reject_below_the_limit_queues_the_next_round() -> None:
    record = active("loop", Phase.CHECK, Slot.RUNNING, round=2, limit=3, attempts=2,
                    deadline=AT + 10, execs=2)
    new = advance(record, event(EventKind.REJECT, feedback="too short"))
    assert new.state is State.QUEUED_ATTEMPT
    assert new.round == 3
    assert new.deadline is None
    assert new.execs == 0
    assert new.worker is None
    assert new.attempts == 2  # the next round consumes its attempt when it begins
    assert new.error is None


def test_reject_at_the_limit_exhausts_the_loop() -> None:
    record = active("loop", Phase.CHECK, Slot.RUNNING, round=3, limit=3, attempts=3)
    new = advance(record, event(EventKind.REJECT, at=AT + 5, feedback="Try again"))
    assert new.state is State.FAILED
    assert new.terminal
    assert new.round == 3
    assert new.phase is Phase.COMPLETE
    assert new.slot is None
    assert new.finished_at == AT + 5
    assert new.error is not None
    assert new.error.type == "LoopTaskExhausted"
    assert new.error.message == "Loop task fix exhausted its 3 rounds"
    assert new.error.details == {"max_rounds": 3, "feedback": "Try again"}
    assert new.error == exhausted_error("fix", 3, "Try again")


def test_a_full_exhausted_loop_counts_one_attempt_per_round() -> None:
    record = advance(TaskRecord(key="fix", kind="loop", limit=3), event(EventKind.ACTIVATE))
    for expected_round in (1, 2, 3):
        assert (record.state, record.round) == (State.QUEUED_ATTEMPT, expected_round)
        for kind in (EventKind.BEGIN, EventKind.CANDIDATE, EventKind.BEGIN, EventKind.REJECT):
            record = advance(record, event(kind, feedback=f"no {expected_round}"))
    assert record.state is State.FAILED
    assert record.attempts == 3
    assert record.token == 1 + 3 * 4
    assert record.error is not None and record.error.details == {"max_rounds": 3,
                                                                 "feedback": "no 3"}


def test_accept_finishes_the_loop() -> None:
    record = active("loop", Phase.CHECK, Slot.RUNNING, round=2, attempts=2)
    new = advance(record, event(EventKind.ACCEPT, at=AT + 1))
    assert new.state is State.DONE
    assert (new.phase, new.round, new.attempts, new.finished_at) == (Phase.COMPLETE, 2, 2, AT + 1)
    assert new.error is None


@pytest.mark.parametrize(
    ("record", "consumes"),
    [
        (active("loop", Phase.ATTEMPT, Slot.QUEUED, attempts=0), True),
        (active("task", Phase.RUN, Slot.QUEUED, attempts=0), True),
        (active("loop", Phase.CHECK, Slot.QUEUED, attempts=1, execs=0), False),
        (active("loop", Phase.CHECK, Slot.QUEUED, attempts=1, execs=1), True),
        (active("loop", Phase.ATTEMPT, Slot.QUEUED, attempts=1, execs=1), True),
        (active("task", Phase.RUN, Slot.QUEUED, attempts=1, execs=2), True),
    ],
    ids=["attempt", "run", "first-check", "check-replay", "attempt-replay", "run-replay"],
)
def test_begin_consumes_an_attempt(record: TaskRecord, consumes: bool) -> None:
    new = advance(record, event(EventKind.BEGIN, worker="w9"))
    assert new.attempts == record.attempts + int(consumes)
    assert new.execs == record.execs + 1
    assert new.state.value.startswith("running_")
    assert new.worker == "w9"
    assert new.prepared is True


def test_begin_sets_the_deadline_once_per_round() -> None:
    record = active("loop", Phase.ATTEMPT, Slot.QUEUED, round=1, limit=3)
    record = advance(record, event(EventKind.BEGIN, at=100.0, timeout_ms=5_000))
    assert record.deadline == pytest.approx(105.0)
    # the check (and any replay) of the same round keeps the round's deadline
    record = advance(record, event(EventKind.CANDIDATE, at=101.0))
    assert record.deadline == pytest.approx(105.0)
    record = advance(record, event(EventKind.BEGIN, at=102.0, timeout_ms=5_000))
    assert record.deadline == pytest.approx(105.0)
    record = advance(record, event(EventKind.EXPIRE, at=103.0))
    record = advance(record, event(EventKind.BEGIN, at=104.0, timeout_ms=5_000))
    assert record.deadline == pytest.approx(105.0)
    # a new round gets a new deadline
    record = advance(record, event(EventKind.REJECT, at=104.5, feedback="again"))
    assert record.deadline is None
    record = advance(record, event(EventKind.BEGIN, at=200.0, timeout_ms=250))
    assert record.deadline == pytest.approx(200.25)


def test_begin_without_timeout_sets_no_deadline() -> None:
    record = active("loop", Phase.ATTEMPT, Slot.QUEUED)
    assert advance(record, event(EventKind.BEGIN, timeout_ms=None)).deadline is None


@pytest.mark.parametrize(
    "record",
    [
        active("loop", Phase.ATTEMPT, Slot.QUEUED, round=1, attempts=0),
        active("task", Phase.RUN, Slot.QUEUED, round=1, attempts=0),
    ],
    ids=["loop", "task"],
)
def test_cache_hit_restores_without_attempts_or_rounds(record: TaskRecord) -> None:
    new = advance(record, event(EventKind.SUCCEED, at=AT + 2, cache_hit=True))
    assert new.state is State.DONE
    assert new.cache_hit is True
    assert new.attempts == 0
    assert new.round == 0
    assert new.phase is None
    assert new.started_at == new.finished_at == AT + 2


def test_plain_success_is_not_a_cache_hit() -> None:
    record = active("task", Phase.RUN, Slot.RUNNING, round=2, attempts=2)
    new = advance(record, event(EventKind.SUCCEED, at=AT + 3))
    assert new.state is State.DONE
    assert (new.cache_hit, new.round, new.attempts, new.phase) == (False, 2, 2, Phase.RUN)


def test_retry_queues_the_next_try_with_its_backoff() -> None:
    record = active("task", Phase.RUN, Slot.RUNNING, round=1, limit=3, deadline=AT + 1)
    new = advance(record, event(EventKind.RETRY, not_before=AT + 30))
    assert (new.state, new.round, new.execs, new.deadline) == (State.QUEUED_RUN, 2, 0, None)
    assert new.not_before == AT + 30
    begun = advance(new, event(EventKind.BEGIN, at=AT + 31))
    assert begun.not_before is None
    assert begun.attempts == record.attempts + 1


def test_expire_requeues_the_running_phase_keeping_its_round() -> None:
    record = active("loop", Phase.ATTEMPT, Slot.RUNNING, round=2, attempts=2, execs=1,
                    deadline=AT + 9)
    new = advance(record, event(EventKind.EXPIRE))
    assert new.state is State.QUEUED_ATTEMPT
    assert new.round == 2
    assert new.attempts == 2
    assert new.execs == 1  # so the next BEGIN is a replay
    assert new.deadline == AT + 9
    assert new.worker is None
    replay = advance(new, event(EventKind.BEGIN))
    assert (replay.round, replay.attempts, replay.execs) == (2, 3, 2)


@pytest.mark.parametrize("phase", [Phase.ATTEMPT, Phase.CHECK, Phase.RUN])
def test_hand_back_requeues_the_running_phase_without_counting_a_loss(phase: Phase) -> None:
    kind = "task" if phase is Phase.RUN else "loop"
    record = active(kind, phase, Slot.RUNNING, round=2, attempts=2, execs=1, lost=1, deadline=AT + 9)
    new = advance(record, event(EventKind.HAND_BACK, at=AT + 5))
    assert new.state is active_state(phase, Slot.QUEUED)
    assert (new.round, new.attempts, new.execs, new.lost, new.deadline) == (2, 2, 1, 1, AT + 9)
    assert (new.worker, new.began_at, new.queued_at, new.token) == (None, None, AT + 5, record.token + 1)
    replay = advance(new, event(EventKind.BEGIN, at=AT + 6))
    assert (replay.round, replay.attempts, replay.execs) == (2, 3, 2)


@pytest.mark.parametrize("state", [State.QUEUED_ATTEMPT, State.QUEUED_RUN, State.DONE, State.WAITING])
def test_only_a_running_phase_can_be_handed_back(state: State) -> None:
    record = RECORDS[state][0][1]
    with pytest.raises(IllegalTransition):
        advance(record, event(EventKind.HAND_BACK))


def test_redispatch_changes_only_the_token_and_the_send_time() -> None:
    record = active("loop", Phase.CHECK, Slot.QUEUED, round=2)
    new = advance(record, event(EventKind.REDISPATCH))
    assert new.model_dump(exclude={"token", "queued_at"}) == record.model_dump(exclude={"token", "queued_at"})
    assert new.token == record.token + 1 and new.queued_at == AT


def test_a_phase_remembers_when_its_message_was_sent() -> None:
    queued = advance(RECORDS[State.WAITING][0][1], event(EventKind.ACTIVATE, at=AT))
    running = advance(queued, event(EventKind.BEGIN, at=AT + 2))
    checked = advance(running, event(EventKind.CANDIDATE, at=AT + 3))
    assert (queued.queued_at, running.queued_at, checked.queued_at) == (AT, AT, AT + 3)


@pytest.mark.parametrize(
    ("label", "phase", "state"),
    [
        ("loop-attempt", Phase.ATTEMPT, State.QUEUED_ATTEMPT),
        ("loop-check", Phase.CHECK, State.QUEUED_CHECK),
        ("task-run", Phase.RUN, State.QUEUED_RUN),
    ],
)
def test_resume_requeues_the_interrupted_phase(label: str, phase: Phase, state: State) -> None:
    record = dict(RECORDS[State.FAILED])[label]
    new = advance(record, event(EventKind.RESUME))
    assert new.state is state
    assert new.phase is phase
    assert new.round == record.round
    assert new.attempts == record.attempts
    # execs is kept, so that the replayed phase consumes one attempt when it begins
    assert (new.error, new.finished_at, new.deadline, new.prepared, new.execs) == (
        None, None, None, False, record.execs)


def test_resume_of_an_exhausted_loop_is_refused() -> None:
    record = active("loop", Phase.CHECK, Slot.RUNNING, round=3, limit=3, attempts=3)
    exhausted = advance(record, event(EventKind.REJECT))
    before = exhausted.dump()
    with pytest.raises(IllegalTransition, match="an exhausted loop stays exhausted"):
        advance(exhausted, event(EventKind.RESUME))
    assert exhausted.dump() == before


def test_resume_without_an_interrupted_phase_is_refused() -> None:
    record = finished("loop", TaskStatus.FAILED, phase=Phase.COMPLETE, limit=3, error=BOOM)
    with pytest.raises(IllegalTransition, match="no interrupted phase"):
        advance(record, event(EventKind.RESUME))


@pytest.mark.parametrize("kind", [EventKind.FAIL, EventKind.CANCEL, EventKind.SKIP])
def test_endings_record_their_time_and_error(kind: EventKind) -> None:
    fresh = kind is EventKind.SKIP  # only a phase that never ran can be skipped (by its condition)
    record = active("loop", Phase.ATTEMPT, Slot.QUEUED, round=2, attempts=0 if fresh else 1)
    new = advance(record, event(kind, at=AT + 4))
    assert new.terminal
    assert new.finished_at == AT + 4
    assert new.slot is None
    assert new.round == 2
    assert new.error == (BOOM if kind is EventKind.FAIL else None)


def test_gate_decisions() -> None:
    paused = RECORDS[State.PAUSED][0][1]
    assert advance(paused, event(EventKind.APPROVE)).state is State.DONE
    denied = advance(paused, event(EventKind.DENY))
    assert denied.state is State.REJECTED
    assert denied.terminal


def test_cache_hit_is_refused_after_rounds_were_consumed() -> None:
    record = active("loop", Phase.ATTEMPT, Slot.QUEUED, round=2, limit=3, attempts=2,
                    execs=0, prepared=False)
    with pytest.raises(IllegalTransition):
        advance(record, event(EventKind.SUCCEED, cache_hit=True))


def test_a_queued_loop_becomes_done_only_through_a_cache_hit() -> None:
    record = active("loop", Phase.ATTEMPT, Slot.QUEUED, round=3, limit=3, attempts=2)
    with pytest.raises(IllegalTransition):
        advance(record, event(EventKind.SUCCEED, cache_hit=False))


# --- stateful property test ----------------------------------------------------------------


class LoopRecordMachine(RuleBasedStateMachine):
    """Drives one loop record with random events, legal and illegal, and checks invariants."""

    record: TaskRecord
    now: float

    @initialize(limit=st.integers(min_value=1, max_value=3))
    def start(self, limit: int) -> None:
        self.record = TaskRecord(key="fix", kind="loop", limit=limit)
        self.now = AT
        self.legal_steps = 0

    def _apply(self, kind: EventKind, cache_hit: bool, timeout_ms: int | None) -> None:
        self.now += 1.0
        before = self.record
        snapshot = before.dump()
        ev = PhaseEvent(kind, at=self.now, worker="w", timeout_ms=timeout_ms,
                        error=BOOM if kind is EventKind.FAIL else None,
                        feedback=f"feedback {before.round}" if kind is EventKind.REJECT else None,
                        cache_hit=cache_hit and kind is EventKind.SUCCEED)
        in_table = (before.state, kind) in TABLE
        try:
            new = advance(before, ev)
        except IllegalTransition:
            assert before.dump() == snapshot
            # Listed pairs refused for their payload: RESUME of an exhausted loop or of a
            # failure with no interrupted phase; SUCCEED that is not a cache hit on a fresh queued
            # phase, or a cache hit on a running one.
            fresh = before.execs == 0 and before.attempts == 0 and not before.prepared
            assert not in_table or (
                kind is EventKind.RESUME
                and (
                    (before.error is not None and before.error.type == "LoopTaskExhausted")
                    or (before.status is TaskStatus.SKIPPED and before.reason == "condition")
                    or (before.phase is not None and before.phase not in (Phase.ATTEMPT, Phase.CHECK))
                    or (before.status is TaskStatus.FAILED and before.phase is None)
                )
            ) or (
                kind is EventKind.SUCCEED
                and (before.slot is Slot.QUEUED) is not (ev.cache_hit and fresh)
            ) or (kind is EventKind.SKIP and before.slot is Slot.QUEUED and not fresh
                  ) or refused_by_its_payload(before, kind)
            return
        assert in_table, f"{kind} was accepted in {before.state}"
        assert before.state not in TERMINAL_NO_EVENTS
        assert before.state not in RESUMABLE_TERMINAL or kind is EventKind.RESUME
        assert before.dump() == snapshot
        assert new.state in TABLE[(before.state, kind)]
        assert new.token == before.token + 1
        assert new.kind == "loop"
        assert new.state not in (State.QUEUED_RUN, State.RUNNING_RUN, State.PAUSED)
        if new.state is State.DONE and before.state is State.RUNNING_CHECK:
            assert kind is EventKind.ACCEPT
        if new.cache_hit:  # SPEC: a hit has no attempts and empty rounds
            assert (kind, new.state, new.round, new.attempts) == (EventKind.SUCCEED,
                                                                  State.DONE, 0, 0)
        else:
            assert new.round >= before.round
            assert new.attempts >= before.attempts
        if kind is EventKind.REJECT:
            if before.round >= before.limit:
                assert new.state is State.FAILED
                assert new.error == exhausted_error("fix", before.limit, f"feedback {before.round}")
            else:
                assert (new.state, new.round) == (State.QUEUED_ATTEMPT, before.round + 1)
        self.record = new
        self.legal_steps += 1

    @rule(kind=st.sampled_from(EventKind), cache_hit=st.booleans(),
          timeout_ms=st.none() | st.integers(min_value=1, max_value=60_000))
    def any_event(self, kind: EventKind, cache_hit: bool, timeout_ms: int | None) -> None:
        self._apply(kind, cache_hit, timeout_ms)

    def _listed(self, kinds: frozenset[EventKind]) -> list[EventKind]:
        return sorted((k for s, k in TABLE if s is self.record.state and k in kinds),
                      key=lambda k: k.value)

    @precondition(lambda self: self.record.state not in TERMINAL_NO_EVENTS)
    @rule(data=st.data(), cache_hit=st.booleans())
    def listed_event(self, data: st.DataObject, cache_hit: bool) -> None:
        kind = data.draw(st.sampled_from(self._listed(frozenset(EventKind))), label="kind")
        self._apply(kind, cache_hit, 1_000)

    @precondition(lambda self: self.record.state not in TERMINAL_NO_EVENTS)
    @rule(data=st.data())
    def progress_event(self, data: st.DataObject) -> None:
        """A listed event that keeps the loop going, so runs reach later rounds and exhaustion."""
        kind = data.draw(st.sampled_from(self._listed(PROGRESS)), label="kind")
        self._apply(kind, False, None)

    @invariant()
    def round_is_within_the_limit(self) -> None:
        assert 0 <= self.record.round <= self.record.limit

    @invariant()
    def active_records_have_a_phase_and_slot(self) -> None:
        record = self.record
        assert (record.status is TaskStatus.ACTIVE) == (record.slot is not None)
        if record.status is TaskStatus.ACTIVE:
            assert record.phase in (Phase.ATTEMPT, Phase.CHECK)
            assert record.round >= 1

    @invariant()
    def token_counts_the_legal_transitions(self) -> None:
        assert self.record.token == self.legal_steps

    @invariant()
    def exhaustion_is_never_done(self) -> None:
        record = self.record
        if record.error is not None and record.error.type == "LoopTaskExhausted":
            assert record.state is State.FAILED
            assert record.round == record.limit


LoopRecordMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_loop_record_machine = LoopRecordMachine.TestCase

"""Scores, plateaus and best-of (SPEC §3) as pure logic: the score a check may give, the plateau
rule against a plain model of it, which round a best-of loop keeps, and what the state machine
records when a loop ends on each."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import taskloop as tl
from taskloop.base.errors import DefinitionError, InvalidCheckResult
from taskloop.core import scores
from taskloop.core.begin import initial_record
from taskloop.core.phases import EventKind, PhaseEvent, advance
from taskloop.core.states import TaskStatus

NOW = 1000.0


def test_a_score_is_a_finite_number_and_is_recorded_only_when_given() -> None:
    assert tl.LoopCheck(done=False, feedback="x", score=3).score == 3.0
    assert tl.LoopCheck(done=True).stored() == {"done": True, "feedback": None}
    assert tl.LoopCheck(done=False, feedback="x", score=0.5).stored() == {"done": False, "feedback": "x", "score": 0.5}
    assert tl.LoopCheck.coerce({"done": True, "score": 0.9}).score == 0.9
    for bad in (math.inf, -math.inf, math.nan, True, "0.5", [1]):
        with pytest.raises(InvalidCheckResult, match="loop check score must be a finite number"):
            tl.LoopCheck(done=True, score=bad)


def test_plateau_options_name_the_field_and_the_fix() -> None:
    assert tl.Plateau(rounds=2, min_gain=0.01).describe() == {"rounds": 2, "min_gain": 0.01}
    assert tl.Plateau(rounds=1).min_gain == 0.0
    with pytest.raises(DefinitionError, match=r"plateau\.rounds must be a positive safe integer"):
        tl.Plateau(rounds=0)
    for bad in (-0.1, math.inf, "0.1", True):
        with pytest.raises(DefinitionError, match=r"plateau\.min_gain must be a finite number >= 0"):
            tl.Plateau(rounds=2, min_gain=bad)
    loop = dict(max_rounds=3, attempt=lambda c, f: 1, check=lambda c, x: tl.LoopCheck(done=True))
    with pytest.raises(DefinitionError, match=r"plateau must be a tl\.Plateau"):
        tl.define_loop_task("p", plateau={"rounds": 2}, **loop)  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match=r"on_exhausted must be one of \['fail', 'best'\]"):
        tl.define_loop_task("p", on_exhausted="best-effort", **loop)


def test_the_fingerprint_of_a_loop_without_the_new_options_does_not_change() -> None:
    loop = dict(max_rounds=3, attempt=lambda c, f: 1, check=lambda c, x: tl.LoopCheck(done=True))
    plain = tl.define_loop_task("f", **loop).describe()
    assert "plateau" not in plain and "on_exhausted" not in plain
    best = tl.define_loop_task("f", plateau=tl.Plateau(rounds=2), on_exhausted="best", **loop).describe()
    assert best["plateau"] == {"rounds": 2, "min_gain": 0.0} and best["on_exhausted"] == "best"


def model_plateau(history: list[float | None], rounds: int, min_gain: float) -> bool:
    """The rule as a person states it: look at the scored rounds; the best of the last `rounds`
    of them failed to beat the best before them by `min_gain`."""
    scored = [s for s in history if s is not None]
    if len(scored) < rounds + 1:
        return False
    earlier, recent = scored[: len(scored) - rounds], scored[len(scored) - rounds:]
    return not (max(recent) - max(earlier) >= min_gain)


score_lists = st.lists(st.one_of(st.none(), st.floats(-100, 100, allow_nan=False)), max_size=12)


@given(score_lists, st.integers(1, 5), st.floats(0, 5, allow_nan=False))
def test_the_plateau_rule_matches_the_plain_model(history: list[float | None], rounds: int, min_gain: float) -> None:
    assert scores.plateaued(history, rounds, min_gain) is model_plateau(history, rounds, min_gain)


@given(score_lists.filter(bool))
def test_the_best_round_is_the_highest_score_latest_among_equals(history: list[float | None]) -> None:
    kept = scores.best_round(history)
    scored = [(s, n) for n, s in enumerate(history, 1) if s is not None]
    if not scored:
        assert kept == len(history)  # no score at all: the last candidate
    else:
        assert kept == max(scored)[1]  # max of (score, round): the latest of the best


def test_best_round_examples() -> None:
    assert scores.best_round([0.4, 0.9, 0.9, 0.2]) == 3  # a tie: the later one
    assert scores.best_round([None, 0.1, None]) == 2
    assert scores.best_round([None, None, None]) == 3
    assert scores.plateaued([0.2, 0.6, 0.55, 0.58], 2, 0.01)  # two rounds without beating 0.6
    assert not scores.plateaued([0.2, 0.6, 0.55, 0.61], 2, 0.01)
    assert not scores.plateaued([0.2, None, None, 0.1], 2, 0.0)  # only two scored rounds


def _running_check(max_rounds: int = 4, **options: object) -> tuple[tl.Task, object]:
    task = tl.define_loop_task("draft", max_rounds=max_rounds, attempt=lambda c, f: 1,
                               check=lambda c, x: tl.LoopCheck(done=True), **options)  # type: ignore[arg-type]
    record = advance(initial_record(task), PhaseEvent(EventKind.ACTIVATE, NOW))
    return task, record


def _round(record, kind: EventKind, score: float | None, **event: object):  # type: ignore[no-untyped-def]
    record = advance(record, PhaseEvent(EventKind.BEGIN, NOW, worker="w"))
    record = advance(record, PhaseEvent(EventKind.CANDIDATE, NOW))
    record = advance(record, PhaseEvent(EventKind.BEGIN, NOW, worker="w"))
    return advance(record, PhaseEvent(kind, NOW, feedback="again", score=score, **event))  # type: ignore[arg-type]


def test_a_plateau_ends_the_loop_as_an_exhaustion_before_its_rounds_are_spent() -> None:
    _, record = _running_check(max_rounds=6)
    for score in (0.5, 0.4, 0.45):
        record = _round(record, EventKind.REJECT, score, plateau=(2, 0.0))
    assert record.status is TaskStatus.FAILED and record.round == 3
    assert record.error.type == "LoopTaskExhausted" and record.error.details["reason"] == "plateau"
    assert record.error.message == "Loop task draft stopped improving (plateau) in round 3 of 6"
    assert record.scores == [0.5, 0.4, 0.45]


def test_best_of_ends_done_with_the_round_it_keeps_and_says_why() -> None:
    _, record = _running_check(max_rounds=3)
    for score in (0.5, 0.7, 0.6):
        record = _round(record, EventKind.REJECT, score, keep_best=True)
    assert record.status is TaskStatus.DONE and record.error is None
    assert (record.exhausted, record.kept_round, record.scores) == ("rounds", 2, [0.5, 0.7, 0.6])
    _, record = _running_check(max_rounds=5)
    for score in (0.5, 0.3, 0.2):
        record = _round(record, EventKind.REJECT, score, keep_best=True, plateau=(2, 0.0))
    assert (record.status, record.exhausted, record.kept_round) == (TaskStatus.DONE, "plateau", 1)


def test_unscored_loops_record_no_scores_and_an_accepted_round_keeps_its_score() -> None:
    _, record = _running_check(max_rounds=3)
    record = _round(record, EventKind.REJECT, None)
    assert record.scores is None  # nothing recorded for a loop that never scores
    record = _round(record, EventKind.ACCEPT, 0.9)
    assert record.status is TaskStatus.DONE and record.scores == [None, 0.9] and record.exhausted is None
    _, record = _running_check(max_rounds=2)
    for _ in range(2):
        record = _round(record, EventKind.REJECT, None, keep_best=True)
    assert (record.status, record.kept_round) == (TaskStatus.DONE, 2)  # no score: the last candidate
    assert scores.keeps([], None) and not scores.keeps([0.3], None) and scores.keeps([None, None], 0.0)

"""A round's recorded check and the feedback an attempt gets (taskloop/core/checks.py): the stored
form round-trips, the forms stored so far read as before, what is not a check is refused, and the
one feedback rule (a fork's for the round, else the last check's). Pure."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

import taskloop as tl
from taskloop.base.jsonvalue import dumps
from taskloop.core import checks, reads
from taskloop.core import fields as fld
from taskloop.core.checks import StoredCheck
from taskloop.core.states import Phase

# a score of -0.0 is not lossless JSON (it reads back as 0): the stored form refuses it
SCORES = st.none() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False).map(
    lambda x: x + 0.0)
LOOP_CHECKS = st.one_of(
    st.builds(lambda score: tl.LoopCheck(done=True, score=score), SCORES),
    st.builds(lambda feedback, score: tl.LoopCheck(done=False, feedback=feedback, score=score),
              st.text(alphabet=st.characters(blacklist_categories=("Cs",))), SCORES),
)


@given(LOOP_CHECKS)
def test_a_check_reads_back_as_it_was_written(check: tl.LoopCheck) -> None:
    stored = StoredCheck.of(check).encode(10**6)
    assert stored.raw is not None
    assert stored.raw == dumps(check.stored())  # the LoopCheck's own account of what is recorded
    assert StoredCheck.decode(stored.raw) == StoredCheck(check.done, check.feedback, check.score)
    assert StoredCheck.decode(stored.raw).form() == check.stored()


def test_the_score_is_recorded_only_when_there_is_one() -> None:
    assert StoredCheck(True).encode(100).raw == '{"done":true,"feedback":null}'
    assert StoredCheck(False, "again", 0.5).encode(100).raw == '{"done":false,"feedback":"again","score":0.5}'


def test_a_check_over_the_feedback_cap_is_not_encoded() -> None:
    stored = StoredCheck(False, "x" * 100).encode(50)
    assert stored.raw is None and stored.size is not None and stored.size > 50


@pytest.mark.parametrize(("raw", "check"), [
    ('{"done": false, "feedback": "again"}', StoredCheck(False, "again")),  # before scores
    ('{"done": true, "feedback": null}', StoredCheck(True)),
    ('{"done": true, "feedback": null, "score": 7}', StoredCheck(True, None, 7.0)),
    ('{"done": false, "feedback": "x", "score": null}', StoredCheck(False, "x")),
    ('{"done": false}', StoredCheck(False)),  # no feedback field: none
    ('{"done": true, "feedback": null, "later": 1}', StoredCheck(True)),  # a field it does not know
])
def test_the_forms_stored_so_far_read_as_before(raw: str, check: StoredCheck) -> None:
    assert StoredCheck.decode(raw) == check
    assert StoredCheck.read(raw) == check


NOT_CHECKS = {  # what is stored: what is wrong with it
    "not json": "Expecting value",
    "": "Expecting value",
    "[1]": "a JSON object, got list",
    "null": "a JSON object, got NoneType",
    '{"feedback": "x"}': "done is true or false, got None",
    '{"done": 0, "feedback": "x"}': "done is true or false, got 0",
    '{"done": false, "feedback": 3}': "feedback is a string or null, got int",
    '{"done": true, "feedback": null, "score": "7"}': "score is a number, got str",
    '{"done": true, "feedback": null, "score": true}': "score is a number, got bool",
}


@pytest.mark.parametrize(("raw", "problem"), NOT_CHECKS.items())
def test_what_is_not_a_check_is_refused(raw: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        StoredCheck.decode(raw)
    assert StoredCheck.read(raw) is None


def test_not_json_raises_json_s_own_error() -> None:
    with pytest.raises(json.JSONDecodeError):
        StoredCheck.decode("{")


def test_nothing_recorded_reads_as_none() -> None:
    assert StoredCheck.read(None) is None


def test_a_rejection_is_done_false_with_feedback() -> None:
    assert StoredCheck(False, "again").rejected
    assert StoredCheck(False, "").rejected
    assert not StoredCheck(False).rejected
    assert not StoredCheck(True, "fine").rejected


def _get(values: dict[str, str]) -> tuple[list[str], Callable[[str], str | None]]:
    asked: list[str] = []

    def get(name: str) -> str | None:
        asked.append(name)
        return values.get(name)
    return asked, get


def test_round_one_gets_no_feedback_unless_a_fork_gave_one() -> None:
    asked, get = _get({})
    assert checks.attempt_feedback("fix", 1, get) is None
    assert asked == [fld.feedback_field("fix", 1)]
    _, get = _get({fld.feedback_field("fix", 1): checks.encode_given("start here")})
    assert checks.attempt_feedback("fix", 1, get) == "start here"


def test_a_later_round_gets_the_last_check_s_feedback() -> None:
    asked, get = _get({fld.check_field("fix", 2): StoredCheck(False, "too long").encode(100).raw or ""})
    assert checks.attempt_feedback("fix", 3, get) == "too long"
    assert asked == [fld.feedback_field("fix", 3), fld.check_field("fix", 2)]


def test_a_fork_s_feedback_wins_and_the_check_is_not_read() -> None:
    asked, get = _get({fld.feedback_field("fix", 3): checks.encode_given("shorter, é ✓"),
                       fld.check_field("fix", 2): StoredCheck(False, "too long").encode(100).raw or ""})
    assert checks.attempt_feedback("fix", 3, get) == "shorter, é ✓"
    assert asked == [fld.feedback_field("fix", 3)]


def test_a_fork_s_feedback_is_stored_as_a_json_string() -> None:
    assert checks.encode_given("shorter, é") == '"shorter, é"'
    assert checks.decode_given(checks.encode_given("a \u2028 b")) == "a \u2028 b"


def test_an_unreadable_last_check_raises() -> None:
    _, get = _get({fld.check_field("fix", 1): "not json"})
    with pytest.raises(ValueError):
        checks.attempt_feedback("fix", 2, get)


def test_an_attempt_reads_the_fields_of_the_rule() -> None:
    for round in (1, 2, 5):
        assert reads.phase_fields(Phase.ATTEMPT, "fix", round) == checks.feedback_fields("fix", round)
    assert checks.feedback_fields("fix", 1) == [fld.feedback_field("fix", 1)]
    assert checks.feedback_fields("fix", 4) == [fld.feedback_field("fix", 4), fld.check_field("fix", 3)]

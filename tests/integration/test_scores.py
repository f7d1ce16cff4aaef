"""Scores, plateaus and best-of on real workers (SPEC §3): a plateau ends a loop early, a best-of
loop ends done with its best candidate (ties: the later; no scores: the last) and its dependents
run, scores show in inspect and in events, a non-finite score fails the task naming its round."""

from __future__ import annotations

import time

import pytest

import taskloop as tl
from tests.integration import score_flows as sf

pytestmark = pytest.mark.usefixtures("workers")


def _run(client, workflow, **given):  # type: ignore[no-untyped-def]
    handle = client.start(workflow, input=given, run_id=f"score-{workflow.name}-{time.time_ns()}")
    return handle, handle.wait(timeout=30)


def test_a_plateau_ends_the_loop_early_as_an_exhaustion(client) -> None:
    handle, result = _run(client, sf.plateau, scores=[0.5, 0.6, 0.55, 0.605, 0.9])
    assert result.status == "failed"
    error = result.errors[0]
    assert error.type == "LoopTaskExhausted" and error.details["reason"] == "plateau" and error.details["round"] == 4
    assert error.message == "Loop task draft stopped improving (plateau) in round 4 of 6"
    with pytest.raises(tl.LoopTaskExhausted) as raised:
        result.raise_for_status()
    assert raised.value.reason == "plateau" and raised.value.max_rounds == 6
    view = client.inspect(handle.run_id)
    assert [r.check["score"] for r in view.tasks["draft"].rounds] == [0.5, 0.6, 0.55, 0.605]  # round 5 never ran
    assert view.tasks["draft"].round == 4


def test_best_of_ends_done_with_the_best_candidate_and_its_dependents_run(client) -> None:
    handle, result = _run(client, sf.best, scores=[0.5, 0.7, 0.6])
    assert result.status == "done" and result.values == {"draft": "draft 2", "publish": "published draft 2"}
    draft = client.inspect(handle.run_id).tasks["draft"]
    assert (draft.status, draft.exhausted, draft.kept_round) == ("done", "rounds", 2)
    ended = [e for e in client.events(handle.run_id) if e.type == "task" and e.key == "draft"]
    assert ended[-1].data == {"status": "done", "exhausted": "rounds", "kept_round": 2}
    scored = [e.data["score"] for e in client.events(handle.run_id) if e.type == "phase" and e.phase == "complete"]
    assert scored == [0.5, 0.7, 0.6]


def test_best_of_ties_keep_the_later_round_and_without_scores_the_last(client) -> None:
    handle, result = _run(client, sf.best, scores=[0.7, 0.4, 0.7])
    assert result.values["draft"] == "draft 3"
    handle, result = _run(client, sf.best, scores=[])
    assert result.status == "done" and result.values["draft"] == "draft 3"
    assert client.inspect(handle.run_id).tasks["draft"].kept_round == 3
    assert all("score" not in r.check for r in client.inspect(handle.run_id).tasks["draft"].rounds)


def test_best_of_with_a_plateau_keeps_the_best_round_before_it(client) -> None:
    handle, result = _run(client, sf.best_plateau, scores=[0.2, 0.9, 0.3, 0.8, 0.95])
    assert result.status == "done" and result.values["draft"] == "draft 2"
    draft = client.inspect(handle.run_id).tasks["draft"]
    assert (draft.exhausted, draft.kept_round, draft.round) == ("plateau", 2, 4)


def test_an_accepted_round_keeps_its_score(client) -> None:
    handle, result = _run(client, sf.best, scores=[0.1, 0.95], accept_at=2)
    assert result.values["draft"] == "draft 2"
    draft = client.inspect(handle.run_id).tasks["draft"]
    assert draft.exhausted is None and draft.kept_round is None
    assert [r.check["score"] for r in draft.rounds] == [0.1, 0.95]


def test_a_non_finite_score_fails_the_task_and_names_the_round(client) -> None:
    _, result = _run(client, sf.best, scores=[0.5, "inf"])
    assert result.status == "failed"
    error = result.errors[0]
    assert error.type == "InvalidCheckResult"
    assert "loop check score must be a finite number" in error.message and "task draft round 2" in error.message

"""Scores of a loop's rounds (pure): when a loop has stopped improving (``Plateau``), and which
round's candidate a best-of loop keeps (``on_exhausted="best"``).

``scores`` holds one entry per round so far, None for a round its check did not score."""

from __future__ import annotations

from collections.abc import Sequence

Scores = Sequence[float | None]


def plateaued(scores: Scores, rounds: int, min_gain: float) -> bool:
    """The plateau rule: there are more than ``rounds`` scored rounds, and the best score of the
    last ``rounds`` of them gained less than ``min_gain`` over the best score before them (rounds
    without a score are left out; a gain of 0 is not less than 0, so ``min_gain=0`` stops only on
    a fall)."""
    scored = [s for s in scores if s is not None]
    if len(scored) <= rounds:
        return False
    return max(scored[-rounds:]) - max(scored[:-rounds]) < min_gain


def best_round(scores: Scores) -> int:
    """The round (1-based) whose candidate a best-of loop keeps: the highest score, the latest
    among equals; the last round when no round was scored."""
    best: int | None = None
    for n, score in enumerate(scores, start=1):
        if score is not None and (best is None or score >= (scores[best - 1] or 0.0)):
            best = n
    return best if best is not None else len(scores)


def keeps(scores_before: Scores, score: float | None) -> bool:
    """Whether this round's candidate becomes the one kept (``best_round`` of the scores with it),
    from the scores of the rounds before it."""
    return best_round([*scores_before, score]) == len(scores_before) + 1


def before(scores: Scores | None, round: int) -> list[float | None]:
    """The scores of the rounds before ``round``, one entry each."""
    found = list(scores or [])[: round - 1]
    return found + [None] * (round - 1 - len(found))


def with_score(scores: Scores | None, round: int, score: float | None) -> list[float | None] | None:
    """The scores after round ``round``: None while no round has been scored (unscored loops
    record nothing)."""
    if score is None and not any(s is not None for s in scores or ()):
        return None
    return [*before(scores, round), score]

"""The score of each round of a loop as a small line chart (pure: the template draws it as SVG)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from taskloop.runtime.models import RoundView

WIDTH, HEIGHT, PAD = 320, 90, 18


@dataclass(frozen=True)
class Point:
    round: int
    score: float
    x: float
    y: float
    kept: bool


@dataclass(frozen=True)
class Chart:
    points: list[Point]
    path: str
    low: float
    high: float
    width: int = WIDTH
    height: int = HEIGHT


def score_chart(rounds: Sequence[RoundView], kept_round: int | None = None) -> Chart | None:
    """The chart of the scored rounds (None when no round was scored)."""
    scored = [(r.round, float(r.check["score"])) for r in rounds
              if r.check is not None and isinstance(r.check.get("score"), int | float)]
    if not scored:
        return None
    low, high = min(s for _, s in scored), max(s for _, s in scored)
    span = (high - low) or 1.0
    last = max(len(rounds), 2)

    def x(n: int) -> float:
        return round(PAD + (n - 1) * (WIDTH - 2 * PAD) / (last - 1), 1)

    def y(score: float) -> float:
        return round(HEIGHT - PAD - (score - low) * (HEIGHT - 2 * PAD) / span, 1)

    points = [Point(n, s, x(n), y(s), n == kept_round) for n, s in scored]
    path = "M" + " L".join(f"{p.x},{p.y}" for p in points)
    return Chart(points=points, path=path, low=low, high=high)

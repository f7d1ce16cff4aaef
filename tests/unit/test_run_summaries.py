"""``client.runs(limit=N)`` for any N: ``views.run_summaries`` reads pages of at most MAX_PAGE."""

from __future__ import annotations

from typing import Any

import pytest

from taskloop.base.errors import InvalidInput
from taskloop.runtime import views
from taskloop.runtime.models import RunPage, RunSummary


def _listed(total: int, monkeypatch: pytest.MonkeyPatch, shift_once: bool = False) -> list[tuple[int, int]]:
    """``run_page`` over ``total`` runs (run-0 newest); ``shift_once``: a run is started before the
    second page, which shifts the list by one. Returns the (offset, limit) of each page read."""
    ids = [f"run-{n}" for n in range(total)]
    asked: list[tuple[int, int]] = []

    def page(store: Any, status: Any, workflow: Any, offset: int, limit: int) -> RunPage:
        assert limit <= views.MAX_PAGE
        asked.append((offset, limit))
        if shift_once and len(asked) == 2:
            ids.insert(0, "run-new")
        runs = [RunSummary(run_id=i, workflow="w", version="1", status="done", termination_code=None,
                           created_at=0.0, finished_at=None) for i in ids[offset: offset + limit]]
        return RunPage(runs=runs, total=len(ids), offset=offset, limit=limit, more=offset + limit < len(ids))

    monkeypatch.setattr(views, "run_page", page)
    return asked


def test_a_limit_past_one_page_is_read_in_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _listed(1_200, monkeypatch)
    found = views.run_summaries(None, limit=1_000)  # type: ignore[arg-type]
    assert [r.run_id for r in found] == [f"run-{n}" for n in range(1_000)]
    assert asked == [(0, 500), (500, 500)]


def test_fewer_runs_than_the_limit_end_the_paging(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _listed(700, monkeypatch)
    assert len(views.run_summaries(None, limit=5_000)) == 700  # type: ignore[arg-type]
    assert asked == [(0, 500), (500, 500)]


def test_a_run_started_while_paging_lists_no_run_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    _listed(600, monkeypatch, shift_once=True)
    found = [r.run_id for r in views.run_summaries(None, limit=600)]  # type: ignore[arg-type]
    assert len(found) == len(set(found))


@pytest.mark.parametrize("limit", [0, -1, True, 2.5])
def test_a_limit_that_is_no_count_is_refused(limit: Any) -> None:
    with pytest.raises(InvalidInput, match="limit must be an integer"):
        views.run_summaries(None, limit=limit)  # type: ignore[arg-type]

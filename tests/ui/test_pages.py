"""The run UI in a real browser: the list and the run pages of runs in every state, a page that
updates live, and the JSON API behind them. Real redis-server, real workers, a real `taskloop ui`
process, Debian's chromium."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.integration import control_flows as cf
from tests.ui import ui_flows
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


@pytest.fixture(scope="module")
def runs(redis_server, workers) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """One run in each state the pages must show, by name."""
    import redis

    from examples import workflows
    from taskloop.runtime.client import TaskLoop

    client = TaskLoop(redis_server.url)
    probe = redis.Redis.from_url(redis_server.url, decode_responses=True)
    stamp = time.time_ns()
    ids = {name: f"ui-{name}-{stamp}" for name in ("done", "exhausted", "cancelled", "waiting", "failed", "graph")}
    client.start(ui_flows.writer, input={"accept_in": 3}, run_id=ids["done"])
    client.start(ui_flows.never_good, input={}, run_id=ids["exhausted"])
    client.start(cf.cancellable, input={"hold": "attempt"}, run_id=ids["cancelled"])
    client.start(ui_flows.gated, input={}, run_id=ids["waiting"])
    probe.set(f"test:{ids['failed']}:broken", "1")
    client.start(cf.resumable, input={}, run_id=ids["failed"])
    client.start(workflows.report_revision, input={"approve_in": 2}, run_id=ids["graph"])
    wait_until(lambda: probe.get(f"test:{ids['cancelled']}:started") is not None, timeout=20, what="attempt began")
    client.cancel(ids["cancelled"], "not needed any more", actor="tester")
    for name, status in (("done", "done"), ("exhausted", "failed"), ("cancelled", "cancelled"), ("failed", "failed"),
                         ("graph", "done")):
        wait_until(lambda run_id=ids[name], want=status: client.inspect(run_id).status == want, timeout=30,
                   what=f"run {name} ends {status}")
    wait_until(lambda: client.inspect(ids["waiting"]).status == "waiting", timeout=30, what="the gate waits")
    probe.close()
    client.close()
    return ids


def test_the_list_shows_every_run_with_its_status_and_loops(ui, tab, runs) -> None:
    page = tab.page
    page.goto(f"{ui.url}/")
    expected = {"done": "done", "exhausted": "failed", "cancelled": "cancelled", "waiting": "waiting",
                "failed": "failed", "graph": "done"}
    for name, status in expected.items():
        row = page.locator(f'tr[data-run="{runs[name]}"]')
        assert row.count() == 1, name
        assert row.locator(".badge").first.inner_text() == status, name
    assert "draft 3/4" in page.locator(f'tr[data-run="{runs["done"]}"] td.loops').inner_text()
    assert "polish 2/2" in page.locator(f'tr[data-run="{runs["exhausted"]}"] td.loops').inner_text()
    # filters: by status (paged in Redis), by workflow, by id prefix
    page.goto(f"{ui.url}/?status=failed")
    shown = page.locator("tr[data-run]").evaluate_all("rows => rows.map(r => r.dataset.run)")
    assert runs["exhausted"] in shown and runs["failed"] in shown and runs["done"] not in shown
    assert set(page.locator("tr[data-run] .badge").all_inner_texts()) == {"failed"}
    page.goto(f"{ui.url}/?workflow=ui-gate")
    assert runs["waiting"] in page.locator("tr[data-run]").evaluate_all("rows => rows.map(r => r.dataset.run)")
    assert set(page.locator("tr[data-run] td:nth-child(3)").all_inner_texts()) == {"ui-gate v1"}
    page.goto(f"{ui.url}/?q={runs['graph'][:-3]}")
    assert runs["graph"] in page.locator("tr[data-run]").evaluate_all("rows => rows.map(r => r.dataset.run)")
    assert tab.errors == [] and tab.dialogs == []


def test_a_loop_run_shows_each_round_with_its_verdict_and_feedback(ui, tab, runs) -> None:
    page = tab.page
    page.goto(f"{ui.url}/runs/{runs['done']}")
    assert page.locator("#run-status").inner_text() == "done"
    rounds = page.locator("#task-draft tr.round")
    assert rounds.count() == 3
    verdicts = page.locator("#task-draft tr.round td:nth-child(3)").all_inner_texts()
    assert verdicts == ["rejected", "rejected", "accepted"]
    assert "round 1: cite a source" in rounds.nth(0).locator("td.feedback").inner_text()
    # round 1's long output is collapsed, its start shown; opening it shows all of it
    first = page.locator("#o-draft-1")
    assert first.evaluate("d => d.tagName") == "DETAILS" and not first.evaluate("d => d.open")
    first.locator("summary").click()
    assert "Bounded loops give a reviewer" in first.locator("pre").inner_text()
    # the graph: every task drawn with its live status, edges between them
    nodes = page.locator("svg g.node")
    assert {n.get_attribute("data-key"): n.get_attribute("data-status") for n in nodes.all()} == {
        "outline": "done", "draft": "done", "publish": "done"}
    assert page.locator("svg path.edge").count() == 2
    assert "round 3/4" in page.locator('svg g.node[data-key="draft"] text.sub').text_content()
    # the timeline, in human times
    assert page.locator("table.events tr.ev").count() >= 10
    assert "accepted" in page.locator("table.events").inner_text()
    assert tab.errors == []


def test_failed_exhausted_cancelled_waiting_and_graph_runs_show_what_ended_them(ui, tab, runs) -> None:
    page = tab.page
    page.goto(f"{ui.url}/runs/{runs['exhausted']}")
    assert page.locator("#run-status").inner_text() == "failed"
    error = page.locator("#task-polish details.error summary").inner_text()
    assert "LoopTaskExhausted" in error and "exhausted its 2 rounds" in error
    page.goto(f"{ui.url}/runs/{runs['failed']}")
    page.locator("#e-fix summary").click()
    assert "reviewer crashed" in page.locator("#e-fix").inner_text()
    assert "Traceback" in page.locator("#e-fix pre.tb").inner_text()  # the recorded traceback
    assert page.locator("#resume-run").count() == 1
    page.goto(f"{ui.url}/runs/{runs['cancelled']}")
    assert page.locator("#run-status").inner_text() == "cancelled"
    assert "not needed any more" in page.locator("table.events").inner_text()
    assert "by tester" in page.locator("table.events").inner_text()
    page.goto(f"{ui.url}/runs/{runs['waiting']}")
    assert page.locator("#run-status").inner_text() == "waiting"
    assert "Publish this draft?" in page.locator("#gate-approval").inner_text()
    assert page.locator("#approve-approval").count() == 1
    page.goto(f"{ui.url}/runs/{runs['graph']}")
    assert "Business state" in page.locator("section.state").inner_text()
    assert '"approved": true' in page.locator("section.state").inner_text()
    assert page.locator("section.activations tr[id^=task-review]").count() == 2
    assert page.locator('svg g.node[data-key="review"]').get_attribute("data-status") == "done"
    assert page.locator("svg path.edge.back").count() == 1  # review -> review, a declared loop
    assert tab.errors == []


def test_a_live_page_shows_round_2s_feedback_while_the_run_goes_on(ui, tab, client) -> None:
    run_id = f"ui-live-{time.time_ns()}"
    handle = client.start(ui_flows.writer, input={"pace": 0.6, "accept_in": 4}, run_id=run_id)
    page = tab.page
    page.goto(f"{ui.url}/runs/{run_id}")
    page.evaluate("window.__sameDocument = true")
    feedback = page.locator('#task-draft tr.round[data-round="2"] td.feedback')
    feedback.wait_for(timeout=20_000)
    page.wait_for_function(
        "() => (document.querySelector('#task-draft tr.round[data-round=\"2\"] td.feedback') || {}).innerText"
        "?.includes('round 2: cite a source')", timeout=20_000)
    # while the run is still going, without a reload
    assert page.locator("#run-status").inner_text() in ("running", "waiting")
    assert page.evaluate("window.__sameDocument") is True
    assert client.inspect(run_id).status == "running"
    page.wait_for_function("() => document.querySelector('#run-status').innerText === 'done'", timeout=30_000)
    assert handle.wait(timeout=30).status == "done"
    assert page.evaluate("window.__sameDocument") is True
    assert tab.errors == []


def test_an_opened_output_stays_open_across_live_updates(ui, tab, client) -> None:
    run_id = f"ui-open-{time.time_ns()}"
    client.start(ui_flows.writer, input={"pace": 0.5, "accept_in": 3}, run_id=run_id)
    page = tab.page
    page.goto(f"{ui.url}/runs/{run_id}")
    page.locator("#o-draft-1 summary").click(timeout=20_000)
    page.wait_for_function("() => document.querySelector('#run-status').innerText === 'done'", timeout=30_000)
    assert page.locator("#o-draft-1").evaluate("d => d.open") is True


def test_the_api_serves_what_the_pages_show(ui, runs) -> None:
    found = _get_json(f"{ui.url}/api/runs?status=failed&limit=500")
    assert runs["exhausted"] in [r["run_id"] for r in found["runs"]] and found["total"] >= 2
    assert found["progress"][runs["exhausted"]] == [{"key": "polish", "round": 2, "max_rounds": 2, "status": "failed"}]
    view = _get_json(f"{ui.url}/api/runs/{runs['done']}")
    rounds = view["run"]["tasks"]["draft"]["rounds"]
    assert [r["check"]["done"] for r in rounds] == [False, False, True]
    assert [t["key"] for t in view["shape"]["tasks"]] == ["outline", "draft", "publish"]
    events = _get_json(f"{ui.url}/api/runs/{runs['done']}/events")
    assert events[0]["type"] == "run.started" and events[-1]["type"] == "run.finished"
    later = _get_json(f"{ui.url}/api/runs/{runs['done']}/events?after={events[-2]['id']}")
    assert [e["id"] for e in later] == [events[-1]["id"]]
    fleet = _get_json(f"{ui.url}/api/fleet")
    assert len(fleet["workers"]) >= 2 and fleet["runs_by_status"]["done"] >= 2
    session = _get_json(f"{ui.url}/api/session")
    assert session["read_only"] is False and len(session["csrf"]) == 40


def test_the_fleet_page_shows_workers_queues_and_runs(ui, tab, runs) -> None:
    page = tab.page
    page.goto(f"{ui.url}/fleet")
    text = page.locator("#fleet").inner_text()
    assert "Workers" in text and "online" in text and "w1@" in text and "w2@" in text
    assert "taskloop" in page.locator("#fleet table").nth(1).inner_text()  # the default queue
    assert "expired leases" in text and "reconciler" in text


def test_throttled_phases_show_on_their_run_and_their_limit_on_the_fleet(ui, tab, redis_server) -> None:
    from taskloop.runtime.client import TaskLoop
    from tests.integration import limit_flows as lf

    client = TaskLoop(redis_server.url)
    tag = f"ui-limits-{time.time_ns()}"
    try:
        handles = [client.start(lf.held, input={"tag": tag, "doc": "ui-doc", "hold_s": 2.0}) for _ in range(3)]
        wait_until(lambda: sum(client.inspect(h.run_id).tasks["hold"].throttled is not None for h in handles) >= 1,
                   timeout=15, what="a phase waits for the limit")
        waiting = next(h for h in handles if client.inspect(h.run_id).tasks["hold"].throttled is not None)
        page = tab.page
        page.goto(f"{ui.url}/runs/{waiting.run_id}")
        assert "throttled by test-doc [ui-doc]" in page.locator(".throttled").first.inner_text()
        page.goto(f"{ui.url}/fleet")
        row = page.locator(".limits tr", has_text="ui-doc")
        assert "test-doc" in row.inner_text() and "1 at once" in row.inner_text()
        limits = _get_json(f"{ui.url}/api/fleet")["limits"]
        assert any(found["name"] == "test-doc" and found["value"] == "ui-doc" for found in limits)
        assert [h.wait(timeout=30).status for h in handles] == ["done"] * 3
    finally:
        client.close()


def test_a_closed_tab_releases_its_live_stream(ui, browser, runs) -> None:
    from tests.ui.conftest import Page

    def open_streams() -> int:
        return int(_get_json(f"{ui.url}/api/fleet")["ui"]["streams_open"])

    wait_until(lambda: open_streams() == 0, timeout=15, what="the earlier tests' streams were released")
    opened = Page(browser)
    opened.page.goto(f"{ui.url}/runs/{runs['done']}")
    wait_until(lambda: open_streams() == 1, timeout=10, what="the page's stream opened")
    opened.close()
    wait_until(lambda: open_streams() == 0, timeout=10, what="the closed tab's stream was released")


def test_unknown_and_malformed_run_ids_get_a_clear_404(ui, tab) -> None:
    page = tab.page
    reply = page.goto(f"{ui.url}/runs/no-such-run")
    assert reply is not None and reply.status == 404
    assert "no-such-run" in page.locator("main").inner_text()
    reply = page.goto(f"{ui.url}/runs/%3Cscript%3E")
    assert reply is not None and reply.status == 404


def test_a_scored_loop_shows_its_scores_per_round_and_the_round_it_kept(ui, tab, client) -> None:
    from tests.integration import score_flows as sf

    run_id = f"ui-scores-{time.time_ns()}"
    assert client.start(sf.best, input={"scores": [0.4, 0.8, 0.6]}, run_id=run_id).wait(timeout=30).status == "done"
    page = tab.page
    page.goto(f"{ui.url}/runs/{run_id}")
    points = page.locator("#task-draft figure.scores circle.pt")
    assert [p.get_attribute("data-score") for p in points.all()] == ["0.4", "0.8", "0.6"]
    assert page.locator("#task-draft circle.pt.kept").get_attribute("data-round") == "2"
    assert "kept the best candidate: round 2" in page.locator("#task-draft .exhausted").inner_text()
    assert page.locator('#task-draft tr.round[data-round="2"] td:nth-child(5)').inner_text() == "0.8"


def test_the_api_forks_and_says_why_it_will_not(ui, runs) -> None:
    session = _get_json(f"{ui.url}/api/session")

    def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        request = urllib.request.Request(f"{ui.url}{path}", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json", "X-CSRF-Token": session["csrf"]})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, body = post(f"/api/runs/{runs['done']}/fork", {"task": "draft", "round": 2, "feedback": "tighter"})
    assert status == 200 and body["ok"] and body["run"]["forked_from"]["run_id"] == runs["done"]
    assert body["run"]["tasks"]["draft"]["rounds"][0]["copied"] is True
    status, body = post(f"/api/runs/{runs['done']}/fork", {"task": "draft", "round": 9})
    assert status == 400 and body["error"]["type"] == "InvalidInput" and "never reached" in body["error"]["message"]
    status, body = post(f"/api/runs/{runs['waiting']}/fork", {"task": "draft", "round": 1})
    assert status == 409 and body["error"]["type"] == "NotForkable"

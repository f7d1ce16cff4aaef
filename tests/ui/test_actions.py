"""Acting from the UI by clicking, in a real browser: approving a gate, cancelling and resuming a
run; each action recorded with its actor. Real workers and a real `taskloop ui` process."""

from __future__ import annotations

import time

import pytest

from tests.integration import control_flows as cf
from tests.ui import ui_flows
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")


def _status(page) -> str:  # type: ignore[no-untyped-def]
    return str(page.locator("#run-status").inner_text())


def test_approving_a_gate_by_clicking_lets_the_run_finish(ui, tab, client) -> None:
    run_id = f"ui-approve-{time.time_ns()}"
    handle = client.start(ui_flows.gated, input={}, run_id=run_id)
    wait_until(lambda: client.inspect(run_id).status == "waiting", timeout=30, what="the gate waits")
    page = tab.page
    page.goto(f"{ui.url}/runs/{run_id}")
    form = page.locator("#gate-approval form.decide")
    form.locator('input[name="actor"]').fill("alice")
    form.locator('input[name="reason"]').fill("reads well")
    page.locator("#approve-approval").click()
    page.wait_for_url(f"{ui.url}/runs/{run_id}?done=approve")
    result = handle.wait(timeout=30)
    assert result.status == "done" and result.values["publish"] == "published: a draft to approve"
    page.wait_for_function("() => document.querySelector('#run-status').innerText === 'done'", timeout=15_000)
    decision = page.locator("#gate-approval .decision").inner_text()
    assert "alice" in decision and "approve" in decision and "reads well" in decision
    gate_events = [e for e in client.events(run_id) if e.type == "gate"]
    assert [(e.phase, e.data["actor"], e.data["reason"]) for e in gate_events] == [("approve", "alice", "reads well")]
    assert tab.errors == []


def test_rejecting_a_gate_by_clicking_rejects_the_run(ui, tab, client) -> None:
    run_id = f"ui-reject-{time.time_ns()}"
    handle = client.start(ui_flows.gated, input={}, run_id=run_id)
    wait_until(lambda: client.inspect(run_id).status == "waiting", timeout=30, what="the gate waits")
    page = tab.page
    page.goto(f"{ui.url}/runs/{run_id}")
    page.locator("#reject-approval").click()
    page.wait_for_url(f"{ui.url}/runs/{run_id}?done=reject")
    assert handle.wait(timeout=30).status == "rejected"
    assert _status(page) == "rejected"


def test_an_input_gate_resumes_with_the_value_typed_and_refuses_bad_json(ui, tab, client) -> None:
    run_id = f"ui-input-{time.time_ns()}"
    handle = client.start(cf.input_flow, input={}, run_id=run_id)
    wait_until(lambda: client.inspect(run_id).status == "waiting", timeout=30, what="the input gate waits")
    page = tab.page
    page.goto(f"{ui.url}/runs/{run_id}")
    page.locator('#gate-edit textarea[name="value"]').fill("not json")
    page.locator("#resume-edit").click()
    notice = page.locator("p.notice.bad")
    assert "value must be JSON" in notice.inner_text()  # said on the page, nothing decided
    assert client.inspect(run_id).status == "waiting"
    page.locator('#gate-edit textarea[name="value"]').fill('"Bounded loops, watched"')
    page.locator("#resume-edit").click()
    page.wait_for_url(f"{ui.url}/runs/{run_id}?done=resume")
    assert handle.wait(timeout=30).values["titled"] == "title: Bounded loops, watched"


def test_cancelling_by_clicking_stops_the_run_with_the_reason_and_actor(ui, tab, client, probe) -> None:
    run_id = f"ui-cancel-{time.time_ns()}"
    handle = client.start(cf.cancellable, input={"hold": "attempt"}, run_id=run_id)
    wait_until(lambda: probe.get(f"test:{run_id}:started") is not None, timeout=20, what="the attempt began")
    page = tab.page
    page.goto(f"{ui.url}/runs/{run_id}")
    page.locator('.actions input[name="actor"]').first.fill("bob")
    page.locator('.actions input[name="reason"]').fill("wrong topic")
    page.locator("#cancel-run").click()  # the page asks first; dismissed, nothing is cancelled
    assert tab.dialogs == [f"Cancel run {run_id}? Its running steps are stopped; it cannot be resumed."]
    assert page.url == f"{ui.url}/runs/{run_id}" and client.inspect(run_id).control is None
    tab.confirm = True
    page.locator("#cancel-run").click()
    page.wait_for_url(f"{ui.url}/runs/{run_id}?done=cancel")
    assert "Cancel requested" in page.locator("#done-notice").inner_text()
    result = handle.wait(timeout=30)
    assert result.status == "cancelled" and result.termination_code == "aborted"
    cancel = next(e for e in client.events(run_id) if e.type == "run.cancel")
    assert cancel.data == {"reason": "wrong topic", "actor": "bob"}
    page.wait_for_function("() => document.querySelector('#run-status').innerText === 'cancelled'", timeout=15_000)
    assert page.locator("#cancel-run").count() == 0  # a finished run offers no cancel


def test_resuming_by_clicking_replays_the_failed_step(ui, tab, client, probe) -> None:
    run_id = f"ui-resume-{time.time_ns()}"
    probe.set(f"test:{run_id}:broken", "1")
    assert client.start(cf.resumable, input={}, run_id=run_id).wait(timeout=30).status == "failed"
    probe.delete(f"test:{run_id}:broken")
    page = tab.page
    page.goto(f"{ui.url}/runs/{run_id}")
    page.locator("#resume-run").click()
    page.wait_for_url(f"{ui.url}/runs/{run_id}?done=resume")
    page.wait_for_function("() => document.querySelector('#run-status').innerText === 'done'", timeout=30_000)
    result = client.result(run_id)
    assert result is not None and result.values == {"fix": 2, "report": "fixed in 2"}
    resumed = next(e for e in client.events(run_id) if e.type == "run.resumed")
    assert resumed.data == {"tasks": ["fix"], "actor": "ui"}  # no auth, no name given: the default actor


def test_a_refused_resume_is_said_on_the_run_page_at_the_run_pages_address(ui, tab, client) -> None:
    run_id = f"ui-noresume-{time.time_ns()}"
    assert client.start(ui_flows.never_good, input={}, run_id=run_id).wait(timeout=30).status == "failed"
    page = tab.page
    page.goto(f"{ui.url}/runs/{run_id}")
    page.locator("#resume-run").click()  # an exhausted loop stays exhausted: refused
    assert "NotResumable" in page.locator("p.notice.bad").inner_text()
    page.wait_for_url(f"{ui.url}/runs/{run_id}")  # not /resume: a reload shows the run, it posts nothing
    page.reload()
    assert page.locator("p.notice.bad").count() == 0 and _status(page) == "failed"
    assert [e for e in tab.errors if "409 (Conflict)" not in e] == []  # the refusal's status, logged


def test_forking_from_a_round_by_clicking_starts_the_new_run_with_the_feedback_typed(ui, tab, client) -> None:
    from tests.integration import fork_flows as ff

    run_id = f"ui-fork-{time.time_ns()}"
    assert client.start(ff.essay, input={"accept_at": 3}, run_id=run_id).wait(timeout=30).status == "done"
    page = tab.page
    page.goto(f"{ui.url}/runs/{run_id}")
    page.locator("#fork-draft-2 summary").click()
    box = page.locator('#fork-draft-2 textarea[name="feedback"]')
    assert box.input_value() == "round 1: too long"  # the recorded feedback, to edit
    box.fill("shorter, please")
    page.locator("#fork-draft-2-go").click()
    page.wait_for_url(f"{ui.url}/runs/*?forked=1")
    new_id = page.url.split("/runs/")[1].split("?")[0]
    assert new_id != run_id
    page.wait_for_function("() => document.querySelector('#run-status').innerText === 'done'", timeout=30_000)
    assert f"forked from {run_id} at draft round 2" in page.locator("p.forked").inner_text()
    first = page.locator('#task-draft tr.round[data-round="1"]')
    assert "copied" in first.locator("td").first.inner_text()
    assert "shorter, please" in page.locator('#task-draft tr.round[data-round="2"] p.given').inner_text()
    result = client.result(new_id)
    assert result is not None and result.values["draft"] == "draft 2 after shorter, please"
    started = client.events(new_id)[0]
    assert started.data["forked_from"] == {"run_id": run_id, "task": "draft", "round": 2}
    assert started.data["actor"] == "ui"
    # a live run offers no fork; the refusal of a bad round is said on the page
    page.goto(f"{ui.url}/runs/{run_id}")
    assert tab.errors == []

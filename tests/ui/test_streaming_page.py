"""A run's live text in the UI (SPEC §13), against a real `taskloop ui`, a real worker and Debian's
chromium: the run page shows the text a phase streams growing under its round while the phase
runs, hostile text inert (no script runs, no element or link is made, controls and a bidi override
shown escaped, markup as text), and keeps it (folded) once the round has ended;
``/api/runs/<id>/stream`` serves the chunks as server-sent events that end with the run's status,
answers an unknown run with a 404 and a bad argument with a 400 as JSON, and 401 without
credentials when auth is on.

This module has its own Redis, worker and UI, so that only its worker takes its runs.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from taskloop.ops.embedded import RedisServer
from taskloop.runtime.client import TaskLoop
from tests.integration.flows import recorded
from tests.ui.conftest import AUTH, Page, UIServer
from tests.waiting import wait_until
from tests.workers import WorkerProcess

HOSTILE = ["plain ", '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script> ',
           "[red]markup[/red] ", "\x1b[31mred\x1b[0m \u202eevil ", "line\nnext "]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("stream-ui-redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def worker(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    started = WorkerProcess(redis_server.url, ["tests.integration.stream_flows"],
                            tmp_path_factory.mktemp("stream-ui") / "worker.log", name="sui", pool="threads")
    yield started.ready(60)
    started.stop()


@pytest.fixture(scope="module")
def ui(redis_server: RedisServer, worker: WorkerProcess,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[UIServer]:
    server = UIServer(redis_server.url, tmp_path_factory.mktemp("stream-ui") / "ui.log")
    yield server
    server.stop()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.headers.get("content-type", ""), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("content-type", ""), exc.read().decode()


def test_the_run_page_shows_the_text_growing_under_its_round_and_hostile_text_inert(
        ui: UIServer, tab: Page, client: TaskLoop, probe: redis.Redis) -> None:
    run = client.start("streamed", {"tokens": HOSTILE, "holds": [3], "rounds": 2})
    wait_until(lambda: recorded(probe, run.run_id, "held"), 30, "the attempt to hold")
    page = tab.page
    page.goto(f"{ui.url}/runs/{run.run_id}")
    live = page.locator('pre[data-stream="write|1"]')

    # Given the attempt held after three tokens: they are under round 1, whose output is not recorded yet
    wait_until(lambda: "[red]markup[/red]" in live.inner_text(), 15, "the first tokens on the page")
    text = live.inner_text()
    assert text.startswith("attempt\nplain <img src=x onerror=") and "<script>window.__pwned=2</script>" in text
    round_row = page.locator('tr.round[data-round="1"]')
    assert "attempting" in round_row.inner_text()
    assert page.locator("tr.stream-row.has-text").count() == 1

    # When it goes on: the rest comes, round 2 streams under its own round, and the run ends
    probe.set(f"test:{run.run_id}:go:3", "1")
    assert run.wait(30).status == "done"
    wait_until(lambda: page.locator("#run-status").inner_text() == "done", 15, "the page to show the run done")
    wait_until(lambda: "next" in (page.locator('pre[data-stream="write|2"]').text_content() or ""), 15,
               "round 2's text (folded)")
    # Then an ended round keeps its live text folded, whole, escaped where a page must not act on it
    folded = page.locator("details#s-write-1")
    assert folded.count() == 1 and folded.get_attribute("open") is None
    folded.locator("summary").click()
    shown = page.locator('pre[data-stream="write|1"]').inner_text()
    assert "\\x1b[31mred\\x1b[0m \\u202eevil line\nnext" in shown
    assert "check\n[review of round 1:" in shown
    # and nothing of it became a page element, a script run, a dialog or an error
    assert page.locator("pre.stream img, pre.stream script, pre.stream a").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert tab.dialogs == [] and tab.errors == []


def test_the_api_serves_the_live_text_as_server_sent_events(ui: UIServer, client: TaskLoop) -> None:
    run = client.start("streamed", {"tokens": HOSTILE})
    assert run.wait(30).status == "done"
    status, kind, body = _get(f"{ui.url}/api/runs/{run.run_id}/stream")
    assert status == 200 and kind.startswith("text/event-stream")
    events = [block for block in body.split("\n\n") if block.startswith(("id:", "event:"))]
    chunks = [json.loads(block.split("data: ", 1)[1]) for block in events if "event: chunk" in block]
    assert "".join(c["text"] for c in chunks if c["phase"] == "attempt") == "".join(HOSTILE)  # raw: the data
    assert all(block.startswith(f"id: {c['id']}\n") for block, c in zip(events, chunks, strict=False))
    assert events[-1] == f'event: end\ndata: {{"run_id": "{run.run_id}", "status": "done", "termination": null}}'
    # after a chunk (as a browser that reconnects asks with Last-Event-ID), only what follows it
    _, _, rest = _get(f"{ui.url}/api/runs/{run.run_id}/stream", {"Last-Event-ID": chunks[0]["id"]})
    assert rest.count("event: chunk") == len(chunks) - 1
    # the page's form of the text: escaped as the page shows it
    _, _, page = _get(f"{ui.url}/api/runs/{run.run_id}/stream?text=page&task=write")
    assert "\\\\x1b[31mred" in page and "\\\\u202eevil" in page

    # An unknown run and bad arguments: JSON errors as on every /api route
    status, kind, body = _get(f"{ui.url}/api/runs/no-such-run/stream")
    assert status == 404 and kind == "application/json" and json.loads(body)["error"]["type"] == "RunNotFound"
    status, _, body = _get(f"{ui.url}/api/runs/{run.run_id}/stream?task=nope")
    assert status == 400 and "task 'nope' is not a task of run" in json.loads(body)["error"]["message"]
    status, _, body = _get(f"{ui.url}/api/runs/{run.run_id}/stream?after=later")
    assert status == 400 and "after must be the id of a chunk" in json.loads(body)["error"]["message"]


def test_the_live_text_needs_the_credentials_when_auth_is_on(redis_server: RedisServer, client: TaskLoop,
                                                              tmp_path: Path, worker: Any) -> None:
    run = client.start("streamed", {"count": 3})
    assert run.wait(30).status == "done"
    server = UIServer(redis_server.url, tmp_path / "ui-auth.log", env={"TASKLOOP_UI_AUTH": ":".join(AUTH)})
    try:
        url = f"{server.url}/api/runs/{run.run_id}/stream"
        assert _get(url)[0] == 401
        assert _get(url, {"Authorization": "Basic " + base64.b64encode(b"ops:guess").decode()})[0] == 401
        status, _, body = _get(url, {"Authorization": "Basic " + base64.b64encode(":".join(AUTH).encode()).decode()})
        assert status == 200 and "w0 w1 w2 " in "".join(
            json.loads(line[6:])["text"] for line in body.splitlines() if line.startswith("data: {\"task\""))
    finally:
        server.stop()

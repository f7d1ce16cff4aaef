"""The UI's guards, against a real `taskloop ui` process and a real browser: basic auth on every
path, actions refused across sites or without the token, hostile feedback shown inert, the
read-only mode, and the security headers."""

from __future__ import annotations

import base64
import http.server
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from taskloop.ops.embedded import free_port
from tests.integration import control_flows as cf
from tests.ui import ui_flows
from tests.ui.conftest import AUTH, Page
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")

HOSTILE = ('<img src=x onerror="window.__pwned=1;alert(1)"><script>window.__pwned=2;alert(2)</script>'
           '\x1b[31m red \u202eevil</textarea><svg onload=alert(3)>')


def _request(url: str, method: str = "GET", data: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture(scope="module")
def finished(client) -> str:  # type: ignore[no-untyped-def]
    run_id = f"ui-sec-{time.time_ns()}"
    assert client.start(ui_flows.writer, input={"accept_in": 2}, run_id=run_id).wait(timeout=30).status == "done"
    return run_id


@pytest.fixture(scope="module")
def client(redis_server):  # type: ignore[no-untyped-def]
    from taskloop.runtime.client import TaskLoop

    c = TaskLoop(redis_server.url)
    yield c
    c.close()


def test_every_path_answers_401_without_credentials(ui_auth, finished) -> None:
    paths = ["/", "/fleet", f"/runs/{finished}", f"/runs/{finished}/live", f"/runs/{finished}/body",
             "/fragments/runs", "/static/ui.css", "/static/htmx.min.js", "/api/runs", f"/api/runs/{finished}",
             f"/api/runs/{finished}/events", "/api/fleet", "/api/session", "/nowhere"]
    for path in paths:
        status, headers, _ = _request(ui_auth.url + path)
        assert status == 401, path
        assert headers.get("www-authenticate", "").startswith('Basic realm="taskloop"'), path
    for path in ("/", f"/api/runs/{finished}", "/static/ui.css"):  # a wrong password is no better
        assert _request(ui_auth.url + path, headers=_basic(AUTH[0], "guess"))[0] == 401
    assert _request(f"{ui_auth.url}/runs/{finished}/cancel", "POST", b"reason=x")[0] == 401
    for path in ("/", f"/runs/{finished}", "/static/ui.css", "/api/session"):
        assert _request(ui_auth.url + path, headers=_basic(*AUTH))[0] == 200, path
    assert _request(ui_auth.url + "/healthz")[0] == 200  # the probe says "ok" and nothing else


def test_a_browser_with_the_credentials_sees_the_run_and_acts_as_its_user(ui_auth, browser, client, probe) -> None:
    run_id = f"ui-auth-cancel-{time.time_ns()}"
    handle = client.start(cf.cancellable, input={"hold": "attempt"}, run_id=run_id)
    wait_until(lambda: probe.get(f"test:{run_id}:started") is not None, timeout=20, what="the attempt began")
    tab = Page(browser, http_credentials={"username": AUTH[0], "password": AUTH[1]})
    try:
        tab.page.goto(f"{ui_auth.url}/runs/{run_id}")
        assert tab.page.locator('.actions input[name="actor"]').count() == 0  # the actor is the user
        tab.confirm = True  # the page asks before it cancels
        tab.page.locator("#cancel-run").click()
        tab.page.wait_for_url(f"{ui_auth.url}/runs/{run_id}?done=cancel")
    finally:
        tab.close()
    assert handle.wait(timeout=30).status == "cancelled"
    cancel = next(e for e in client.events(run_id) if e.type == "run.cancel")
    assert cancel.data["actor"] == "ops"


@pytest.fixture()
def evil_site(ui) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """Another origin (another port) serving a page that posts a cancel to the UI by itself."""
    target: dict[str, str] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (f'<form id="f" method="post" action="{ui.url}/runs/{target["run"]}/cancel">'
                    '<input name="reason" value="evil"><input name="csrf" value="guessed"></form>'
                    '<script>document.getElementById("f").submit()</script>').encode()
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    target["url"] = f"http://127.0.0.1:{port}/evil.html"
    yield target  # type: ignore[misc]
    server.shutdown()
    server.server_close()


def test_a_cross_site_post_is_refused_and_changes_nothing(ui, tab, client, probe, evil_site) -> None:
    run_id = f"ui-csrf-{time.time_ns()}"
    client.start(cf.cancellable, input={"hold": "attempt"}, run_id=run_id)
    wait_until(lambda: probe.get(f"test:{run_id}:started") is not None, timeout=20, what="the attempt began")
    evil_site["run"] = run_id  # type: ignore[index]
    # a real browser on another origin submits a form to the UI
    with tab.page.expect_response(lambda r: "/cancel" in r.url) as posted:
        tab.page.goto(evil_site["url"])  # type: ignore[index]
    assert posted.value.status == 403
    assert "cross-site request refused" in posted.value.text()
    # the same POST by hand: another Origin, no Origin but no token, a wrong token
    token = _request(f"{ui.url}/api/session")[2].split('"csrf":"')[1].split('"')[0]
    form = f"reason=evil&csrf={token}".encode()
    assert _request(f"{ui.url}/runs/{run_id}/cancel", "POST", form,
                    {"Origin": "http://evil.example", "Content-Type": "application/x-www-form-urlencoded"})[0] == 403
    assert _request(f"{ui.url}/runs/{run_id}/cancel", "POST", b"reason=evil",
                    {"Content-Type": "application/x-www-form-urlencoded"})[0] == 403
    status, _, body = _request(f"{ui.url}/api/runs/{run_id}/cancel", "POST", b'{"reason": "evil"}',
                               {"Content-Type": "application/json", "X-CSRF-Token": "0" * 40})
    assert status == 403 and "token" in body
    status, _, _ = _request(f"{ui.url}/api/runs/{run_id}/cancel", "POST", b'{"reason": "evil"}',
                            {"Content-Type": "application/json", "Origin": "null", "X-CSRF-Token": token})
    assert status == 403
    view = client.inspect(run_id)
    assert view.control is None and view.status == "running"  # nothing was cancelled
    # and the token with the UI's own origin is what works (the API as a client uses it)
    status, _, body = _request(f"{ui.url}/api/runs/{run_id}/cancel", "POST", b'{"reason": "by the api"}',
                               {"Content-Type": "application/json", "X-CSRF-Token": token})
    assert status == 200 and '"done":"cancel"' in body.replace(" ", "")
    wait_until(lambda: client.inspect(run_id).status == "cancelled", timeout=30, what="the API's cancel landed")


def test_hostile_feedback_is_shown_as_text_and_runs_nothing(ui, tab, client) -> None:
    run_id = f"ui-hostile-{time.time_ns()}"
    assert client.start(ui_flows.writer, input={"accept_in": 2, "feedback": HOSTILE, "topic": HOSTILE},
                        run_id=run_id).wait(timeout=30).status == "done"
    page = tab.page
    page.goto(f"{ui.url}/runs/{run_id}")
    page.wait_for_timeout(500)
    assert tab.dialogs == []
    assert page.evaluate("window.__pwned") is None
    shown = page.locator('#task-draft tr.round[data-round="1"] td.feedback').inner_text()
    assert '<img src=x onerror="window.__pwned=1;alert(1)">' in shown and "<script>" in shown
    assert "\\x1b[31m" in shown and "\\u202eevil" in shown  # controls and bidi overrides made visible
    assert page.locator("main img").count() == 0 and page.locator("main script").count() == 0
    assert page.locator("main svg [onload]").count() == 0
    assert "<script>" in page.locator("table.events").inner_text()  # the timeline quotes it, as text
    status, headers, _ = _request(f"{ui.url}/api/runs/{run_id}")
    assert status == 200 and headers["content-type"] == "application/json"  # JSON is never served as a page
    page.goto(f"{ui.url}/api/runs/{run_id}")
    assert tab.dialogs == [] and page.evaluate("window.__pwned") is None


def test_read_only_hides_and_refuses_every_action(ui_read_only, tab, client, probe) -> None:
    run_id = f"ui-ro-{time.time_ns()}"
    client.start(ui_flows.gated, input={}, run_id=run_id)
    wait_until(lambda: client.inspect(run_id).status == "waiting", timeout=30, what="the gate waits")
    page = tab.page
    page.goto(f"{ui_read_only.url}/runs/{run_id}")
    assert "read-only" in page.locator("header.top").inner_text()
    assert page.locator("main form").count() == 0 and page.locator("main button").count() == 0
    token = _request(f"{ui_read_only.url}/api/session")[2].split('"csrf":"')[1].split('"')[0]
    for path, body in ((f"/runs/{run_id}/cancel", f"csrf={token}"),
                       (f"/runs/{run_id}/gates/approval", f"csrf={token}&action=approve")):
        status, _, text = _request(ui_read_only.url + path, "POST", body.encode(),
                                   {"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 403 and "read-only" in text
    status, _, text = _request(f"{ui_read_only.url}/api/runs/{run_id}/gates/approval", "POST",
                               b'{"action": "approve"}', {"Content-Type": "application/json", "X-CSRF-Token": token})
    assert status == 403 and "read-only" in text
    assert client.inspect(run_id).status == "waiting"
    client.decide(run_id, "approval", "approve", actor="test")  # tidy up


def test_pages_carry_the_security_headers_and_no_inline_script(ui, finished) -> None:
    status, headers, body = _request(f"{ui.url}/runs/{finished}")
    assert status == 200
    lowered = {k.lower(): v for k, v in headers.items()}
    csp = lowered["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert "frame-ancestors 'none'" in csp and lowered["x-frame-options"] == "DENY"
    assert lowered["x-content-type-options"] == "nosniff" and lowered["cache-control"] == "no-store"
    assert "<script>" not in body and " on" not in body.split("<body>")[1].split("=")[0]
    for script in ("htmx.min.js", "sse.min.js", "ui.js"):
        assert f'<script src="/static/{script}" defer></script>' in body
    assert _request(f"{ui.url}/static/ui.css")[1].get("content-security-policy")


def test_the_ui_refuses_an_open_address_without_auth(redis_server, tmp_path) -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "TASKLOOP_REDIS_URL": redis_server.url}
    env.pop("TASKLOOP_UI_AUTH", None)
    found = subprocess.run([sys.executable, "-m", "taskloop", "ui", "--host", "0.0.0.0", "--port", str(free_port())],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert found.returncode == 1
    assert "refusing to serve the UI on 0.0.0.0 without authentication" in found.stderr
    bad = subprocess.run([sys.executable, "-m", "taskloop", "ui", "--port", str(free_port())], cwd=REPO,
                         env={**env, "TASKLOOP_UI_AUTH": "nopassword"}, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 1 and "TASKLOOP_UI_AUTH must be user:password" in bad.stderr


def test_behind_a_trusted_tls_proxy_the_origin_is_https(redis_server, tmp_path, ui, client, probe) -> None:
    from tests.ui.conftest import UIServer

    behind = UIServer(redis_server.url, tmp_path / "ui-proxy.log", "--trusted-proxy", "127.0.0.1")
    try:
        for server, expected in ((behind, 200), (ui, 403)):
            run_id = f"ui-proxy-{time.time_ns()}"
            client.start(cf.cancellable, input={"hold": "attempt"}, run_id=run_id)
            wait_until(lambda r=run_id: probe.get(f"test:{r}:started") is not None, timeout=20, what="attempt began")
            token = _request(f"{server.url}/api/session")[2].split('"csrf":"')[1].split('"')[0]
            status, _, body = _request(
                f"{server.url}/api/runs/{run_id}/cancel", "POST", b'{"reason": "through the proxy"}',
                {"Content-Type": "application/json", "X-CSRF-Token": token, "X-Forwarded-Proto": "https",
                 "Origin": f"https://127.0.0.1:{server.port}"})
            assert status == expected, body  # the browser's https origin is this UI's only behind the proxy
            if expected == 403:
                client.cancel(run_id, "tidy up")
    finally:
        behind.stop()

"""The UI tests' parts: a real `taskloop ui` process (on the session's redis-server, beside the
session's workers), and Debian's chromium driven by Playwright (``executable_path``: nothing is
downloaded). Without a browser the tests are skipped locally; in CI (``CI`` set) they fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taskloop.ops.embedded import RedisServer, free_port
from tests.conftest import REPO

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
UI_IMPORTS = ("tests.ui.ui_flows", "tests.integration.control_flows", "examples.workflows",
              "tests.integration.fork_flows", "tests.integration.score_flows")


def chromium_path() -> str | None:
    for candidate in (os.environ.get("TASKLOOP_TEST_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


class UIServer:
    """One `taskloop ui` process."""

    def __init__(self, redis_url: str, logfile: Path, *args: str, env: dict[str, str] | None = None,
                 modules: tuple[str, ...] = UI_IMPORTS) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logfile = logfile
        imports = [arg for module in modules for arg in ("--import", module)]
        self.log = logfile.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "taskloop", "ui", "--port", str(self.port), *imports, *args],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "TASKLOOP_REDIS_URL": redis_url, "PYTHONPATH": str(REPO), **(env or {})})
        deadline = time.monotonic() + 30
        while True:
            assert self.process.poll() is None, f"taskloop ui exited: {self.output()}"
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"taskloop ui did not answer: {self.output()}"
            time.sleep(0.1)

    def output(self) -> str:
        self.log.flush()
        return self.logfile.read_text()[-3000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self.log.close()


def _server(redis_server: RedisServer, tmp: pytest.TempPathFactory, name: str, *args: str,
            env: dict[str, str] | None = None) -> Iterator[UIServer]:
    server = UIServer(redis_server.url, tmp.mktemp("ui") / f"{name}.log", *args, env=env)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ui(redis_server: RedisServer, workers: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UIServer]:
    yield from _server(redis_server, tmp_path_factory, "ui")


AUTH = ("ops", "s3cret: with a colon")


@pytest.fixture(scope="session")
def ui_auth(redis_server: RedisServer, workers: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UIServer]:
    yield from _server(redis_server, tmp_path_factory, "ui-auth", env={"TASKLOOP_UI_AUTH": ":".join(AUTH)})


@pytest.fixture(scope="session")
def ui_read_only(redis_server: RedisServer, workers: Any,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[UIServer]:
    yield from _server(redis_server, tmp_path_factory, "ui-ro", "--read-only")


@pytest.fixture(scope="module")  # not the session: Playwright's sync API holds this thread's event loop while it
def browser() -> Iterator[Any]:  # runs, and the tests after the UI's (asyncio.run in callbacks) need it back
    path = chromium_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run must install it (apt-get install chromium)")
        pytest.skip("chromium not found (apt-get install chromium); the UI tests need a real browser")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


class Page:
    """A browser tab that records what a hostile page would try: dialogs, console errors, CSP
    violations, page errors."""

    def __init__(self, browser: Any, **context: Any) -> None:
        self.context = browser.new_context(viewport={"width": 1300, "height": 900}, **context)
        self.page = self.context.new_page()
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.confirm = False  # a test that clicks through a page's own confirmation sets it

        def on_dialog(dialog: Any) -> None:
            self.dialogs.append(dialog.message)
            if self.confirm and dialog.type == "confirm":
                dialog.accept()
            else:
                dialog.dismiss()

        self.page.on("dialog", on_dialog)
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("console", lambda msg: self.errors.append(msg.text) if msg.type == "error" else None)

    def close(self) -> None:
        self.context.close()


@pytest.fixture()
def tab(browser: Any) -> Iterator[Page]:
    opened = Page(browser)
    yield opened
    opened.close()

"""Make the screenshots of docs/ui.md and the README again:

    python -m tests.ui.screenshots            # writes docs/ui/runs.png, run.png, run-waiting.png, fleet.png

It starts a private redis-server, a real worker and a real `taskloop ui`, runs the UI tests'
example workflows (tests/ui/ui_flows.py), and photographs the pages in Debian's chromium."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from taskloop.ops.embedded import RedisServer, spawn_worker, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "ui"


def main() -> None:
    from playwright.sync_api import sync_playwright

    from tests.ui.conftest import CHROMIUM_ARGS, UIServer, chromium_path

    browser_path = chromium_path()
    if browser_path is None:
        sys.exit("chromium not found: apt-get install chromium")
    OUT.mkdir(parents=True, exist_ok=True)
    server = RedisServer().start()
    os.environ["TASKLOOP_REDIS_URL"] = server.url
    logdir = Path(tempfile.mkdtemp(prefix="taskloop-shots-"))
    worker = spawn_worker(server.url, ["tests.ui.ui_flows", "examples.workflows"], concurrency=2, loglevel="INFO",
                          logfile=str(logdir / "worker.log"), extra_env={"PYTHONPATH": str(REPO)})
    ui = None
    try:
        wait_until_ready(worker, str(logdir / "worker.log"))
        from examples import workflows
        from taskloop.runtime.client import TaskLoop
        from tests.ui import ui_flows

        client = TaskLoop(server.url)
        for topic in ("retries that stop", "watching loops"):
            client.start(workflows.essay, input={"topic": topic}).wait(timeout=30)
        client.start(ui_flows.never_good, input={}).wait(timeout=30)
        client.start(workflows.report_revision, input={"approve_in": 2}).wait(timeout=30)
        shown = client.start(ui_flows.writer, input={"topic": "bounded loops"}, run_id=f"writer-{int(time.time())}")
        shown.wait(timeout=30)
        waiting = client.start(ui_flows.gated, input={})
        live = client.start(ui_flows.writer, input={"pace": 3, "accept_in": 4, "topic": "a run still going"})
        time.sleep(1)
        ui = UIServer(server.url, logdir / "ui.log")
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=browser_path, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
            for path, name, full in ((f"/runs/{shown.run_id}", "run.png", True), ("/", "runs.png", False),
                                     (f"/runs/{waiting.run_id}", "run-waiting.png", False),
                                     ("/fleet", "fleet.png", False)):
                page.goto(ui.url + path)
                if name == "run.png":
                    page.locator("#o-draft-1 summary").click()
                page.wait_for_timeout(800)
                page.screenshot(path=str(OUT / name), full_page=full)
                print(f"wrote {OUT / name}")
            browser.close()
        client.cancel(live.run_id, "screenshots taken")
        client.close()
    finally:
        if ui is not None:
            ui.stop()
        worker.terminate()
        worker.wait(30)
        server.stop()


if __name__ == "__main__":
    main()

"""Prometheus metrics: a real Prometheus server scrapes a real prefork worker (its processes
summed through the supervisor), and the fleet exporter reads Redis. The numbers match the runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from taskloop.ops.embedded import RedisServer, free_port
from taskloop.runtime.client import TaskLoop
from tests.conftest import REPO
from tests.integration import flows
from tests.waiting import wait_until
from tests.workers import WorkerProcess

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.timeout(240)


@pytest.fixture()
def fleet(tmp_path: Path) -> Iterator[tuple[str, TaskLoop, int]]:
    """A private Redis and one worker (2 pool processes) exporting metrics on a free port."""
    (tmp_path / "redis").mkdir()
    with RedisServer(tmp_path / "redis") as server:
        port = free_port()
        log = tmp_path / "worker.log"
        worker = WorkerProcess(server.url, ["tests.integration.flows", "tests.integration.score_flows"], log, name="m",
                               args=["--metrics-port", str(port)])
        client = TaskLoop(server.url)
        try:
            worker.ready()
            yield server.url, client, port
        finally:
            client.close()
            worker.terminate()
            worker.wait(30)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _scrape_until(port: int, ready: Callable[[str], bool], what: str) -> str:
    def attempt() -> str | None:
        text = _scrape(port)
        return text if ready(text) else None
    return wait_until(attempt, timeout=20, what=what)


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_worker_exports_what_its_processes_did(fleet) -> None:
    _, client, port = fleet
    # Given 5 runs of core (source: 1 try; fix: 2 rounds, attempt + check each; publish: 1 try)
    results = [client.start(flows.core, {}).wait(timeout=30) for _ in range(5)]
    assert {r.status for r in results} == {"done"}
    text = _scrape_until(port, lambda t: _value(t, "taskloop_phases_total") >= 30, "the metrics of 30 phases")
    # Then the worker's metrics, summed over its pool processes, count exactly what ran
    assert _value(text, "taskloop_phases_total") == 30
    assert _value(text, "taskloop_phases_total", workflow="core", task="fix", phase="check") == 10
    assert _value(text, "taskloop_rounds_total", workflow="core", task="fix") == 10
    assert _value(text, "taskloop_phase_duration_seconds_count", workflow="core", task="fix", phase="attempt") == 10
    assert _value(text, "taskloop_queue_wait_seconds_count", workflow="core") == 30
    assert _value(text, "taskloop_runs_finished_total", workflow="core", status="done") == 5


def test_exhaustions_failures_and_refusals_are_counted(fleet) -> None:
    _, client, port = fleet
    assert client.start(flows.core, {"target": 99}).wait(timeout=30).status == "failed"
    assert client.start(flows.core, {"fail": "attempt"}).wait(timeout=30).status == "failed"
    text = _scrape_until(port, lambda t: _value(t, "taskloop_exhaustions_total") > 0, "the exhaustion to be counted")
    assert _value(text, "taskloop_exhaustions_total", workflow="core", task="fix", reason="rounds") == 1
    assert _value(text, "taskloop_phases_total", task="fix", phase="attempt", outcome="failed") == 1
    assert _value(text, "taskloop_runs_finished_total", workflow="core", status="failed", termination="failed") == 2


def test_loop_quality_is_counted_rounds_to_acceptance_scores_and_exhaustions_by_reason(fleet) -> None:
    from tests.integration import score_flows as sf

    _, client, port = fleet
    assert client.start(sf.plateau, {"scores": [0.5, 0.6, 0.55, 0.58]}).wait(timeout=30).status == "failed"
    assert client.start(sf.best, {"scores": [0.2, 0.9, 0.4]}).wait(timeout=30).status == "done"
    assert client.start(sf.best, {"scores": [0.3, 0.8], "accept_at": 2}).wait(timeout=30).status == "done"
    text = _scrape_until(port, lambda t: _value(t, "taskloop_loop_rounds_to_accept_count") > 0, "loop quality")
    assert _value(text, "taskloop_exhaustions_total", workflow="score-plateau", task="draft", reason="plateau") == 1
    assert _value(text, "taskloop_exhaustions_total", workflow="score-best", task="draft", reason="rounds") == 1
    assert _value(text, "taskloop_loop_rounds_to_accept_count", workflow="score-best", task="draft") == 1
    assert _value(text, "taskloop_loop_rounds_to_accept_sum", workflow="score-best", task="draft") == 2
    assert _value(text, "taskloop_loop_scores_count", workflow="score-plateau") == 4
    assert _value(text, "taskloop_loop_scores_sum", workflow="score-best") == pytest.approx(0.2 + 0.9 + 0.4 + 0.3 + 0.8)
    assert _value(text, "taskloop_loop_scores_bucket", workflow="score-best", le="0.5") == 3


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (apt-get install -y prometheus)")
def test_a_real_prometheus_scrapes_the_worker_and_the_fleet(fleet, tmp_path: Path) -> None:
    url, client, worker_port = fleet
    fleet_port, prom_port = free_port(), free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "taskloop", "metrics", "--port", str(fleet_port)],
                                env={**__import__("os").environ, "TASKLOOP_REDIS_URL": url, "PYTHONPATH": str(REPO)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "taskloop-workers", "static_configs": [{"targets": [f"127.0.0.1:{worker_port}"]}]},
            {"job_name": "taskloop-fleet", "static_configs": [{"targets": [f"127.0.0.1:{fleet_port}"]}]},
        ]}))
    prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{prom_port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        results = [client.start(flows.core, {}).wait(timeout=30) for _ in range(4)]
        assert {r.status for r in results} == {"done"}

        def query(expr: str) -> float | None:
            request = f"http://127.0.0.1:{prom_port}/api/v1/query?query={urllib.parse.quote(expr)}"
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    data = json.loads(response.read())["data"]["result"]
            except OSError:
                return None
            return float(data[0]["value"][1]) if data else None

        import urllib.parse

        wait_until(lambda: query("sum(taskloop_phases_total)") == 24, timeout=60,
                   what="Prometheus to have scraped 24 phases")
        assert query('sum(taskloop_rounds_total{task="fix"})') == 8
        assert query('sum(taskloop_runs_finished_total{status="done"})') == 4
        wait_until(lambda: query('sum(taskloop_runs_started_total{workflow="core"})') == 4, timeout=30,
                   what="the fleet exporter's start counter")
        assert query('taskloop_phases_queued{queue="taskloop"}') == 0
        assert query("taskloop_leases_expired") == 0
        assert query('up{job="taskloop-workers"}') == 1 and query('up{job="taskloop-fleet"}') == 1
    finally:
        prometheus.terminate()
        exporter.terminate()
        prometheus.wait(30)
        exporter.wait(30)


def test_the_metrics_port_binds_to_localhost_by_default(fleet) -> None:
    _, _, port = fleet
    listening = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout
    assert f"127.0.0.1:{port} " in listening and f"0.0.0.0:{port} " not in listening
    time.sleep(0)


def test_the_metrics_directory_is_removed_when_the_worker_stops(tmp_path: Path) -> None:
    """The supervisor's prometheus-client directory (one file per pool process and metric kind) is
    its own: a worker stopped with SIGTERM leaves nothing behind in the temporary directory."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    (tmp_path / "redis").mkdir()
    with RedisServer(tmp_path / "redis") as server:
        log = tmp_path / "worker.log"
        worker = WorkerProcess(server.url, ["tests.integration.flows"], log, name="d", concurrency=1,
                               env={"TMPDIR": str(temp)}, args=["--metrics-port", str(free_port())])
        try:
            worker.ready()
            assert [p.name for p in temp.iterdir() if p.name.startswith("taskloop-metrics-")], "no metrics directory"
        finally:
            worker.terminate()
            assert worker.wait(30) == 0
    assert not [p.name for p in temp.iterdir() if p.name.startswith("taskloop-metrics-")]

"""docker-compose.yml, run on the host without Docker (tests/ops/stack.py): every service's command
line with the same arguments and environment (ports moved to free ones, service names mapped to
127.0.0.1, mounted files copied with their container paths rewritten). Redis starts from the
compose file's arguments (ops/redis/redis.conf, the ACL file rendered by render-acl.sh, the
passwords); two worker replicas, the reconciler, the fleet exporter, Flower and Prometheus run
as the compose file says, each with its own Redis user; then the producer service's command runs
a workflow end to end (it starts runs by name: it never imports the workflow code).

Checked: the producer finishes and every run is done; the workers' and the fleet exporter's
metrics count those runs; Prometheus (the compose prometheus.yml, its worker DNS discovery turned
into the replicas' addresses) scrapes every target, loads the alert rules and answers every
dashboard query; Flower answers /api/workers with basic auth and 401 without; Redis's ACL LOG
records no refused command, key or channel for any role.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path

import pytest
import redis
import yaml

from tests.ops.stack import REPO, Stack, http_get, metric_sum, tool, wait_for

pytestmark = pytest.mark.timeout(180)
DASHBOARD = REPO / "ops" / "grafana" / "dashboard.json"


def test_compose_services_run_a_workflow_end_to_end(tmp_path: Path) -> None:
    tool("prometheus")
    began = time.monotonic()
    stack = Stack(tmp_path, scale={"worker": 2})
    timings: dict[str, float] = {}
    try:
        stack.start("redis")
        redis_replica = stack.replicas["redis"][0]
        wait_for(lambda: stack.healthcheck("redis"), 20, "the redis health check",
                 dead=lambda: None if redis_replica.alive() else redis_replica.text()[-1500:])
        timings["redis healthy"] = time.monotonic() - began
        for service in ("worker", "reconciler", "metrics", "flower", "prometheus"):
            stack.start(service)
        for replica in stack.replicas["worker"]:
            wait_for(lambda r=replica: " ready." in r.text() and stack.healthcheck("worker", r.index), 60,
                     f"worker replica {replica.index} to be ready and healthy",
                     dead=lambda r=replica: None if r.alive() else r.text()[-2000:])
        timings["workers ready"] = time.monotonic() - began

        produced = stack.run("producer", timeout=120)
        assert produced.returncode == 0, produced.stdout + produced.stderr
        lines = [line for line in produced.stdout.splitlines() if line.strip()]
        assert len(lines) == 10 and all(line.split()[1] == "done" for line in lines), produced.stdout
        timings["producer done"] = time.monotonic() - began

        admin = redis.Redis.from_url(stack.redis_url(), decode_responses=True)
        run_ids = admin.zrange("tl:runs", 0, -1)
        assert len(run_ids) == 10
        assert {admin.hget(f"tl:{{{run_id}}}", "status") for run_id in run_ids} == {"done"}

        # every worker replica exports its own metrics; together they ended the 10 runs
        def scraped_workers() -> list[str] | None:
            texts = [http_get(f"http://{stack.address('worker', 9808, r.index)}/metrics")
                     for r in stack.replicas["worker"]]
            if any(code != 200 for code, _ in texts):
                return None
            decoded = [body.decode() for _, body in texts]
            return decoded if sum(metric_sum(t, "taskloop_runs_finished_total") for t in decoded) == 10 else None
        worker_texts = wait_for(scraped_workers, 20, "the workers' metrics to count 10 finished runs")
        assert sum(metric_sum(t, "taskloop_phases_total") for t in worker_texts) > 0
        assert sum(metric_sum(t, "taskloop_runs_finished_total", status="done") for t in worker_texts) == 10

        code, body = http_get(f"http://{stack.address('metrics', 9809)}/metrics")
        fleet = body.decode()
        assert code == 200, fleet
        assert metric_sum(fleet, "taskloop_runs_started_total", workflow="essay") == 5
        assert metric_sum(fleet, "taskloop_runs_started_total", workflow="report-revision") == 5
        assert 'taskloop_phases_queued{queue="taskloop"} 0.0' in fleet

        reconciler = stack.replicas["reconciler"][0]
        wait_for(lambda: "examined" in reconciler.text(), 15, "a reconcile pass of the reconciler service")

        _check_prometheus(stack)
        timings["prometheus checked"] = time.monotonic() - began
        _check_flower(stack)
        timings["flower checked"] = time.monotonic() - began

        denied = admin.execute_command("ACL", "LOG")
        assert not denied, f"Redis refused some role something: {denied}"
        admin.close()
        for name in ("worker", "reconciler", "metrics", "flower", "prometheus", "redis"):
            for replica in stack.replicas[name]:
                assert replica.alive(), f"{name} exited: {replica.text()[-1500:]}"
    finally:
        stack.stop()
    print("\ncompose on the host: " + ", ".join(f"{k} at {v:.1f} s" for k, v in timings.items())
          + f", total {time.monotonic() - began:.1f} s")


def _check_prometheus(stack: Stack) -> None:
    base = f"http://{stack.address('prometheus', 9090)}"

    def query(expr: str) -> dict[str, object]:
        code, body = http_get(f"{base}/api/v1/query?query={urllib.parse.quote(expr)}")
        assert code == 200, body[:500]
        return dict(json.loads(body))

    wait_for(lambda: http_get(f"{base}/-/ready")[0] == 200, 30, "Prometheus to be ready")

    def all_up() -> bool:
        result = query("up")["data"]["result"]  # type: ignore[index]
        jobs = sorted((r["metric"]["job"], r["value"][1]) for r in result)
        return jobs == [("taskloop-fleet", "1"), ("taskloop-workers", "1"), ("taskloop-workers", "1")]
    wait_for(all_up, 30, "Prometheus to scrape the fleet exporter and both workers (up == 1)", interval=0.5)

    code, body = http_get(f"{base}/api/v1/rules")
    assert code == 200, body[:300]
    loaded = {rule["name"] for group in json.loads(body)["data"]["groups"] for rule in group["rules"]}
    rules_file = stack.replicas["prometheus"][0].root / "etc" / "prometheus" / "alerts.yml"
    defined = {rule["alert"] for group in yaml.safe_load(rules_file.read_text())["groups"] for rule in group["rules"]}
    assert loaded == defined, f"Prometheus loaded {loaded}"

    wait_for(lambda: query("sum(taskloop_phases_total)")["data"]["result"], 20,  # type: ignore[index]
             "Prometheus to have the phases counted")
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$workflow", ".*")
            answer = query(expr)
            assert answer["status"] == "success", f"{panel['title']}: {answer}"


def _check_flower(stack: Stack) -> None:
    base = f"http://{stack.address('flower', 5555)}"
    auth = stack.env["FLOWER_BASIC_AUTH"]

    def workers() -> set[str] | None:
        code, body = http_get(f"{base}/api/workers?refresh=1", auth, timeout=10)
        return set(json.loads(body)) if code == 200 and body else None
    nodes = wait_for(lambda: (found := workers()) and len(found) == 2 and found, 30,
                     "Flower to list both workers", interval=0.5)
    assert all(node.startswith("worker") for node in nodes), nodes
    assert http_get(f"{base}/api/workers", None)[0] == 401
    assert http_get(f"{base}/api/workers", "ops:wrong-password")[0] == 401

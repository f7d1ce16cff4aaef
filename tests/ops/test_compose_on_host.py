"""docker-compose.yml, run on the host without Docker (tests/ops/stack.py): every service's command
line with the same arguments and environment (ports moved to free ones, service names mapped to
127.0.0.1, mounted files copied with their container paths rewritten). Redis starts from the
compose file's arguments (ops/redis/redis.conf, the ACL file rendered by render-acl.sh, the
passwords); two worker replicas, the reconciler, the fleet exporter, the run UI, Flower and
Prometheus run as the compose file says, each with its own Redis user; then the producer
service's command runs a workflow end to end (it starts runs by name: it never imports the
workflow code).

Checked: the producer finishes and every run is done; the workers' and the fleet exporter's
metrics count those runs; Prometheus (the compose prometheus.yml, its worker DNS discovery turned
into the replicas' addresses) scrapes every target, loads the alert rules and answers every
dashboard query; Flower answers /api/workers with basic auth and 401 without; the UI passes its
compose health check (/healthz, no credentials), answers 401 on every other path without
UI_BASIC_AUTH or with a wrong password, and signs its action tokens with .env's UI_SECRET; Redis's
ACL LOG records no refused command, key or channel for any role.

Two more tests: the ui service's command, without TASKLOOP_UI_AUTH, refuses to start on the
compose file's 0.0.0.0; and the UI reads runs and acts on them (cancel, resume, a gate) as its
compose Redis user (worker), or only reads as the monitor user with --read-only.
"""

from __future__ import annotations

import base64
import html
import json
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml

from tests.ops.roles import ui_request
from tests.ops.stack import REPO, Stack, http_get, metric_sum, tool, wait_for

pytestmark = pytest.mark.timeout(180)
DASHBOARD = REPO / "ops" / "grafana" / "dashboard.json"
UI_PORT = 8188


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
        for service in ("worker", "model-worker", "reconciler", "metrics", "ui", "flower", "prometheus"):
            stack.start(service)
        for replica in [*stack.replicas["worker"], *stack.replicas["model-worker"]]:
            wait_for(lambda r=replica: " ready." in r.text() and stack.healthcheck(r.service, r.index), 60,
                     f"{replica.service} replica {replica.index} to be ready and healthy",
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
        _check_ui_auth(stack)
        timings["ui checked"] = time.monotonic() - began

        denied = admin.execute_command("ACL", "LOG")
        assert not denied, f"Redis refused some role something: {denied}"
        admin.close()
        for name in ("worker", "model-worker", "reconciler", "metrics", "ui", "flower", "prometheus", "redis"):
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
        return jobs == [("taskloop-fleet", "1"), *[("taskloop-workers", "1")] * 3]
    wait_for(all_up, 30, "Prometheus to scrape the fleet exporter, both workers and the model worker (up == 1)",
             interval=0.5)

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
    nodes = wait_for(lambda: (found := workers()) and len(found) == 3 and found, 30,
                     "Flower to list both workers and the model worker", interval=0.5)
    assert sum(node.startswith("worker") for node in nodes) == 2, nodes  # and the model worker's default name
    assert http_get(f"{base}/api/workers", None)[0] == 401
    assert http_get(f"{base}/api/workers", "ops:wrong-password")[0] == 401


def _check_ui_auth(stack: Stack) -> None:
    """The UI's health check and basic auth, and its action tokens signed with UI_SECRET."""
    from taskloop.ui.security import Tokens

    replica = stack.replicas["ui"][0]
    wait_for(lambda: stack.healthcheck("ui"), 30, "the ui health check",
             dead=lambda: None if replica.alive() else replica.text()[-1500:])
    base = f"http://{stack.address('ui', UI_PORT)}"
    auth = stack.env["UI_BASIC_AUTH"]
    user = auth.split(":", 1)[0]
    assert http_get(f"{base}/healthz", None) == (200, b"ok\n")
    for path in ("/", "/fleet", "/api/session", "/api/runs", "/static/ui.css", "/no-such-page"):
        assert http_get(f"{base}{path}", None)[0] == 401, path
        assert http_get(f"{base}{path}", f"{user}:wrong-password")[0] == 401, path
    code, body = http_get(f"{base}/api/session", auth)
    assert code == 200, body[:300]
    session = json.loads(body)
    assert session["user"] == user and session["read_only"] is False, session
    assert session["csrf"] == Tokens(stack.env["UI_SECRET"].encode()).token(user), "the token's key is UI_SECRET"
    assert "basic auth on" in replica.text() and "read-only" not in replica.text(), replica.text()[-500:]


def test_the_ui_service_refuses_to_start_without_auth(tmp_path: Path) -> None:
    """The ui service's command and environment without TASKLOOP_UI_AUTH, on the compose file's
    host (0.0.0.0: the one address here that is not 127.0.0.1; the UI refuses before it binds)."""
    stack = Stack(tmp_path)
    argv, env = stack.command("ui")
    compose_command = stack.services["ui"]["command"]
    host = compose_command[compose_command.index("--host") + 1]
    assert host == "0.0.0.0"
    argv[argv.index("--host") + 1] = host
    assert env.pop("TASKLOOP_UI_AUTH")
    process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, text=True)
    try:
        out, _ = process.communicate(timeout=20)  # a UI that did start is stopped after this
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert process.returncode != 0, out
    assert "refusing to serve the UI on 0.0.0.0 without authentication" in out, out
    assert "taskloop ui on http" not in out, out


def _first_live_event(url: str, auth: str) -> str:
    """The first server-sent event of a run's live page (the run as it is now)."""
    request = urllib.request.Request(url)
    request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            lines = []
            for _ in range(40):
                line = response.readline().decode(errors="replace")
                lines.append(line)
                if line.startswith("event: "):
                    return line.strip()
            return "no event in " + "".join(lines)[:300]
    except (OSError, urllib.error.HTTPError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("role, flags", [("worker", ()), ("monitor", ("--read-only",))],
                         ids=["worker (the compose ui service)", "monitor --read-only"])
def test_the_ui_service_reads_and_acts_as_its_redis_user(tmp_path: Path, role: str, flags: tuple[str, ...]) -> None:
    """The ui service as docker-compose.yml runs it (the worker user, as `taskloop resume`): its
    pages and API show the runs (filtered, searched), a run's page, its events and live stream, and
    the fleet; it approves a gate, resumes a failed run and cancels a running one. The same with the
    monitor user and --read-only (what docs/operations.md gives for a UI that only looks): every
    read works, every action is refused with 403. Redis's ACL LOG must record no refusal for the
    UI's user, and every step must work."""
    stack = Stack(tmp_path)
    ui_env = stack.services["ui"]["environment"]
    assert "//worker:" in ui_env["TASKLOOP_REDIS_URL"], "the compose ui service acts as the worker user"
    if role != "worker":
        password = stack.env[f"REDIS_{role.upper()}_PASSWORD"]
        ui_env["TASKLOOP_REDIS_URL"] = ui_env["TASKLOOP_REDIS_URL"].replace(
            f"//worker:{stack.env['REDIS_WORKER_PASSWORD']}@", f"//{role}:{password}@")
    assert f"//{role}:" in ui_env["TASKLOOP_REDIS_URL"]
    marker = tmp_path / "flaky-marker"
    problems: list[str] = []

    def expect(step: str, code: int, body: bytes, wanted: int = 200, contains: str = "") -> None:
        text = html.unescape(body.decode(errors="replace"))
        if code != wanted or contains not in text:
            why = re.search(r"no permissions to [^;)]*|can(?:'|&#39;)t run this command[^;)]*", text)
            problems.append(f"{step}: HTTP {code} {why.group(0) if why else text[:120]!r}")

    try:
        stack.start("redis")
        redis_replica = stack.replicas["redis"][0]
        wait_for(lambda: stack.healthcheck("redis"), 20, "the redis health check",
                 dead=lambda: None if redis_replica.alive() else redis_replica.text()[-1500:])
        stack.start("worker", extra_args=["--import", "tests.ops.flows"])
        worker = stack.replicas["worker"][0]
        wait_for(lambda: " ready." in worker.text(), 60, "the worker to be ready",
                 dead=lambda: None if worker.alive() else worker.text()[-2000:])
        stack.start("ui", extra_args=["--import", "tests.ops.flows", *flags])
        ui = stack.replicas["ui"][0]
        wait_for(lambda: stack.healthcheck("ui"), 30, "the ui health check",
                 dead=lambda: None if ui.alive() else ui.text()[-1500:])

        from taskloop.runtime.client import TaskLoop

        admin = TaskLoop(stack.redis_url())
        essay = admin.start("essay", {"topic": "the ui"})
        assert essay.wait(timeout=30).status == "done"
        gate = admin.start("ops-gate", {})
        flaky = admin.start("ops-flaky", {"marker": str(marker)})
        slow = admin.start("ops-slow", {})
        wait_for(lambda: admin.inspect(gate.run_id).status == "waiting", 20, "the gate to wait")
        wait_for(lambda: admin.inspect(flaky.run_id).status == "failed", 20, "the flaky run to fail")
        wait_for(lambda: admin.inspect(slow.run_id).status == "running", 20, "the slow run to run")
        watcher = redis.Redis.from_url(stack.redis_url(), decode_responses=True)
        watcher.execute_command("ACL", "LOG", "RESET")

        base = f"http://{stack.address('ui', UI_PORT)}"
        auth = stack.env["UI_BASIC_AUTH"]
        for path, contains in (("/", essay.run_id), ("/?status=done", essay.run_id),
                               (f"/?q={essay.run_id[:10]}", essay.run_id), ("/?workflow=essay", essay.run_id),
                               (f"/runs/{essay.run_id}", essay.run_id), (f"/runs/{gate.run_id}", "approval"),
                               ("/api/runs?status=done", essay.run_id), (f"/api/runs/{essay.run_id}", essay.run_id),
                               (f"/api/runs/{essay.run_id}/events", "run.finished"), ("/fleet", "worker"),
                               ("/api/fleet", "worker")):
            expect(f"GET {path}", *ui_request(base + path, auth), contains=contains)
        live = _first_live_event(f"{base}/runs/{slow.run_id}/live", auth)
        if live != "event: run":
            problems.append(f"GET /runs/{slow.run_id}/live: {live[:120]!r}")

        code, body = ui_request(f"{base}/api/session", auth)
        assert code == 200, body[:300]
        token = {"X-CSRF-Token": json.loads(body)["csrf"]}
        wanted = 403 if "--read-only" in flags else 200
        approve = ui_request(f"{base}/api/runs/{gate.run_id}/gates/approval", auth, "POST", {"action": "approve"},
                              token)
        expect("approve the gate", *approve, wanted=wanted)
        marker.write_text("fixed")
        expect("resume the failed run", *ui_request(f"{base}/api/runs/{flaky.run_id}/resume", auth, "POST", {},
                                                      token), wanted=wanted)
        expect("cancel the running run", *ui_request(f"{base}/api/runs/{slow.run_id}/cancel", auth, "POST",
                                                       {"reason": "from the test"}, token), wanted=wanted)
        if wanted == 200 and not problems:
            for run, status in ((gate, "done"), (flaky, "done"), (slow, "cancelled")):
                try:
                    wait_for(lambda r=run, s=status: admin.inspect(r.run_id).status == s, 20,
                             f"{run.run_id} to be {status}")
                except AssertionError as exc:
                    problems.append(str(exc))

        denied = sorted({f"{e['reason']} {re.sub(r'^[0-9a-f-]{36}', '*', e['object'])[:60]} ({e['context']})"
                         for e in watcher.execute_command("ACL", "LOG", 1000) if e["username"] == role})
        watcher.close()
        admin.close()
        if not ui.alive():
            problems.append(f"the ui exited: {ui.text()[-1500:]}")
    finally:
        stack.stop()
    assert not denied, f"ops/redis/users.acl: Redis refused the {role} user what the UI does: {'; '.join(denied)}. " \
        f"Failed: {' | '.join(problems) or 'nothing'}"
    assert not problems, "\n".join(problems)

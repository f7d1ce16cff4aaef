"""The operations files are valid, offline: docker-compose.yml against the Compose specification
(check-jsonschema's vendored schema), ops/k8s against Kubernetes' schemas (kubernetes-validate,
strict) and the KEDA resources against ops/k8s/schemas, the alert rules with promtool (check and
unit tests), and the Grafana dashboard against the metric names taskloop/metrics.py exports.

Each validator is also shown a broken file, so that a validator that accepts anything (no schema
found, wrong mode) fails the test instead of passing it. promtool, check-jsonschema and
kubernetes-validate skip the tests that need them when missing, except in CI (CI=1), where
.ci/run must install them.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ops.stack import REPO, fresh_env, load_compose, missing, tool

COMPOSE = REPO / "docker-compose.yml"
K8S = REPO / "ops" / "k8s"
PROMETHEUS = REPO / "ops" / "prometheus"
DASHBOARD = REPO / "ops" / "grafana" / "dashboard.json"
METRICS_MODULE = REPO / "taskloop" / "metrics.py"
KEDA_SCHEMAS = {"ScaledObject": K8S / "schemas" / "keda-scaledobject.schema.json",
                "TriggerAuthentication": K8S / "schemas" / "keda-triggerauthentication.schema.json"}
LONGEST_PHASE_S = 300  # the assumption documented in docker-compose.yml and ops/k8s/worker.yaml


def _check_jsonschema(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        import check_jsonschema  # noqa: F401
    except ImportError:
        missing("check-jsonschema is not installed (pip install -e '.[dev]')")
    return subprocess.run([sys.executable, "-m", "check_jsonschema", *args], capture_output=True, text=True,
                          timeout=120)


def _kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        missing("kubernetes-validate is not installed (pip install -e '.[dev]')")
    return kubernetes_validate


def _k8s_documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


# --- docker compose ------------------------------------------------------------------------------


def test_compose_file_follows_the_compose_specification(tmp_path: Path) -> None:
    out = _check_jsonschema("--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    assert out.returncode == 0, out.stdout + out.stderr
    # the validator refuses what the specification does not allow (a misspelt service key)
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("    stop_grace_period: 300s", "    stop_grace_periods: 300s"))
    out = _check_jsonschema("--builtin-schema", "vendor.compose-spec", str(broken))
    assert out.returncode != 0 and "stop_grace_periods" in out.stdout, out.stdout


def test_compose_file_needs_only_what_env_example_sets() -> None:
    services = load_compose(fresh_env())["services"]
    assert set(services) >= {"redis", "worker", "reconciler", "metrics", "flower", "prometheus", "producer"}
    worker = services["worker"]
    assert "ports" not in worker, "worker metrics stay on the compose network"
    assert "--metrics-host" in worker["command"] and "0.0.0.0" in worker["command"]
    assert _seconds(worker["stop_grace_period"]) >= LONGEST_PHASE_S
    assert all(p.startswith("127.0.0.1:") for p in services["flower"]["ports"]), "Flower binds to the host's loopback"
    assert "FLOWER_BASIC_AUTH" in services["flower"]["environment"]
    assert "examples.workflows" not in " ".join(services["producer"]["command"]), "the producer imports no workflow"


def _seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smh])", text))


# --- kubernetes ----------------------------------------------------------------------------------


def test_kubernetes_manifests_against_the_kubernetes_schemas() -> None:
    kv = _kubernetes_validate()
    core = [(name, doc) for name, doc in _k8s_documents() if doc["kind"] not in KEDA_SCHEMAS]
    assert {doc["kind"] for _, doc in core} >= {"Deployment", "Service", "ConfigMap", "Secret"}
    version = kv.latest_version()
    for name, doc in core:
        try:
            kv.validate(doc, version, strict=True)
        except (kv.ValidationError, kv.SchemaNotFoundError) as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc}")
    # strict validation refuses a misspelt field
    deployment = json.loads(json.dumps(next(d for _, d in core if d["kind"] == "Deployment")))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 330
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, version, strict=True)


def test_keda_resources_against_their_schemas(tmp_path: Path) -> None:
    """KEDA's CRDs are not built into Kubernetes (kubernetes-validate finds no schema for them and
    only warns): ScaledObject and TriggerAuthentication are checked against ops/k8s/schemas."""
    keda = [(name, doc) for name, doc in _k8s_documents() if doc["kind"] in KEDA_SCHEMAS]
    assert sorted(doc["kind"] for _, doc in keda) == ["ScaledObject", "TriggerAuthentication"]
    for name, doc in keda:
        instance = tmp_path / f"{doc['kind']}.json"
        instance.write_text(json.dumps(doc))
        out = _check_jsonschema("--schemafile", str(KEDA_SCHEMAS[doc["kind"]]), str(instance))
        assert out.returncode == 0, f"{name}: {out.stdout}{out.stderr}"
    scaled = next(doc for _, doc in keda if doc["kind"] == "ScaledObject")
    scaled["spec"]["triggers"][0]["metadata"]["listname"] = "taskloop"
    instance = tmp_path / "broken.json"
    instance.write_text(json.dumps(scaled))
    assert _check_jsonschema("--schemafile", str(KEDA_SCHEMAS["ScaledObject"]), str(instance)).returncode != 0
    out = _check_jsonschema("--check-metaschema", *map(str, KEDA_SCHEMAS.values()))
    assert out.returncode == 0, out.stdout


def test_kubernetes_manifests_agree_with_each_other() -> None:
    docs = _k8s_documents()
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for _, doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    worker = by_kind["Deployment"]["taskloop-worker"]["spec"]["template"]["spec"]
    assert worker["terminationGracePeriodSeconds"] > LONGEST_PHASE_S
    container = worker["containers"][0]
    assert {"readinessProbe", "livenessProbe", "resources"} <= set(container)
    assert container["readinessProbe"]["httpGet"]["port"] == "metrics"
    scaled = by_kind["ScaledObject"]["taskloop-worker"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == "taskloop-worker"
    trigger = scaled["triggers"][0]
    import celeryconfig

    assert trigger["type"] == "redis" and trigger["metadata"]["listName"] == celeryconfig.task_default_queue
    auth = by_kind["TriggerAuthentication"][trigger["authenticationRef"]["name"]]["spec"]
    secrets = by_kind["Secret"]
    for ref in auth["secretTargetRef"]:
        assert ref["key"] in secrets[ref["name"]]["stringData"], ref
    config = by_kind["ConfigMap"]["taskloop-config"]["data"]
    for deployment in by_kind["Deployment"].values():
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], ref
            defined = set(config) | {e["name"] for e in c.get("env", [])}
            used = set(re.findall(r"\$\((\w+)\)", json.dumps(c.get("env", [])) + json.dumps(c["command"])))
            assert used <= defined, f"{deployment['metadata']['name']}: undefined $(...) {used - defined}"


# --- prometheus ----------------------------------------------------------------------------------


def test_alert_rules_check_and_unit_tests() -> None:
    promtool = _promtool()
    out = subprocess.run([promtool, "check", "rules", str(PROMETHEUS / "alerts.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([promtool, "test", "rules", "alerts.test.yml"], cwd=PROMETHEUS, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS / "alerts.test.yml").read_text()))
    defined = {rule["alert"] for group in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
               for rule in group["rules"]}
    assert defined <= tested, f"alerts without a unit test: {defined - tested}"


def test_prometheus_config_is_valid(tmp_path: Path) -> None:
    promtool = _promtool()
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    (tmp_path / "alerts.yml").write_text((PROMETHEUS / "alerts.yml").read_text())
    config["rule_files"] = [str(tmp_path / Path(p).name) for p in config["rule_files"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == {"taskloop-workers", "taskloop-fleet"}, "alerts.yml names these jobs"


def _promtool() -> str:
    return tool("promtool")


# --- the metric names ----------------------------------------------------------------------------


def exported_names() -> set[str]:
    """Every series name taskloop/metrics.py exports: a Counter x as x_total (and x_created), a
    Histogram as x_bucket/x_sum/x_count, a Gauge as x, read from the constructors' first argument."""
    tree = ast.parse(METRICS_MODULE.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
            continue
        func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        base = node.args[0].value
        if not isinstance(base, str):
            continue
        if func in ("Counter", "CounterMetricFamily"):
            base = base.removesuffix("_total")
            names |= {f"{base}_total", f"{base}_created"}
        elif func in ("Histogram", "HistogramMetricFamily"):
            names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count", f"{base}_created"}
        elif func in ("Gauge", "GaugeMetricFamily"):
            names.add(base)
        elif func in ("Summary", "SummaryMetricFamily"):
            names |= {base, f"{base}_sum", f"{base}_count", f"{base}_created"}
    return names


def dashboard_targets() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    return found


def _names_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(taskloop_[a-z0-9_]+)\b", expr))


def test_metric_names_are_known() -> None:
    names = exported_names()
    assert {"taskloop_phases_total", "taskloop_phase_duration_seconds_bucket", "taskloop_runs_live"} <= names
    # and the cross-check itself works: a name that is not exported is caught
    assert "taskloop_phase_total" not in names


def test_dashboard_is_well_formed_and_uses_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported_names()
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], f"{panel['title']} has no query"
            assert panel["datasource"]["uid"] == "${datasource}"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    used: set[str] = set()
    for title, expr in dashboard_targets():
        unknown = _names_in(expr) - names
        assert not unknown, f"panel {title!r} uses metrics taskloop/metrics.py does not export: {unknown}"
        used |= _names_in(expr)
        assert set(re.findall(r"\$(\w+)", expr)) - {"__rate_interval"} <= variables, f"{title}: unknown variable"
    wanted = {"taskloop_phases_total", "taskloop_phase_duration_seconds_bucket", "taskloop_queue_wait_seconds_bucket",
              "taskloop_rounds_total", "taskloop_exhaustions_total", "taskloop_refused_deliveries_total",
              "taskloop_lost_executions_total", "taskloop_reconciler_actions_total", "taskloop_runs_live",
              "taskloop_phases_queued", "taskloop_leases_expired"}
    assert wanted <= used, f"the dashboard lacks {wanted - used}"


def test_dashboard_and_alert_expressions_parse(tmp_path: Path) -> None:
    """promtool parses every dashboard query (as a recording rule, variables filled in) and every
    alert uses only exported metric names (plus Prometheus' own `up`)."""
    promtool = _promtool()
    rules = [{"record": f"dashboard:query_{i}", "expr": _fill_variables(expr)}
             for i, (_, expr) in enumerate(dashboard_targets())]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    names = exported_names()
    for group in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            unknown = _names_in(rule["expr"]) - names
            assert not unknown, f"alert {rule['alert']} uses metrics taskloop/metrics.py does not export: {unknown}"


def _fill_variables(expr: str) -> str:
    return expr.replace("$__rate_interval", "5m").replace("$workflow", ".*")


# --- the Redis ACL file --------------------------------------------------------------------------


def _render(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    target = tmp_path / "users.acl"
    variables = {"PATH": os.environ["PATH"], "TASKLOOP_ACL_TEMPLATE": str(REPO / "ops" / "redis" / "users.acl"),
                 "TASKLOOP_ACL_FILE": str(target), **env}
    return subprocess.run(["sh", str(REPO / "ops" / "redis" / "render-acl.sh"), "true"], env=variables,
                          capture_output=True, text=True, timeout=30)


def test_render_acl_fills_in_the_passwords_and_refuses_bad_ones(tmp_path: Path) -> None:
    good = {name: f"{name.lower().replace('_', '-')}-0123456789" for name in
            ("REDIS_PASSWORD", "REDIS_WORKER_PASSWORD", "REDIS_CLIENT_PASSWORD", "REDIS_MONITOR_PASSWORD")}
    out = _render(tmp_path, **good)
    assert out.returncode == 0, out.stderr
    rendered = (tmp_path / "users.acl").read_text()
    assert "${" not in rendered and all(f">{value}" in rendered for value in good.values())
    assert (tmp_path / "users.acl").stat().st_mode & 0o077 == 0, "the ACL file is readable by its owner only"
    for name, value, says in (("REDIS_WORKER_PASSWORD", "has space-in-it-0123", "may contain only"),
                              ("REDIS_CLIENT_PASSWORD", "tooShort1", "shorter than 16"),
                              ("REDIS_MONITOR_PASSWORD", "", "is not set")):
        out = _render(tmp_path, **{**good, name: value})
        assert out.returncode != 0 and name in out.stderr and says in out.stderr, out.stderr
        assert value == "" or value not in out.stderr, "a refused password is not echoed"

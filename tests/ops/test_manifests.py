"""The operations files are valid, offline: docker-compose.yml against the Compose specification
(check-jsonschema's vendored schema), ops/k8s against Kubernetes' schemas (kubernetes-validate,
strict) and the KEDA resources against ops/k8s/schemas, the alert rules with promtool (check and
unit tests), and the Grafana dashboard against the metric names taskloop/ops/metrics.py exports.
The run UI's compose service and Deployment get their basic auth from a required value (.env's
UI_BASIC_AUTH, the taskloop-ui Secret), and the image's lock pins the UI's dependencies.

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
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ops.stack import REPO, InterpolationError, fresh_env, load_compose, missing, tool

COMPOSE = REPO / "docker-compose.yml"
K8S = REPO / "ops" / "k8s"
PROMETHEUS = REPO / "ops" / "prometheus"
DASHBOARD = REPO / "ops" / "grafana" / "dashboard.json"
METRICS_MODULE = REPO / "taskloop" / "ops" / "metrics.py"
ACL_FILE = REPO / "ops" / "redis" / "users.acl"
KEDA_SCHEMAS = {"ScaledObject": K8S / "schemas" / "keda-scaledobject.schema.json",
                "TriggerAuthentication": K8S / "schemas" / "keda-triggerauthentication.schema.json"}
LONGEST_PHASE_S = 300  # the assumption documented in docker-compose.yml and ops/k8s/worker.yaml
UI_PORT = 8188


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
    assert set(services) >= {"redis", "worker", "reconciler", "metrics", "ui", "flower", "prometheus", "producer"}
    worker = services["worker"]
    assert "ports" not in worker, "worker metrics stay on the compose network"
    assert "--metrics-host" in worker["command"] and "0.0.0.0" in worker["command"]
    assert _seconds(worker["stop_grace_period"]) >= LONGEST_PHASE_S
    assert all(p.startswith("127.0.0.1:") for p in services["flower"]["ports"]), "Flower binds to the host's loopback"
    assert "FLOWER_BASIC_AUTH" in services["flower"]["environment"]
    assert services["ui"]["ports"] == [f"127.0.0.1:{UI_PORT}:{UI_PORT}"], "the UI binds to the host's loopback"
    assert f"http://127.0.0.1:{UI_PORT}/healthz" in " ".join(services["ui"]["healthcheck"]["test"])
    assert "examples.workflows" not in " ".join(services["producer"]["command"]), "the producer imports no workflow"
    # every service's Redis user is one of ops/redis/users.acl, with that user's password
    acl_users = set(re.findall(r"^user (\w+) on ", ACL_FILE.read_text(), re.M))
    raw = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in raw.items():
        url = service.get("environment", {}).get("TASKLOOP_REDIS_URL")
        if url is None:
            continue
        user, variable = re.match(r"redis://(\w+):\$\{(\w+)[:?}]", url).groups()  # type: ignore[union-attr]
        assert user in acl_users and variable == f"REDIS_{user.upper()}_PASSWORD", f"{name}: {url}"
    # the UI acts as `taskloop resume` does (docs/security.md, "ACL roles"): the worker user
    assert raw["ui"]["environment"]["TASKLOOP_REDIS_URL"] == raw["worker"]["environment"]["TASKLOOP_REDIS_URL"]


def test_the_ui_service_cannot_start_without_auth() -> None:
    """The compose ui service's TASKLOOP_UI_AUTH is .env's UI_BASIC_AUTH, required: without it (or
    with it empty) Compose refuses the file. It serves on 0.0.0.0, where `taskloop ui` refuses to
    start without TASKLOOP_UI_AUTH anyway (tests/ops/test_compose_on_host.py runs that), and never
    with --allow-unauthenticated. TASKLOOP_UI_SECRET is .env's UI_SECRET."""
    raw = yaml.safe_load(COMPOSE.read_text())["services"]["ui"]["environment"]
    assert re.fullmatch(r"\$\{UI_BASIC_AUTH:\?[^}]+\}", raw["TASKLOOP_UI_AUTH"]), raw["TASKLOOP_UI_AUTH"]
    env = fresh_env()
    ui = load_compose(env)["services"]["ui"]
    assert ui["environment"]["TASKLOOP_UI_AUTH"] == env["UI_BASIC_AUTH"]
    assert ui["environment"]["TASKLOOP_UI_SECRET"] == env["UI_SECRET"]
    command = ui["command"]
    assert command[:2] == ["taskloop", "ui"] and "--allow-unauthenticated" not in command, command
    assert command[command.index("--host") + 1] == "0.0.0.0" and command[command.index("--port") + 1] == str(UI_PORT)
    without = {name: value for name, value in env.items() if name != "UI_BASIC_AUTH"}
    for broken in (without, {**without, "UI_BASIC_AUTH": ""}):
        with pytest.raises(InterpolationError, match="UI_BASIC_AUTH"):
            load_compose(broken)


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
    # every Service selects the pods of a Deployment and sends to one of their container ports
    for service in by_kind["Service"].values():
        selector = service["spec"]["selector"]
        pods = [d["spec"]["template"] for d in by_kind["Deployment"].values()
                if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {service['metadata']['name']} selects no Deployment's pods"
        ports = {p.get("name"): p["containerPort"] for pod in pods for c in pod["spec"]["containers"]
                 for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports or port["targetPort"] in ports.values(), service["metadata"]["name"]


def test_kubernetes_pods_use_tls_and_network_policies_admit_only_their_ports() -> None:
    """F7: every pod's Redis URL is rediss://, verified against the CA mounted from the
    taskloop-redis-tls Secret; a default-deny ingress policy, and each port a Service exposes is
    let in by a policy that selects its pods (and no other port)."""
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for _, doc in _k8s_documents():
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    config = by_kind["ConfigMap"]["taskloop-config"]["data"]
    assert config["TASKLOOP_TLS_CA"] == "/etc/taskloop/tls/ca.crt"
    assert "ca.crt" in by_kind["Secret"]["taskloop-redis-tls"]["stringData"]
    for name, deployment in by_kind["Deployment"].items():
        pod = deployment["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        assert volumes["redis-tls"]["secret"]["secretName"] == "taskloop-redis-tls", name
        for container in pod["containers"]:
            urls = [e["value"] for e in container.get("env", []) if e["name"].endswith("_URL")]
            assert urls and all(url.startswith("rediss://") for url in urls), (name, urls)
            mounts = {m["name"]: m for m in container["volumeMounts"]}
            assert mounts["redis-tls"]["mountPath"] == "/etc/taskloop/tls" and mounts["redis-tls"]["readOnly"], name
    trigger = by_kind["ScaledObject"]["taskloop-worker"]["spec"]["triggers"][0]
    assert trigger["metadata"]["enableTLS"] == "true"
    auth = by_kind["TriggerAuthentication"][trigger["authenticationRef"]["name"]]["spec"]["secretTargetRef"]
    assert {"parameter": "ca", "name": "taskloop-redis-tls", "key": "ca.crt"} in auth

    policies = by_kind["NetworkPolicy"]
    deny = [p for p in policies.values() if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"], "no default-deny ingress policy"

    def selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
        selector = policy["spec"]["podSelector"]  # {} selects every pod
        if not selector.get("matchLabels", {}).items() <= labels.items():
            return False
        return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))

    for service in by_kind["Service"].values():
        pods = [d["spec"]["template"] for d in by_kind["Deployment"].values()
                if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        for pod in pods:
            labels = pod["metadata"]["labels"]
            ports = {p.get("name"): p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
            allowed = {port["port"] for policy in policies.values() if selects(policy, labels)
                       for rule in policy["spec"].get("ingress", []) for port in rule.get("ports", [])}
            for port in service["spec"]["ports"]:
                target = ports.get(port["targetPort"], port["targetPort"])
                assert target in allowed, f"Service {service['metadata']['name']}: port {target} is let in by no policy"
            assert allowed <= set(ports.values()) | {9808, 9809}, (labels, allowed)


def test_the_ui_deployment_cannot_start_without_auth() -> None:
    """ops/k8s/ui.yaml: TASKLOOP_UI_AUTH and TASKLOOP_UI_SECRET come from keys of the taskloop-ui
    Secret, not optional (the pod does not start without them), never from a literal value or the
    ConfigMap; the UI serves on 0.0.0.0 (where it refuses to start without TASKLOOP_UI_AUTH) without
    --allow-unauthenticated; probes ask /healthz (the one path open without credentials); it runs
    as the others do (non-root, read-only root file system, resources); its Service is ClusterIP."""
    by_kind: dict[str, dict[str, dict[str, Any]]] = {}
    for name, doc in _k8s_documents():
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = {**doc, "file": name}
    deployment = by_kind["Deployment"]["taskloop-ui"]
    service = by_kind["Service"]["taskloop-ui"]
    assert deployment["file"] == service["file"] == "ui.yaml"
    flower = by_kind["Deployment"]["taskloop-flower"]
    for doc in (deployment, service):
        assert doc["metadata"]["namespace"] == flower["metadata"]["namespace"]
        assert doc["metadata"]["labels"] == {"app.kubernetes.io/name": "taskloop-ui",
                                             "app.kubernetes.io/part-of": "taskloop"}
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 1
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and container["resources"]["limits"]["memory"]
    command = container["command"]
    assert command[:2] == ["taskloop", "ui"] and "--allow-unauthenticated" not in command, command
    assert command[command.index("--host") + 1] == "0.0.0.0" and command[command.index("--port") + 1] == str(UI_PORT)
    env = {e["name"]: e for e in container["env"]}
    secrets = by_kind["Secret"]
    for name in ("TASKLOOP_UI_AUTH", "TASKLOOP_UI_SECRET"):
        assert set(env[name]) == {"name", "valueFrom"}, env[name]
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "taskloop-ui" and ref["key"] == name and not ref.get("optional", False), ref
        assert ref["key"] in secrets[ref["name"]]["stringData"]
        assert name not in by_kind["ConfigMap"]["taskloop-config"]["data"]
    assert _ui_accepts_credentials(secrets["taskloop-ui"]["stringData"]["TASKLOOP_UI_AUTH"])
    # the worker user (its actions run the workers' scripts, as `taskloop resume` does), as worker.yaml gives it
    worker_env = {e["name"]: e for e in by_kind["Deployment"]["taskloop-worker"]["spec"]["template"]["spec"]
                  ["containers"][0]["env"]}
    assert re.match(r"rediss://worker:\$\(REDIS_WORKER_PASSWORD\)@", env["TASKLOOP_REDIS_URL"]["value"])
    for name in ("REDIS_WORKER_PASSWORD", "TASKLOOP_REDIS_URL"):
        assert env[name] == worker_env[name], name
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": UI_PORT}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz" and container[probe]["httpGet"]["port"] == "http"
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(UI_PORT, "http")]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def _ui_accepts_credentials(text: str) -> bool:
    """The example value is one `taskloop ui` accepts (user:password)."""
    from taskloop.ui.security import Credentials

    return bool(Credentials.parse(text))


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
    for job in config["scrape_configs"]:  # F2: a scrape of unbounded labels fails, it does not fill the TSDB
        assert 0 < job["sample_limit"] <= 50_000 and job["label_value_length_limit"] == 200, job


def _promtool() -> str:
    return tool("promtool")


# --- the metric names ----------------------------------------------------------------------------


def exported_names() -> set[str]:
    """Every series name taskloop/ops/metrics.py exports: a Counter x as x_total (and x_created), a
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
        assert not unknown, f"panel {title!r} uses metrics taskloop/ops/metrics.py does not export: {unknown}"
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
            assert not unknown, f"alert {rule['alert']} uses metrics taskloop/ops/metrics.py does not export: {unknown}"


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
            ("REDIS_PASSWORD", "REDIS_WORKER_PASSWORD", "REDIS_CLIENT_PASSWORD", "REDIS_MONITOR_PASSWORD",
             "REDIS_FLOWER_PASSWORD")}
    out = _render(tmp_path, **good)
    assert out.returncode == 0, out.stderr
    rendered = (tmp_path / "users.acl").read_text()
    assert "${" not in rendered and all(f">{value}" in rendered for value in good.values())
    assert (tmp_path / "users.acl").stat().st_mode & 0o077 == 0, "the ACL file is readable by its owner only"
    for name, value, says in (("REDIS_WORKER_PASSWORD", "has space-in-it-0123", "may contain only"),
                              ("REDIS_CLIENT_PASSWORD", "tooShort1", "shorter than 16"),
                              ("REDIS_MONITOR_PASSWORD", "", "is not set"),
                              ("REDIS_FLOWER_PASSWORD", "", "is not set")):
        out = _render(tmp_path, **{**good, name: value})
        assert out.returncode != 0 and name in out.stderr and says in out.stderr, out.stderr
        assert value == "" or value not in out.stderr, "a refused password is not echoed"


def test_render_acl_refuses_the_example_passwords(tmp_path: Path) -> None:
    """F6: `. .env.example; render-acl.sh` used to render an ACL file whose admin password was
    published in this repository; now every change-me example is refused, naming the variable."""
    examples = {}
    for line in (REPO / ".env.example").read_text().splitlines():
        name, _, value = line.partition("=")
        if name.startswith("REDIS_") and name.endswith("PASSWORD"):
            examples[name] = value.strip()
    assert len(examples) == 5 and all(v.startswith("change-me") for v in examples.values())
    out = _render(tmp_path, **examples)
    assert out.returncode != 0 and "still the published example value" in out.stderr, out.stderr
    assert not (tmp_path / "users.acl").exists()
    for name in examples:  # each one alone is refused too
        fresh = {n: f"{n.lower().replace('_', '-')}-0123456789" for n in examples}
        out = _render(tmp_path, **{**fresh, name: examples[name]})
        assert out.returncode != 0 and name in out.stderr, (name, out.stderr)
    secret = next(doc for _, doc in _k8s_documents() if doc["kind"] == "Secret" and
                  doc["metadata"]["name"] == "taskloop-redis")["stringData"]
    out = _render(tmp_path, **{n: v for n, v in secret.items() if n.endswith("PASSWORD")})
    assert out.returncode != 0, "the k8s example Secret's passwords are refused too"


def _locked(path: Path) -> dict[str, str]:
    """name -> version of a hashed lock (requirements/*.txt), every entry with its hashes."""
    text = path.read_text()
    found = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^ \\\n]+) \\\n    --hash=sha256:", text, re.M))
    assert found, path
    entries = re.findall(r"^[A-Za-z0-9_.-]+==", text, re.M)
    assert len(entries) == len(found), f"{path}: an entry without hashes"
    return {name.lower().replace("_", "-"): version for name, version in found.items()}


def test_ci_and_the_image_install_the_same_hashed_lock() -> None:
    image, dev = _locked(REPO / "requirements" / "image.txt"), _locked(REPO / "requirements" / "dev.txt")
    assert "--require-hashes -r requirements/image.txt" in (REPO / "ops" / "docker" / "Dockerfile").read_text()
    # the image installs taskloop with --no-deps: its lock pins the dependencies and the ui extra's
    # (taskloop ui runs in it), each within pyproject.toml's bounds
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for line in [*project["dependencies"], *project["optional-dependencies"]["ui"]]:
        wanted = Requirement(line)
        name = wanted.name.lower().replace("_", "-")
        assert name in image and wanted.specifier.contains(image[name]), f"requirements/image.txt: {wanted}"
    assert "--require-hashes -r requirements/dev.txt" in (REPO / ".ci" / "run").read_text()
    differ = {name: (version, dev.get(name)) for name, version in image.items() if dev.get(name) != version}
    assert not differ, f"the image would run other versions than CI tests: {differ}"
    # what this test process runs is the lock (CI installs it), and the Celery fixes were checked against it
    from importlib.metadata import version

    from taskloop.celery_fixes import CHECKED

    for name, checked in CHECKED.items():
        assert dev[name] in checked and version(name) == dev[name], name


DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def test_base_images_are_pinned_by_digest() -> None:
    """F9: every image the Dockerfile and the compose file pull is pinned by its digest (the image
    built from this repo, taskloop:local, is not pulled)."""
    froms = re.findall(r"^FROM\s+(\S+)", (REPO / "ops" / "docker" / "Dockerfile").read_text(), re.M)
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    pulled = [service["image"] for service in compose["services"].values()
              if "image" in service and "build" not in service and not service["image"].startswith("taskloop:")]
    assert froms and pulled
    unpinned = [image for image in [*froms, *pulled] if not DIGEST.search(image)]
    assert not unpinned, f"pinned by tag only: {unpinned}"

"""docker-compose.yml on the host, without Docker: every service's command line run as a process.

The compose file is read as Compose reads it (``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``,
``$$`` and YAML merge keys), with the variables of ``.env.example`` given fresh values. Each
service then runs with the same arguments and environment, translated as the host needs:

- a tiny "container file system" per service under a temporary directory: every bind mount is
  copied there, every named volume is an empty directory there, and container paths in the
  arguments and in the copied files point into it;
- every port a service listens on moves to a free port on 127.0.0.1, and every ``service:port``
  address (URLs, scrape targets, config files) points at it; ``0.0.0.0`` becomes ``127.0.0.1``;
- image commands are the host's: ``taskloop`` and ``celery`` run with this Python, ``redis-server``
  is a Redis 7 binary, ``prometheus`` the one on PATH.

Nothing here touches the Redis on 6379 or any network but 127.0.0.1.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from taskloop.ops.embedded import free_port

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
REDIS_PORT = 6379  # the redis service's port (its clients name it in their URLs)
HOST = "127.0.0.1"


# --- binaries ------------------------------------------------------------------------------------


def missing(reason: str) -> None:
    """Skip locally; fail in CI, where .ci/run must install what the ops tests need."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must install it (.ci/run)")
    pytest.skip(reason)


def _version(binary: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(n) for n in found.groups()) if found else ()


def redis7() -> str:
    """A redis-server of version 7 or newer (the compose file runs redis:7.2; the ACL file uses
    Redis 7 syntax such as %R~ read-only key patterns). TASKLOOP_TEST_REDIS7 names one."""
    candidates = [os.environ.get("TASKLOOP_TEST_REDIS7", ""), "/usr/bin/redis-server", "/usr/local/bin/redis-server"]
    candidates += [os.path.join(d, "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep)]
    for binary in candidates:
        if binary and os.access(binary, os.X_OK) and _version(binary) >= (7, 0, 0):
            return binary
    missing("no redis-server 7 or newer (apt-get install redis-server)")
    raise AssertionError("unreachable")


def tool(name: str) -> str:
    found = shutil.which(name)
    if not found:
        missing(f"{name} not found")
    assert found is not None
    return found


# --- the compose file ----------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class InterpolationError(ValueError):
    pass


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3) or ""
        value = env.get(name)
        unset_or_empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-") and unset_or_empty:
            return interpolate(arg, env)
        if op in (":?", "?") and unset_or_empty:
            raise InterpolationError(f"{name}: {arg}")
        return value or ""

    return _VARIABLE.sub(one, text)


def _interpolate_all(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_all(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_all(value, env) for key, value in node.items()}
    return node


def env_names() -> list[str]:
    """The variables .env.example sets."""
    names = []
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            names.append(line.split("=", 1)[0].strip())
    return names


def fresh_env() -> dict[str, str]:
    """A fresh value for every variable of .env.example (passwords: 32 hex digits)."""
    env: dict[str, str] = {}
    for name in env_names():
        if name.endswith("PASSWORD"):
            env[name] = secrets.token_hex(16)
        elif name in ("FLOWER_BASIC_AUTH", "UI_BASIC_AUTH"):
            env[name] = f"ops:{secrets.token_hex(8)}"
        elif name == "UI_SECRET":
            env[name] = secrets.token_hex(32)
        elif name == "WORKER_CONCURRENCY":
            env[name] = "2"
        else:
            raise AssertionError(f"tests/ops/stack.py does not know how to fill {name} of .env.example")
    return env


def load_compose(env: dict[str, str]) -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    return dict(_interpolate_all(raw, env))


# --- one service on the host ---------------------------------------------------------------------


def _container_ports(service: dict[str, Any], name: str) -> list[int]:
    ports = [int(str(p).split("/")[0]) for p in service.get("expose", [])]
    for spec in service.get("ports", []):
        ports.append(int(str(spec).rsplit(":", 1)[-1].split("/")[0]))
    if name == "redis":
        ports.append(REDIS_PORT)
    return sorted(set(ports))


@dataclass
class Replica:
    """One running copy of a service."""

    service: str
    index: int
    root: Path  # its "container file system"
    ports: dict[int, int]  # container port -> host port
    log: Path
    process: subprocess.Popen[bytes] | None = None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def port(self, container_port: int) -> int:
        return self.ports[container_port]

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Stack:
    """The compose services as host processes (see the module docstring)."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None, scale: dict[str, int] | None = None) -> None:
        self.workdir = workdir
        self.env = env or fresh_env()
        self.compose = load_compose(self.env)
        self.services: dict[str, dict[str, Any]] = self.compose["services"]
        self.scale = scale or {}
        self.replicas: dict[str, list[Replica]] = {}
        self.redis_binary = redis7()
        for name, service in self.services.items():
            ports = _container_ports(service, name)
            self.replicas[name] = [
                Replica(name, i, workdir / f"{name}-{i}", {p: free_port() for p in ports}, workdir / f"{name}-{i}.log")
                for i in range(self.scale.get(name, 1))]

    # addresses ----------------------------------------------------------------------------------
    def address(self, service: str, port: int, index: int = 0) -> str:
        return f"{HOST}:{self.replicas[service][index].port(port)}"

    def redis_port(self) -> int:
        return self.replicas["redis"][0].port(REDIS_PORT)

    def redis_url(self, user: str = "default", password: str | None = None) -> str:
        if password is None:
            password = self.env["REDIS_PASSWORD" if user == "default" else f"REDIS_{user.upper()}_PASSWORD"]
        return f"redis://{user}:{password}@{HOST}:{self.redis_port()}/0"

    def _host_text(self, text: str, replica: Replica) -> str:
        """Addresses and paths of the container world, as the host sees them."""
        for service, copies in self.replicas.items():
            for container_port, host_port in copies[0].ports.items():
                text = re.sub(rf"(?<![\w.-]){re.escape(service)}:{container_port}(?!\d)", f"{HOST}:{host_port}", text)
        for container_port, host_port in replica.ports.items():
            text = re.sub(rf"(?<=[=:\s]){container_port}(?=$|\s|/)|^{container_port}$", str(host_port), text,
                          flags=re.M)
        text = text.replace("0.0.0.0", HOST)
        for target in self._mount_targets(replica.service):
            text = re.sub(rf"(?<![\w/.]){re.escape(target)}(?=/|\b|$)", str(replica.root) + target, text)
        return text

    def _mount_targets(self, service: str) -> list[str]:
        targets = []
        for spec in self.services[service].get("volumes", []):
            parts = spec.split(":")
            targets.append(parts[1])
        return sorted(targets, key=len, reverse=True)

    def _lay_out(self, replica: Replica) -> None:
        """The replica's file system: bind mounts copied (files rewritten for the host), named
        volumes as empty directories."""
        for spec in self.services[replica.service].get("volumes", []):
            source, target = spec.split(":")[:2]
            where = replica.root / target.lstrip("/")
            if source.startswith((".", "/")):
                path = (REPO / source).resolve()
                files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
                for item in files:
                    dest = where if path.is_file() else where / item.relative_to(path)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_text(self._host_config(item.read_text(), replica, item.name))
            else:
                where.mkdir(parents=True, exist_ok=True)

    def _host_config(self, text: str, replica: Replica, name: str) -> str:
        if name == "redis.conf":
            text = re.sub(r"(?m)^bind .*$", f"bind {HOST}", text)
            text = re.sub(r"(?m)^protected-mode .*$", "protected-mode yes", text)
        if name == "prometheus.yml":
            return yaml.safe_dump(self._host_prometheus(yaml.safe_load(text), replica))
        return self._host_text(text, replica)

    def _host_prometheus(self, config: dict[str, Any], replica: Replica) -> dict[str, Any]:
        """DNS service discovery of a compose service becomes its replicas' addresses; static
        targets and rule files are translated like any other text. Scrapes and rule evaluations
        every second (the test would otherwise wait up to a 15 s interval for the first one)."""
        config.setdefault("global", {}).update({"scrape_interval": "1s", "evaluation_interval": "1s"})
        for job in config.get("scrape_configs", []):
            statics = job.setdefault("static_configs", [])
            for sd in job.pop("dns_sd_configs", []):
                targets = [f"{HOST}:{copy.port(int(sd['port']))}" for name in sd["names"]
                           for copy in self.replicas[name]]
                statics.append({"targets": targets})
            for static in statics:
                static["targets"] = [self._host_text(t, replica) for t in static["targets"]]
        config["rule_files"] = [self._host_text(path, replica) for path in config.get("rule_files", [])]
        return config

    def _argv(self, replica: Replica, argv: list[str]) -> list[str]:
        """The image's programs are the host's: the first word, and the command an entrypoint
        script execs (``redis-server``)."""
        heads = {"taskloop": [sys.executable, "-m", "taskloop"], "celery": [sys.executable, "-m", "celery"],
                 "python": [sys.executable], "prometheus": [tool("prometheus")], "/bin/sh": ["sh"]}
        out: list[str] = []
        for i, arg in enumerate(argv):
            if i == 0 and arg in heads:
                out += heads[arg]
            elif arg == "redis-server":
                out.append(self.redis_binary)
            else:
                out.append(self._host_text(arg, replica))
        return out

    def command(self, service: str, index: int = 0) -> tuple[list[str], dict[str, str]]:
        """The host argv and environment of one replica of ``service``."""
        spec = self.services[service]
        replica = self.replicas[service][index]
        argv = [*spec.get("entrypoint", []), *spec.get("command", [])]
        if service == "prometheus" and not spec.get("entrypoint"):
            argv = ["prometheus", *argv]  # the image's entrypoint
        environment = spec.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env.pop("TASKLOOP_BROKER_URL", None)
        env.update({key: self._host_text(str(value), replica) for key, value in environment.items()})
        return self._argv(replica, [str(a) for a in argv]), env

    def start(self, service: str, extra_args: list[str] | None = None,
              extra_env: dict[str, str] | None = None) -> list[Replica]:
        for replica in self.replicas[service]:
            replica.root.mkdir(parents=True, exist_ok=True)
            self._lay_out(replica)
            argv, env = self.command(service, replica.index)
            argv += extra_args or []
            env.update(extra_env or {})
            if service == "worker":  # each container has its own hostname: so does each node here
                argv += ["-n", f"worker{replica.index}@%h"]
            replica.argv, replica.env = argv, env
            with replica.log.open("ab") as log:
                replica.process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, start_new_session=True)
        return self.replicas[service]

    def run(self, service: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run a one-shot service (the producer) to its end."""
        replica = self.replicas[service][0]
        replica.root.mkdir(parents=True, exist_ok=True)
        argv, env = self.command(service)
        return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)

    def healthcheck(self, service: str, index: int = 0) -> bool:
        """Run the service's compose health check on the host (its test, translated)."""
        test = self.services[service]["healthcheck"]["test"]
        replica = self.replicas[service][index]
        _, env = self.command(service, index)
        if test[0] == "CMD-SHELL":
            script = self._host_text(test[1], replica)
            script = re.sub(r"\bredis-cli\b", f"redis-cli -h {HOST} -p {self.redis_port()}", script)
            argv = ["sh", "-c", script]
        else:
            argv = self._argv(replica, test[1:])
        try:
            return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, timeout=15).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def stop(self, service: str | None = None, grace: float = 20.0) -> None:
        names = [service] if service else list(reversed(list(self.replicas)))
        for name in names:
            for replica in self.replicas[name]:
                if replica.alive():
                    assert replica.process is not None
                    replica.process.send_signal(signal.SIGTERM)
            for replica in self.replicas[name]:
                if replica.process is None:
                    continue
                try:
                    replica.process.wait(grace)
                except subprocess.TimeoutExpired:
                    os.killpg(replica.process.pid, signal.SIGKILL)
                    replica.process.wait(10)


# --- waiting and HTTP ----------------------------------------------------------------------------


def wait_for(condition: Any, timeout: float, what: str, interval: float = 0.1, dead: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if dead is not None and dead():
            raise AssertionError(f"gave up waiting for {what}: {dead()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def http_get(url: str, auth: str | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    import base64

    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples (Prometheus text format) whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def iter_log_lines(text: str, *needles: str) -> Iterator[str]:
    for line in text.splitlines():
        if any(n in line for n in needles):
            yield line

"""The three Redis ACL roles of ops/redis/users.acl, each run for real against the compose file's
Redis (tests/ops/stack.py), and what each role must be able to do:

- **worker** (the `worker`, `reconciler` and `ui` services, and operator commands that need the
  workflow code such as `taskloop resume`): run workflows started by name to the end, serve cache
  hits, re-send a phase whose message was lost (reconciler), resume a failed run, record reconcile
  passes and forget finished runs (and trim the run lists), answer control commands (inspect
  ping) and send task events when asked to (as Flower does); the run UI shows the runs list
  (filtered by status and workflow, searched by id prefix), a run's page, its events, its live
  stream and the fleet, and approves a gate.
- **client** (the `producer` service): tests/ops/client_role.py.
- **monitor** (`taskloop status`, the `metrics` service, `taskloop ui --read-only`, KEDA):
  read-only. Status lists the worker (from its heartbeat), the fleet exporter answers, the
  read-only UI shows the same pages as the worker's (and refuses an action).
- **flower** (the `flower` service): Flower lists the workers, sees the tasks (events) and the
  queue length; its remote-control replies sweep kombu's overdue binding tables.

Each scenario raises Broken(step, detail) at the first thing that does not work.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from taskloop.base.config import Settings
from taskloop.runtime.celery_app import START_TASK
from taskloop.runtime.client import RunHandle, TaskLoop
from taskloop.runtime.fleet import decode_held
from taskloop.store import keys
from taskloop.worker.recovery import census
from tests.ops.stack import REPO, Replica, Stack, http_get, metric_sum

STEP_TIMEOUT_S = 10.0
ROLES = ("worker", "client", "monitor", "flower")
# The services each role's scenario runs (with the role's credentials, as docker-compose.yml says).
ROLE_SERVICES = {"worker": ("worker", "reconciler", "ui"), "client": (), "monitor": ("metrics", "ui"),
                 "flower": ("flower",)}
# What else must run for the scenario (with full permissions: the other roles' ACL lines).
SUPPORT_SERVICES = {"worker": ("metrics", "flower"), "client": ("worker",), "monitor": ("worker",),
                    "flower": ("worker",)}
# The worker thread reconciles often (the lost message), and a short lease lets the reconciler
# forget a finished run within seconds (it looks at a run again one lease after its last write).
# Short timers. The compose file's shutdown grace (280 s) is for production: here a phase still
# running at the warm-shutdown step is handed back after 5 s (that path needs the same grants),
# so the step ends within the test's 30 s whatever runs at that moment.
WORKER_ENV = {"TASKLOOP_RECONCILE_INTERVAL_S": "0.5", "TASKLOOP_LEASE_S": "2", "TASKLOOP_SHUTDOWN_GRACE_S": "5"}
# For the monitor, the worker does not reconcile: a live run made due stays due while the monitor reads it.
MONITOR_WORKER_ENV = {"TASKLOOP_RECONCILE_INTERVAL_S": "0", "TASKLOOP_LEASE_S": "2", "TASKLOOP_SHUTDOWN_GRACE_S": "5"}
UI_PORT = 8188
# The ui service as each role runs it: the compose service (the worker user, with actions: gates
# plan with the definition, as `taskloop resume` does), or --read-only with the monitor user (the
# override docs/operations.md gives for a UI that only looks).
UI_ARGS = {"worker": ["--import", "tests.ops.flows"], "monitor": ["--read-only"]}


class Broken(AssertionError):
    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"{step}: {detail}")
        self.step = step
        self.detail = detail


def within(step: str, condition: Callable[[], Any], timeout: float = STEP_TIMEOUT_S,
           alive: Callable[[], str | None] | None = None) -> Any:
    """Poll ``condition`` until it is truthy; Broken(step) when it is not in time (or a process died)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            found = condition()
        except Exception as exc:  # the role's own error is the evidence
            found, last = None, f"{type(exc).__name__}: {str(exc)[:300]}"
        if found:
            return found
        dead = alive() if alive else None
        if dead:
            raise Broken(step, dead)
        if time.monotonic() > deadline:
            raise Broken(step, f"not within {timeout:.0f} s" + (f" (last error {last})" if last else ""))
        time.sleep(0.05)


# --- the ACL file -----------------------------------------------------------------------------------


def acl_lines(stack: Stack) -> dict[str, list[str]]:
    """Each user's rules from ops/redis/users.acl, passwords filled in (as render-acl.sh does)."""
    rules: dict[str, list[str]] = {}
    for line in (REPO / "ops" / "redis" / "users.acl").read_text().splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "user":
            rules[words[1]] = [stack._host_text(w, stack.replicas["redis"][0]) if not w.startswith(">") else
                               ">" + _fill(w[1:], stack.env) for w in words[2:]]
    return rules


def _fill(text: str, env: dict[str, str]) -> str:
    for name, value in env.items():
        text = text.replace("${" + name + "}", value)
    return text


def permissions(rules: list[str]) -> list[str]:
    """The grants of a user's rules: commands (+cmd), key patterns (~p, %R~p ...), channels (&c)."""
    return [r for r in rules if r.startswith(("+", "~", "%", "&")) and r != "+@all"]


def set_user(admin: redis.Redis, user: str, rules: list[str]) -> None:
    admin.execute_command("ACL", "SETUSER", user, "reset", *rules)


def acl_denials(admin: redis.Redis, user: str) -> list[str]:
    """ACL LOG entries of ``user``: 'reason object' (e.g. 'command hset', 'key tl:x')."""
    found = []
    for entry in admin.execute_command("ACL", "LOG", "128"):
        info = dict(zip(entry[::2], entry[1::2], strict=False)) if isinstance(entry, list) else entry
        info = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in info.items()}
        if info.get("username") == user:
            found.append(f"{info.get('reason')} {info.get('object')} (x{info.get('count')})")
    return found


def stale_binding(admin: redis.Redis) -> None:
    """A binding table whose consumers went away over an hour ago (kombu's deadline passed): the
    next kombu channel that consumes an expiring queue (a worker's pidbox, a control command's
    reply queue, Flower's event queue) sweeps it, as happens in any long-lived deployment."""
    admin.sadd("_kombu.binding.stale.exchange", "stale\x06\x16\x06\x16stale.queue")
    admin.zadd("_kombu.binding_deadlines", {"stale.exchange": 0})


def swept(admin: redis.Redis) -> bool:
    return not admin.exists("_kombu.binding.stale.exchange")


def log_failures(text: str, *needles: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in needles)]


# --- starting runs as a producer does (by name) ---------------------------------------------------


def start_by_name(client: TaskLoop, name: str, input: Any) -> RunHandle:
    """What TaskLoop.start does for a workflow this process has not imported (whatever the test
    process has imported): record the run pending, send taskloop.start."""
    from taskloop.runtime import starting

    started = starting.record_pending(client.store, name, None, input, None, client.settings)
    client.app.send_task(START_TASK, args=[started.run_id], ignore_result=True, shadow=f"{name}.start")
    return RunHandle(client, started.run_id)


def finished(client: TaskLoop, handle: RunHandle, status: str = "done") -> Callable[[], bool]:
    def check() -> bool:
        result = client.result(handle.run_id)
        if result is None:
            return False
        if result.status != status:
            raise AssertionError(f"run ended {result.status}, not {status}: {result.errors}")
        return True
    return check


# --- the run UI, over HTTP -------------------------------------------------------------------------


def ui_request(url: str, auth: str, method: str = "GET", body: dict[str, Any] | None = None,
               headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    if data is not None:
        request.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError as exc:
        return 0, f"{type(exc).__name__}: {exc}".encode()


def ui_refusal(body: bytes) -> str:
    """What a page or API answer says went wrong (Redis's refusal if it names one), in short."""
    text = html.unescape(body.decode(errors="replace"))
    why = re.search(r"no permissions to [^;)\"]*|can't run this command[^;)\"]*|NOPERM[^;)\"]*", text)
    return why.group(0) if why else " ".join(text.split())[:200]


class UI:
    """The role's `taskloop ui` (the compose ui service, on the host), as a browser or an API client
    uses it, with the compose file's basic auth."""

    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.base = f"http://{sc.stack.address('ui', UI_PORT)}"
        self.auth = sc.stack.env["UI_BASIC_AUTH"]

    def get(self, step: str, path: str, contains: str) -> bytes:
        code, body = ui_request(self.base + path, self.auth)
        if code != 200 or contains.encode() not in body:
            raise Broken(step, f"GET {path}: HTTP {code}: {ui_refusal(body)}")
        return body

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        code, session = ui_request(self.base + "/api/session", self.auth)
        if code != 200:
            raise Broken("UI session", f"GET /api/session: HTTP {code}: {ui_refusal(session)}")
        token = json.loads(session)["csrf"]
        return ui_request(self.base + path, self.auth, "POST", body, {"X-CSRF-Token": token})

    def first_live_event(self, step: str, run_id: str, timeout: float = 5.0) -> None:
        """The first message of a run's live stream (``event: run``, the run's body): the stream
        reads the run's events (XREAD) and renders the run before it sends anything but its
        opening comment. A stream that fails ends without it."""
        request = urllib.request.Request(f"{self.base}/runs/{run_id}/live")
        request.add_header("Authorization", "Basic " + base64.b64encode(self.auth.encode()).decode())
        lines: list[str] = []
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                event = False
                while True:
                    line = response.readline().decode(errors="replace")
                    if not line:
                        break  # the stream ended: it failed
                    lines.append(line)
                    if line.startswith("event: "):
                        event = line.strip() == "event: run"
                    elif line == "\n" and event:
                        return
        except (OSError, ValueError) as exc:
            raise Broken(step, f"{type(exc).__name__}: {exc}; read {''.join(lines)[:200]!r}") from exc
        raise Broken(step, f"the stream ended without 'event: run': {''.join(lines)[:300]!r}")

    def reads(self, shown: RunHandle, live: RunHandle, name: str) -> None:
        """Every page and API read the UI serves, on a finished run ``shown`` (a workflow ``name``)
        and a live run ``live``."""
        sc, run_id = self.sc, shown.run_id
        self.get("UI: the runs list", "/", run_id)
        self.get("UI: the runs list", "/api/runs?status=done", run_id)
        self.get("UI: the runs list", f"/?workflow={name}&status=done", run_id)
        self.get("UI: the runs list", f"/?q={run_id[:10]}", run_id)
        sc.ok("UI: the runs list")
        self.get("UI: a run's page", f"/runs/{run_id}", run_id)
        self.get("UI: a run's page", f"/runs/{live.run_id}", live.run_id)
        self.get("UI: a run's page", f"/api/runs/{run_id}", run_id)
        sc.ok("UI: a run's page")
        self.get("UI: a run's events", f"/api/runs/{run_id}/events", "run.finished")
        sc.ok("UI: a run's events")
        self.first_live_event("UI: a run's live stream", live.run_id)
        sc.ok("UI: a run's live stream")

        def fleet() -> bool:
            # the workers answer Celery's remote control within the UI's 0.5 s, once they are up
            return b"worker0@" in self.get("UI: the fleet", "/fleet", "Workers")
        within("UI: the fleet", fleet, alive=sc.alive("ui"))
        sc.ok("UI: the fleet")

    def no_errors(self) -> None:
        failures = [line for replica in self.sc.stack.replicas["ui"]
                    for line in log_failures(replica.text(), "ERROR", "Traceback", "Exception")]
        if failures:
            raise Broken("UI: no errors in its log", " / ".join(failures[:3]))
        self.sc.ok("UI: no errors in its log")


# --- the scenarios -------------------------------------------------------------------------------


@dataclass
class Scenario:
    stack: Stack
    workdir: Path
    steps: list[str] = field(default_factory=list)
    stopped: set[str] = field(default_factory=set)  # services the scenario stopped on purpose

    @property
    def admin_url(self) -> str:
        return self.stack.redis_url()

    def alive(self, *services: str) -> Callable[[], str | None]:
        def check() -> str | None:
            for name in services:
                for replica in self.stack.replicas[name]:
                    if replica.process is not None and not replica.alive():
                        return f"the {name} process exited with code {replica.process.returncode}"
            return None
        return check

    def ok(self, step: str) -> None:
        self.steps.append(step)


def worker_scenario(sc: Scenario) -> None:
    from tests.ops import flows

    alive = sc.alive("worker")  # the reconciler's exit is recorded by Roles.run (it is restarted in compose)
    started_at = time.time()
    admin = TaskLoop(sc.admin_url)
    probe = redis.Redis.from_url(sc.admin_url, decode_responses=True)
    try:
        essay = start_by_name(admin, "essay", {"topic": "acl"})
        revision = start_by_name(admin, "report-revision", {"approve_in": 2})
        within("run workflows started by name", finished(admin, essay), alive=alive)
        within("run workflows started by name", finished(admin, revision), alive=alive)
        budgeted = start_by_name(admin, "ops-budgeted", {})  # a budget: begin.lua reads the usage counters
        within("run a workflow with a budget", finished(admin, budgeted), alive=alive)
        sc.ok("run workflows started by name")

        n = time.time_ns()
        first = start_by_name(admin, "ops-cached", {"n": n})
        within("cache a value", finished(admin, first), alive=alive)
        second = start_by_name(admin, "ops-cached", {"n": n})
        within("serve a cache hit", finished(admin, second), alive=alive)
        if not any(e.type == "cache.hit" for e in admin.events(second.run_id)):
            raise Broken("serve a cache hit", "the second run did not hit the cache")
        sc.ok("cache")

        # A phase recorded queued whose message never reached the broker: the reconciler re-sends it.
        from taskloop.runtime import starting

        quick = Settings(redis_url=sc.admin_url, queued_lease_s=0.5)
        lost = starting.start_defined(admin.store, lambda *args: None, flows.cached, {"n": n + 1}, None, quick)
        within("re-send a lost message", finished(admin, RunHandle(admin, lost.run_id)), alive=alive)
        sc.ok("re-send a lost message")

        marker = sc.workdir / f"marker-{n}"
        flaky = start_by_name(admin, "ops-flaky", {"marker": str(marker)})
        within("fail a run (to resume)", finished(admin, flaky, "failed"), alive=alive)
        marker.write_text("")
        _, env = sc.stack.command("worker")
        resumed = subprocess.run([sys.executable, "-m", "taskloop", "resume", flaky.run_id, "--import",
                                  "tests.ops.flows", "--wait", "--timeout", str(STEP_TIMEOUT_S)],
                                 env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        if resumed.returncode != 0:
            raise Broken("resume a failed run", (resumed.stdout + resumed.stderr).strip()[-400:])
        sc.ok("resume a failed run")

        def reconciled() -> bool:
            last = probe.get("tl:reconciler:last")
            return bool(last) and json.loads(last)["at"] > started_at and \
                probe.zscore("tl:live", essay.run_id) is None
        within("record reconcile passes and forget finished runs", reconciled, alive=alive)
        sc.ok("reconcile passes")

        # The pass that forgets a finished run compacts it (compact.lua: HLEN, XLEN, PTTL, PEXPIRE), and
        # the compact record keeps the run's retention (a script refused its last PEXPIRE would have
        # written the record all the same: Redis does not undo a script's writes)
        compact_key = keys.RunKeys.of(essay.run_id).compact
        within("compact finished runs", lambda: probe.exists(compact_key) == 1, alive=alive)
        retention = probe.pttl(compact_key)
        if retention <= 0:
            raise Broken("compact finished runs", f"the compact record has no retention (PTTL {retention})")
        sc.ok("compact finished runs")

        # A phase whose message was taken from its queue and never reached a worker (here: never
        # sent, under the shipped queued lease of 300 s): the census dates the tail of the busy queue
        # (LINDEX) and sends the phase again long before its lease.
        lost_in_broker = starting.start_defined(admin.store, lambda *args: None, flows.cached, {"n": n + 2}, None,
                                                Settings(redis_url=sc.admin_url))
        time.sleep(census.MARGIN_S + 1)
        backlog = [start_by_name(admin, "ops-slow", {}) for _ in range(20)]
        try:
            within("(setup) a busy queue", lambda: probe.llen("taskloop") > 0, alive=alive)
            within("send again a message lost in the broker",
                   finished(admin, RunHandle(admin, lost_in_broker.run_id)),
                   timeout=census.CENSUS_S + census.MARGIN_S + STEP_TIMEOUT_S, alive=alive)
        finally:
            for run in backlog:
                admin.cancel(run.run_id, "acl test: the backlog is no longer needed")
        sc.ok("send again a message lost in the broker")

        replies = within("answer inspect ping", lambda: admin.app.control.inspect(timeout=1.0).ping(), alive=alive)
        if not any(node.startswith("worker") for node in replies):
            raise Broken("answer inspect ping", f"replies {replies}")
        sc.ok("answer control commands")

        # The run UI (the compose ui service: this user, with actions): every page it serves, and
        # a gate approved through its API (decide plans with the definition, as resume does).
        gate = start_by_name(admin, "ops-gate", {})
        within("(setup) a run waiting at a gate", lambda: admin.inspect(gate.run_id).status == "waiting", alive=alive)
        ui = UI(sc)
        ui.reads(essay, gate, "essay")

        # A live run due for a reconcile pass: the fleet page counts its expired leases (ZCOUNT). The
        # UI reads the fleet at most every 2 s (ui/pages.py FleetCache), so this read is a fresh one,
        # and the reconciler looks at the run again within a second, so it is made due just before.
        time.sleep(2.5)
        probe.zadd(keys.LIVE_INDEX, {gate.run_id: 0})
        ui.get("UI: the fleet with a run due", "/fleet", "Workers")
        sc.ok("UI: the fleet with a run due")
        code, body = ui.post(f"/api/runs/{gate.run_id}/gates/approval", {"action": "approve", "reason": "acl"})
        if code != 200:
            raise Broken("UI: approve a gate", f"HTTP {code}: {ui_refusal(body)}")
        within("UI: approve a gate", finished(admin, gate), alive=alive)
        sc.ok("UI: approve a gate")
        ui.no_errors()

        listener = probe.pubsub()
        listener.psubscribe("/0.celeryev/*")
        admin.app.control.enable_events()
        start_by_name(admin, "essay", {"topic": "events"})

        def task_event() -> bool:
            message = listener.get_message(timeout=0.2)
            return bool(message and message["type"] == "pmessage" and "task" in message["channel"])
        within("send task events", task_event, alive=alive)
        listener.close()
        sc.ok("send task events")
        failures = [line for name in ("worker", "reconciler") for replica in sc.stack.replicas[name]
                    for line in log_failures(replica.text(), "ERROR/", "CRITICAL/", "Traceback", "Error:")
                    if "ops-flaky" not in line and "no marker file" not in line]
        if failures:
            raise Broken("work without errors in the logs", " / ".join(failures[:3]))
        sc.ok("work without errors in the logs")

        # A warm shutdown (SIGTERM) with messages prefetched: they go back to the queue (kombu's
        # restore, from the worker's memory: ack emulation is off), the node's queue bindings are
        # deleted and its subscriptions closed, with no error and no refusal (a refused clean-up
        # leaves a dead node's binding behind in Redis for good).
        for _ in range(6):
            start_by_name(admin, "ops-slow", {})

        def prefetched() -> list[tuple[str, str, int]]:  # what the worker's heartbeat says it holds, not run yet
            held = [m for raw in probe.hvals(keys.HELD) for m in decode_held(raw)]
            return [(m.run_id, m.key, m.token) for m in held if m.since is None and m.key and m.token is not None]

        within("(setup) messages prefetched", lambda: len(prefetched()) >= 2, alive=alive)
        waiting = set(prefetched())
        worker = sc.stack.replicas["worker"][0]
        assert worker.process is not None
        before, refused = len(worker.text()), len(acl_denials(probe, "worker"))
        sc.stopped.add("worker")
        worker.process.send_signal(signal.SIGTERM)
        try:
            code = worker.process.wait(30)
        except subprocess.TimeoutExpired as exc:
            tail = worker.text()[before:][-2500:]
            raise Broken("warm shutdown",
                         f"the worker did not stop within 30 s of SIGTERM; its log since: {tail}") from exc
        failures = log_failures(worker.text()[before:], "ERROR/", "CRITICAL/", "Traceback")
        if code != 0 or failures:
            raise Broken("warm shutdown", f"exit code {code}: " + " / ".join(failures[:3]))
        queued = {(m.run_id, m.key, m.token) for raw in probe.lrange("taskloop", 0, -1)
                  if (m := census.read_message(raw)) is not None and m.key is not None}
        def untaken(run_id: str, key: str, token: int) -> bool:  # still queued under it, and nobody began it
            snap = admin.store.snapshot(run_id, [f"t:{key}", f"x:{key}"])
            record = snap.record(key)
            note = snap.get(f"x:{key}") or ""
            return record is not None and record.token == token and not note.startswith(f"{token} ")

        # each one is back in the queue, or another worker took it from there already
        lost = [held for held in waiting - queued if untaken(*held)]
        if lost:
            raise Broken("warm shutdown", f"{len(lost)} prefetched messages were not handed back: {lost[:3]}")
        if len(acl_denials(probe, "worker")) != refused:
            raise Broken("warm shutdown", f"refused: {acl_denials(probe, 'worker')}")
        sc.ok("warm shutdown")
    finally:
        admin.close()
        probe.close()


def client_scenario(sc: Scenario) -> None:
    probe = redis.Redis.from_url(sc.admin_url, decode_responses=True)
    admin = TaskLoop(sc.admin_url)
    try:
        # a run whose records expired but that is still in the run lists: `runs` does not show it
        gone = start_by_name(admin, "essay", {"topic": "gone"})
        within("(setup) a run to forget", finished(admin, gone))
        probe.delete(f"tl:{{{gone.run_id}}}")
        # a finished run compacted (as the reconciler does once it forgets it): the client reads it
        # from its compact record (GET)
        compacted = start_by_name(admin, "essay", {"topic": "compacted"})
        within("(setup) a run to compact", finished(admin, compacted))
        admin.store.compact(compacted.run_id)
        within("(setup) a compacted run", lambda: probe.exists(keys.RunKeys.of(compacted.run_id).compact) == 1)
    finally:
        admin.close()
        probe.close()
    _, env = sc.stack.command("producer")
    with redis.Redis.from_url(sc.admin_url) as flusher:
        flusher.script_flush()  # the client may be the first to run taskloop's scripts after a restart
    try:
        out = subprocess.run([sys.executable, "-m", "tests.ops.client_role", gone.run_id, compacted.run_id],
                             env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as exc:
        raise Broken("client", "tests.ops.client_role did not end in 90 s") from exc
    for line in out.stdout.splitlines():
        if line.startswith("ok "):
            sc.ok(line[3:])
        elif line.startswith("broken "):
            step, _, detail = line[7:].partition(": ")
            raise Broken(step, detail)
    if out.returncode != 0:
        raise Broken("client", (out.stdout + out.stderr).strip()[-600:])


def monitor_scenario(sc: Scenario) -> None:
    alive = sc.alive("metrics", "ui")
    admin = TaskLoop(sc.admin_url)
    try:
        first = start_by_name(admin, "essay", {"topic": "monitor"})
        within("(setup) a run", finished(admin, first))
        live = start_by_name(admin, "ops-slow", {})  # a live run while the monitor looks
        within("(setup) a live run", lambda: any(e.type == "phase" for e in admin.events(live.run_id)))
        try:
            from taskloop.worker.recovery.reconciler import reconcile

            reconcile(admin.store, admin.settings, admin.send)  # a pass on record (the worker's thread is off)
            with redis.Redis.from_url(sc.admin_url) as probe:  # due now: status and the exporter read its leases
                probe.zadd("tl:live", {live.run_id: 0})
            _monitor_steps(sc, alive, first, live)
        finally:
            admin.cancel(live.run_id, "monitor scenario over")
    finally:
        admin.close()


def _monitor_steps(sc: Scenario, alive: Callable[[], str | None], done: RunHandle, live: RunHandle) -> None:
    _, env = sc.stack.command("metrics")
    status = subprocess.run([sys.executable, "-m", "taskloop", "status", "--json"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    if status.returncode != 0:
        raise Broken("taskloop status --json", (status.stdout + status.stderr).strip()[-400:])
    found = json.loads(status.stdout)
    if not found["workers"] or "taskloop" not in found["queues"] or found["reconciler_last_pass"] is None \
            or found["live_runs_by_status"].get("running", 0) < 1:
        raise Broken("taskloop status --json", f"incomplete: {status.stdout[:400]}")
    sc.ok("taskloop status --json")

    fleet = sc.stack.address("metrics", 9809)

    def scraped() -> bool:
        code, body = http_get(f"http://{fleet}/metrics")
        text = body.decode()
        if code != 200:
            raise AssertionError(f"HTTP {code}: {text[:200]}")
        return "taskloop_runs_live" in text and 'taskloop_phases_queued{queue="taskloop"}' in text \
            and metric_sum(text, "taskloop_runs_started_total") > 0
    within("the fleet exporter", scraped, alive=alive)
    sc.ok("the fleet exporter")

    # `taskloop ui --read-only` as this user: the worker's UI pages, and no action
    ui = UI(sc)
    ui.reads(done, live, "essay")
    code, body = ui.post(f"/api/runs/{live.run_id}/cancel", {"reason": "read-only"})
    if code != 403 or "read-only" not in body.decode(errors="replace"):
        raise Broken("UI: read-only refuses actions", f"HTTP {code}: {ui_refusal(body)}")
    sc.ok("UI: read-only refuses actions")
    ui.no_errors()


def flower_scenario(sc: Scenario) -> None:
    admin = TaskLoop(sc.admin_url)
    live = start_by_name(admin, "ops-slow", {})  # a live run: its phases send Flower events
    try:
        _flower_steps(sc)
    finally:
        admin.cancel(live.run_id, "flower scenario over")
        admin.close()


def _flower_steps(sc: Scenario) -> None:
    alive = sc.alive("flower")
    with redis.Redis.from_url(sc.admin_url) as admin:
        admin.script_flush()  # Flower may be the first to run kombu's binding script after a restart
        stale_binding(admin)
    flower = sc.stack.address("flower", 5555)
    auth = sc.stack.env["FLOWER_BASIC_AUTH"]

    def api(path: str) -> Any:
        code, body = http_get(f"http://{flower}{path}", auth, timeout=10)
        if code != 200:
            raise AssertionError(f"HTTP {code}")
        return json.loads(body or b"null")

    within("Flower lists the workers", lambda: any(n.startswith("worker") for n in api("/api/workers?refresh=1")),
           timeout=20, alive=alive)
    sc.ok("Flower lists the workers")
    # Flower turns task events on in the workers it finds, 5 s after it starts and every 5 s
    # after: once it has, it sees the phases of the live run. A run started before that sends it
    # no event at all (this step used to start its run at once, and failed whenever the steps
    # before it took less than Flower's first 5 s).
    within("Flower turns task events on", lambda: api("/api/tasks?limit=1"),
           timeout=20, alive=alive)
    sc.ok("Flower turns task events on")
    admin = TaskLoop(sc.admin_url)
    try:
        # then it sees every phase of a run
        handle = start_by_name(admin, "essay", {"topic": "flower"})
        within("(setup) a run for Flower", finished(admin, handle))
        within("Flower sees the tasks (events)",
               lambda: any(handle.run_id in (t.get("args") or "") for t in api("/api/tasks?limit=500").values()),
               timeout=20, alive=alive)
        sc.ok("Flower sees the tasks")
    finally:
        admin.close()
    queues = within("Flower reads the queue length", lambda: api("/api/queues/length"), alive=alive)
    if not any(q["name"] == "taskloop" for q in queues["active_queues"]):
        raise Broken("Flower reads the queue length", str(queues)[:300])
    sc.ok("Flower reads the queue length")
    with redis.Redis.from_url(sc.admin_url) as admin:
        within("Flower's inspect sweeps an overdue kombu binding table", lambda: swept(admin), alive=alive)
    sc.ok("Flower sweeps overdue binding tables")
    # Flower retries what fails (an inspect call, the event capture), so a refused command shows in
    # its log before it shows anywhere else (inspect calls that time out are normal at start-up)
    failures = log_failures(sc.stack.replicas["flower"][0].text(), "no permissions", "NOPERM", "[E ", "Traceback")
    if failures:
        raise Broken("Flower works without refusals", " / ".join(failures[:3]))
    sc.ok("Flower works without refusals")


SCENARIOS: dict[str, Callable[[Scenario], None]] = {
    "worker": worker_scenario, "client": client_scenario, "monitor": monitor_scenario, "flower": flower_scenario}


# --- one role, for real ---------------------------------------------------------------------------


@dataclass
class Outcome:
    role: str
    removed: str | None
    steps: list[str]
    broken: Broken | None
    denials: list[str]
    exits: list[str]  # role processes that exited on their own (code, last log lines)
    seconds: float

    def describe(self) -> str:
        what = f"broke at '{self.broken.step}' ({self.broken.detail[:200]})" if self.broken else "did not break"
        return (f"{self.role} without {self.removed}: {what}; ACL LOG: {'; '.join(self.denials) or 'nothing'}"
                + (f"; EXITED: {' | '.join(self.exits)}" if self.exits else "") + f" [{self.seconds:.1f} s]")


class Roles:
    """A Redis from docker-compose.yml (its ACL file) and the role services, started fresh for each
    scenario, with one permission of one role taken away if asked."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.stack = Stack(workdir / "stack", scale={"worker": 1})
        self.stack.start("redis")
        self.admin = redis.Redis.from_url(self.stack.redis_url(), decode_responses=True)
        self.rules = acl_lines(self.stack)
        deadline = time.monotonic() + 20
        while not self.stack.healthcheck("redis"):
            if time.monotonic() > deadline:
                raise RuntimeError("redis from docker-compose.yml is not healthy:\n" +
                                   self.stack.replicas["redis"][0].text()[-2000:])
            time.sleep(0.1)

    def run(self, role: str, removed: str | None = None) -> Outcome:
        started = time.monotonic()
        self.admin.flushall()
        self.admin.script_flush()  # as after a Redis restart: whoever runs a script first loads it
        self.admin.execute_command("ACL", "LOG", "RESET")
        stale_binding(self.admin)
        for user, rules in self.rules.items():
            if user != "default":
                set_user(self.admin, user, [r for r in rules if r != removed] if user == role else rules)
        # The worker role starts first (it must meet the overdue binding table before Flower does);
        # the others need a worker before anything else.
        first, then = (ROLE_SERVICES[role], SUPPORT_SERVICES[role]) if role == "worker" else \
            (SUPPORT_SERVICES[role], ROLE_SERVICES[role])
        services = [*first, *then]
        sc = Scenario(self.stack, self.workdir)
        broken: Broken | None = None
        try:
            for group in (first, then):
                for name in group:
                    env = (MONITOR_WORKER_ENV if role in ("monitor", "flower") else WORKER_ENV) \
                        if name in ("worker", "reconciler") else None
                    extra = ["--import", "tests.ops.flows"] if name in ("worker", "reconciler") else None
                    if name == "ui":
                        extra = UI_ARGS[role]
                        env = {"TASKLOOP_REDIS_URL": self.stack.redis_url(role)} if role != "worker" else None
                    self._start(name, extra, env)
                if "worker" in group:
                    self._ready(self.stack.replicas["worker"][0])
                if "ui" in group:
                    self._ui_ready(sc)
                if role == "worker" and group is first:  # before Flower (monitor) could sweep it
                    within("sweep an overdue kombu binding table", lambda: swept(self.admin), timeout=15,
                           alive=sc.alive("worker"))
                    sc.ok("sweep overdue binding tables")
            SCENARIOS[role](sc)
        except Broken as exc:
            broken = exc
        exits = [f"{r.service} exited {r.process.returncode}: " + " / ".join(r.text().strip().splitlines()[-3:])
                 for name in ROLE_SERVICES[role] if name not in sc.stopped for r in self.stack.replicas[name]
                 if r.process is not None and r.process.poll() is not None]
        if broken is None and exits:
            broken = Broken("a role process exited", exits[0])
        denials = acl_denials(self.admin, role)
        for name in reversed(services):
            self.stack.stop(name, grace=10)
        return Outcome(role, removed, sc.steps, broken, denials, exits, time.monotonic() - started)

    def _start(self, name: str, extra: list[str] | None, env: dict[str, str] | None) -> None:
        for replica in self.stack.replicas[name]:
            replica.log.write_text("")
        self.stack.start(name, extra_args=extra, extra_env=env)

    def _ready(self, replica: Replica, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while " ready." not in replica.text():
            if not replica.alive():
                raise Broken("worker start", f"the worker exited: {replica.text()[-600:]}")
            if time.monotonic() > deadline:
                raise Broken("worker start", f"not ready in {timeout:.0f} s: {replica.text()[-600:]}")
            time.sleep(0.05)

    def _ui_ready(self, sc: Scenario, timeout: float = 30.0) -> None:
        """The ui service's compose health check (/healthz: no credentials, no Redis)."""
        url = f"http://{self.stack.address('ui', UI_PORT)}/healthz"
        within("UI start", lambda: http_get(url)[0] == 200, timeout=timeout, alive=sc.alive("ui"))

    def close(self) -> None:
        self.admin.close()
        self.stack.stop()


def sweep_order(role: str, rules: list[str]) -> list[str]:
    return permissions(rules)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")

"""The Redis ACL roles of ops/redis/users.acl, for real (tests/ops/roles.py): a Redis started from
docker-compose.yml's arguments (redis.conf, the rendered ACL file, the passwords), and each role's
services run with that role's user (the run UI with actions as the worker, `--read-only` as the
monitor, Flower as flower).

- Each role does everything it is for, and Redis's ACL LOG records no denial.
- Each role is minimal: taking away one grant (a command, a key pattern or a channel) breaks it:
  a step of its scenario fails, one of its processes exits, its logs show an error, or its warm
  shutdown is refused a clean-up (in the full sweep, a refusal in ACL LOG that the role survives
  also shows the grant is used). The default run takes away a representative set (REPRESENTATIVE:
  a command run only inside taskloop's Lua scripts, script loading, a broker key, a store key
  pattern, a read-only key pattern, a pub/sub channel, a blocking command, a command of a rare
  path such as the hand-back of prefetched messages at shutdown); `pytest -m slow
  tests/ops/test_acl_roles.py` sweeps every grant of every role (about 140 runs; 30-45 minutes).
  TASKLOOP_ACL_SWEEP_REPORT=path appends each outcome as a JSON line (what broke, where, and what
  ACL LOG said); `python -m tests.ops.acl_report path` makes ops/redis/acl-sweep.md of it.
- A role process must log a refused command and keep going, not exit: the reconciler logs each
  failed pass; the worker's Celery process exits non-zero and its supervisor restarts it.
- The monitor reads the store and the queue but can write neither (`%R~`), even from a script,
  and cannot publish: `celery control shutdown` with its credentials is refused and the worker
  runs on (with the flower user's, the same command stops it: Flower's buttons can).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from taskloop.runtime.client import TaskLoop
from tests.ops.roles import ROLES, WORKER_ENV, Outcome, Roles, acl_lines, permissions, set_user, start_by_name
from tests.ops.stack import REPO

pytestmark = pytest.mark.timeout(300)

# Grants whose removal breaks the role quickly and that stand for the kinds of grant (see the
# module docstring); the slow sweep covers all of them. The monitor's +xread is a blocking read
# that only the read-only UI's live page runs (so the UI's part of the scenario is checked too).
# One grant of each kind runs in CI (a command, a key pattern, a read-only key pattern, a channel);
# the others of this list, with -m slow.
REPRESENTATIVE = {
    "worker": ["+persist", "+evalsha", "~taskloop*", "+brpop"],
    "client": ["~_kombu.binding.taskloop", "+blmove", "+zscan"],
    "monitor": ["%R~tl:*", "%R~taskloop*", "+xread"],
    "flower": ["&/0.celery.pidbox", "~celeryev.*"],
}
IN_CI = {("worker", "+persist"), ("client", "~_kombu.binding.taskloop"), ("monitor", "%R~tl:*"),
         ("flower", "&/0.celery.pidbox")}
# Grants kept for a path no scenario takes (the full sweep expects them to break nothing), each with
# that path.
UNEXERCISED = {
    ("monitor", "+ping"): "redis-py's health check of a connection idle for 15 s (connections/clients.py) in the "
                          "long-running exporter and read-only UI; no scenario idles that long",
}


def _all_grants() -> list[tuple[str, str]]:
    rules: dict[str, list[str]] = {}
    for line in (REPO / "ops" / "redis" / "users.acl").read_text().splitlines():
        words = line.split()
        if len(words) > 2 and words[0] == "user" and words[1] in ROLES:
            rules[words[1]] = words[2:]
    return [(role, grant) for role in ROLES for grant in permissions(rules[role])]


@pytest.fixture(scope="module")
def roles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Roles]:
    found = Roles(tmp_path_factory.mktemp("acl-roles"))
    try:
        yield found
    finally:
        found.close()


def _record(outcome: Outcome) -> None:
    print("\n" + outcome.describe())
    report = os.environ.get("TASKLOOP_ACL_SWEEP_REPORT")
    if report:
        with Path(report).open("a") as out:
            out.write(json.dumps({
                "role": outcome.role, "removed": outcome.removed, "steps_done": outcome.steps,
                "broken_at": outcome.broken.step if outcome.broken else None,
                "detail": outcome.broken.detail[:400] if outcome.broken else None,
                "acl_log": outcome.denials, "exited": outcome.exits, "seconds": round(outcome.seconds, 1)}) + "\n")


def test_representative_grants_exist() -> None:
    grants = set(_all_grants())
    for role, chosen in REPRESENTATIVE.items():
        for grant in chosen:
            assert (role, grant) in grants, f"{grant} is not in the {role} line of ops/redis/users.acl"


@pytest.mark.parametrize("role", ROLES)
def test_each_role_does_its_work_with_no_denial(roles: Roles, role: str) -> None:
    outcome = roles.run(role)
    _record(outcome)
    assert outcome.broken is None, outcome.describe()
    assert not outcome.denials, f"ACL LOG for {role}: {outcome.denials}"
    assert not outcome.exits, outcome.exits


@pytest.mark.parametrize(("role", "grant"), [pytest.param(r, g, marks=() if (r, g) in IN_CI else pytest.mark.slow)
                                             for r, gs in REPRESENTATIVE.items() for g in gs])
def test_taking_a_grant_away_breaks_the_role(roles: Roles, role: str, grant: str) -> None:
    outcome = roles.run(role, grant)
    _record(outcome)
    assert outcome.broken is not None, f"{role} still works without {grant}: the grant is not needed"
    assert outcome.denials, f"{role} broke without {grant}, but ACL LOG recorded no denial: {outcome.describe()}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("role", "grant"), [
    pytest.param(r, g, marks=pytest.mark.xfail(reason=UNEXERCISED[(r, g)], strict=False)) if (r, g) in UNEXERCISED
    else (r, g) for r, g in _all_grants()])
def test_every_grant_is_needed(roles: Roles, role: str, grant: str) -> None:
    outcome = roles.run(role, grant)
    _record(outcome)
    # needed: without it the role breaks, or Redis refuses it something it does (a path the role
    # takes and survives, such as kombu's unacked mutex released with GET by Flower)
    assert outcome.broken is not None or outcome.denials, \
        f"{role} still works without {grant}, and Redis refused it nothing: the grant is not needed"


def test_a_worker_refused_a_channel_keeps_running(roles: Roles) -> None:
    """A Celery worker stopped by a NOPERM exits non-zero (it used to exit 0), so `taskloop worker`
    restarts it with backoff and logs each restart: the role process keeps retrying."""
    outcome = roles.run("worker", "&/0.celery.pidbox")
    _record(outcome)
    assert not any(e.startswith("worker exited") for e in outcome.exits), outcome.exits
    log = roles.stack.replicas["worker"][0].text()
    assert "NoPermissionError" in log and "exited unexpectedly" in log, log[-2000:]


def test_the_reconciler_refused_a_key_keeps_running(roles: Roles) -> None:
    """`taskloop reconcile --every S` logs a failed pass and tries again (it used to exit)."""
    outcome = roles.run("worker", "~tl:*")
    _record(outcome)
    assert outcome.broken is not None
    assert not outcome.exits, outcome.exits
    reconciler = roles.stack.replicas["reconciler"][0].text()
    assert "reconcile pass failed" in reconciler and "does not let ACL user 'worker'" in reconciler, reconciler[-800:]


def test_acl_file_renders_every_user(roles: Roles) -> None:
    rules = acl_lines(roles.stack)
    assert set(rules) == {"default", *ROLES}
    for user, words in rules.items():
        assert "on" in words and any(w.startswith(">") and len(w) > 16 for w in words), user
        assert not any("${" in w for w in words), user


def test_the_monitor_reads_the_store_and_writes_none_of_it(roles: Roles) -> None:
    """The monitor is read-only (F5): its `tl:*` and `taskloop*` patterns are `%R~` and its commands
    are reads: every read the read-only UI, `taskloop status` and the exporter need works, and no
    write, publish or script reaches Redis (it used to hold PUBLISH on the pidbox, DEL and SET)."""
    admin = roles.admin
    admin.flushall()
    set_user(admin, "monitor", roles.rules["monitor"])  # as the file says (a test before may have taken a grant)
    run = "tl:{0123456789abcdef0123456789abcdef}"
    admin.hset(run, "f", "v")
    admin.xadd(f"{run}:events", {"t": "x"})
    admin.zadd("tl:runs", {"0123456789abcdef0123456789abcdef": 1})
    admin.sadd("tl:runs:workflows", "essay")
    admin.rpush("taskloop", "message")
    admin.sadd("_kombu.binding.taskloop", "binding")
    sha = admin.script_load("return redis.call('SET', KEYS[1], 'x')")
    monitor = redis.Redis.from_url(roles.stack.redis_url("monitor"), decode_responses=True)
    try:
        assert monitor.zrevrange("tl:runs", 0, -1) and monitor.zcard("tl:runs") == 1
        assert monitor.zscan("tl:runs", 0, match="0123*")[1]
        assert monitor.hscan(run, 0)[1] == {"f": "v"} and monitor.smembers("tl:runs:workflows") == {"essay"}
        assert monitor.xrange(f"{run}:events") and monitor.xread({f"{run}:events": "0-0"}, block=1)
        assert monitor.llen("taskloop") == 1
        writes: list[tuple[Any, ...]] = [
            ("SET", "tl:reconciler:last", "x"), ("DEL", run), ("DEL", "taskloop"), ("ZADD", "tl:runs", "2", "x"),
            ("ZREM", "tl:runs", "0123456789abcdef0123456789abcdef"), ("SADD", "tl:runs:workflows", "x"),
            ("SREM", "tl:runs:workflows", "essay"), ("HSET", run, "f", "w"), ("XADD", f"{run}:events", "*", "t", "y"),
            ("EVALSHA", sha, "1", "tl:x"), ("EVALSHA", sha, "1", "taskloop"), ("SCRIPT", "LOAD", "return 1"),
            ("PUBLISH", "/0.celery.pidbox", "x"), ("DEL", "_kombu.binding.taskloop"), ("SET", "unacked_mutex", "x"),
            ("LPUSH", "taskloop", "x"), ("BRPOP", "taskloop", "1")]
        for command in writes:
            with pytest.raises(redis.exceptions.ResponseError, match=r"(?i)no permissions|can't run"):
                monitor.execute_command(*command)
    finally:
        monitor.close()
    assert admin.hgetall(run) == {"f": "v"} and admin.zcard("tl:runs") == 1 and admin.llen("taskloop") == 1
    assert not admin.exists("tl:x") and admin.get("tl:reconciler:last") is None
    assert admin.smembers("_kombu.binding.taskloop") == {"binding"}


def _celery_control(roles: Roles, user: str, *command: str) -> subprocess.CompletedProcess[str]:
    _, env = roles.stack.command("flower")
    env["TASKLOOP_REDIS_URL"] = roles.stack.redis_url(user)
    return subprocess.run([sys.executable, "-m", "celery", "-A", "taskloop", *command, "--timeout", "3"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_the_monitor_cannot_stop_a_worker(roles: Roles) -> None:
    """F5, with a real worker: `celery control shutdown` with the monitor's credentials is refused
    (NOPERM on the publish), the worker runs on and finishes a run; the same command with the
    flower user's credentials does stop it, so the refusal is the monitor's rights, not a broken
    command. (Flower's user needs that right: Flower's own buttons shut down and resize workers.)"""
    admin = roles.admin
    admin.flushall()
    for user, rules in roles.rules.items():
        if user != "default":
            set_user(admin, user, rules)
    worker = roles.stack.replicas["worker"][0]
    roles._start("worker", ["--import", "tests.ops.flows"], WORKER_ENV)
    try:
        roles._ready(worker)
        refused = _celery_control(roles, "monitor", "control", "shutdown")
        assert refused.returncode != 0, refused.stdout + refused.stderr
        assert "NOPERM" in refused.stderr or "permission" in refused.stderr.lower(), refused.stderr[-1500:]
        time.sleep(3)  # a shutdown that got through stops the worker within a second
        assert worker.alive() and "Got shutdown from remote" not in worker.text()
        client = TaskLoop(roles.stack.redis_url())
        try:
            handle = start_by_name(client, "essay", {"topic": "after the refused shutdown"})
            assert handle.wait(timeout=60).status == "done"
        finally:
            client.close()
        stopped = _celery_control(roles, "flower", "control", "shutdown")
        # (a worker told to shut down does not reply: celery says "No nodes replied", exit 69)
        assert "NOPERM" not in stopped.stderr and "permission" not in stopped.stderr.lower(), stopped.stderr
        deadline = time.monotonic() + 30
        while "Got shutdown from remote" not in worker.text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "Got shutdown from remote" in worker.text(), worker.text()[-1500:]
        assert worker.process is not None and worker.process.wait(60) is not None
    finally:
        roles.stack.stop("worker", grace=10)

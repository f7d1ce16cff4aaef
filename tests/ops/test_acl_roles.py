"""The Redis ACL roles of ops/redis/users.acl, for real (tests/ops/roles.py): a Redis started from
docker-compose.yml's arguments (redis.conf, the rendered ACL file, the passwords), and each role's
services run with that role's user.

- Each role does everything it is for, and Redis's ACL LOG records no denial.
- Each role is minimal: taking away one grant (a command, a key pattern or a channel) breaks it:
  a step of its scenario fails, one of its processes exits, its logs show an error, or its warm
  shutdown is refused a clean-up. The default run takes away a representative set (REPRESENTATIVE:
  a command run only inside taskloop's Lua scripts, script loading, a broker key, a store key
  pattern, a read-only key pattern, a pub/sub channel, a blocking command, a command of a rare
  path such as the hand-back of prefetched messages at shutdown); `pytest -m slow
  tests/ops/test_acl_roles.py` sweeps every grant of every role (about 120 runs; 15-30 minutes).
  TASKLOOP_ACL_SWEEP_REPORT=path appends each outcome as a JSON line (what broke, where, and what
  ACL LOG said); `python -m tests.ops.acl_report path` makes ops/redis/acl-sweep.md of it.
- A role process must log a refused command and keep going, not exit: the reconciler logs each
  failed pass; the worker's Celery process exits non-zero and its supervisor restarts it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ops.roles import ROLES, Outcome, Roles, acl_lines, permissions
from tests.ops.stack import REPO

pytestmark = pytest.mark.timeout(300)

# Grants whose removal breaks the role quickly and that stand for the kinds of grant (see the
# module docstring); the slow sweep covers all of them.
REPRESENTATIVE = {
    "worker": ["+evalsha", "+persist", "~unacked", "+watch"],
    "client": ["+blmove", "+zscan", "~_kombu.binding.taskloop"],
    "monitor": ["&/0.celery.pidbox", "%R~tl:*", "+llen"],
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


@pytest.mark.parametrize(("role", "grant"), [(r, g) for r, gs in REPRESENTATIVE.items() for g in gs])
def test_taking_a_grant_away_breaks_the_role(roles: Roles, role: str, grant: str) -> None:
    outcome = roles.run(role, grant)
    _record(outcome)
    assert outcome.broken is not None, f"{role} still works without {grant}: the grant is not needed"
    assert outcome.denials, f"{role} broke without {grant}, but ACL LOG recorded no denial: {outcome.describe()}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("role", "grant"), _all_grants())
def test_every_grant_is_needed(roles: Roles, role: str, grant: str) -> None:
    outcome = roles.run(role, grant)
    _record(outcome)
    assert outcome.broken is not None, f"{role} still works without {grant}: the grant is not needed"


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

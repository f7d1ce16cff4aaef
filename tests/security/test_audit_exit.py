"""F8 of Security III: `.ci/audit.py` never reads as a clean audit when it checked nothing.

Before the fix it printed "0 of 84 dependencies audited" and exited 0, and a crash of pip-audit
exited 0 too. A stand-in `pip-audit` on PATH plays each case (a crash, a report whose packages
were all skipped, a clean report, a vulnerability); `--offline` is the one way to exit 0 on an
audit that could not reach its service, and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SKIPPED = {"dependencies": [{"name": "celery", "version": "5.7.0", "skip_reason": "Dependency not found on PyPI"}]}
CLEAN = {"dependencies": [{"name": "celery", "version": "5.7.0", "vulns": []}]}
VULNERABLE = {"dependencies": [{"name": "celery", "version": "5.7.0",
                                "vulns": [{"id": "PYSEC-0000-0", "fix_versions": ["9.9"]}]}]}


def _audit(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "bin" / "pip-audit"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, str(REPO / ".ci" / "audit.py"), *args], env=env, capture_output=True,
                          text=True, timeout=120)


def _report(found: dict[str, object]) -> str:
    return f"echo '{json.dumps(found)}'"


@pytest.mark.parametrize(("script", "code", "says"), [
    ("echo 'Traceback: boom' >&2; exit 1", 2, "NOT AUDITED — pip-audit failed"),
    (_report(SKIPPED), 2, "NOT AUDITED: 1 of 1 dependencies could not be checked"),
    (_report({"dependencies": []}), 2, "0 of 0 dependencies audited"),
    (_report(CLEAN), 0, "1 of 1 dependencies audited, 0 with known vulnerabilities"),
    (_report(VULNERABLE), 1, "PYSEC-0000-0"),
], ids=["crash", "all-skipped", "nothing", "clean", "vulnerable"])
def test_the_audit_fails_unless_it_audited_everything(tmp_path: Path, script: str, code: int, says: str) -> None:
    done = _audit(tmp_path, script)
    assert done.returncode == code, done.stdout + done.stderr
    assert says in done.stdout + done.stderr


def test_offline_says_so_and_still_fails_on_a_vulnerability(tmp_path: Path) -> None:
    done = _audit(tmp_path, _report(SKIPPED), "--offline")
    assert done.returncode == 0 and "NOT AUDITED" in done.stderr, done.stdout + done.stderr
    assert _audit(tmp_path, _report(VULNERABLE), "--offline").returncode == 1

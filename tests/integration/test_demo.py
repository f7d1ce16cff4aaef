"""`taskloop demo`, the README's first command: embedded Redis + a spawned worker, end to end."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_end_to_end_on_an_embedded_redis(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKLOOP_")}
    env["COLUMNS"] = "200"
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    done = subprocess.run([sys.executable, "-m", "taskloop", "demo"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "embedded redis-server on redis://127.0.0.1:" in out
    assert ":6379/" not in out  # never the machine's shared Redis
    assert "status done" in out and "fix = 12" in out
    assert "fix: rounds" in out and "rejected: Try again" in out and "accepted" in out
    assert not list((tmp_path / "tmp").glob("taskloop-demo-*"))  # its folder (the worker's log) is removed

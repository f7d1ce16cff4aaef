"""`taskloop reconcile --every S` as a sidecar keeps going through a Redis outage (it used to exit
on the first failed pass), and says so on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from taskloop.ops.embedded import RedisServer
from tests.conftest import REPO
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def test_the_reconcile_sidecar_survives_a_redis_outage(tmp_path: Path) -> None:
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with RedisServer(tmp_path) as server:
        env = {**os.environ, "PYTHONPATH": str(REPO), "TASKLOOP_REDIS_URL": server.url}
        env.pop("TASKLOOP_BROKER_URL", None)
        with out.open("w") as stdout, err.open("w") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "taskloop", "reconcile", "--every", "0.2"],
                                    env=env, stdout=stdout, stderr=stderr, cwd=REPO)
        try:
            wait_until(lambda: "examined" in out.read_text(), timeout=30, what="a first pass")
            server.kill()
            wait_until(lambda: "reconcile pass failed: cannot reach Redis" in err.read_text(), timeout=30,
                       what="a failed pass reported")
            time.sleep(1.0)
            assert proc.poll() is None, err.read_text()[-2000:]
            passes = out.read_text().count("examined")
            server.start()
            wait_until(lambda: out.read_text().count("examined") > passes, timeout=30, what="passes again")
            assert "Traceback" not in err.read_text()
        finally:
            proc.terminate()
            proc.wait(20)

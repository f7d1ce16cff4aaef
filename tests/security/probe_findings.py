"""Four findings of the security review, re-run against whatever taskloop is importable: prints
REPRODUCED (the bad behaviour is there) or FIXED for each. The tests that guard them are in
tests/connections/ (test_tls.py, test_auth.py, test_urls.py); they need modules the reviewed code
did not have, so this script (public API only) is what shows the findings on that code:

    python -m tests.security.probe_findings                      # this tree: all FIXED
    git worktree add /tmp/reviewed 4ef9a6c
    cp tests/servers.py /tmp/reviewed/tests/ && mkdir -p /tmp/reviewed/tests/security
    cp tests/security/probe_findings.py /tmp/reviewed/tests/security/
    cd /tmp/reviewed && python -m tests.security.probe_findings  # all REPRODUCED
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import redis

from taskloop.base.config import Settings
from taskloop.ops.embedded import free_port
from taskloop.runtime.celery_app import make_app
from taskloop.runtime.client import TaskLoop
from tests.servers import Node, base_args, make_tls_files, tls_node

tmp = Path(tempfile.mkdtemp())


def round_trip(url: str) -> None:
    app = make_app(Settings(redis_url=url, broker_url=url))
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=5)
        queue = conn.SimpleQueue("probe")
        queue.put({"x": 1})
        message = queue.get(timeout=5)
        message.ack()
        queue.close()


# 1. a bare rediss:// broker URL and a self-signed certificate
files = make_tls_files(tmp / "tls")
node = tls_node(tmp / "tls-redis", files).start()
try:
    round_trip(f"rediss://127.0.0.1:{node.port}/0")
    print("1 bare rediss:// broker: REPRODUCED (the broker accepted a certificate nobody verified)")
except Exception as exc:
    print(f"1 bare rediss:// broker: FIXED (refused: {type(exc).__name__}: {str(exc)[:120]})")
finally:
    node.stop()

# 2. ?password= in the broker URL, and in an error message
port = free_port()
plain = Node(tmp / "pw-redis", [*base_args(tmp / "pw-redis", port), "--requirepass", "s3cret-pw"], port,
             probe=lambda: redis.Redis(port=port, password="s3cret-pw", socket_timeout=1)).start()
try:
    try:
        round_trip(f"redis://127.0.0.1:{port}/0?password=s3cret-pw")
        print("2a ?password= broker: FIXED (the broker connects)")
    except Exception as exc:
        print(f"2a ?password= broker: REPRODUCED ({type(exc).__name__}: {str(exc)[:120]})")
    # 3. a wrong password: what the error says, and whether it shows the password
    client = TaskLoop(config=Settings(redis_url=f"redis://127.0.0.1:{port}/0?password=wr0ng-pw",
                                      broker_url=f"redis://127.0.0.1:{port}/0?password=s3cret-pw"))
    try:
        client.inspect("probe-run")
        print("3 wrong password: no error?")
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        leak = "wr0ng-pw" in text
        unreachable = "cannot reach" in text
        print(f"2b password in the error message: {'REPRODUCED' if leak else 'FIXED'}")
        print(f"3 auth failure described as 'cannot reach Redis': {'REPRODUCED' if unreachable else 'FIXED'}"
              f" ({text[:160]})")
finally:
    plain.stop()

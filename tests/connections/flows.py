"""The integration flows (tests.integration.flows, control_flows) for a worker whose store is a
Sentinel, a Cluster or TLS: their callbacks record into TASKLOOP_REDIS_URL through a client made
by taskloop.connections (redis.Redis.from_url does not read sentinel:// or redis+cluster://).
Also a loop slow enough to be caught mid-run by a failover."""

from __future__ import annotations

import os
import time
from typing import Any

import taskloop as tl
from taskloop.connections import clients
from tests.integration import control_flows, flows

_client: Any = None
_client_pid: int | None = None


def _redis() -> Any:
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        _client = clients.store_client(os.environ["TASKLOOP_REDIS_URL"], retries=10)
        _client_pid = os.getpid()
    return _client


flows._redis = _redis  # type: ignore[assignment]
control_flows._redis = _redis  # type: ignore[assignment]


def _slow_attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
    time.sleep(ctx.input.get("pause_s", 0.05))
    return ctx.round


def _slow_check(ctx: tl.LoopContext, candidate: int) -> dict[str, Any]:
    time.sleep(ctx.input.get("pause_s", 0.05))
    return {"done": candidate >= ctx.input["rounds"], "feedback": f"round {candidate}"}


slow_loop = tl.define_workflow("slow-loop", version="1", tasks=[
    tl.define_loop_task("crawl", max_rounds=50, attempt=_slow_attempt, check=_slow_check),
])


def _held(ctx: tl.TaskContext) -> list[float]:
    """Hold for a moment; the output says when (a limit's test checks that no two overlapped)."""
    began = time.time()
    time.sleep(float(ctx.input.get("hold_s", 0.3)))
    return [began, time.time()]


# Fleet limits on a Cluster (each limit in a slot of its own): one without a key, taken in the
# full path's calls (never inside begin.lua, whose keys are the run's slot), and one with a key.
one_at_a_time = tl.Concurrency("cluster-one", limit=1)
per_doc = tl.Concurrency("cluster-doc", limit=1, key=lambda ctx: ctx.input["doc"])
held_unkeyed = tl.define_workflow("cluster-held", version="1",
                                  tasks=[tl.define_task("hold", _held, limits=[one_at_a_time])])
held_keyed = tl.define_workflow("cluster-held-keyed", version="1",
                                tasks=[tl.define_task("hold", _held, limits=[per_doc])])

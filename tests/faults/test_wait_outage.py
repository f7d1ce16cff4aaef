"""wait() rides out a Redis restart: it says so, keeps its place, and returns the result."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskloop.runtime.models import RunResult
from tests.faults import flows
from tests.faults.harness import Cluster

pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, 0).start(workers=("o1",))
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.parametrize("observed", [False, True], ids=["end-marker", "event-stream"])
def test_a_redis_restart_during_wait_does_not_fail_the_wait(cluster: Cluster, observed: bool) -> None:
    assert cluster.client is not None
    client = cluster.client
    run = client.start(flows.grind, input={"hold_s": 0.8, "accept_round": 3})
    notices: list[str] = []
    seen: list[str] = []
    outcome: list[RunResult | BaseException] = []

    def wait() -> None:
        try:
            on_event = (lambda e: seen.append(f"{e.type}:{e.round}:{e.phase}")) if observed else None
            outcome.append(client.wait(run.run_id, timeout=120, on_event=on_event, on_notice=notices.append))
        except BaseException as exc:  # reported below
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(1.5)
    cluster.redis.kill()
    time.sleep(2.0)
    cluster.redis.start()
    waiter.join(120)
    [result] = outcome
    assert isinstance(result, RunResult), result
    assert result.status == "done" and result.values["work"]["round"] == 3
    assert any(n.startswith("Redis unreachable, retrying for up to 30s") for n in notices), notices
    assert any(n.startswith("Redis reachable again after") for n in notices), notices
    if observed:  # the wait kept its place in the event stream: no event twice, none missing
        phases = [s for s in seen if s.startswith("phase:")]
        assert len(phases) == len(set(phases)) and "phase:3:complete" in phases
    cluster.assert_fleet_whole()  # the worker rode out the restart too

"""A SIGKILL in the round a fork runs (SPEC §9): the killed attempt is replayed in the fork, the
fork ends right, and each phase has exactly one outcome (the ledger balances); the original is
not touched. At the shipped defaults."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import Cluster
from tests.integration import fork_flows as ff
from tests.integration.flows import recorded
from tests.ledger import assert_balanced
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, 0, imports=("tests.faults.flows", "tests.integration.flows",
                                      "tests.integration.fork_flows")).start(workers=("k1", "k2"))
    try:
        yield c
    finally:
        c.stop()


def test_a_worker_killed_in_a_forked_round_is_replayed_and_commits_once(cluster: Cluster) -> None:
    assert cluster.client is not None and cluster.probe is not None
    client, probe = cluster.client, cluster.probe
    pace_key = f"test:pace:{os.getpid()}:{id(cluster)}"
    original = client.start(ff.essay, {"accept_at": 3, "pace_key": pace_key})
    assert original.wait(timeout=60).status == "done"
    before = client.events(original.run_id)
    # When the fork's round 2 attempt (slow now) is killed in its pool process
    probe.set(pace_key, "1.0")
    fork = client.fork(original.run_id, "draft", 2, "shorter")
    started = wait_until(lambda: recorded(probe, fork.run_id, "attempt_pids"), timeout=60, what="round 2 to start")
    os.kill(started[0]["pid"], signal.SIGKILL)
    result = fork.wait(timeout=120)
    # Then the attempt ran again, and the fork ended as one clean run would
    assert result.status == "done" and result.values["draft"] == "draft 2 after shorter"
    assert [a["round"] for a in recorded(probe, fork.run_id, "attempt_pids")] == [2, 2]
    events = client.events(fork.run_id)
    assert_balanced(events)
    phases = [(e.key, e.round, e.phase) for e in events if e.type == "phase" and e.key == "draft"]
    assert phases == [("draft", 2, "attempt"), ("draft", 2, "check"), ("draft", 2, "complete")]
    assert [e.type for e in events].count("lost") == 1
    assert client.events(original.run_id) == before  # the original is never changed
    cluster.assert_fleet_whole()

"""A SIGKILL in the middle of a flow loop or a graph workflow loses nothing: the killed phase is
replayed where it was (iteration 4 resumes at iteration 4), and the run ends as it should."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import Cluster
from tests.integration import graph_flows as gf
from tests.integration.flows import recorded
from tests.ledger import assert_balanced
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, 0, imports=("tests.faults.flows", "tests.integration.flows",
                                      "tests.integration.graph_flows")).start(workers=("g1", "g2"))
    try:
        yield c
    finally:
        c.stop()


def test_a_worker_killed_in_iteration_4_resumes_at_iteration_4(cluster: Cluster) -> None:
    assert cluster.client is not None and cluster.probe is not None
    # Given a flow loop whose body takes a while, ten iterations long
    run = cluster.client.start(gf.refine, {"hold_s": 0.6, "goal": 300})
    # When the process running iteration 4's body is killed
    fourth = wait_until(lambda: [b for b in recorded(cluster.probe, run.run_id, "bodies") if b["iteration"] == 4],
                        timeout=60, what="iteration 4 to start")
    os.kill(fourth[0]["pid"], signal.SIGKILL)
    result = run.wait(timeout=120)
    # Then the loop went on from iteration 4 (replayed once), not from 1, and ended right
    assert result.status == "done" and result.values["improve"]["quality"] == 300
    iterations = [b["iteration"] for b in recorded(cluster.probe, run.run_id, "bodies")]
    assert iterations == [1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 10], iterations
    qualities = [b["quality"] for b in recorded(cluster.probe, run.run_id, "bodies")]
    assert qualities[3] == qualities[4] == 90  # the replay started from iteration 3's state
    assert_balanced(cluster.client.events(run.run_id))
    cluster.assert_fleet_whole()  # the same workers, their pools whole again, still consuming


def test_a_sigkill_mid_graph_loses_nothing(cluster: Cluster) -> None:
    assert cluster.client is not None and cluster.probe is not None
    run = cluster.client.start(gf.revision, {"approve_in": None, "hold_s": 1.0})
    second = wait_until(lambda: [r for r in recorded(cluster.probe, run.run_id, "reviews") if r["round"] == 2],
                        timeout=60, what="the second review to start")
    os.kill(second[0]["pid"], signal.SIGKILL)
    result = run.wait(timeout=120)
    assert (result.status, result.termination_code) == ("done", None)
    view = cluster.client.inspect(run.run_id)
    assert view.state == {"rounds": 2, "approved": False}
    assert sorted(view.tasks) == ["review@1", "review@2"]  # the replay is the same action, not a third one
    assert [r["round"] for r in recorded(cluster.probe, run.run_id, "reviews")] == [1, 2, 2]
    events = cluster.client.events(run.run_id)
    assert len([e for e in events if e.type == "transition"]) == 2  # each outcome applied once
    assert_balanced(events)
    cluster.assert_fleet_whole()

"""Who is live and what the live workers hold, from their heartbeats alone (runtime/fleet.py
``holdings``), the silent-worker test of a redelivery (worker/recovery/executions.py ``worker_silent``) and
what a heartbeat says a held request names (worker/liveness/presence.py ``held_message``): pure logic, no
Redis."""

from __future__ import annotations

import json

from taskloop.core.records import TaskRecord
from taskloop.core.states import Phase, Slot, TaskStatus
from taskloop.define.tasks import TaskKind
from taskloop.runtime.fleet import HEARTBEAT_S, HOLD_MARGIN_S, ONLINE_WITHIN_S, Held, WorkerInfo, holdings, node_of
from taskloop.worker.liveness.presence import held_message
from taskloop.worker.recovery.executions import worker_silent


def phase(run_id: str, token: int = 1) -> Held:
    return Held(task="taskloop.attempt", run_id=run_id, key="work", token=token)


def beat(node: str, at: float, *held: Held) -> WorkerInfo:
    return WorkerInfo(node=node, processes=2, at=at, messages=list(held))


def test_no_worker_means_nothing_is_known_held() -> None:
    hold = holdings({}, now=100.0)
    assert hold.before is None and not hold.phases and not hold.silent


def test_a_worker_silent_while_the_others_go_on_is_gone_and_its_messages_are_nobodys() -> None:
    beats = {"a": beat("a", 100.0, phase("m1")), "b": beat("b", 100.0 - ONLINE_WITHIN_S - 0.5, phase("m2"))}
    hold = holdings(beats, now=101.0)
    assert hold.silent == {"b"}
    assert hold.phases == {("m1", "work", 1)}  # m2 is held by nobody live
    assert hold.before == 100.0 - HOLD_MARGIN_S  # the oldest live heartbeat, less the margin


def test_a_worker_a_little_behind_is_still_live() -> None:
    beats = {"a": beat("a", 100.0, phase("m1")), "b": beat("b", 100.0 - ONLINE_WITHIN_S + 0.5, phase("m2"))}
    hold = holdings(beats, now=100.5)
    assert not hold.silent and hold.phases == {("m1", "work", 1), ("m2", "work", 1)}
    # a message b took after its last heartbeat is not in that heartbeat: the cut is before it
    assert hold.before == beats["b"].at - HOLD_MARGIN_S  # type: ignore[operator]


def test_after_an_outage_of_the_store_every_heartbeat_is_old_and_nobody_is_gone() -> None:
    # Given heartbeats all written before a 60 s outage, read just after it
    beats = {"a": beat("a", 100.0, phase("m1")), "b": beat("b", 99.0, phase("m2"))}
    hold = holdings(beats, now=160.0)
    # Then nobody fell silent while the others went on, and nothing may be taken back yet
    assert not hold.silent
    assert hold.before is None


def test_the_fleet_is_settled_again_after_one_round_of_heartbeats() -> None:
    beats = {"a": beat("a", 160.0), "b": beat("b", 159.0)}
    assert holdings(beats, now=160.0 + HEARTBEAT_S).before == 159.0 - HOLD_MARGIN_S


def record(worker: str | None, began_at: float | None) -> TaskRecord:
    return TaskRecord(key="work", kind=TaskKind.LOOP, limit=3, status=TaskStatus.ACTIVE, phase=Phase.ATTEMPT,
                      slot=Slot.RUNNING, round=1, token=2, worker=worker, began_at=began_at)


def test_node_of_an_execution() -> None:
    assert node_of("w1@host/123") == "w1@host"
    assert node_of("w1@host") == "w1@host"
    assert node_of(None) is None


def test_a_redelivery_of_a_phase_whose_worker_fell_silent_is_a_lost_execution() -> None:
    beats = {"a@h": beat("a@h", 100.0), "b@h": beat("b@h", 80.0)}
    assert worker_silent(record("b@h/7", 79.0), beats, now=100.5)
    assert not worker_silent(record("a@h/7", 99.0), beats, now=100.5)


def test_a_worker_without_a_heartbeat_counts_as_silent_only_once_it_had_time_to_write_one() -> None:
    beats = {"a@h": beat("a@h", 100.0)}
    assert not worker_silent(record("new@h/1", 99.0), beats, now=100.0)
    assert worker_silent(record("gone@h/1", 100.0 - ONLINE_WITHIN_S - 1), beats, now=100.0)
    assert not worker_silent(record(None, None), beats, now=100.0)


class Request:
    """A stand-in for Celery's Request: what the heartbeat reads of one."""

    def __init__(self, task: str, args: list, worker_pid: int | None = None) -> None:
        self.type, self.args, self.worker_pid = task, args, worker_pid


def test_what_a_heartbeat_says_each_held_request_names() -> None:
    found = held_message(Request("taskloop.check", ["r1", "draft", 2, 7], 31), since=5.0)
    assert found == Held(task="taskloop.check", run_id="r1", key="draft", token=7, since=5.0, pid=31)
    waiting = held_message(Request("taskloop.run", ["r1", "k", 1, 3], 31), since=None)
    assert waiting is not None and waiting.pid is None  # prefetched: no process runs it yet
    assert held_message(Request("taskloop.dispatch", ["r2", ["a", "b"]]), None) == \
        Held(task="taskloop.dispatch", run_id="r2", keys=["a", "b"])
    assert held_message(Request("taskloop.start", ["r3"]), None) == Held(task="taskloop.start", run_id="r3")
    for other in (Request("celery.chain", ["r1", "k", 1, 3]), Request("taskloop.check", ["r1", "k", 1, "3"]),
                  Request("taskloop.check", ["r1", "k"]), Request("taskloop.start", [], None)):
        assert held_message(other, None) is None
    # a dispatch message's holder covers its run in a census
    hold = holdings({"a": beat("a", 100.0, held_message(Request("taskloop.dispatch", ["r2", ["a"]]), None))},
                    now=100.0)
    assert hold.dispatching == {"r2"}


def test_the_census_reads_phase_and_dispatch_messages_and_nothing_else() -> None:
    import base64

    from taskloop.worker.recovery.census import read_message

    def message(task: str, args: list, encoded: bool = True) -> str:
        body = json.dumps([args, {}, {}])
        payload = {"body": base64.b64encode(body.encode()).decode() if encoded else body,
                   "headers": {"id": "x", "task": task},
                   "properties": {"body_encoding": "base64"} if encoded else {}}
        return json.dumps([payload, "", "taskloop"])

    found = read_message(message("taskloop.check", ["r1", "draft", 2, 7]))
    assert found is not None and (found.run_id, found.key, found.token) == ("r1", "draft", 7)
    assert read_message(json.loads(message("taskloop.run", ["r1", "k", 1, 3]))[0] and
                        json.dumps(json.loads(message("taskloop.run", ["r1", "k", 1, 3]))[0])) is not None
    fanout = read_message(message("taskloop.dispatch", ["r2", ["a", "b"]]))
    assert fanout is not None and fanout.run_id == "r2" and fanout.keys == ("a", "b") and fanout.key is None
    for other in (message("celery.chain", ["r1", "k", 1, 3]), message("taskloop.check", ["r1", "k", 1, "3"]),
                  message("taskloop.check", ["r1", "k"]), "not json", json.dumps([{"headers": {}}])):
        assert read_message(other) is None

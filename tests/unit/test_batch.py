"""The program a Batch builds for cas.lua (taskloop/core/batch.py): guards, writes, events in one
stream entry, leases, broker pushes named by position, the finishing part ``z`` and the global
indexes. Pure: nothing here talks to Redis."""

from __future__ import annotations

import json
from typing import Any

import pytest

from taskloop.core import fields as fld
from taskloop.core.batch import Batch, Index, Listed, Writes
from taskloop.core.events import Event, entry_fields

NOW = 1000.0


def _program(batch: Batch) -> dict[str, Any]:
    """The decoded ARGV[1] of the batch."""
    argv = batch.argv()
    assert len(argv) == 1
    decoded = json.loads(argv[0])
    assert isinstance(decoded, dict)
    return decoded


def test_an_empty_batch_is_no_guards_and_no_writes() -> None:
    assert Writes().program() == {}
    assert _program(Batch("r1")) == {"g": [], "w": {}}


def test_each_guard_kind_has_its_own_shape_and_a_label() -> None:
    batch = (Batch("r1")
             .expect("t:a", '{"x":1}', "task:a")
             .expect(fld.F_WORKFLOW, None)
             .exists(fld.F_STATUS, "run exists")
             .one_of(fld.F_STATUS, ["pending", "running"])
             .cap(fld.usage_field("attempts"), 10, 2, "budget:attempts"))
    assert batch.guards == [
        ["eq", "t:a", '{"x":1}'],
        ["nx", fld.F_WORKFLOW],
        ["ex", fld.F_STATUS],
        ["in", fld.F_STATUS, ["pending", "running"]],
        ["cap", "u:attempts", 10, 2],
    ]
    # a guard without a label is reported under its field's name
    assert batch.labels == ["task:a", fld.F_WORKFLOW, "run exists", fld.F_STATUS, "budget:attempts"]
    assert _program(batch)["g"] == batch.guards


def test_an_empty_string_is_a_value_to_compare_not_an_absence() -> None:
    assert Batch("r1").expect("f", "").guards == [["eq", "f", ""]]


def test_hash_writes_are_flat_pairs_deletes_and_increments() -> None:
    batch = Batch("r1").set("a", "1").set("b", "two").set("a", "3").delete("c").delete("d")
    batch.incr("n", 2).incr("n", 3).incr("zero", 0)
    writes = _program(batch)["w"]
    assert writes["h"] == ["a", "3", "b", "two"]  # a field set twice keeps its last value, in first-set order
    assert writes["d"] == ["c", "d"]
    assert writes["i"] == [["n", 5]]
    assert "zero" not in batch.hincr  # an increment of 0 is no write at all


def test_increments_that_cancel_out_are_left_out_of_the_program() -> None:
    batch = Batch("r1").incr(fld.F_ACTIVE, 1).incr(fld.F_ACTIVE, -1)
    assert batch.hincr == {fld.F_ACTIVE: 0}
    assert _program(batch)["w"] == {"i": []}  # no HINCRBY by 0 is sent


def test_all_the_events_of_a_write_go_into_one_stream_entry() -> None:
    first = Event(type="phase", key="a", round=1, phase="attempt", at=NOW)
    second = Event(type="task", key="a", at=NOW, data={"status": "done"})
    writes = _program(Batch("r1").event(first).event(second))["w"]
    assert len(writes["x"]) == 1  # one XADD entry, whatever the number of events
    name, payload = writes["x"][0]
    assert [name, payload] == entry_fields([first, second])
    assert name == "e"
    assert json.loads(payload) == [{"t": "phase", "k": "a", "r": 1, "p": "attempt", "at": NOW},
                                   {"t": "task", "k": "a", "at": NOW, "d": {"status": "done"}}]


def test_leases_are_score_member_pairs_and_a_dropped_lease_is_removed() -> None:
    batch = Batch("r1").lease("a", 1030.0).lease("b", 1300.5).lease("c", 1100.0)
    batch.lease("c", None)  # taken back in the same write: not added, removed
    writes = _program(batch)["w"]
    assert writes["l"] == [1030.0, "a", 1300.5, "b"]
    assert writes["r"] == ["c"]


def test_end_marker_ttl_and_revive_flags() -> None:
    writes = Writes()
    writes.end_marker = "done"
    writes.ttl = 3600
    assert writes.program() == {"e": "done", "t": 3600}
    writes.ttl_leases = True
    writes.revive = True
    assert writes.program() == {"e": "done", "t": 3600, "tl": True, "p": True}


def test_ttl_leases_means_nothing_without_a_ttl() -> None:
    writes = Writes()
    writes.ttl_leases = True
    assert writes.program() == {}


def test_pushes_name_their_broker_list_by_position_from_one() -> None:
    batch = Batch("r1")
    batch.push("lpush", "celery", b"message-1")
    batch.push("lpush", "llm", "message-2")
    batch.push("pexpire", "celery", 5000)
    assert batch.broker_keys == ["celery", "llm"]  # each list once, in first-use order
    program = _program(batch)
    # cas.lua reads list n as KEYS[4 + n]: the run's four keys come first
    assert program["q"] == [["lpush", 1, "message-1"], ["lpush", 2, "message-2"], ["pexpire", 1, 5000]]


def test_a_batch_without_pushes_has_no_q_part() -> None:
    assert "q" not in _program(Batch("r1").set("a", "1"))


def test_the_final_part_carries_the_open_counter_field_and_its_writes() -> None:
    # Given a batch that ends one task, with the writes that end the run if it was the last
    batch = Batch("r1").set(fld.task_field("a"), "{}")
    batch.open_delta = -1
    batch.final.hset[fld.F_STATUS] = "done"
    batch.final.events.append(Event(type="run.finished", at=NOW, data={"status": "done", "termination": None}))
    batch.final.end_marker = "done"
    batch.final.ttl = 60
    # When it is turned into the program
    program = _program(batch)
    # Then "z" names the counter, the delta and the finishing writes; the step's own writes stay in "w"
    assert program["z"]["n"] == -1
    assert program["z"]["f"] == fld.F_OPEN == "n:open"
    final = program["z"]["w"]
    assert final["h"] == [fld.F_STATUS, "done"] and final["e"] == "done" and final["t"] == 60
    assert json.loads(final["x"][0][1])[0]["t"] == "run.finished"
    assert program["w"] == {"h": [fld.task_field("a"), "{}"]}


def test_no_final_part_without_an_open_delta() -> None:
    batch = Batch("r1")
    batch.final.hset[fld.F_STATUS] = "done"  # prepared, but nothing ends a task
    assert "z" not in _program(batch)


def test_indexes_are_kept_for_the_store_and_not_sent_to_the_script() -> None:
    batch = Batch("r1").index(Index.LIVE, "r1", NOW + 30)
    assert batch.indexes == [(Index.LIVE, "r1", NOW + 30)]
    assert _program(batch) == {"g": [], "w": {}}  # written outside the script (another slot)
    assert {index.value for index in Index} == {"live"}


def _list_key(entry: Listed) -> str:
    return f"L:{entry.workflow}:{entry.status}"


def test_run_lists_go_into_the_script_after_the_broker_lists_when_the_store_lets_them() -> None:
    batch = Batch("r1").push("lpush", "celery", "m")
    batch.list_run("wf", "running", NOW, new=True)
    batch.final.list_run("wf", "done", NOW, was="running")
    keys = batch.list_keys(_list_key)
    # the workflow's status lists and the lists of every status: no status list across workflows
    assert keys == ["L:wf:running", "L:None:None", "L:wf:None", "L:wf:done"]
    program = json.loads(batch.argv(_list_key)[0])
    # positions count from the first extra key: the broker list is KEYS[5] (1), the lists follow
    assert program["w"]["k"] == [[2, NOW], [3, NOW], [4, NOW]]
    assert "z" not in program  # no open delta: the finishing part is not sent
    batch.open_delta = -1
    program = json.loads(batch.argv(_list_key)[0])
    assert program["z"]["w"]["k"] == [[2, False], [5, NOW]]  # leave running, enter done
    # without a key function (a Cluster) the lists stay out of the script, for the store to write after
    assert "k" not in json.loads(batch.argv()[0])["w"]
    assert batch.all_listed(finished=False) == batch.listed and len(batch.all_listed()) == 5


def test_a_run_deleted_as_it_ends_leaves_every_list() -> None:
    writes = Writes()
    writes.unlist_run("wf", "running")
    assert {(e.workflow, e.status) for e in writes.listed} == {("wf", "running"), (None, None), ("wf", None)}
    assert all(e.score is None for e in writes.listed)


def test_final_events_go_into_their_own_field_of_the_entry() -> None:
    batch = Batch("r1").event(Event(type="phase", key="a", at=NOW))
    batch.final.events.append(Event(type="run.finished", at=NOW))
    batch.open_delta = -1
    program = _program(batch)
    assert program["w"]["x"][0][0] == "e" and program["z"]["w"]["x"][0][0] == "z"


def test_the_program_is_compact_json_that_keeps_non_ascii_text() -> None:
    argv = Batch("r1").set("v:a", '"héllo ✓"').argv()[0]
    assert " " not in argv.replace("héllo ✓", "")  # compact separators
    assert "héllo ✓" in argv  # not \u-escaped: cas.lua stores the bytes as given


def test_every_builder_returns_the_batch_for_chaining() -> None:
    batch = Batch("r1")
    results = [batch.expect("a", None), batch.exists("a"), batch.one_of("a", ["x"]), batch.cap("a", 1, 1, "c"),
               batch.set("a", "1"), batch.delete("b"), batch.incr("c", 1),
               batch.event(Event(type="task", at=NOW)), batch.lease("k", NOW), batch.push("lpush", "q", "m"),
               batch.index(Index.LIVE, "r1", NOW)]
    assert all(result is batch for result in results)


@pytest.mark.parametrize("delta", [-3, 2])
def test_the_final_part_is_sent_for_any_nonzero_delta(delta: int) -> None:
    batch = Batch("r1")
    batch.open_delta = delta
    assert _program(batch)["z"] == {"n": delta, "f": fld.F_OPEN, "w": {}}

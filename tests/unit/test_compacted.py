"""The compact record of a finished run (taskloop/store/compacted.py): what it keeps, and that it
reads back exactly (pure: no Redis; the store's side is in tests/integration/test_compaction.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taskloop.core import fields as fld
from taskloop.store.compacted import FORMAT, decode, encode, live_only


def test_a_record_reads_back_exactly() -> None:
    fields = {"t:fix": json.dumps({"key": "fix", "round": 3}), "o:fix:1": "1", "c:fix:1": '{"done":false}',
              "input": '{"topic":"é \\u2028 ✓"}'}
    entries = [("1796184058200-0", {"e": '[{"t":"run.started"}]'}),
               ("1796184058292-0", {"e": "[]", "z": '[{"t":"run.finished"}]'})]
    record = decode(encode(fields, entries))
    assert record.fields == fields
    assert record.entries == entries


@given(st.dictionaries(st.text(min_size=1, max_size=20), st.text(max_size=200), max_size=30),
       st.lists(st.tuples(st.from_regex(r"\A[0-9]{1,13}-[0-9]{1,3}\Z"),
                          st.dictionaries(st.sampled_from(["e", "z"]), st.text(max_size=100))), max_size=20))
def test_any_fields_and_entries_read_back(fields: dict[str, str], entries: list[tuple[str, dict[str, str]]]) -> None:
    record = decode(encode(fields, entries))
    assert record.fields == fields and record.entries == entries


def test_a_small_loop_compresses_well() -> None:
    check = json.dumps({"done": False, "feedback": "not yet: the score is below 90, tighten the argument"})
    fields = {**{f"c:refine:{n}": check for n in (1, 2)}, "c:refine:3": '{"done":true,"feedback":null}',
              **{f"o:refine:{n}": str(n) for n in (1, 2, 3)}, "v:refine": "3", "input": '{"n":29}',
              "t:refine": json.dumps({"key": "refine", "kind": "loop", "limit": 3, "status": "done",
                                      "phase": "complete", "round": 3, "token": 13, "attempts": 3, "execs": 1})}
    entries = [(f"17961840582{n:02d}-0", {"e": json.dumps([{"t": "phase", "k": "refine", "r": n, "p": "check"}])})
               for n in range(7)]
    text = encode(fields, entries)
    assert text.startswith(FORMAT.decode())
    assert len(text) < len(json.dumps({"f": fields, "e": entries})) / 2


def test_a_record_of_another_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="not a compact record of layout"):
        decode("9" + encode({}, [])[1:])


def test_what_only_a_live_run_needs_is_not_kept() -> None:
    assert live_only(fld.F_OPEN) and live_only(fld.begin_field("fix")) and live_only(fld.throttle_field("fix"))
    for kept in (fld.task_field("fix"), fld.worker_field("fix"), fld.value_field("fix"), fld.F_INPUT, fld.F_STATUS):
        assert not live_only(kept)

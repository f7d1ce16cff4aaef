"""Redis key and hash-field names (taskloop/store/keys.py, taskloop/core/fields.py): every key of a
run is hash-tagged with its run id, so one run lives in one cluster slot; field names round-trip
and never collide. Pure."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from taskloop.base import names
from taskloop.core import fields as fld
from taskloop.core.batch import Index, Listed
from taskloop.store import keys as k

RUN_IDS = ["r1", "0f3c9a2e4b5d4e6f8a7b9c0d1e2f3a4b", "order:2026-11:42", "a.b_c-d", "Z" * 200]


def _slot(key: str) -> int:
    return int(key_slot(key.encode()))


@pytest.mark.parametrize("run_id", RUN_IDS)
def test_every_key_of_a_run_is_in_the_slot_of_its_run_id(run_id: str) -> None:
    keys = k.RunKeys.of(run_id).all()
    assert len(keys) == 4
    assert {_slot(key) for key in keys} == {_slot(run_id)}  # the {run_id} tag decides the slot
    assert all(f"{{{run_id}}}" in key for key in keys)


def test_the_keys_of_a_run_in_script_order() -> None:
    keys = k.RunKeys.of("r1")
    assert (keys.run, keys.events, keys.end, keys.leases) == ("tl:{r1}", "tl:{r1}:events", "tl:{r1}:end",
                                                               "tl:{r1}:leases")
    assert keys.all() == [keys.run, keys.events, keys.end, keys.leases]  # KEYS[1..4] of cas.lua


def test_runs_with_different_ids_get_different_keys_and_usually_different_slots() -> None:
    a, b = k.RunKeys.of("run-a"), k.RunKeys.of("run-b")
    assert not set(a.all()) & set(b.all())
    slots = {_slot(k.RunKeys.of(f"run-{n}").run) for n in range(50)}
    assert len(slots) > 40  # runs spread over the cluster, not all in one slot


def test_a_run_id_that_looks_like_a_prefix_of_another_does_not_share_its_keys() -> None:
    short, long = k.RunKeys.of("r1"), k.RunKeys.of("r1:events")
    assert short.events != long.run  # "tl:{r1}:events" vs "tl:{r1:events}"
    assert not set(short.all()) & set(long.all())


def test_global_keys_are_not_tagged_with_a_run() -> None:
    for key in (k.RUNS_INDEX, k.LIVE_INDEX, k.STATS, k.RECONCILER_LOCK, k.RECONCILER_LAST, k.SERVER_SEEN):
        assert key.startswith(f"{k.PREFIX}:") and "{" not in key
    assert len({k.RUNS_INDEX, k.LIVE_INDEX, k.STATS, k.RECONCILER_LOCK, k.RECONCILER_LAST, k.SERVER_SEEN}) == 6


def test_index_keys_cover_every_index() -> None:
    assert set(k.INDEX_KEYS) == set(Index)
    assert k.INDEX_KEYS[Index.LIVE] == k.LIVE_INDEX == "tl:live"
    assert len(set(k.INDEX_KEYS.values())) == len(Index)


def test_run_lists_have_one_key_per_shape_and_the_list_of_every_run_is_the_runs_index() -> None:
    assert k.run_list(Listed(None, None, 1.0)) == k.RUNS_INDEX == "tl:runs"
    with pytest.raises(ValueError, match="merge the workflows' lists"):  # no such list: a page merges them
        k.run_list(Listed(None, "done", None))
    assert k.run_list(Listed("report", None, None)) == "tl:runs:w:report"
    assert k.run_list(Listed("report", "done", None)) == "tl:runs:w:report:s:done"
    # a workflow name holds no ':', so a name that looks like a shape cannot be written
    assert not names.is_name("report:s:done")
    assert k.LISTED_WORKFLOWS == "tl:runs:workflows"


def test_cache_keys_are_global_per_fingerprint() -> None:
    fingerprint = "ab" * 32
    assert k.cache_key(fingerprint) == f"tl:cache:{fingerprint}"
    assert k.cache_key(fingerprint) != k.cache_key("cd" * 32)


# --- fields -----------------------------------------------------------------------------------------

TASK_KEYS = ["a", "fetch", "review@2", "x.y_z-1", "open", "A9"]


@pytest.mark.parametrize("key", TASK_KEYS)
def test_record_fields_are_the_json_then_the_execution(key: str) -> None:
    assert fld.record_fields(key) == (f"t:{key}", f"w:{key}", f"bt:{key}", f"dl:{key}")
    assert fld.record_fields(key)[0] == fld.task_field(key)
    assert fld.record_fields(key)[1:] == (fld.worker_field(key), fld.began_field(key), fld.deadline_field(key))


@pytest.mark.parametrize("key", TASK_KEYS)
def test_a_task_field_gives_back_its_key(key: str) -> None:
    field = fld.task_field(key)
    assert field.startswith(fld.TASK_PREFIX)
    assert fld.key_of_task_field(field) == key


@pytest.mark.parametrize("key", TASK_KEYS)
def test_the_fields_of_a_task_never_collide_with_each_other_or_the_run_meta(key: str) -> None:
    names = [*fld.record_fields(key), fld.value_field(key), fld.candidate_field(key, 1), fld.check_field(key, 1),
             fld.notes_field(key, 1, "attempt"), fld.begin_field(key), fld.fingerprint_field(key),
             fld.activation_field(key)]
    assert len(set(names)) == len(names)
    meta = {*fld.META_FIELDS, fld.F_INPUT, fld.F_INPUT_DIGEST, fld.F_GATES, fld.F_STATE, fld.F_ACTIVATIONS,
            *fld.USAGE_FIELDS}
    assert not set(names) & meta
    # only the record's JSON is under the task prefix (what resend_queued scans for)
    assert [name for name in names if name.startswith(fld.TASK_PREFIX)] == [fld.task_field(key)]


def test_round_fields_differ_by_round_and_phase() -> None:
    assert fld.candidate_field("a", 1) != fld.candidate_field("a", 2)
    assert fld.check_field("a", 1) != fld.candidate_field("a", 1)
    assert fld.notes_field("a", 1, "attempt") != fld.notes_field("a", 1, "check")


def test_meta_fields_are_distinct_and_counters_are_named_as_the_scripts_expect() -> None:
    assert len(set(fld.META_FIELDS)) == len(fld.META_FIELDS)
    assert (fld.F_OPEN, fld.F_ACTIVE, fld.F_PAUSED) == ("n:open", "n:active", "n:paused")
    assert {fld.F_OPEN, fld.F_ACTIVE, fld.F_PAUSED} <= set(fld.META_FIELDS)
    assert fld.USAGE_FIELDS == ("u:attempts", "u:input", "u:cached", "u:output")
    assert fld.stat_field("observer_errors") == "s:observer_errors"


def test_graph_fields_and_fleet_counters() -> None:
    assert fld.activation_count_field("review") == "a#:review"
    assert fld.activation_field("review@1") == "a:review@1"
    assert fld.activation_count_field("review") != fld.activation_field("review")
    assert fld.receipt_field("req-1") == "r:req-1"
    assert fld.started_stat("wf") == "started:wf"
    assert fld.finished_stat("wf", "failed", "limit") == "finished:wf:failed:limit"


@pytest.mark.parametrize("key", ["loop", "a", "draft.v2", "t", "v-1"])
def test_the_result_scan_finds_each_tasks_record_value_and_execution_and_no_long_text(key: str) -> None:
    import fnmatch

    read = [*fld.record_fields(key), fld.value_field(key)]
    assert all(fnmatch.fnmatchcase(name, fld.RESULT_SCAN) for name in read)
    long_texts = [fld.candidate_field(key, 2), fld.check_field(key, 2), fld.feedback_field(key, 2),
                  fld.notes_field(key, 2, "attempt"), fld.F_INPUT, fld.F_STATE]
    assert not any(fnmatch.fnmatchcase(name, fld.RESULT_SCAN) for name in long_texts)

"""The pools a worker runs phases on (taskloop/worker/pools/): which are taken, which refused and
why; the asyncio pool's frames; what a worker with thousands in flight says at its heartbeat."""

from __future__ import annotations

import gc

import pytest
from celery.concurrency.base import BasePool
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.thread import TaskPool as ThreadPool
from click.testing import CliRunner

from taskloop.base.errors import PoolRefused
from taskloop.cli import cli as main
from taskloop.runtime.fleet import Held, decode_held, encode_held
from taskloop.worker import pools
from taskloop.worker.pools.asyncio_pool import ThreadsPool
from taskloop.worker.pools.frames import PhaseFrame, Reader, ReplyFrame, pack


@pytest.mark.parametrize("name, given", [("prefork", "taskloop.celery_fixes.pool:TaskPool"),
                                         ("processes", "taskloop.celery_fixes.pool:TaskPool"),
                                         ("threads", "taskloop.worker.pools.asyncio_pool:ThreadsPool"),
                                         ("thread", "taskloop.worker.pools.asyncio_pool:ThreadsPool"),
                                         ("gevent", "gevent"),
                                         ("asyncio", "taskloop.worker.pools.asyncio_pool:TaskPool"),
                                         ("solo", "solo")])
def test_each_pool_taskloop_runs_on_maps_to_a_celery_pool(name: str, given: str) -> None:
    assert pools.celery_pool(name) == given


@pytest.mark.parametrize("name, why", [("eventlet", "Celery deprecated eventlet"),
                                        ("custom", "cannot tell whether it runs phases correctly")])
def test_a_pool_taskloop_cannot_run_on_is_refused_with_the_reason_and_the_choices(name: str, why: str) -> None:
    with pytest.raises(PoolRefused) as refused:
        pools.celery_pool(name)
    assert f"pool {name!r} is refused" in str(refused.value) and why in str(refused.value)
    assert "prefork, threads, gevent, asyncio, solo" in str(refused.value)


def test_the_kind_of_a_celery_pool_class_and_of_a_subclass() -> None:
    assert pools.kind_of(PreforkPool) == "prefork"
    assert pools.kind_of(ThreadsPool) == "threads"  # taskloop's -P threads
    assert pools.kind_of(ThreadPool) == "celery-threads"  # `celery worker --pool threads`: Celery's own

    class Tuned(ThreadPool):  # type: ignore[misc]
        pass

    assert pools.kind_of(Tuned) == "celery-threads"

    class Odd(BasePool):  # type: ignore[misc]
        pass

    with pytest.raises(PoolRefused, match="Odd' is refused"):
        pools.kind_of(Odd)


def test_taskloop_worker_refuses_a_pool_before_starting_anything() -> None:
    result = CliRunner().invoke(main, ["worker", "-P", "eventlet", "--no-supervise"])
    assert result.exit_code == 2
    assert "pool 'eventlet' is refused" in result.output


def test_the_collector_is_tuned_for_a_process_of_many_phases() -> None:
    before = gc.get_threshold()
    try:
        pools.tune_collector()
        assert gc.get_threshold() == pools.COLLECTOR_THRESHOLDS
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_frames_cross_in_pieces_and_parse_back() -> None:
    phase = PhaseFrame(id="t1", task="taskloop.attempt", args=["r1", "draft", 2, 7], kwargs={}, name="w.draft.attempt",
                       hostname="w1@h", carry=["x", None], queued_at=1.5, redelivered=True)
    reply = ReplyFrame(id="t1", reply="done")
    stream = pack(phase) + pack(reply)
    reader = Reader()
    bodies = [body for i in range(0, len(stream), 7) for body in reader.feed(stream[i:i + 7])]
    assert PhaseFrame.model_validate_json(bodies[0]) == phase
    assert ReplyFrame.model_validate_json(bodies[1]) == reply


def test_a_frame_too_long_to_be_ours_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of taskloop's"):
        Reader().feed(b"\xff\xff\xff\xff{}")


def test_a_reply_frame_with_a_field_of_nobody_s_does_not_parse() -> None:
    with pytest.raises(ValueError):
        ReplyFrame.model_validate_json(b'{"id": "t1", "surprise": 1}')


def test_holdings_round_trip_compactly_and_skip_what_does_not_parse() -> None:
    held = [Held("taskloop.attempt", "r1", "draft", 3, [], 10.5, 42),
            Held("taskloop.dispatch", "r2", None, None, ["a", "b"], None, None)]
    raw = encode_held(held)
    assert decode_held(raw) == held
    assert len(raw) < 100
    assert decode_held("not json") == [] and decode_held(None) == []
    assert decode_held('[["zz", "r"], ' + raw[1:]) == held  # a row of nobody's is left out

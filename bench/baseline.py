"""The baseline: a hand-rolled attempt/check loop on plain Celery, the way teams write it today.

``bench.attempt`` enqueues ``bench.check``, which enqueues the next ``bench.attempt`` until the
check accepts (round 3) or the loop runs out of rounds (the exhaust variant). The loop's state
lives only in the messages: no record survives a lost message.

Celery's own defaults, as a team would run it: JSON, prefetch 4 per process, task events off
(``celery worker -E`` turns them on, as Flower does), no result backend, and ``acks_late`` with
``reject_on_worker_lost`` — the least a loop that must not lose work needs.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

from bench import ACCEPT_ROUND, LOOP_CELERY_SETTINGS, MAX_ROUNDS

app = Celery("bench", broker=os.environ.get("TASKLOOP_REDIS_URL", "redis://127.0.0.1:6379/0"))
if os.environ.get("BENCH_BASELINE_KOMBU_CLIENTS") == "1":  # bench.run's baseline-kombu system: not Celery's defaults
    from taskloop.celery_fixes import transport

    app.conf.broker_transport = transport.TRANSPORT  # kombu's Redis transport with one client per channel
app.conf.update(**LOOP_CELERY_SETTINGS,
                task_default_queue=os.environ.get("BENCH_QUEUE", "bench"))  # bench.run's kombu-fix baseline has its own

_redis: redis.Redis | None = None


def store() -> redis.Redis:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(app.conf.broker_url)
    return _redis


def produce(loop_id: str, round: int) -> int:
    return round  # the "work": as cheap as taskloop's benchmark callbacks


@app.task(name="bench.attempt", ignore_result=True)
def attempt(loop_id: str, round: int, mode: str) -> None:
    candidate = produce(loop_id, round)
    check.delay(loop_id, round, mode, candidate)


@app.task(name="bench.check", ignore_result=True)
def check(loop_id: str, round: int, mode: str, candidate: int) -> None:
    accepted = mode == "accept" and candidate >= ACCEPT_ROUND
    if accepted or round >= MAX_ROUNDS:
        store().rpush("bench:finished", f"{loop_id} {'done' if accepted else 'exhausted'} {round}")
        store().rpush(f"bench:result:{loop_id}", "1")
        return
    attempt.delay(loop_id, round + 1, mode)

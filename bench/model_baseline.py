"""The hand-rolled loop of bench/baseline.py with phases that wait like a model call: each attempt
and each check sleeps ``phase_s`` seconds (``time.sleep``: gevent's under ``-P gevent``, whose
monkey patching Celery's own command does before anything else). The phase time rides in the
message, which costs a Celery message nothing."""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from bench import ACCEPT_ROUND, LOOP_CELERY_SETTINGS, MAX_ROUNDS, shared_client

QUEUE = "bench-model"

app = Celery("bench_model", broker=os.environ.get("TASKLOOP_REDIS_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(**LOOP_CELERY_SETTINGS, task_default_queue=QUEUE)

_redis: redis.Redis | None = None


def store() -> redis.Redis:
    global _redis
    if _redis is None:
        _redis = shared_client(app.conf.broker_url)
    return _redis


@app.task(name="bench_model.attempt", ignore_result=True)
def attempt(loop_id: str, round: int, phase_s: float) -> None:
    time.sleep(phase_s)
    check.delay(loop_id, round, phase_s, round)


@app.task(name="bench_model.check", ignore_result=True)
def check(loop_id: str, round: int, phase_s: float, candidate: int) -> None:
    time.sleep(phase_s)
    if candidate >= ACCEPT_ROUND or round >= MAX_ROUNDS:
        store().rpush("bench:finished", f"{loop_id} {'done' if candidate >= ACCEPT_ROUND else 'exhausted'} {round}")
        return
    attempt.delay(loop_id, round + 1, phase_s)

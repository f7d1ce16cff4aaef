"""What a hand-rolled Celery task gets from Celery's own ``rate_limit`` (per worker node), at
Celery's defaults, for bench/limits.py: ``celery -A bench.limit_baseline worker``."""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

app = Celery("bench-limit-baseline", broker=os.environ["TASKLOOP_REDIS_URL"])
app.conf.task_default_queue = "bench-limit-baseline"
_redis = redis.Redis.from_url(os.environ["TASKLOOP_REDIS_URL"], decode_responses=True)


def _started() -> None:
    _redis.rpush("bench:limits:starts", repr(time.time()))


for _rate in (20, 50, 100):
    app.task(name=f"bench.rated{_rate}", rate_limit=f"{_rate}/s", ignore_result=True)(_started)

"""The benchmarks: bench/run.py and the others it names.

What the hand-rolled loops (baseline.py, durable.py) share: their rounds, and the Celery settings
a team would run a loop with, Celery's defaults plus what a loop that must not lose work needs
(JSON, ``acks_late`` with ``reject_on_worker_lost``, no result backend); and the Redis client the
callbacks of a worker with many threads record their finished loops on."""

import redis

MAX_ROUNDS = 3
ACCEPT_ROUND = 3

LOOP_CELERY_SETTINGS = {
    "task_serializer": "json",
    "accept_content": ["json"],
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "task_ignore_result": True,
    "broker_connection_retry_on_startup": True,
}


def shared_client(url: str) -> redis.Redis:
    """A client that hundreds of threads of one worker share: they wait for one of its connections
    (redis-py's default pool raises "Too many connections" past 100)."""
    return redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(url, max_connections=100, timeout=None))

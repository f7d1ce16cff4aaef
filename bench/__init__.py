"""The benchmarks: bench/run.py and the others it names.

What the hand-rolled loops (baseline.py, durable.py) share: their rounds, and the Celery settings
a team would run a loop with, Celery's defaults plus what a loop that must not lose work needs
(JSON, ``acks_late`` with ``reject_on_worker_lost``, no result backend)."""

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

"""Celery settings for taskloop workers and clients (the defaults; edit to taste).

taskloop loads this module (or the one named by TASKLOOP_CELERY_CONFIG) when it is importable.
TASKLOOP_BROKER_URL / TASKLOOP_REDIS_URL, when set, override broker_url. The settings marked
"required" are forced by taskloop whatever this file says, because its guarantees rest on them.
Reasons for each are in docs/operations.md; the measured effect of prefetch and events is in
docs/benchmarks.md.
"""

# Broker: TASKLOOP_BROKER_URL, else TASKLOOP_REDIS_URL, else this (the environment wins).
broker_url = "redis://127.0.0.1:6379/0"

# JSON only (required): messages carry ids, never user payloads, and never pickle.
task_serializer = "json"
accept_content = ["json"]

# Acknowledge after the phase ran, and re-queue it if the worker process dies (required).
task_acks_late = True
task_reject_on_worker_lost = True

# Prefetch: Celery's default (4 messages per process), with fair scheduling (`-O fair`, which
# `taskloop worker` passes and Celery 5 uses by default): a process that is busy with a long
# phase is not handed more, and the prefetched messages keep the others fed.
# worker_prefetch_multiplier = 4

# taskloop keeps its own results in Redis: no Celery result backend traffic.
task_ignore_result = True

# Task events are off, as in Celery. `taskloop worker -E` turns them on; Flower turns them on by
# itself in the workers it watches (its enable_events option), so Flower still sees every phase.
worker_send_task_events = False
task_send_sent_event = False

# taskloop's workers consume with kombu's ack emulation off (forced: taskloop/connections/broker.py):
# the broker keeps no copy of a message a worker took, and nothing comes back after a visibility
# timeout. The store keeps every phase (records, leases, start notes), and what a worker that dies
# held is sent again from it (docs/reliability.md, *Messages a worker holds*).
broker_transport_options = {"visibility_timeout": 3600}

task_default_queue = "taskloop"
broker_connection_retry_on_startup = True
# Keep reconnecting to a broker that went away, however long it stays away (Celery gives up after
# 100 tries, about 50 minutes, and the worker exits). Between tries Celery waits 2, 4, 6 ... up
# to 30 s, so a worker is back at most 30 s after Redis is.
broker_connection_max_retries = None

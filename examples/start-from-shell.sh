#!/bin/sh
# Start a taskloop run from any language: push one Celery message (protocol 2, JSON) onto the
# queue. This script uses only sh, base64 and redis-cli; any Celery client library (celery-node,
# gocelery, rusty-celery, ...) sends the same message with send_task("taskloop.start", kwargs).
#
#   TASKLOOP_REDIS_URL=redis://127.0.0.1:6379/0 sh examples/start-from-shell.sh essay '{"topic": "x"}' [RUN_ID]
#
# WORKFLOW is a name the workers know; INPUT is JSON; RUN_ID (optional) makes the start
# idempotent. It prints the run id: wait for it from anywhere with `taskloop wait`-style calls,
# e.g. `taskloop inspect RUN_ID`, or TaskLoop().wait(RUN_ID) in Python.
set -eu
WORKFLOW=${1:?usage: start-from-shell.sh WORKFLOW INPUT_JSON [RUN_ID]}
INPUT=${2:-null}
RUN_ID=${3:-shell-$(date +%s)-$$}
ID=$(cat /proc/sys/kernel/random/uuid)
# The body: [args, kwargs, embed]. taskloop.start takes kwargs workflow, input, version, run_id.
BODY=$(printf '[[], {"workflow": "%s", "input": %s, "run_id": "%s"}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]' \
    "$WORKFLOW" "$INPUT" "$RUN_ID" | base64 | tr -d '\n')
MESSAGE=$(printf '{"body": "%s", "content-encoding": "utf-8", "content-type": "application/json", "headers": {"lang": "sh", "task": "taskloop.start", "id": "%s", "root_id": "%s", "parent_id": null, "group": null, "retries": 0, "eta": null, "expires": null, "argsrepr": "", "kwargsrepr": "", "origin": "start-from-shell"}, "properties": {"correlation_id": "%s", "reply_to": "", "delivery_mode": 2, "delivery_info": {"exchange": "", "routing_key": "taskloop"}, "priority": 0, "body_encoding": "base64", "delivery_tag": "%s"}}' \
    "$BODY" "$ID" "$ID" "$ID" "$ID")
# The queue is a Redis list named after it (taskloop's default queue is "taskloop").
redis-cli -u "${TASKLOOP_BROKER_URL:-${TASKLOOP_REDIS_URL:-redis://127.0.0.1:6379/0}}" LPUSH taskloop "$MESSAGE" >/dev/null
echo "$RUN_ID"

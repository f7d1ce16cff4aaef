"""The durable floor: the hand-rolled loop of bench/baseline.py plus the least a loop needs to be
durable, one Lua compare-and-set and one XADD per step, in one script call.

Each loop has a hash ``durable:{id}`` whose field ``step`` names the step the loop is at
(``a1``, ``c1``, ``a2``, ...). A step runs its callback, then its script moves ``step`` from its
own name to the next one and appends the step to the loop's stream, or does nothing if the loop
is no longer at that step (a duplicate or a replay): the fencing a durable loop needs. Nothing
else: no leases, no reconciler, no ledger. It is the floor taskloop is measured against (issue
24): what a minimal durable loop on Celery's defaults costs.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

from bench import ACCEPT_ROUND, LOOP_CELERY_SETTINGS, MAX_ROUNDS

QUEUE = "durable"

app = Celery("durable", broker=os.environ.get("TASKLOOP_REDIS_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(**LOOP_CELERY_SETTINGS, task_default_queue=QUEUE)

# KEYS: the loop's hash, its stream; ARGV: the step it must be at, the next step, the event
MOVE = """
if redis.call('HGET', KEYS[1], 'step') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'step', ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', '100', '*', 'step', ARGV[1], 'e', ARGV[3])
return 1
"""

_redis: redis.Redis | None = None
_move = None


def store() -> redis.Redis:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(app.conf.broker_url)
    return _redis


def keys(loop_id: str) -> list[str]:
    return [f"durable:{{{loop_id}}}", f"durable:{{{loop_id}}}:events"]


def move(loop_id: str, at: str, to: str, event: str) -> bool:
    global _move
    if _move is None:
        _move = store().register_script(MOVE)
    return bool(_move(keys=keys(loop_id), args=[at, to, event]))


def begin(pipe: redis.client.Pipeline, loop_id: str) -> None:
    """What the producer writes before it sends the first attempt."""
    pipe.hset(keys(loop_id)[0], "step", "a1")


@app.task(name="durable.attempt", ignore_result=True)
def attempt(loop_id: str, round: int, mode: str) -> None:
    candidate = round  # the "work", as cheap as the other systems' callbacks
    if move(loop_id, f"a{round}", f"c{round}", str(candidate)):
        check.delay(loop_id, round, mode, candidate)


@app.task(name="durable.check", ignore_result=True)
def check(loop_id: str, round: int, mode: str, candidate: int) -> None:
    accepted = mode == "accept" and candidate >= ACCEPT_ROUND
    if accepted or round >= MAX_ROUNDS:
        ending = "done" if accepted else "exhausted"
        if move(loop_id, f"c{round}", ending, ending):
            store().rpush("bench:finished", f"{loop_id} {ending} {round}")
            store().rpush(f"bench:result:{loop_id}", "1")
        return
    if move(loop_id, f"c{round}", f"a{round + 1}", "again"):
        attempt.delay(loop_id, round + 1, mode)

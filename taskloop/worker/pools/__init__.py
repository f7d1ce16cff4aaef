"""The pools a taskloop worker runs phases on, and the ones it refuses (SPEC §12).

| ``-P`` | phases at once in one process | for |
|---|---|---|
| ``prefork`` (default) | one per pool process (``-c`` processes) | CPU-bound callbacks |
| ``threads`` | ``-c``, a thread each, in one pool process (asyncio_pool.py) | sync callbacks that wait |
| ``gevent`` | ``-c``, one greenlet each | sync callbacks that wait, on clients gevent can patch |
| ``asyncio`` | ``-c`` on one event loop (asyncio_pool.py) | ``async def`` callbacks |
| ``solo`` | one, in the worker's main process | debugging |

Every one keeps the guarantees of a phase (leases, fencing, cancel, timeouts, fleet limits,
graceful shutdown with hand-back); what a timeout or a cancel can do to a callback that ignores
its signal differs by pool (docs/controls.md, *What each pool can stop*). ``eventlet`` is refused:
Celery deprecated it, and the store's client (redis-py with hiredis) is not known to work under
its patching. Any other pool class is refused too: taskloop cannot tell what it does with a
message, and a pool that drops or holds one is a phase left to its lease. Celery's own thread
pool (``celery worker --pool threads``) is taken, as ``celery-threads``: its phases, Celery's
consumer and their round trips share one process and its interpreter lock.
"""

from __future__ import annotations

from typing import Any

from taskloop.base.errors import PoolRefused

CELERY_POOLS = {
    "prefork": "taskloop.celery_fixes.pool:TaskPool",  # Celery's, with taskloop's fix
    "threads": "taskloop.worker.pools.asyncio_pool:ThreadsPool",
    "gevent": "gevent",
    "asyncio": "taskloop.worker.pools.asyncio_pool:TaskPool",
    "solo": "solo",
}
ALIASES = {"processes": "prefork", "thread": "threads"}
COMMAND_LINE = ("gevent", "solo")  # Celery's own names, given to its --pool as they are
REFUSED = {
    "eventlet": "Celery deprecated eventlet, and taskloop's store client is not known to work under its "
                "patching; use -P gevent or -P threads for sync callbacks that wait, -P asyncio for async ones",
}
# the Celery classes behind each kind (what a worker started by `celery worker` reports)
_CLASSES = {
    "taskloop.celery_fixes.pool.TaskPool": "prefork",
    "celery.concurrency.prefork.TaskPool": "prefork",
    "celery.concurrency.thread.TaskPool": "celery-threads",  # `celery worker --pool threads`: Celery's own
    "taskloop.worker.pools.asyncio_pool.ThreadsPool": "threads",
    "celery.concurrency.gevent.TaskPool": "gevent",
    "taskloop.worker.pools.asyncio_pool.TaskPool": "asyncio",
    "celery.concurrency.solo.TaskPool": "solo",
}


def celery_pool(name: str) -> str:
    """What ``taskloop worker -P NAME`` gives Celery's ``--pool`` (raises PoolRefused)."""
    kind = ALIASES.get(name, name)
    if kind in CELERY_POOLS:
        return CELERY_POOLS[kind]
    raise PoolRefused(refusal(name))


def refusal(name: str) -> str:
    why = REFUSED.get(name) or "taskloop cannot tell whether it runs phases correctly"
    return f"pool {name!r} is refused: {why}. Use one of: {', '.join(CELERY_POOLS)} (docs/operations.md, *Pools*)"


def kind_of(pool_cls: Any) -> str:
    """The kind of a Celery pool class (raises PoolRefused for one taskloop does not run on)."""
    cls = pool_cls if isinstance(pool_cls, type) else type(pool_cls)
    for klass in cls.__mro__:
        kind = _CLASSES.get(f"{klass.__module__}.{klass.__qualname__}")
        if kind is not None:
            return kind
    name = f"{cls.__module__}.{cls.__qualname__}"
    if "eventlet" in name:
        raise PoolRefused(refusal("eventlet"))
    raise PoolRefused(refusal(name))


# Python's collector at its defaults (700, 10, 10) collects the oldest generation whenever a quarter
# of it is new: with thousands of phases in flight, each keeping a few hundred objects for the
# seconds its model call takes, that is a full scan of a million objects or more every few
# seconds, over a second each, holding every phase of the process (measured: docs/benchmarks.md,
# *Loops that wait on models*). A phase leaves no reference cycles behind (tests/unit/test_cycles.py):
# its objects go with it by reference counting, and the old generation needs collecting seldom.
COLLECTOR_THRESHOLDS = (5000, 10, 1000)


def tune_collector() -> None:
    """For a process that runs many phases at once (a threads, gevent or asyncio pool): what it made
    to start is frozen (never scanned again), and its old generation is collected seldom."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*COLLECTOR_THRESHOLDS)

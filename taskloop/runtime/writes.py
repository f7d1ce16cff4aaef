"""A guarded batch that needs no plan (``write``): a control flag (cancel), a pending run's first
records, a counter of refused deliveries, a usage receipt, a lease renewal or a stale lease
dropped, an observer's failure. Applied or refused as a whole, like a plan's write
(runtime/commit.py); with commit.py, the only caller of the store's writes."""

from __future__ import annotations

from taskloop.core.batch import Batch
from taskloop.store.limit_store import Admission
from taskloop.store.redis_store import Applied, Conflict, RedisStore


def write(store: RedisStore, batch: Batch) -> Applied | Conflict:
    """Apply a guarded batch that needs no plan (see the module docstring)."""
    assert batch.limits is None, "a write with a limits operation goes through commit"
    result = store.apply(batch)
    assert not isinstance(result, Admission)
    return result

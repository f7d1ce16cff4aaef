"""The Redis store: key names (keys.py), the compare-and-set script (lua/cas.lua), the store."""

from taskloop.store.batch import Batch
from taskloop.store.redis_store import Conflict, RedisStore, Snapshot

__all__ = ["Batch", "Conflict", "RedisStore", "Snapshot"]

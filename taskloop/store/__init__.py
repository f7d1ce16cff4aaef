"""The Redis store: key and field names (keys.py), typed reads (meta.py), the guarded batch
(batch.py, lua/cas.lua), the prepared begin (lua/begin.lua) and the store itself."""

from taskloop.store.batch import Batch
from taskloop.store.meta import RunMeta, Snapshot
from taskloop.store.redis_store import Applied, BeginReply, Conflict, RedisStore

__all__ = ["Applied", "Batch", "BeginReply", "Conflict", "RedisStore", "RunMeta", "Snapshot"]

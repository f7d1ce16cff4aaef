"""The Redis store: every Redis key name (keys.py), the Lua scripts (lua/*.lua, loaded and called
by redis_store.py) and the store itself (redis_store.py). The records it holds are described in
taskloop/core (fields.py, snapshot.py, batch.py)."""

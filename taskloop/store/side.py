"""Writes sent now whose replies are read later: one connection of the store's pool set aside.

A phase that runs on the fields its message carries (core/reads.py) writes its start note without
waiting for it: the note is sent on this connection before the callback runs, and its reply is
read before the phase's outcome is written (``landed``), so the note is in Redis before the commit
and a reply is never left for another call to read. The store's own connection is not used for
this: the callback may call the store meanwhile (usage reports), and would read the note's reply
as its own.
"""

from __future__ import annotations

import threading
from typing import Any

import redis


class Side:
    """One connection with the count of the replies it still owes (thread-safe: the watcher thread
    may read a note's reply before it begins the phase)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._connection: Any = None
        self._unread = 0
        self._lock = threading.Lock()

    def send(self, *command: str) -> None:
        """Send one command; its reply is read by ``landed`` (or before the next send). Raises
        redis-py's error when the command cannot be sent (the caller's store wraps it)."""
        with self._lock:
            self._read_all()
            try:
                if self._connection is None:
                    self._connection = self._client.connection_pool.get_connection()
                self._connection.send_command(*command)
            except redis.exceptions.RedisError:
                if self._connection is not None:
                    self._connection.disconnect()
                raise
            self._unread += 1

    def landed(self) -> bool:
        """Read the replies still owed: True when every command sent has landed, False when the
        connection failed first (what was sent may or may not have been applied; the connection
        is made again at the next send)."""
        with self._lock:
            try:
                self._read_all()
            except redis.exceptions.RedisError:
                return False
            return True

    def _read_all(self) -> None:
        while self._unread:
            self._unread -= 1
            try:
                self._connection.read_response()
            except redis.exceptions.ResponseError:
                continue  # an error reply (the command was refused): nothing more is owed for it
            except redis.exceptions.RedisError:
                self._unread = 0
                self._connection.disconnect()
                raise

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.disconnect()
                self._connection = None
                self._unread = 0

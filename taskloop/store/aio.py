"""A phase's two hot calls from an event loop: its begin (begin.lua) and the one script call of its
commit (cas.lua or cas_limits.lua), on an asyncio connection of one Redis (``redis.asyncio``), so
that the asyncio pool's loop goes on with its other phases during each round trip instead of
waiting it out (worker/pools/loop_process.py). The arguments and the replies are the sync store's
own (store/running.py ``begin_call`` and ``begin_reply``, RedisStore ``script_call`` and
``applied``): only the transport differs. Errors are the store's (StoreUnavailable,
StoreAccessDenied). A write that is more than one script call (a Cluster, a run's first write, a
cancel) is not made here: ``apply`` says None and the caller takes the sync path."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis

from taskloop.connections import clients, errors
from taskloop.core.batch import Batch
from taskloop.store.limit_store import Admission
from taskloop.store.redis_store import Applied, Conflict, RedisStore
from taskloop.store.running import Begin, BeginReply, begin_call, begin_reply

CAUGHT: tuple[type[BaseException], ...] = (*errors.STORE_ERRORS, redis.exceptions.ResponseError)


class AsyncScripts:
    """The store's scripts, called on an asyncio client. Made and used on one event loop.

    The calls made within one turn of the loop go to Redis together, as pipelines of up to
    ``BATCH`` calls: one send and one read for a burst of phases instead of a round trip each
    (Redis runs them one after the other, each atomic as ever), on a few connections instead of a
    queue of thousands of callers waiting for one."""

    BATCH = 64

    def __init__(self, store: RedisStore, client: Any) -> None:
        self.store = store
        self.client = client
        self._pending: list[tuple[str, Sequence[str], Sequence[str | int | float], asyncio.Future[Any]]] = []
        self._sending: set[asyncio.Task[None]] = set()

    @classmethod
    def of(cls, store: RedisStore) -> AsyncScripts | None:
        """For a store on one Redis; None for a Sentinel or a Cluster (their calls stay sync)."""
        client = clients.async_store_client(store.url)
        return None if client is None else cls(store, client)

    async def call(self, name: str, keys: Sequence[str], args: Sequence[str | int | float]) -> Any:
        """EVALSHA one of the store's scripts (loading it first where this Redis lacks it), with the
        other calls of this turn of the loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((name, keys, args, future))
        return await future

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), self.BATCH):
            task = loop.create_task(self._send(pending[start:start + self.BATCH]))
            self._sending.add(task)  # held until done (the loop keeps only a weak reference)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[str, Sequence[str], Sequence[str | int | float],
                                            asyncio.Future[Any]]]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, keys, args, _ in batch:
                pipe.evalsha(self.store._scripts[name].sha, len(keys), *keys, *args)
            replies = await pipe.execute(raise_on_error=False)
        except BaseException as exc:
            error = self._error(exc) if isinstance(exc, CAUGHT) else exc
            for *_, future in batch:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(exc, Exception):
                raise
            return
        for (name, keys, args, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, redis.exceptions.NoScriptError):
                try:
                    await self.client.script_load(self.store._scripts[name].source)
                    reply = await self.client.evalsha(self.store._scripts[name].sha, len(keys), *keys, *args)
                except CAUGHT as exc:
                    reply = exc
            if isinstance(reply, BaseException):
                future.set_exception(self._error(reply) if isinstance(reply, CAUGHT) else reply)
            else:
                future.set_result(reply)

    def _error(self, exc: BaseException) -> BaseException:
        """What a store call raises for redis-py's ``exc`` (store/calls.py ``wrap``: a script's own
        error is a bug, raised as it is)."""
        if isinstance(exc, redis.exceptions.ResponseError) and not isinstance(exc, errors.STORE_ERRORS) \
                and not errors.denied_in_script(exc):
            return exc
        return errors.describe(exc, self.store.url)

    async def begin(self, begin: Begin) -> BeginReply:
        """store.begin, awaited."""
        keys, argv = begin_call(begin)
        return begin_reply(begin, await self.call("begin", keys, argv))

    async def apply(self, batch: Batch) -> Applied | Conflict | Admission | None:
        """store.apply, awaited, when the write is one script call and nothing else (None: it is not)."""
        call = self.store.script_call(batch)
        if not call.alone:
            return None
        return self.store.applied(batch, call, await self.call(call.script, call.keys, call.args))

    async def close(self) -> None:
        await self.client.aclose()

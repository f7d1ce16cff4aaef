"""Actions asked of a worker by run id (runtime/acting.py), in Redis: ``tl:act:{Q}`` (HASH: the
request's ``body``, who ``taken`` it, its ``verdict``) and ``tl:act:{Q}:reply`` (LIST: the verdict
pushed for the caller's BLPOP), both expiring (store/keys.py). The one-field moves that decide who
acts are request.lua's: a worker's claim and its caller's giving up race on one field."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from taskloop.store import keys as k
from taskloop.store.calls import wrap

ABANDONED = "-"  # the "taken" mark of a caller that gave up waiting: no worker takes the request after it
BODY, TAKEN, VERDICT = "body", "taken", "verdict"  # the request hash's fields


@dataclass(frozen=True)
class Claim:
    """What a worker's claim of a request found."""

    won: bool  # this claim took it
    taken: str  # who holds it (this claim, another worker's, or ABANDONED)
    body: str
    verdict: str | None


class Requests:
    """The request keys, for RedisStore (its client, scripts and blocking reads)."""

    client: Any

    def _call(self, name: str, keys: Sequence[str], args: Sequence[str | int | float]) -> Any: ...

    def _block(self, block_s: float, call: Callable[[Any], Any], nothing: Any) -> Any: ...

    @wrap
    def record_request(self, request_id: str, body: str, ttl_s: int) -> str:
        """Record a request (kept ``ttl_s``); the body stored under its id: ``body``, or the one a
        request recorded earlier under the same id."""
        key, _ = k.request_keys(request_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(key, BODY, body)
        pipe.hget(key, BODY)
        pipe.expire(key, ttl_s)
        return str(pipe.execute()[1])

    @wrap
    def request_verdict(self, request_id: str) -> str | None:
        return self.client.hget(k.request_keys(request_id)[0], VERDICT)  # type: ignore[no-any-return]

    @wrap
    def take_request(self, request_id: str, claim: str) -> Claim | None:
        """A worker's claim (None: the request expired)."""
        found = self._call("request", [k.request_keys(request_id)[0]], ["take", claim, TAKEN, BODY, VERDICT])
        if not found:
            return None
        won, taken, body, verdict = found
        return Claim(bool(won), str(taken), str(body or ""), verdict)

    @wrap
    def abandon_request(self, request_id: str) -> str | None:
        """The caller gives up: who holds the request now (ABANDONED when no worker took it first;
        None: it expired)."""
        taken = self._call("request", [k.request_keys(request_id)[0]], ["abandon", ABANDONED, TAKEN, BODY, VERDICT])
        return str(taken) if taken else None

    @wrap
    def reopen_request(self, request_id: str) -> bool:
        """A request asked again after its caller gave up may be taken again."""
        return bool(self._call("request", [k.request_keys(request_id)[0]], ["reopen", ABANDONED, TAKEN, BODY, VERDICT]))

    @wrap
    def give_verdict(self, request_id: str, verdict: str, ttl_s: int) -> None:
        """Store the verdict and push it for whoever waits (both kept ``ttl_s``)."""
        key, reply = k.request_keys(request_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, VERDICT, verdict)
        pipe.expire(key, ttl_s)
        pipe.rpush(reply, verdict)
        pipe.expire(reply, ttl_s)
        pipe.execute()

    @wrap
    def block_verdict(self, request_id: str, block_s: float) -> str | None:
        """Wait up to ``block_s`` for the verdict (BLPOP on the reply list), then read the stored one
        (another caller of the same request may have taken the pushed copy)."""
        key, reply = k.request_keys(request_id)
        popped = self._block(block_s, lambda c: c.blpop([reply], timeout=max(block_s, 0.01)), None)
        if popped is not None:
            return str(popped[1])
        return self.client.hget(key, VERDICT)  # type: ignore[no-any-return]

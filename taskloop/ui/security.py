"""What guards the UI: basic auth on every request, the security headers of every response, and
the two checks every action (POST) passes: it comes from the UI's own origin, and it carries the
UI's token.

- **Auth.** With ``TASKLOOP_UI_AUTH=user:password`` every path answers 401 without those
  credentials (pages, assets, the API, the live streams), except ``/healthz``, which says "ok"
  and nothing else (a load balancer's probe). Compared in constant time.
- **Cross-site requests.** A POST whose ``Origin`` (or, without one, ``Referer``) names another
  origin is refused; so is one without the token. The token is an HMAC of the user's name under
  the UI's secret (``TASKLOOP_UI_SECRET``, else random per process): pages carry it in their
  forms, API clients read it from ``GET /api/session``. Another site can make a browser send a
  request, but cannot read a page to learn the token.
- **Headers.** A CSP without inline scripts or styles and without eval (every script and
  stylesheet is a file under ``/static``; htmx is configured not to evaluate), frames denied,
  no MIME sniffing, no referrer to other sites, pages never cached.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"permissions-policy", b"camera=(), microphone=(), geolocation=()"),
]
OPEN_PATHS = frozenset({"/healthz"})
REALM = b'Basic realm="taskloop", charset="UTF-8"'


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str

    @classmethod
    def parse(cls, text: str) -> Credentials:
        """``user:password`` (the password may hold ':'); ValueError naming the fix otherwise."""
        user, sep, password = text.partition(":")
        if not sep or not user or not password:
            raise ValueError("TASKLOOP_UI_AUTH must be user:password, both non-empty (e.g. ops:s3cret)")
        return cls(user, password)


class Guard:
    """The ASGI middleware around the UI: auth, then headers on every response."""

    def __init__(self, app: ASGIApp, credentials: Credentials | None) -> None:
        self.app = app
        self.credentials = credentials

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in _OURS]
                message["headers"] = [*headers, *HEADERS]
            await send(message)

        if self.credentials is not None and scope["path"] not in OPEN_PATHS:
            user = self._user(scope)
            if user is None:
                await _plain(send_with_headers, 401, b"authentication required\n", [(b"www-authenticate", REALM)])
                return
            scope.setdefault("state", {})["user"] = user
        await self.app(scope, receive, send_with_headers)

    def _user(self, scope: Scope) -> str | None:
        assert self.credentials is not None
        header = dict(scope.get("headers", [])).get(b"authorization", b"")
        scheme, _, encoded = header.partition(b" ")
        if scheme.lower() != b"basic":
            return None
        try:
            user, _, password = base64.b64decode(encoded.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        ok_user = hmac.compare_digest(user.encode(), self.credentials.user.encode())
        ok_password = hmac.compare_digest(password.encode(), self.credentials.password.encode())
        return user if ok_user and ok_password else None


_OURS = frozenset(name for name, _ in HEADERS)


async def _plain(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class Tokens:
    """The action token of each user (see the module docstring)."""

    def __init__(self, secret: bytes | None = None) -> None:
        configured = os.environ.get("TASKLOOP_UI_SECRET")
        self.secret = secret or (configured.encode() if configured else os.urandom(32))

    def token(self, user: str) -> str:
        return hmac.new(self.secret, f"taskloop-ui-action:{user}".encode(), hashlib.sha256).hexdigest()[:40]

    def valid(self, user: str, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(self.token(user), given)


def cross_site(headers: Any, scheme: str, host: str | None) -> str | None:
    """Why a request comes from another origin, or None: its ``Origin`` (else its ``Referer``) must
    name this UI's scheme, host and port. A request with neither (an API client) passes here and
    must still carry the token."""
    if host is None:
        return "the request has no Host header"
    claimed = headers.get("origin")
    if claimed is None:
        referer = headers.get("referer")
        if referer is None:
            return None
        parts = urlsplit(referer)
        claimed = f"{parts.scheme}://{parts.netloc}"
    if claimed == "null" or claimed.rstrip("/") != f"{scheme}://{host}":
        return f"the request comes from {claimed!r}, not from this UI ({scheme}://{host})"
    return None

"""``taskloop ui``: serve the run UI with uvicorn, after the checks that keep it from being served
open by mistake.

- It binds 127.0.0.1 unless told otherwise.
- On any other address it refuses to start without ``TASKLOOP_UI_AUTH``, unless
  ``--allow-unauthenticated`` says so explicitly (behind a proxy that authenticates, say).
- ``--read-only`` hides and refuses every action: a monitor ACL user is then enough.
"""

from __future__ import annotations

import ipaddress
import logging
import os

from taskloop.base.errors import UIRefused
from taskloop.runtime.client import TaskLoop
from taskloop.ui.security import Credentials

log = logging.getLogger("taskloop.ui")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8188


def credentials_from_env() -> Credentials | None:
    raw = os.environ.get("TASKLOOP_UI_AUTH")
    if not raw:
        return None
    try:
        return Credentials.parse(raw)
    except ValueError as exc:
        raise UIRefused(str(exc)) from None


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, credentials: Credentials | None, allow_unauthenticated: bool) -> None:
    if credentials is None and not loopback(host) and not allow_unauthenticated:
        raise UIRefused(
            f"refusing to serve the UI on {host} without authentication: set TASKLOOP_UI_AUTH=user:password, "
            "or bind 127.0.0.1, or pass --allow-unauthenticated if a proxy in front of it authenticates")


def serve(client: TaskLoop, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, read_only: bool = False,
          allow_unauthenticated: bool = False, max_streams: int = 64, announce: bool = True,
          trusted_proxies: str | None = None) -> None:
    """Serve until interrupted (Ctrl-C). ``trusted_proxies``: the addresses (comma-separated, or
    ``*``) of a proxy in front whose ``X-Forwarded-Proto`` and ``X-Forwarded-For`` to believe, so
    that behind a TLS-terminating proxy the UI knows its origin is https (its cross-site check
    compares the browser's Origin with it)."""
    try:
        import uvicorn
    except ImportError:  # pragma: no cover - the [ui] extra is missing
        raise UIRefused("the UI needs its extra: pip install 'taskloop[ui]'") from None
    from taskloop.ui.app import create_app

    credentials = credentials_from_env()
    check_exposure(host, credentials, allow_unauthenticated)
    app = create_app(client, read_only=read_only, credentials=credentials, max_streams=max_streams)
    if announce:
        shown = f"[{host}]" if ":" in host else host
        print(f"taskloop ui on http://{shown}:{port}/{' (read-only)' if read_only else ''}"
              f"{' (basic auth on)' if credentials else ''}", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=2,
                proxy_headers=trusted_proxies is not None, forwarded_allow_ips=trusted_proxies)

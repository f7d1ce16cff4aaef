"""``taskloop ui``: the run UI in a browser (taskloop/ui/)."""

from __future__ import annotations

import click

from taskloop.cli.common import IMPORT_OPTION, check_port, import_modules


@click.command(name="ui")
@IMPORT_OPTION
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Any other than loopback needs TASKLOOP_UI_AUTH (or --allow-unauthenticated).")
@click.option("--port", type=click.IntRange(1, 65535), default=8188, show_default=True, help="Port to bind.")
@click.option("--read-only", is_flag=True, help="Hide and refuse every action (a monitor ACL user is enough).")
@click.option("--allow-unauthenticated", is_flag=True,
              help="Serve on a non-loopback address without TASKLOOP_UI_AUTH (a proxy in front authenticates).")
@click.option("--max-streams", type=click.IntRange(1, 10_000), default=64, show_default=True,
              help="Live pages served at once; more pages stay open but update only after a reload.")
@click.option("--trusted-proxy", "trusted_proxies", default=None, metavar="ADDRS",
              help="Believe X-Forwarded-Proto/-For from these proxy addresses (comma-separated, or '*'): "
                   "needed behind a TLS-terminating proxy for actions to pass the same-origin check.")
def ui(imports: tuple[str, ...], host: str, port: int, read_only: bool, allow_unauthenticated: bool,
       max_streams: int, trusted_proxies: str | None) -> None:
    """Serve the run UI: runs, each run's rounds and graph live, the fleet, and the actions (cancel,
    resume, gates). Reads TASKLOOP_REDIS_URL like every command; --import the workflow modules for
    resume and gates (they plan with the definition)."""
    from taskloop.base.errors import StoreAccessDenied, StoreUnavailable
    from taskloop.runtime.client import TaskLoop
    from taskloop.ui.serve import serve

    import_modules(imports)
    check_port(host, port, "taskloop ui or demo --ui")
    client = TaskLoop()
    try:  # a Redis that is down or refuses taskloop is said now (its URL without password); the UI
        client.run_page(limit=1)  # still starts: its pages show the error until Redis answers
    except (StoreUnavailable, StoreAccessDenied) as exc:
        click.echo(f"warning: {exc}; the UI starts, and its pages say so until Redis answers", err=True)
    serve(client, host, port, read_only=read_only, allow_unauthenticated=allow_unauthenticated,
          max_streams=max_streams, trusted_proxies=trusted_proxies)

"""``taskloop limits``: the fleet's rate limits and concurrency keys, their use and their queues;
``taskloop limits set NAME``: change a limit's numbers for the whole fleet, at once, without a
deploy (the override lives in Redis and wins over the declaration; ``--clear`` removes it)."""

from __future__ import annotations

import json

import click
from rich.table import Table

from taskloop.base import clock, config
from taskloop.base.errors import InvalidInput
from taskloop.base.names import NAME_RULE, is_name
from taskloop.base.text import visible
from taskloop.cli.common import JSON_OPTION, console
from taskloop.cli.display import plain
from taskloop.define.limits import MAX_RATE, MAX_SLOTS, MAX_WINDOW_S


@click.group(invoke_without_command=True)
@JSON_OPTION
@click.pass_context
def limits(ctx: click.Context, as_json: bool) -> None:
    """Fleet limits: each limit's use (slots held, or starts/tokens in its window), what it allows
    now (with an operator's override) and how many phases wait for it."""
    if ctx.invoked_subcommand is not None:
        return
    from taskloop.runtime.fleet import limits_view
    from taskloop.store.redis_store import RedisStore

    found = limits_view(RedisStore(config.settings().redis_url), clock.now())
    if as_json:
        click.echo(json.dumps([info.model_dump() for info in found], indent=2))
        return
    if not found:
        console.print("no fleet limit has been used yet")
        return
    table = Table("limit", "kind", "key", "in use", "allows", "waiting", "override")
    for info in found:
        allows = f"{info.allowed:g} slots" if info.kind == "concurrency" else \
            f"{info.allowed:g} {info.unit} / {info.per_s:g}s"
        table.add_row(plain(visible(info.name)), info.kind, plain(visible(info.value) or "-"), str(info.used), allows,
                      str(info.waiting), plain(visible(", ".join(f"{k}={v}" for k, v in info.overridden.items()))
                                               or "-"))
    console.print(table)


@limits.command(name="set")
@click.argument("name")
@click.option("--rate", type=click.IntRange(1, MAX_RATE), default=None, help="A rate limit's starts (or tokens) "
              "per window.")
@click.option("--per-s", "per_s", type=click.FloatRange(0.001, MAX_WINDOW_S), default=None,
              help="A rate limit's window, in seconds.")
@click.option("--limit", type=click.IntRange(1, MAX_SLOTS), default=None,
              help="A concurrency limit's phases running at once (per key value).")
@click.option("--clear", is_flag=True, help="Remove the overrides: the declared numbers apply again.")
def set_limit(name: str, rate: int | None, per_s: float | None, limit: int | None, clear: bool) -> None:
    """Override limit NAME's numbers fleet-wide, now: phases already waiting are looked at again
    with them; running phases are not stopped (a lowered concurrency limit lets no new phase
    start until the running ones are under it)."""
    from taskloop.store.redis_store import RedisStore

    if not is_name(name):
        raise InvalidInput(f"limits set: the limit name {name!r} is invalid: it must {NAME_RULE}")
    if clear:
        values: dict[str, float | int | None] = {"rate": None, "per_s": None, "limit": None}
    else:
        values = {key: value for key, value in (("rate", rate), ("per_s", per_s), ("limit", limit))
                  if value is not None}
        if not values:
            raise InvalidInput("limits set: give --rate, --per-s or --limit (or --clear)")
    now = RedisStore(config.settings().redis_url).set_limit(name, values)
    console.print(plain(f"limit {visible(name)}: " + (", ".join(f"{k}={v}" for k, v in sorted(now.items()))
                                                      or "the declared numbers")))

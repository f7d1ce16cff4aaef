"""What every command shares: importing workflow modules, the client, JSON options, run ids by
prefix, and turning errors into one clear line."""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click
import redis
from rich.console import Console

from taskloop import config
from taskloop.errors import TaskLoopError

if TYPE_CHECKING:
    from taskloop.client import TaskLoop

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

IMPORT_OPTION = click.option(
    "--import", "-I", "imports", multiple=True, metavar="MODULE",
    help="Module that defines workflows (repeatable; also TASKLOOP_IMPORTS).")
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def import_modules(modules: tuple[str, ...]) -> None:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in [*modules, *config.settings().imports]:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise click.ClickException(
                f"cannot import workflow module {name!r}: {exc}; run from the directory that contains "
                "it or add that directory to PYTHONPATH"
            ) from exc


def make_client() -> TaskLoop:
    from taskloop.client import TaskLoop

    return TaskLoop()


def parse_json(option: str, raw: str | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc}); pass e.g. {option} '{{\"topic\": \"x\"}}'") from None
    except RecursionError:
        raise click.BadParameter("nested too deeply to be a run input; flatten it") from None


def resolve(client: TaskLoop, run_id: str) -> str:
    """A run id, or a unique prefix of one (as `taskloop runs` prints them)."""
    return client.find(run_id)


@contextmanager
def clear_errors() -> Iterator[None]:
    """taskloop's errors and Redis failures as one line on stderr, never a traceback."""
    try:
        yield
    except TaskLoopError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
    except redis.exceptions.ResponseError as exc:
        raise click.ClickException(f"Redis refused a command ({exc}); check that TASKLOOP_REDIS_URL points at a "
                                   "Redis server (6.2 or newer) and that its user may run taskloop's commands") from exc
    except (redis.exceptions.RedisError, ValueError) as exc:
        if isinstance(exc, ValueError) and "redis" not in str(exc).lower() and "url" not in str(exc).lower():
            raise
        raise click.ClickException(
            f"TASKLOOP_REDIS_URL does not lead to a Redis server ({type(exc).__name__}: {exc}); use a URL such as "
            "redis://127.0.0.1:6379/0") from exc

"""What every command shares: importing workflow modules, the client, JSON options, run ids by
prefix, and turning errors into one clear line."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from taskloop.base import config, names
from taskloop.base.errors import TaskLoopError
from taskloop.base.text import shown, visible
from taskloop.worker.supervisor import cannot_import

if TYPE_CHECKING:
    from taskloop.runtime.client import TaskLoop

PIPED_WIDTH = 100_000  # piped or redirected output: lines as long as they are (nothing wrapped, no column cut)


def _console(stderr: bool = False) -> Console:
    """A terminal gets Rich's tables and wrapping at its width; a pipe or a file gets whole lines
    (Rich would wrap them at 80 columns and cut table cells), unless COLUMNS asks for a width."""
    found = Console(stderr=stderr, highlight=False)
    if not found.is_terminal and not os.environ.get("COLUMNS"):
        found = Console(stderr=stderr, highlight=False, width=PIPED_WIDTH, soft_wrap=True)
    return found


console = _console()
err_console = _console(stderr=True)

IMPORT_OPTION = click.option(
    "--import", "-I", "imports", multiple=True, metavar="MODULE",
    help="Module that defines workflows (repeatable; also TASKLOOP_IMPORTS).")
REQUEST_OPTION = click.option(
    "--request-id", default=None, metavar="ID",
    help="Without --import: the id of the request a worker carries out; the same id again gives the same verdict.")
JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
MAX_SECONDS = 31_536_000.0  # a year: any longer wait is a typo (and past what time.sleep takes)


class Seconds(click.ParamType):  # type: ignore[type-arg]  # generic in click >= 8.2
    """A number of seconds: finite, from 0 (or above 0 with ``positive``) to a year. Click's float
    takes nan, inf and negative numbers, which end in a traceback deep inside a wait or a sleep."""

    name = "seconds"

    def __init__(self, positive: bool = False) -> None:
        self.positive = positive

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            number = value
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                self.fail(f"{shown(value)} is not a number of seconds", param, ctx)
        low = "above 0" if self.positive else "0 or more"
        if not math.isfinite(number) or number < 0 or (self.positive and number == 0) or number > MAX_SECONDS:
            self.fail(f"{shown(value)} is not a number of seconds {low} (at most {MAX_SECONDS:.0f})", param, ctx)
        return number


def import_modules(modules: tuple[str, ...], find_only: bool = False) -> None:
    """Import the workflow modules (``modules`` and TASKLOOP_IMPORTS), or with ``find_only`` only
    check that each can be found (the supervisor of ``taskloop worker``: its Celery worker imports
    them, and says so and exits with EXIT_BAD_IMPORT when one fails)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in [*modules, *config.settings().imports]:
        if not MODULE_NAME.match(name):
            hint = _module_hint(name) or "e.g. myapp.workflows"
            raise click.BadParameter(f"{shown(name)} is not a module name ({hint})",
                                     param_hint="'--import' / TASKLOOP_IMPORTS")
        try:
            if not find_only:
                importlib.import_module(name)
            elif importlib.util.find_spec(name) is None:
                raise ModuleNotFoundError(f"No module named {name!r}")
        except ImportError as exc:
            hint = _module_hint(name)
            raise click.ClickException(f"cannot import workflow module {name!r}: {hint}" if hint else
                                       cannot_import(name, exc)) from exc


def _module_hint(name: str) -> str:
    """What a file name given as a module name should have been: ``myflow.py`` or ``pkg/flows.py``
    is ``myflow`` or ``pkg.flows``."""
    if not name.endswith(".py"):
        return ""
    module = name[:-3].replace(os.sep, ".").replace("/", ".").strip(".")
    return f"--import takes a module name, not a file: drop the .py (--import {visible(module)})" if module else ""


def check_port(host: str, port: int, what: str) -> None:
    """Refuse, before anything starts, a port that another program (another ``taskloop ui``) listens
    on: the user picks another with --port (the first free one after it is suggested)."""
    if _bindable(host, port):
        return
    free = next((p for p in range(port + 1, min(port + 50, 65536)) if _bindable(host, p)), None)
    other = f" (e.g. --port {free})" if free is not None else ""
    raise click.ClickException(
        f"port {port} on {host} is taken (another {what} already serves there?); choose another port with "
        f"--port{other}")


def _bindable(host: str, port: int) -> bool:
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise click.BadParameter(f"cannot resolve {shown(host)} ({exc})", param_hint="'--host'") from None
    family, kind, proto, _, address = found[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no owner
        try:
            probe.bind(address)
        except OSError:
            return False
    return True



def make_client() -> TaskLoop:
    """The command's client, closed when the command ends (its producer goes back to the pool)."""
    from taskloop.runtime.client import TaskLoop

    client = TaskLoop()
    context = click.get_current_context(silent=True)
    if context is not None:
        context.call_on_close(client.close)
    return client


def parse_json(option: str, raw: str | None) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc}); pass e.g. {option} '{{\"topic\": \"x\"}}'",
                                 param_hint=f"'{option}'") from None
    except RecursionError:
        raise click.BadParameter("nested too deeply to be a run input; flatten it", param_hint=f"'{option}'") from None
    except ValueError as exc:  # an int past Python's 4300-digit limit
        raise click.BadParameter(f"JSON that Python cannot read ({exc})", param_hint=f"'{option}'") from None


def resolve(client: TaskLoop, run_id: str) -> str:
    """A run id, or a unique prefix of one (as `taskloop runs` prints them)."""
    return client.find(cli_run_id(run_id, "RUN_ID"))


def cli_run_id(run_id: str, where: str) -> str:
    """A run id typed on the command line: one that no run can have is refused with a hint for the
    command line (the client's InvalidInput speaks of Python arguments)."""
    if not names.is_run_id(run_id):
        raise click.BadParameter(f"{shown(run_id, 80)} is not a run id ({names.RUN_ID_RULE}); `taskloop runs` "
                                 "lists the runs, and any unique prefix of an id works", param_hint=where)
    return run_id


@contextmanager
def clear_errors() -> Iterator[None]:
    """taskloop's errors and Redis failures as one line on stderr, never a traceback. Anything else
    (a bug) is one line too, saying so; TASKLOOP_DEBUG=1 lets its traceback through."""
    try:
        yield
    except (click.exceptions.ClickException, click.exceptions.Abort, click.exceptions.Exit):
        raise
    except TaskLoopError as exc:
        raise click.ClickException(visible(f"{type(exc).__name__}: {exc}")) from exc
    except Exception as exc:
        _redis_or_unexpected(exc)


def _redis_or_unexpected(exc: Exception) -> None:
    """A Redis failure as one line (redis-py is looked up, not imported: a command that never
    loaded it, such as the supervisor of ``taskloop worker``, cannot have met one); else a bug."""
    errors = getattr(sys.modules.get("redis"), "exceptions", None)
    if errors is not None and isinstance(exc, errors.ResponseError):
        raise click.ClickException(visible(
            f"Redis refused a command ({exc}); check that TASKLOOP_REDIS_URL points at a Redis server (6.2 or "
            "newer) and that its user may run taskloop's commands")) from exc
    if (errors is not None and isinstance(exc, errors.RedisError)) or \
            (isinstance(exc, ValueError) and ("redis" in str(exc).lower() or "url" in str(exc).lower())):
        raise click.ClickException(visible(
            f"TASKLOOP_REDIS_URL does not lead to a Redis server ({type(exc).__name__}: {exc}); use a URL such as "
            "redis://127.0.0.1:6379/0")) from exc
    _unexpected(exc)


def _unexpected(exc: Exception) -> None:
    if os.environ.get("TASKLOOP_DEBUG", "").strip().lower() in ("1", "true", "yes", "on"):
        raise exc
    raise click.ClickException(visible(
        f"unexpected {type(exc).__name__}: {shown(str(exc), 500)[1:-1]} (this is a bug in taskloop or in a "
        "workflow module: run again with TASKLOOP_DEBUG=1 to see the traceback)")) from exc

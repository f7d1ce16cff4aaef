"""The ``taskloop`` command line: runs (runs.py), the fleet (fleet.py), the UI (ui.py), what they show
(display.py)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

import click

from taskloop.cli import fleet, limits, runs, ui
from taskloop.cli.common import clear_errors


def _version() -> str:
    try:
        return version("taskloop")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree that is not installed
        return "unknown"


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        with clear_errors():
            return super().invoke(ctx)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), "--version", "-V", prog_name="taskloop",
                      message="%(prog)s %(version)s (Celery + Redis)")
def cli() -> None:
    """Durable, bounded loop tasks and workflows on Celery + Redis."""


for command in (runs.start, runs.inspect, runs.runs, runs.events, runs.watch, runs.cancel, runs.decide, runs.resume,
                runs.fork, runs.graph,
                fleet.worker, fleet.reconcile_command, fleet.status, fleet.metrics_command, fleet.demo,
                fleet.completion, limits.limits, ui.ui):
    cli.add_command(command)


def main() -> None:
    cli(prog_name="taskloop")

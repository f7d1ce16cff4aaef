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


# `taskloop --help` lists each command with this line: a whole sentence that fits 80 columns
# (click cuts a longer docstring mid-sentence with "...").
SHORT_HELP = {
    "start": "Start a run of a workflow (--wait to follow it).",
    "inspect": "Show a run: tasks, rounds, checks, workers and errors.",
    "runs": "List recent runs, newest first.",
    "events": "Print a run's events in order, with their times.",
    "watch": "Print a run's live text as it comes, until it ends.",
    "cancel": "Cancel a run.",
    "decide": "Approve, reject or resume a gate of a waiting run.",
    "resume": "Replay the interrupted phases of a failed run.",
    "fork": "Start a new run from a round of a finished run.",
    "graph": "Print a workflow as a Mermaid flowchart.",
    "worker": "Run a supervised Celery worker for taskloop phases.",
    "reconcile": "Re-dispatch phases whose lease expired.",
    "status": "Show the fleet: workers, queues, runs and limits.",
    "metrics": "Serve the fleet's Prometheus metrics.",
    "demo": "Run the README example end to end.",
    "completion": "Print the shell completion script.",
    "limits": "Show or change the fleet limits.",
    "ui": "Serve the run UI in a browser.",
}

for command in (runs.start, runs.inspect, runs.runs, runs.events, runs.watch, runs.cancel, runs.decide, runs.resume,
                runs.fork, runs.graph,
                fleet.worker, fleet.reconcile_command, fleet.status, fleet.metrics_command, fleet.demo,
                fleet.completion, limits.limits, ui.ui):
    assert command.name is not None
    command.short_help = SHORT_HELP[command.name]
    cli.add_command(command)


def main() -> None:
    cli(prog_name="taskloop")

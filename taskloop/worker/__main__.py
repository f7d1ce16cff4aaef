"""The Celery worker process that ``taskloop worker`` supervises:
``python -m taskloop.worker <celery worker options>``."""

from __future__ import annotations

import importlib
import sys

from taskloop.base.config import settings
from taskloop.worker.app import run_worker
from taskloop.worker.supervisor import EXIT_BAD_IMPORT, cannot_import


def main() -> None:
    sys.exit(run_worker(sys.argv[1:]))


def import_workflows() -> None:
    """Import TASKLOOP_IMPORTS before Celery starts: a module that fails ends the process with
    one clear line and EXIT_BAD_IMPORT, which the supervisor does not restart (it would fail
    again), instead of Celery's traceback and a restart loop."""
    for name in settings().imports:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            print(f"Error: {cannot_import(name, exc)}", file=sys.stderr)
            sys.exit(EXIT_BAD_IMPORT)


if __name__ == "__main__":
    import_workflows()
    main()

"""The Celery worker process that ``taskloop worker`` supervises:
``python -m taskloop.worker <celery worker options>``."""

from __future__ import annotations

import sys

from taskloop.worker.app import run_worker


def main() -> None:
    sys.exit(run_worker(sys.argv[1:]))


if __name__ == "__main__":
    main()

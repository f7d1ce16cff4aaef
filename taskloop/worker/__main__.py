"""The Celery worker process that ``taskloop worker`` supervises:
``python -m taskloop.worker <celery worker options>``."""

from __future__ import annotations

import sys

from taskloop.worker.app import app


def main() -> None:
    app.worker_main(["worker", *sys.argv[1:]])


if __name__ == "__main__":
    main()

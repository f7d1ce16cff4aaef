"""A workflow module that cannot be imported (tests/integration/test_worker_startup.py): it
needs a package that is not installed."""

import taskloop_no_such_dependency  # type: ignore[import-not-found]  # noqa: F401

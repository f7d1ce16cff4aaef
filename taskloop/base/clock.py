"""All time comes from here, so tests of timeouts and leases can patch one function."""

from __future__ import annotations

import time


def now() -> float:
    """Epoch seconds (wall clock: it is recorded and compared across hosts)."""
    return time.time()

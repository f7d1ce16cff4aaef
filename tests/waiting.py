"""Waiting in tests: poll a condition instead of sleeping for a guessed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 20.0, what: str = "the condition",
               interval: float = 0.02) -> T:
    """Call ``condition`` until it returns something truthy, and return that; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)

"""Helpers more than one test file uses (their fixtures are in tests/conftest.py): a sender that
records what a commit dispatched, and the CLI run on a real pseudo-terminal."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from taskloop.core.begin import Dispatch
from taskloop.define.workflow import Workflow

REPO = Path(__file__).resolve().parent.parent


class Sent:
    """A sender that records the dispatches of each call: (workflow, run, [(key, phase, round, token)])."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[tuple[str, str, int, int]]]] = []

    def __call__(self, workflow: Workflow, run_id: str, dispatches: list[Dispatch]) -> None:
        self.calls.append((workflow.name, run_id, [(d.key, d.phase.value, d.round, d.token) for d in dispatches]))


def on_terminal(argv: list[str], env: dict[str, str], timeout: float = 60.0) -> tuple[int, bytes]:
    """Run ``python -m taskloop ARGV`` on a real pseudo-terminal (colours on: NO_COLOR is dropped),
    from the repository: its exit code and every byte it wrote."""
    import pty

    env = {**env}
    env.pop("NO_COLOR", None)
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI on the terminal
        os.chdir(REPO)
        os.execve(sys.executable, [sys.executable, "-m", "taskloop", *argv], env)
    output = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        output += chunk
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output

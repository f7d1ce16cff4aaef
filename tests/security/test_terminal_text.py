"""Untrusted text on terminals (findings F3, F4 of docs/security.md).

Feedback, outputs, inputs and versions are stored as given: usually a model's reply. The CLI
shows them through one escaper (taskloop/base/text.py): control characters and escapes become
visible (``\\x1b``, ``\\n``), Rich markup is never interpreted. Before the fix ``taskloop
inspect`` exited 1 with MarkupError on ``[/]``, ``[link=...]`` became a real hyperlink, and an
OSC-8 link, a screen clear or a forged event line reached the terminal, piped or not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from taskloop.base.text import terminal_json, visible
from taskloop.core import fields as fld
from taskloop.store import keys as k
from tests.conftest import REPO
from tests.harness import on_terminal as run_on_terminal
from tests.security import flows
from tests.security.conftest import Stack

pytestmark = pytest.mark.timeout(120)

# what a hostile reviewer model could reply: a forged event line, an OSC-8 hyperlink ended by BEL,
# a screen clear, a C1 CSI, a bidi override, and Rich markup that closes a tag or opens a link
FEEDBACK = ("ok\nrun.finished run done \x1b]8;;https://evil/\x07x [/] [link=https://evil.example/]docs[/link] "
            "\x1b[2J\x9b31m \u202e!")
VERSION = "1\nforged-run\tsec-hostile-text\t9\tdone\t\t2026"
HOSTILE_BYTES = [b"\x1b", b"\x07", "\x9b".encode(), "\u202e".encode()]
ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "TASKLOOP_REDIS_URL": stack.server.url}
    return subprocess.run([sys.executable, "-m", "taskloop", *args], capture_output=True, env=env, cwd=REPO,
                          timeout=60)


def on_terminal(stack: Stack, *args: str) -> tuple[int, bytes]:
    """Run the CLI on a real pseudo-terminal (colours on): its exit code and every byte it wrote."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm-256color", "COLUMNS": "200", "LINES": "50",
           "TASKLOOP_REDIS_URL": stack.server.url}
    return run_on_terminal(list(args), env)


def without_styles(output: bytes) -> bytes:
    """What a terminal shows once Rich's own colour codes (SGR) and cursor moves are taken away."""
    return re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", output)


@pytest.fixture(scope="module")
def hostile_run(stack: Stack) -> str:
    run = stack.client.start(flows.hostile_text, input={"note": "[/] [bold]x", "output": FEEDBACK,
                                                        "feedback": FEEDBACK})
    result = run.wait(timeout=60)
    assert result.status == "failed" and result.errors[0].type == "LoopTaskExhausted"
    # a version as it may be stored (recorded by a service or an older release): it tries to forge a row
    stack.probe.hset(k.RunKeys.of(run.run_id).run, fld.F_VERSION, VERSION)
    return run.run_id


def assert_inert(output: bytes) -> None:
    for raw in HOSTILE_BYTES:
        assert raw not in output, f"{raw!r} reached the terminal: {output[-1500:]!r}"


def test_inspect_piped_shows_markup_and_escapes_as_text(stack: Stack, hostile_run: str) -> None:
    done = cli(stack, "inspect", hostile_run)
    assert done.returncode == 0, done.stderr.decode()
    assert_inert(done.stdout)
    text = done.stdout.decode()
    assert "[/] [bold]x" in text  # the input's markup, shown as it is
    assert "last feedback: ok\\nrun.finished run done \\x1b]8;;https://evil/\\x07x [/] " in text
    assert "\\u202e" in text and "\\x9b31m" in text
    assert not any(line.startswith("run.finished") for line in text.splitlines())


def test_inspect_on_a_terminal_exits_0_with_no_escape_of_the_feedback(stack: Stack, hostile_run: str) -> None:
    code, output = on_terminal(stack, "inspect", hostile_run)
    assert code == 0, output[-2000:]
    assert b"\x1b]8;" not in output  # no hyperlink: neither the OSC-8 of the feedback nor [link=...] markup
    assert_inert(without_styles(output))  # and, once Rich's own colours are taken away, no escape at all
    assert b"[link=https://evil.example/]docs[/link]" in output.replace(b"\r\n", b"")


def test_events_piped_and_as_json_forge_no_line(stack: Stack, hostile_run: str) -> None:
    events = stack.client.events(hostile_run)
    done = cli(stack, "events", hostile_run)
    assert done.returncode == 0, done.stderr.decode()
    assert_inert(done.stdout)
    lines = done.stdout.decode().splitlines()
    assert len(lines) == len(events)  # one line per event: the newline in the feedback forged none
    assert all(ISO.match(line) for line in lines), lines
    assert any("rejected: ok\\nrun.finished run done \\x1b]8;;https://evil/" in line for line in lines)
    as_json = cli(stack, "events", hostile_run, "--json")
    assert as_json.returncode == 0
    assert_inert(as_json.stdout)
    decoded = [json.loads(line) for line in as_json.stdout.decode().splitlines()]
    assert len(decoded) == len(events)
    assert any((e.get("data") or {}).get("feedback") == FEEDBACK for e in decoded)  # the JSON keeps the text


def test_events_on_a_terminal(stack: Stack, hostile_run: str) -> None:
    code, output = on_terminal(stack, "events", hostile_run)
    assert code == 0, output[-2000:]
    assert_inert(output)


def test_runs_piped_keeps_one_run_a_line(stack: Stack, hostile_run: str) -> None:
    done = cli(stack, "runs", "--workflow", "sec-hostile-text")
    assert done.returncode == 0, done.stderr.decode()
    assert_inert(done.stdout)
    lines = [line for line in done.stdout.decode().splitlines() if line]
    mine = [line for line in lines if line.startswith(hostile_run)]
    assert len(mine) == 1 and all(len(line.split("\t")) == 6 for line in lines), lines
    assert mine[0].split("\t")[2] == visible(VERSION)  # the version's newline and tabs are shown escaped
    assert not any(line.startswith("forged-run") for line in lines)


def test_runs_on_a_terminal_and_as_json(stack: Stack, hostile_run: str) -> None:
    code, output = on_terminal(stack, "runs", "--workflow", "sec-hostile-text")
    assert code == 0, output[-2000:]
    assert_inert(without_styles(output))
    as_json = cli(stack, "runs", "--workflow", "sec-hostile-text", "--json")
    assert as_json.returncode == 0
    assert_inert(as_json.stdout)
    assert VERSION in [r["version"] for r in json.loads(as_json.stdout)]


def test_the_live_display_shows_the_feedback_inert(stack: Stack) -> None:
    code, output = on_terminal(stack, "start", "sec-hostile-text", "--wait", "--input",
                               json.dumps({"output": 1, "feedback": FEEDBACK}))
    assert code == 1, output[-2000:]  # the loop exhausts its rounds: the run failed, and says so
    assert b"\x1b]8;" not in output and b"\x07" not in output
    assert_inert(without_styles(output))
    assert b"status failed" in without_styles(output)


def test_terminal_json_escapes_what_json_leaves_raw() -> None:
    raw = json.dumps({"f": "a\x9bb\u202ec\u2028d\x7f"}, ensure_ascii=False)
    safe = terminal_json(raw)
    assert json.loads(safe) == json.loads(raw)
    assert all(c not in safe for c in "\x9b\u202e\u2028\x7f")


def test_visible_makes_every_control_visible_and_keeps_text() -> None:
    assert visible("plain text, é 中文") == "plain text, é 中文"
    assert visible("a\nb\tc\rd\x1b[2J\x07\x9b\u202e\ud800") == "a\\nb\\tc\\rd\\x1b[2J\\x07\\x9b\\u202e\\ud800"

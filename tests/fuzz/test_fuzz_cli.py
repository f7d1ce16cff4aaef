"""Fuzzing the command line: ``taskloop`` commands with random run ids, workflow names, JSON inputs
(invalid JSON, huge numbers, nesting 10,000 deep, NaN, lone surrogates), option values (timeouts,
limits, statuses, actions, module names) and stray arguments, through click's CliRunner against a
real redis-server, and a few through a real ``python -m taskloop`` subprocess (argv bytes that are
not UTF-8 included).

Property: a command either succeeds, or exits non-zero with an ``Error: ...`` line that names the
problem; a Python traceback never reaches the output.

CI runs a hundred invocations; ``TASKLOOP_FUZZ_PROFILE=long python -m pytest
tests/fuzz/test_fuzz_cli.py`` runs thousands.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import event, given
from hypothesis import strategies as st

from taskloop.base import config
from taskloop.cli import cli
from taskloop.ops.embedded import RedisServer
from taskloop.runtime.client import TaskLoop
from tests.fuzz import TIMEOUT, fuzz
from tests.fuzz.conftest import REPO
from tests.fuzz.flows import GATES, PING
from tests.fuzz.strategies import SPEC_NAME, SPEC_RUN_ID, hostile_text, is_lossless, is_utf8_text, lossless_json

pytestmark = pytest.mark.timeout(TIMEOUT)

TRACEBACK = "Traceback (most recent call last)"
_serial = itertools.count()


@dataclass
class Runs:
    url: str
    ids: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def runs(fuzz_redis: RedisServer, fuzz_client: TaskLoop) -> Runs:
    """Runs that exist (no worker here: one running, one waiting at a gate, one pending by name)."""
    found = Runs(fuzz_redis.url)
    found.ids["running"] = fuzz_client.start(PING, {}, run_id="fuzz-cli-running").run_id
    found.ids["waiting"] = fuzz_client.start(GATES["input"], {}, run_id="fuzz-cli-waiting").run_id
    found.ids["pending"] = fuzz_client.start("fuzz-cli-unknown", {}, run_id="fuzz-cli-pending").run_id
    return found


def invoke(url: str, args: list[str]) -> Result:
    """``taskloop ARGS`` in this process, against the module's Redis; settings are read afresh."""
    env = {"TASKLOOP_REDIS_URL": url, "TASKLOOP_BROKER_URL": url, "COLUMNS": "200", "TASKLOOP_IMPORTS": None,
           "TASKLOOP_DEBUG": None}
    config.reset()
    try:
        return CliRunner().invoke(cli, args, env=env, prog_name="taskloop")
    finally:
        config.reset()


def assert_clean(result: Result, args: list[str], words: tuple[str, ...] = ()) -> None:
    """Success, or a non-zero exit with an ``Error:`` line (naming one of ``words`` when given),
    and no traceback either way."""
    output = result.output  # stdout and stderr, as a terminal shows them
    assert TRACEBACK not in output, f"taskloop {args!r} printed a traceback:\n{output}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"taskloop {args!r} raised {result.exception!r} (a traceback for the user)")
    if result.exit_code == 0:
        event("exit 0")
        return
    event(f"exit {result.exit_code}")
    if not args:  # no command at all: the help, as click shows it
        assert output.startswith("Usage: taskloop") and result.exit_code == 2, output
        return
    errors = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, f"taskloop {args!r} exited {result.exit_code} without one Error line:\n{output}"
    usage = ("No such option", "No such command", "Missing argument", "Got unexpected extra argument",
             "requires an argument", "Missing option")  # click's own words for a malformed command line
    if words and not any(phrase in errors[0] for phrase in usage):
        assert any(word.lower() in errors[0].lower() for word in words), f"{errors[0]!r} names none of {words}"


# --- arguments ----------------------------------------------------------------------------------

def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


JSON_TEXT = st.one_of(
    lossless_json(max_leaves=8).map(_json_text),
    st.sampled_from(["", "{", "{'a': 1}", "[1,]", "NaN", "Infinity", "-Infinity", "-0.0", "1e400", "null", '"\\ud800"',
                     '{"a": "\\udfff"}', "[" * 10_000 + "]" * 10_000, '{"a":' * 5_000 + "1" + "}" * 5_000,
                     "[" * 300 + "]" * 300, "1" + "0" * 5_000, "-" + "9" * 4_400, '{"k": 1, "k": 2}', "\x00"]),
    hostile_text(max_size=12),
)
RUN_IDS = st.one_of(st.sampled_from(["<running>", "<waiting>", "<pending>", "fuzz-cli", "fuzz-cli-no-such-run", "f"]),
                    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,12}", fullmatch=True), hostile_text(max_size=12),
                    st.sampled_from(["-", "--", "-x", "a" * 201, "a" * 10_000]))
NAMES = st.one_of(st.sampled_from(["fuzz-ping", "fuzz-gate-input", "fuzz-cli-unknown"]),
                  st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,12}", fullmatch=True), hostile_text(max_size=10))
SECONDS = st.one_of(st.sampled_from(["0.2", "0.05", "0", "-1", "nan", "inf", "-inf", "1e400", "1e9", "abc", "", "1,5"]),
                    st.floats().map(repr))
TEXT = st.one_of(st.text(max_size=10), hostile_text(max_size=10))


@dataclass
class Call:
    args: list[str]
    words: tuple[str, ...] = ()  # what the error must name, when the call is known to be wrong


def _short(raw: str, positive: bool = False) -> str:
    """A valid number of seconds becomes a short one (nothing here may wait for long); an invalid
    one stays as it is."""
    return "0.1" if _seconds_ok(raw, positive) and float(raw) > 0.3 else raw


def _seconds_ok(raw: str, positive: bool) -> bool:
    try:
        value = float(raw)
    except ValueError:
        return False
    return value == value and value not in (float("inf"), float("-inf")) and (value > 0 if positive else value >= 0) \
        and value <= 31_536_000


@st.composite
def calls(draw: st.DrawFn) -> Call:
    command = draw(st.sampled_from(["start", "start", "inspect", "events", "cancel", "decide", "resume", "runs",
                                    "graph", "status", "reconcile", "completion", "garbage"]))
    if command == "start":
        name = draw(NAMES)
        args, words = ["start", name], []
        if not SPEC_NAME.match(name):
            words.append("workflow")
        if draw(st.booleans()):
            raw = draw(JSON_TEXT)
            args += ["--input", raw]
            if not _lossless_text(raw):
                words += ["--input", "input"]
        if draw(st.booleans()):
            run_id = draw(RUN_IDS)
            args += ["--run-id", run_id]
            if not (SPEC_RUN_ID.match(run_id) or run_id in ("<running>", "<waiting>", "<pending>")):
                words.append("--run-id")
        if draw(st.integers(0, 3)) == 0:
            version = draw(TEXT)
            args += ["--version", version]
            if not is_utf8_text(version):
                words.append("version")
        if draw(st.integers(0, 3)) == 0:
            seconds = _short(draw(SECONDS))
            args += ["--wait", "--timeout", seconds]
            if not _seconds_ok(seconds, False):
                words.append("--timeout")
        return Call(args, tuple(words))
    if command in ("inspect", "events", "resume"):
        return Call([command, draw(RUN_IDS), *draw(st.sampled_from([[], ["--json"]]))])
    if command == "cancel":
        args = ["cancel", draw(RUN_IDS)]
        if draw(st.booleans()):
            args += ["--reason", draw(TEXT)]
        return Call(args)
    if command == "decide":
        args = ["decide", draw(RUN_IDS), draw(st.sampled_from(["edit", "prep", "nope", "-x"])),
                draw(st.sampled_from(["approve", "reject", "resume", "APPROVE", "", "skip"])),
                "--actor", draw(TEXT)]
        if draw(st.booleans()):
            args += ["--value", draw(JSON_TEXT)]
        if draw(st.booleans()):
            args += ["--reason", draw(TEXT)]
        return Call(args)
    if command == "runs":
        args = ["runs"]
        if draw(st.booleans()):
            args += ["--status", draw(st.sampled_from(["failed", "done", "nope", ""]))]
        if draw(st.booleans()):
            args += ["--workflow", draw(NAMES)]
        if draw(st.booleans()):
            args += ["--limit", draw(st.sampled_from(["1", "0", "-1", "10001", "1e3", "x", str(2**70)]))]
        return Call(args + draw(st.sampled_from([[], ["--ids"], ["--json"]])))
    if command == "graph":
        return Call(["graph", draw(NAMES), *draw(st.sampled_from([[], ["--version", "1"], ["-I", "tests.fuzz.flows"],
                                                                  ["-I", ".bad"], ["-I", "no_such_module_x"]]))])
    if command == "status":
        return Call(["status", *draw(st.sampled_from([[], ["--json"]]))])
    if command == "reconcile":
        if draw(st.booleans()):
            return Call(["reconcile"])
        seconds = draw(SECONDS.filter(lambda s: not _seconds_ok(s, True)))  # a valid --every never returns
        return Call(["reconcile", "--every", seconds], ("--every",))
    if command == "completion":
        return Call(["completion", draw(st.sampled_from(["bash", "zsh", "fish", "powershell", ""]))])
    return Call(draw(st.lists(st.one_of(TEXT, st.sampled_from(["--json", "-h", "--version", "start", "--input",
                                                                "--timeout", "-I", "--", "inspect"])), max_size=5)))


def _lossless_text(raw: str) -> bool:
    try:
        return is_lossless(json.loads(raw))
    except (ValueError, RecursionError):
        return False


def _resolve(args: list[str], ids: dict[str, str]) -> list[str]:
    return [ids.get(arg[1:-1], arg) if arg.startswith("<") and arg.endswith(">") else arg for arg in args]


@given(call=calls())
@fuzz(ci=150, long=5000)
def test_cli_arguments_end_in_a_clear_error_never_a_traceback(runs: Runs, call: Call) -> None:
    args = _resolve(call.args, runs.ids)
    assert_clean(invoke(runs.url, args), args, call.words)


# --- regressions (found by the fuzzer, or reported in issue 14) ---------------------------------

def test_start_input_nested_10000_deep_is_a_clear_error_not_a_recursion_error(runs: Runs) -> None:
    """Issue 14: `taskloop start --input` with JSON nested 10,000 deep printed a RecursionError
    traceback. In-process and in a real subprocess (where the interpreter's stack is the real one)."""
    deep = "[" * 10_000 + "]" * 10_000
    result = invoke(runs.url, ["start", "fuzz-ping", "--input", deep])
    assert result.exit_code == 2 and "nested too deeply" in result.output and TRACEBACK not in result.output
    done = _subprocess(runs.url, "start", "fuzz-ping", "--input", deep)
    assert done.returncode == 2, done
    assert "Error: Invalid value for '--input': nested too deeply" in done.stderr and TRACEBACK not in done.stderr


@pytest.mark.parametrize("args, message", [
    (["start", "fuzz-ping", "--input", "1" + "0" * 5_000], "JSON that Python cannot read"),
    (["start", "fuzz-ping", "--input", '"\\ud800"'], "lone surrogate"),
    (["start", "fuzz-ping", "--input", "[" * 500 + "]" * 500], "nested deeper than 200"),
    (["start", "fuzz-ping", "--wait", "--timeout", "nan"], "'--timeout': 'nan' is not a number of seconds"),
    (["start", "fuzz-ping", "--version", "\ud800"], "version must be None or a non-empty string"),
    (["start", "bad name"], "workflow must be a workflow or its name"),
    (["reconcile", "--every", "-1"], "'--every': '-1' is not a number of seconds"),
    (["inspect", "a\ud800b"], "'a\\ud800b' is not a run id"),
    (["graph", "x", "-I", ".relative"], "'.relative' is not a module name"),
    (["decide", "fuzz-cli-waiting", "edit", "resume", "--actor", "a", "--value", "1" + "0" * 5_000],
     "JSON that Python cannot read"),
], ids=["huge-int", "surrogate", "deep-500", "timeout-nan", "version-surrogate", "bad-name", "every-negative",
        "run-id-surrogate", "relative-module", "decide-huge-int"])
def test_inputs_that_printed_tracebacks_are_clear_errors(runs: Runs, args: list[str], message: str) -> None:
    result = invoke(runs.url, args)
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result
    assert TRACEBACK not in result.output and message in result.output, result.output


def test_an_unexpected_exception_is_one_error_line_and_debug_shows_it(runs: Runs,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug (any exception taskloop does not expect) is one `Error: unexpected ...` line;
    TASKLOOP_DEBUG=1 lets the traceback through for whoever debugs it."""
    import taskloop.runtime.client

    def broken(self: Any, *args: Any, **kwargs: Any) -> None:
        raise KeyError("wf")

    monkeypatch.setattr(taskloop.runtime.client.TaskLoop, "inspect", broken)
    result = invoke(runs.url, ["inspect", "fuzz-cli-running"])
    assert result.exit_code == 1 and "Error: unexpected KeyError: 'wf' (this is a bug" in result.output
    monkeypatch.setenv("TASKLOOP_DEBUG", "1")
    config.reset()
    try:
        debug = CliRunner().invoke(cli, ["inspect", "fuzz-cli-running"], env={"TASKLOOP_REDIS_URL": runs.url})
    finally:
        config.reset()
    assert isinstance(debug.exception, KeyError)


# --- a real process -----------------------------------------------------------------------------

def _subprocess(url: str, *args: str | bytes) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TASKLOOP_REDIS_URL": url, "TASKLOOP_BROKER_URL": url, "PYTHONPATH": str(REPO),
           "COLUMNS": "200"}
    env.pop("TASKLOOP_IMPORTS", None)
    env.pop("TASKLOOP_DEBUG", None)
    argv: list[str | bytes] = [sys.executable, "-m", "taskloop", *args]
    done = subprocess.run(argv, capture_output=True, env=env, cwd=REPO, timeout=60)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(errors="replace"),
                                       done.stderr.decode(errors="replace"))


SUBPROCESS_ARGS = st.one_of(
    st.tuples(st.just("start"), st.just("fuzz-ping"), st.just("--input"),
              st.sampled_from(["1" + "0" * 5_000, '{"a":' * 3_000 + "1" + "}" * 3_000, "NaN", "{", '"\\udcff"'])),
    st.tuples(st.sampled_from(["inspect", "events", "cancel"]),
              st.sampled_from([b"\xff\xfe", b"run\nid", b"a" * 300, b"fuzz-subprocess-no-such-run"])),
    st.tuples(st.just("start"), st.sampled_from([b"\xffname", b"x\ny"]), st.just("--input"), st.just(b'"\xff"')),
    st.tuples(st.just("runs"), st.just("--limit"), st.sampled_from(["0", "x", str(2**70)])),
)


@given(args=SUBPROCESS_ARGS)
@fuzz(ci=4, long=200, live=True)
def test_a_real_taskloop_process_prints_no_traceback(runs: Runs, args: tuple[str | bytes, ...]) -> None:
    done = _subprocess(runs.url, *args)
    assert TRACEBACK not in done.stderr + done.stdout, done.stderr
    assert done.returncode != 0 and done.stderr.count("Error: ") == 1, done


@pytest.fixture(autouse=True)
def _fresh_settings() -> Iterator[None]:
    config.reset()
    yield
    config.reset()

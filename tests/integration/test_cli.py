"""The `taskloop` command line, run as a real subprocess against the test Redis and workers."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.harness import on_terminal
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workers")


def taskloop(*args: str, env: dict[str, str | None] | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m taskloop ARGS``, piped; ``env`` adds to the environment (a None value removes)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", **(env or {})}
    full_env = {name: value for name, value in full_env.items() if value is not None}
    return subprocess.run([sys.executable, "-m", "taskloop", *args], capture_output=True, text=True,
                          env=full_env, cwd=REPO, timeout=timeout)


def test_start_wait_inspect_runs_and_graph() -> None:
    started = taskloop("start", "core", "--import", "tests.integration.flows", "--input", "{}", "--wait")
    assert started.returncode == 0, started.stderr
    out = started.stdout
    assert "round 2 check" in out and "status done" in out and "fix = 12" in out
    run_id = out.split("run ", 1)[1].split()[0]

    inspected = taskloop("inspect", run_id, "--json")
    assert inspected.returncode == 0, inspected.stderr
    view = json.loads(inspected.stdout)
    assert view["status"] == "done"
    assert [(r["round"], r["output"]) for r in view["tasks"]["fix"]["rounds"]] == [(1, 11), (2, 12)]

    table = taskloop("inspect", run_id)
    assert "fix: rounds" in table.stdout and "Try again" in table.stdout

    listed = taskloop("runs", "--workflow", "core", "--json")
    assert run_id in [r["run_id"] for r in json.loads(listed.stdout)]

    events = taskloop("events", run_id)
    assert "run.finished" in events.stdout

    cancelled = taskloop("cancel", run_id)
    assert cancelled.returncode == 0 and "already finished (done)" in cancelled.stdout

    graph = taskloop("graph", "core", "--import", "tests.integration.flows")
    assert "flowchart TD" in graph.stdout and "source --> fix" in graph.stdout


def test_fork_the_demos_run_from_round_2_with_new_feedback() -> None:
    started = taskloop("start", "demo", "--import", "taskloop.examples.demo", "--input", "{}", "--wait")
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.split("run ", 1)[1].split()[0]
    forked = taskloop("fork", run_id[:12], "fix", "2", "--feedback", "aim for twelve", "--wait",
                      "--import", "taskloop.examples.demo")
    assert forked.returncode == 0, forked.stderr
    assert f"forked from {run_id} at fix round 2" in forked.stdout and "status done" in forked.stdout
    new_id = forked.stdout.split("run ", 1)[1].split()[0]
    shown = taskloop("inspect", new_id)
    assert shown.returncode == 0, shown.stderr
    assert f"forked from run {run_id} at fix round 2" in shown.stdout
    assert "[copied]" in shown.stdout and "[fed: aim for twelve]" in shown.stdout
    view = json.loads(taskloop("inspect", new_id, "--json").stdout)
    assert [(r["round"], r["copied"]) for r in view["tasks"]["fix"]["rounds"]] == [(1, True), (2, False)]
    assert view["tasks"]["source"]["copied"] is True
    refused = taskloop("fork", run_id, "fix", "3", "--import", "taskloop.examples.demo")
    assert refused.returncode == 1 and "round 3 of task fix was never reached" in refused.stderr


def test_start_without_wait_prints_the_run_id() -> None:
    started = taskloop("start", "spread", "--import", "tests.integration.flows", "--input", '{"rounds": 1}')
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.strip()
    waited = taskloop("inspect", run_id, "--json")
    assert json.loads(waited.stdout)["workflow"] == "spread"


def test_failed_run_exits_non_zero() -> None:
    started = taskloop("start", "core", "--import", "tests.integration.flows", "--input",
                       '{"fail": "check"}', "--wait", "--json")
    assert started.returncode == 1
    result = json.loads(started.stdout)
    assert result["status"] == "failed" and result["errors"][0]["type"] == "RuntimeError"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("start", "core", "--import", "tests.integration.flows", "--input", "{oops"), "not valid JSON"),
        (("start", "nosuch", "--wait", "--timeout", "30"), "workflow 'nosuch' is not registered"),
        (("start", "core", "--import", "no_such_module"), "cannot import workflow module 'no_such_module'"),
        (("inspect", "no-such-run"), "run 'no-such-run' not found"),
    ],
)
def test_bad_input_gets_a_clear_error(args: tuple[str, ...], message: str) -> None:
    done = taskloop(*args)
    assert done.returncode != 0
    assert message in done.stderr + done.stdout


def test_dead_redis_is_a_clear_error() -> None:
    done = taskloop("inspect", "x", env={"TASKLOOP_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert done.returncode != 0
    assert "StoreUnavailable: cannot reach Redis at redis://127.0.0.1:1/0" in done.stderr
    assert "TASKLOOP_REDIS_URL" in done.stderr


# --- the CLI a person can lean on ---------------------------------------------------------------


def _started(*args: str) -> str:
    done = taskloop("start", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_runs_prints_full_ids_and_any_unique_prefix_works() -> None:
    run_id = _started("spread", "--import", "tests.integration.flows", "--input", '{"rounds": 1}', "--run-id",
                      "cli-prefix-" + os.urandom(6).hex())
    listed = taskloop("runs", "--ids", "--limit", "500")
    assert run_id in listed.stdout.split()
    piped = taskloop("runs", "--workflow", "spread", "--limit", "500")  # piped: no table, nothing cut
    lines = piped.stdout.splitlines()
    assert lines[0] == "run_id\tworkflow\tversion\tstatus\ttermination\tcreated"  # a header line
    assert any(line.startswith(run_id + "\t") for line in lines)
    assert all(len(line.split("\t")) == 6 and "" not in line.split("\t") for line in lines)  # no empty field
    prefix = run_id[: len("cli-prefix-") + 5]
    inspected = taskloop("inspect", prefix, "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["run_id"] == run_id
    _started("spread", "--import", "tests.integration.flows", "--input", '{"rounds": 1}', "--run-id",
             "cli-prefix-" + os.urandom(6).hex())
    ambiguous = taskloop("inspect", "cli-prefix-")
    assert ambiguous.returncode == 1 and "matches several runs" in ambiguous.stderr


def test_version_status_choices_and_help_for_every_option() -> None:
    from taskloop.cli import cli

    version = taskloop("--version")
    assert version.returncode == 0 and version.stdout.startswith("taskloop ")
    bogus = taskloop("runs", "--status", "bogus")
    assert bogus.returncode == 2 and "Invalid value for '--status'" in bogus.stderr and "'running'" in bogus.stderr
    for name, command in cli.commands.items():
        assert command.help, f"taskloop {name} has no help"
        for param in command.params:
            if param.param_type_name == "option":
                assert getattr(param, "help", None), f"taskloop {name} {param.opts} has no help"
    completion = taskloop("completion", "bash")
    assert completion.returncode == 0 and "_TASKLOOP_COMPLETE" in completion.stdout


def test_events_have_human_timestamps_and_cancel_reason_is_recorded() -> None:
    run_id = _started("sleeper", "--import", "tests.integration.flows", "--input", '{"seconds": 30}')
    cancelled = taskloop("cancel", run_id[:12], "--reason", "the user asked")
    assert cancelled.returncode == 0 and "cancelling" in cancelled.stdout
    waited = taskloop("start", "sleeper", "--run-id", run_id, "--input", '{"seconds": 30}', "--wait",
                      "--timeout", "30")
    assert "status cancelled (termination aborted)" in waited.stdout
    assert waited.returncode == 0  # a cancellation is an ending (README, Command line)
    events = taskloop("events", run_id)
    lines = events.stdout.splitlines()
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d +\+0\.000s  run\.started", lines[0])
    assert any("run cancel requested: the user asked" in line for line in lines)
    inspected = taskloop("inspect", run_id)
    assert "cancel requested: the user asked" in inspected.stdout


def test_a_failed_run_shows_its_error_feedback_and_traceback() -> None:
    exhausted = _started("core", "--import", "tests.integration.flows", "--input", '{"target": 99, "numbered": true}')
    crashed = _started("core", "--import", "tests.integration.flows", "--input", '{"fail": "attempt"}')
    taskloop("start", "core", "--run-id", crashed, "--input", '{"fail": "attempt"}', "--wait", "--timeout", "30")
    waited = taskloop("start", "core", "--run-id", exhausted, "--input", '{"target": 99, "numbered": true}',
                      "--wait", "--timeout", "30")
    assert "last feedback: Try again (after round 3)" in waited.stdout
    shown = taskloop("inspect", exhausted).stdout
    assert "LoopTaskExhausted: Loop task fix exhausted its 3 rounds" in shown
    assert "fix: last feedback: Try again (after round 3)" in shown
    assert re.search(r"w[12]@\S+", shown)  # the worker of each round ...
    assert re.search(r"│ 0\.\d{3} ", shown)  # ... and how long its phases took
    crash = taskloop("inspect", crashed).stdout
    assert "ValueError: attempt exploded" in crash and "traceback (last" in crash
    assert 'raise ValueError("attempt exploded")' in crash


def test_a_url_that_does_not_lead_to_redis_is_one_clear_line(tmp_path) -> None:
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer_garbage() -> None:  # something that is not Redis
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

    threading.Thread(target=answer_garbage, daemon=True).start()
    try:
        for url in (f"redis://127.0.0.1:{listener.getsockname()[1]}/0", "http://127.0.0.1:8080/"):
            done = taskloop("runs", env={"TASKLOOP_REDIS_URL": url})
            assert done.returncode == 1, done.stdout
            assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
            assert "redis://" in done.stderr  # it says what a Redis URL looks like
    finally:
        listener.close()


def test_start_wait_with_no_worker_says_so_within_5_seconds(tmp_path) -> None:
    from taskloop.ops.embedded import RedisServer

    with RedisServer(tmp_path) as lonely:  # a Redis that no worker consumes from
        started = time.monotonic()
        done = taskloop("start", "spread", "--import", "tests.integration.flows", "--input", '{"rounds": 1}',
                        "--wait", "--timeout", "5", env={"TASKLOOP_REDIS_URL": lonely.url})
        assert time.monotonic() - started < 30
    assert done.returncode == 1
    assert "no worker is consuming queue 'taskloop'; start one with `taskloop worker --import " \
           "tests.integration.flows`" in done.stdout
    assert "RunTimeout" in done.stderr


def test_the_live_display_in_a_terminal() -> None:
    # Given a real pseudo-terminal
    argv = ["start", "spread", "--import", "tests.integration.flows", "--input", '{"rounds": 3}', "--wait"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    code, output = on_terminal(argv, env)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode(errors="replace"))
    # Then it drew a live table of the tasks with their round and phase, and the check verdicts
    assert code == 0, text[-2000:]
    assert "┃ task" in text and "┃ round" in text and "┃ phase" in text and "grind" in text
    assert "rejected: round 1 is not enough" in text and "accepted" in text
    assert "status done" in text


# --- what a new user tripped on (issue 44, part 4) ----------------------------------------------


def test_start_with_import_refuses_a_workflow_it_does_not_define_and_records_nothing() -> None:
    run_id = "cli-typo-" + os.urandom(6).hex()
    done = taskloop("start", "demoo", "--import", "taskloop.examples.demo", "--run-id", run_id)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "did you mean demo?" in done.stderr and "Traceback" not in done.stderr
    assert "not found" in taskloop("inspect", run_id).stderr  # no run was recorded


def test_command_line_hints_for_an_empty_run_id_and_a_file_given_to_import() -> None:
    empty = taskloop("inspect", "")
    assert empty.returncode == 2 and "is not a run id" in empty.stderr and "taskloop runs" in empty.stderr
    assert "run_id=None" not in empty.stderr  # the client's hint is for Python
    as_file = taskloop("start", "demo", "--import", "myflow.py")
    assert as_file.returncode == 1 and "drop the .py (--import myflow)" in as_file.stderr
    as_path = taskloop("start", "demo", "--import", "pkg/flows.py")
    assert as_path.returncode == 2 and "drop the .py (--import pkg.flows)" in as_path.stderr


def test_help_lists_each_command_with_a_whole_sentence() -> None:
    from taskloop.cli import SHORT_HELP, cli

    shown = taskloop("--help", env={"COLUMNS": "80"}).stdout
    assert "..." not in shown.split("Commands:")[1]
    for name in cli.commands:
        assert re.search(rf"^  {name} +{re.escape(SHORT_HELP[name])}$", shown, re.MULTILINE), (name, shown)
        assert SHORT_HELP[name].endswith(".")


def test_piped_output_is_neither_wrapped_nor_cut() -> None:
    pad = "p" * 150
    run_id = _started("core", "--import", "tests.integration.flows", "--input", json.dumps({"pad": pad}),
                      "--run-id", "cli-piped-" + os.urandom(6).hex())
    taskloop("start", "core", "--run-id", run_id, "--input", json.dumps({"pad": pad}), "--wait", "--timeout", "30")
    shown = taskloop("inspect", run_id, env={"COLUMNS": None}).stdout  # Rich would wrap at 80 columns
    assert any(pad in line and line.startswith("input ") for line in shown.splitlines()), shown
    assert re.search(r"│ w[12]@\S+ +│", shown), shown  # worker names whole


def _taken_port() -> tuple[socket.socket, int]:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held, held.getsockname()[1]


def test_ui_and_demo_ui_refuse_a_taken_port_before_they_start() -> None:
    held, port = _taken_port()
    with held:
        ui = taskloop("ui", "--port", str(port), timeout=30)
        demo = taskloop("demo", "--ui", "--port", str(port), env={"TASKLOOP_REDIS_URL": None}, timeout=30)
    for done in (ui, demo):
        assert done.returncode == 1, done.stdout + done.stderr
        assert f"port {port} on 127.0.0.1 is taken" in done.stderr and "--port" in done.stderr
        assert "Errno" not in done.stderr and "Traceback" not in done.stderr
    assert "embedded redis-server" not in demo.stdout  # the demo did not run


def test_ui_says_at_start_that_redis_is_down_without_the_password_and_serves() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TASKLOOP_REDIS_URL": "redis://u:s3cret@127.0.0.1:1/0"}
    ui = subprocess.Popen([sys.executable, "-m", "taskloop", "ui", "--port", str(port)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert ui.stderr is not None
        said = ui.stderr.readline()  # the first thing it says, before it serves
        assert "cannot reach Redis at redis://u:***@127.0.0.1:1/0" in said and "s3cret" not in said, said
        assert "the UI starts" in said  # and it does: its pages show the error until Redis answers
        wait_until(lambda: ui.poll() is None and _serves(port), timeout=30, what="the UI serves")
    finally:
        ui.terminate()
        ui.communicate(timeout=30)


def _serves(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_ctrl_c_while_waiting_says_the_run_goes_on() -> None:
    run_id = "cli-ctrl-c-" + os.urandom(6).hex()
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    waiting = subprocess.Popen([sys.executable, "-m", "taskloop", "start", "sleeper", "--import",
                                "tests.integration.flows", "--input", '{"seconds": 30}', "--run-id", run_id,
                                "--wait"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while json.loads(taskloop("inspect", run_id, "--json").stdout or "{}").get("status") != "running":
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        time.sleep(1.0)  # the command is waiting
        waiting.send_signal(signal.SIGINT)
        out, err = waiting.communicate(timeout=30)
    finally:
        if waiting.poll() is None:
            waiting.kill()
        taskloop("cancel", run_id)
    assert waiting.returncode == 130, out + err
    assert f"run {run_id} goes on" in err and f"taskloop watch {run_id}" in err and "Aborted!" not in err

"""The supervisor's own logic (taskloop/worker/supervisor.py): its options, its log lines, the
command ``taskloop worker`` execs, and restarting a child, with small stand-in children instead of
a Celery worker (tests/faults/test_supervisor.py runs it over a real one)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from taskloop.worker import supervisor
from taskloop.worker.supervisor import EXIT_BAD_IMPORT, Log, Options, Supervisor, command


def test_options_split_the_supervisors_own_from_the_workers() -> None:
    options = Options(["--loglevel", "debug", "--logfile", "/tmp/w.log", "--", "-c", "2", "--loglevel", "INFO"])
    assert (options.loglevel, options.logfile, options.metrics) == ("debug", "/tmp/w.log", None)
    assert options.worker == ["-c", "2", "--loglevel", "INFO"]
    assert Options(["--metrics", "127.0.0.1:9100"]).metrics == "127.0.0.1:9100"


@pytest.mark.parametrize(("args", "says"), [
    (["--verbose"], "unexpected '--verbose'"),
    (["--logfile"], "a value is missing"),
    (["--loglevel", "LOUD"], "use one of DEBUG, INFO, WARNING, ERROR"),
])
def test_a_wrong_option_names_itself_and_the_usage(args: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as raised:
        Options(args)
    assert says in str(raised.value) and "usage: supervisor.py" in str(raised.value)


def test_log_lines_look_like_celerys_and_respect_the_level(tmp_path: Path) -> None:
    path = tmp_path / "w.log"
    log = Log("WARNING", str(path))
    log.info("not shown")
    log.error("the Celery worker exited unexpectedly")
    Log("INFO", str(path)).info("appended")
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}: ERROR/Supervisor\] the Celery worker exited "
                        r"unexpectedly", lines[0]), lines[0]
    assert lines[1].endswith("INFO/Supervisor] appended")


def test_the_command_is_the_bare_file_unless_metrics_are_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TASKLOOP_METRICS", raising=False)
    bare = command(["-c", "2"], "INFO", None, None)
    assert bare[:4] == [sys.executable, "-S", "-P", os.path.abspath(supervisor.__file__)]
    assert bare[4:] == ["--loglevel", "INFO", "--", "-c", "2"]
    served = command(["-c", "2"], "INFO", "/tmp/w.log", ("127.0.0.1", 9100))
    assert served == [sys.executable, "-m", "taskloop.worker.supervisor", "--loglevel", "INFO", "--logfile",
                      "/tmp/w.log", "--metrics", "127.0.0.1:9100", "--", "-c", "2"]
    monkeypatch.setenv("TASKLOOP_METRICS", "1")  # the restarts are counted: prometheus-client is needed
    assert command([], "INFO", None, None)[1:3] == ["-m", "taskloop.worker.supervisor"]


def test_run_bare_it_imports_neither_taskloop_nor_heavy_standard_modules() -> None:
    """What the bare process loads: `-S` leaves site-packages out, so an import of taskloop or of
    a third-party package would fail; logging, argparse, subprocess and threading are not needed."""
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import supervisor; "
             "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-S", "-P", "-c", probe, str(Path(supervisor.__file__).parent)],
                         capture_output=True, text=True, timeout=30, check=True).stdout.split()
    assert "supervisor" in out
    assert not [m for m in out if m.split(".")[0] in ("taskloop", "logging", "argparse", "subprocess",
                                                     "threading", "celery", "prometheus_client")]


def _stand_in(tmp_path: Path, body: str) -> Supervisor:
    """A supervisor whose child is a small script instead of ``python -m taskloop.worker``."""
    script = tmp_path / "child.py"
    script.write_text(body)
    found = Supervisor([], log=Log("INFO", str(tmp_path / "w.log")))
    found.argv = [sys.executable, str(script), str(tmp_path)]
    return found


def test_a_child_that_dies_is_started_again_and_the_restart_is_logged(tmp_path: Path) -> None:
    # the first child exits with 3, the second with 0 (a clean stop, not restarted)
    sup = _stand_in(tmp_path, "import sys, pathlib\nmark = pathlib.Path(sys.argv[1]) / 'ran'\n"
                              "first = not mark.exists()\nmark.touch()\nsys.exit(3 if first else 0)\n")
    restarted: list[int] = []
    sup.on_restart = restarted.append
    started = time.monotonic()
    assert sup.run() == 0
    assert sup.restarts == 1 and restarted == [3]
    assert time.monotonic() - started >= supervisor.BACKOFF_START_S  # it waited the backoff
    log = (tmp_path / "w.log").read_text()
    assert "exited unexpectedly with code 3; restart 1 in 1 s" in log
    assert sup.child is None


def test_a_child_that_cannot_import_its_workflows_is_not_restarted(tmp_path: Path) -> None:
    sup = _stand_in(tmp_path, f"import sys\nsys.exit({EXIT_BAD_IMPORT})\n")
    assert sup.run() == EXIT_BAD_IMPORT
    assert sup.restarts == 0
    assert "not restarting it" in (tmp_path / "w.log").read_text()


def test_sigterm_is_passed_on_and_ends_the_supervisor_with_the_childs_code(tmp_path: Path) -> None:
    """In a process of its own: the supervisor installs signal handlers."""
    child = tmp_path / "child.py"
    child.write_text("import signal, sys, time, pathlib\n"
                     "signal.signal(signal.SIGTERM, lambda *a: sys.exit(5))\n"
                     "pathlib.Path(sys.argv[1], 'up').touch()\ntime.sleep(60)\n")
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import supervisor as s; "
             "sup = s.Supervisor([]); sup.argv = [sys.executable, sys.argv[2], sys.argv[3]]; "
             "sys.exit(s.exit_code(sup.run()))")
    proc = subprocess.Popen([sys.executable, "-S", "-P", "-c", probe, str(Path(supervisor.__file__).parent),
                             str(child), str(tmp_path)])
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "up").exists():
            assert time.monotonic() < deadline, "the child did not start"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(20) == 5  # the child's code, not restarted
    finally:
        if proc.poll() is None:
            proc.kill()

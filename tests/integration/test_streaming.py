"""Streaming a phase's partial output (SPEC §13) on real `taskloop worker` processes and a real Redis:

- on every pool (prefork, threads, gevent, solo, asyncio with an ``async def`` attempt), the chunks
  a phase streams reach ``client.stream`` while the phase still runs (it is held half-way), in
  order, and the text of each phase is its recorded output;
- a phase that streams a thousand tokens costs a few Redis calls (MONITOR on the test's Redis);
- past TASKLOOP_STREAM_MAX_BYTES the rest is dropped, and the chunk that reached the cap says so;
- with Redis away (a proxy black-holes the worker's connections mid-phase), the phase succeeds with
  its whole output, the text streamed meanwhile is dropped, counted in the worker's metrics and
  marked in the next chunk (its ``dropped`` bytes are exactly the gap);
- bad arguments get clear errors: an unknown run (RunNotFound), an unknown task, a non-str text;
- a phase replayed after its pool process was SIGKILLed mid-stream starts a new segment, which
  readers (``client.stream``, ``taskloop watch``) mark, and whose text is the recorded output;
- a run's live text is kept while a phase that streamed still runs (past the grace), and expires
  the grace after its last write (TASKLOOP_STREAM_GRACE_S set short for that test only);
- ``taskloop watch`` prints the live text as it comes (piped, on a real terminal, as JSON), ends
  with the run and its status, and shows hostile text inert: ANSI and OSC escapes, a carriage
  return, a C1 CSI and a bidi override escaped, Rich markup and HTML as plain text.

Each test has this module's Redis, so that only the workers it starts take its messages.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import taskloop as tl
from taskloop.ops.embedded import RedisServer, free_port
from taskloop.runtime.client import TaskLoop
from tests.conftest import REPO
from tests.harness import on_terminal
from tests.integration.flows import recorded
from tests.proxy import FaultProxy
from tests.waiting import wait_until
from tests.workers import WorkerProcess

IMPORTS = ("tests.integration.stream_flows",)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """This module's own Redis (conftest's ``client`` and ``probe`` then use it)."""
    server = RedisServer(tmp_path_factory.mktemp("streaming-redis")).start()
    yield server
    server.stop()


StartWorker = Callable[..., WorkerProcess]


@pytest.fixture()
def start(redis_server: RedisServer, tmp_path: Path) -> Iterator[StartWorker]:
    started: list[WorkerProcess] = []

    def start_worker(name: str = "s1", pool: str | None = None, concurrency: int = 2,
                     env: dict[str, str] | None = None, args: list[str] | None = None) -> WorkerProcess:
        worker = WorkerProcess(redis_server.url, IMPORTS, tmp_path / f"{name}.log", name=name, pool=pool,
                               concurrency=concurrency, env=env, args=args)
        started.append(worker)
        return worker.ready(60)

    yield start_worker
    for worker in started:
        worker.stop()


class Follower:
    """``client.stream(run_id)`` iterated on a thread: the chunks as they come."""

    def __init__(self, client: TaskLoop, run_id: str, task: str | None = None) -> None:
        self.chunks: list[tl.StreamChunk] = []
        self.error: BaseException | None = None
        self.iterator = client.stream(run_id, task)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for chunk in self.iterator:
                self.chunks.append(chunk)
        except BaseException as exc:  # seen by the test
            self.error = exc

    def text(self, round: int | None = None, phase: str = "attempt") -> str:
        return "".join(c.text for c in list(self.chunks) if c.phase == phase and round in (None, c.round))

    def ended(self, timeout: float = 30.0) -> list[tl.StreamChunk]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "client.stream did not end with the run"
        assert self.error is None, self.error
        return self.chunks


def go(probe: redis.Redis, run_id: str, index: int) -> None:
    probe.set(f"test:{run_id}:go:{index}", "1")


@pytest.mark.parametrize(("pool", "workflow"), [(None, "streamed"), ("threads", "streamed"), ("gevent", "streamed"),
                                                ("solo", "streamed"), ("asyncio", "astreamed")],
                         ids=["prefork", "threads", "gevent", "solo", "asyncio-async"])
def test_chunks_are_seen_live_in_order_and_add_up_to_the_recorded_output(
        start: StartWorker, client: TaskLoop, probe: redis.Redis, pool: str | None, workflow: str) -> None:
    start(pool=pool, concurrency=1 if pool == "solo" else 4)
    run = client.start(workflow, {"count": 12, "holds": [6], "gap_s": 0.01, "rounds": 2})
    follower = Follower(client, run.run_id)

    # Given an attempt held after streaming its first six tokens
    wait_until(lambda: recorded(probe, run.run_id, "held"), 30, "the attempt to hold")
    # Then those six are seen while the phase still runs: nothing of it is recorded yet
    wait_until(lambda: follower.text(1) == "w0 w1 w2 w3 w4 w5 ", 10, "the first six tokens, live")
    view = client.inspect(run.run_id)
    assert view.tasks["write"].status == "active" and view.tasks["write"].rounds[0].output is None
    assert [c.round for c in follower.chunks] == [1] * len(follower.chunks)

    # When it goes on, the chunks follow until the run ends
    go(probe, run.run_id, 6)
    wait_until(lambda: len(recorded(probe, run.run_id, "held")) == 2, 30, "round 2 to hold")
    go(probe, run.run_id, 6)
    chunks = follower.ended()
    result = run.wait(30)
    assert result.status == "done"

    # Then each phase's text, in order, is its recorded output, and the review streamed too
    view = client.inspect(run.run_id)
    for found in view.tasks["write"].rounds:
        assert follower.text(found.round) == found.output == "w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 "
        assert follower.text(found.round, "check") == f"[review of round {found.round}: 38 characters]"
    assert [(c.round, c.phase) for c in chunks] == sorted((c.round, c.phase) for c in chunks)
    assert [c.id for c in chunks] == sorted((c.id for c in chunks), key=lambda i: tuple(map(int, i.split("-"))))
    assert {c.segment for c in chunks} == {1} and not any(c.dropped or c.capped for c in chunks)
    # and RunHandle.stream() of the ended run yields the same chunks and ends at once
    assert list(run.stream()) == chunks
    assert [c.text for c in run.stream(task="write")] == [c.text for c in chunks]


def test_a_thousand_tokens_cost_a_few_redis_calls(start: StartWorker, client: TaskLoop, probe: redis.Redis,
                                                  redis_server: RedisServer) -> None:
    start(pool="threads")
    run_id = "stream-thousand"
    key = f"tl:{{{run_id}}}:stream"
    calls: list[str] = []
    monitor_ready = threading.Event()
    stop = threading.Event()

    def watch() -> None:
        # MONITOR on the test's own Redis: every command that touches the run's live-text stream
        with redis.Redis.from_url(redis_server.url, decode_responses=True).monitor() as monitor:
            monitor_ready.set()
            for command in monitor.listen():
                if key in command["command"]:
                    calls.append(command["command"].split()[0].upper())
                if stop.is_set():
                    return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    monitor_ready.wait(5)
    run = client.start("streamed", {"count": 1000, "gap_s": 0.0005}, run_id=run_id)
    assert run.wait(30).status == "done"
    stop.set()
    probe.ping()  # one more command wakes the monitor's read
    thread.join(10)

    chunks = list(run.stream())
    text = "".join(c.text for c in chunks if c.phase == "attempt")
    assert text == client.inspect(run_id).tasks["write"].rounds[0].output
    assert len(text.split()) == 1000
    xadds = calls.count("XADD")
    # the attempt's thousand tokens and the check's one text: a few writes, each one XADD per phase
    # written and one PEXPIRE, in one round trip
    assert 2 <= xadds <= 12, calls
    assert len(calls) <= 2 * xadds + 2, calls
    assert xadds == len(chunks)


def test_past_the_cap_the_rest_is_dropped_and_marked(start: StartWorker, client: TaskLoop) -> None:
    start(pool="threads", env={"TASKLOOP_STREAM_MAX_BYTES": "100"})
    tokens = ["é" * 10 + " "] * 20  # 21 bytes each: the cap falls inside the fifth token (16 bytes: 8 characters)
    run = client.start("streamed", {"tokens": tokens})
    result = run.wait(30)
    assert result.status == "done" and result.values["write"] == "".join(tokens)  # the output is whole
    chunks = [c for c in run.stream() if c.phase == "attempt"]
    text = "".join(c.text for c in chunks)
    assert len(text.encode()) <= 100 and "".join(tokens).startswith(text) and len(text) == 4 * 11 + 8
    assert [c.capped for c in chunks][-1] and sum(c.capped for c in chunks) == 1


def test_bad_arguments_get_clear_errors(client: TaskLoop, start: StartWorker) -> None:
    with pytest.raises(tl.RunNotFound, match="not found"):
        client.stream("no-such-run")
    with pytest.raises(tl.InvalidInput, match="run_id"):
        client.stream("bad id with spaces")
    start(pool="threads")
    run = client.start("streamed", {"count": 2})
    assert run.wait(30).status == "done"
    with pytest.raises(tl.InvalidInput, match=r"task 'nope' is not a task of run .*; its tasks: write"):
        run.stream(task="nope")
    with pytest.raises(tl.InvalidInput, match="after must be the id of a chunk"):
        client.stream(run.run_id, after="yesterday")
    run = client.start("streamed", {"tokens": ["ok", 3]})
    result = run.wait(30)
    assert result.status == "failed"
    assert "ctx.stream: text must be a str" in result.errors[0].message


def _metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_with_redis_away_the_phase_succeeds_and_the_drop_is_counted_and_marked(
        redis_server: RedisServer, tmp_path: Path, client: TaskLoop, probe: redis.Redis) -> None:
    metrics_port = free_port()
    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        url = proxy.url_for(0)  # the worker's store and broker go through the proxy; the test's do not
        worker = WorkerProcess(url, IMPORTS, tmp_path / "away.log", name="away", broker_url=url, pool="threads",
                               env={"STREAM_PROBE_URL": redis_server.url}, args=["--metrics-port", str(metrics_port)])
        try:
            worker.ready(60)
            run = client.start("streamed", {"count": 30, "holds": [10, 20], "gap_s": 0.05})
            follower = Follower(client, run.run_id)
            wait_until(lambda: follower.text(1) == "".join(f"w{i} " for i in range(10)), 30, "the first ten tokens")

            # When Redis is away while the attempt streams ten more tokens
            proxy.black_hole()
            go(probe, run.run_id, 10)
            wait_until(lambda: len(recorded(probe, run.run_id, "held")) == 2, 30, "ten more tokens")
            time.sleep(2.5)  # a write of live text gives up after 2 s (store/streams.py WRITE_TIMEOUT_S)
            proxy.heal()
            go(probe, run.run_id, 20)

            # Then the phase succeeds with its whole output
            result = run.wait(60)
            output = "".join(f"w{i} " for i in range(30))
            assert result.status == "done" and result.values["write"] == output
            # and the text streamed while Redis was away is missing from the live text, marked where it was
            follower.ended(60)
            streamed = follower.text(1)
            assert streamed != output and streamed.startswith("".join(f"w{i} " for i in range(10)))
            assert streamed.endswith("".join(f"w{i} " for i in range(20, 30)))
            position, whole = 0, output.encode()
            for chunk in (c for c in follower.chunks if c.phase == "attempt"):
                position += chunk.dropped
                assert whole[position:position + len(chunk.text.encode())] == chunk.text.encode()
                position += len(chunk.text.encode())
            assert position == len(whole) and sum(c.dropped for c in follower.chunks) > 0
            # and counted in the worker's metrics
            assert _metric(metrics_port, "taskloop_stream_dropped_chunks_total", reason="unavailable") >= 1
            assert _metric(metrics_port, "taskloop_stream_dropped_bytes_total", reason="unavailable") == \
                sum(c.dropped for c in follower.chunks)
            assert "live text of 1 phase(s) dropped: the store did not take it" in worker.log()
        finally:
            proxy.heal()
            worker.stop()


# what a hostile model could stream: colours, an OSC-8 hyperlink ended by BEL, a carriage return and a
# line clear, a bidi override, a C1 CSI, Rich markup, HTML, and a line break (kept: prose has them)
HOSTILE = ["plain ", "\x1b[31mred\x1b[0m ", "[red]markup[/red] [link=https://evil.example/]x[/link] ",
           "<script>alert(1)</script> ", "\x1b]8;;https://evil/\x07link ", "\r\x1b[2Kgone ", "\u202eevil ",
           "\x9b31m ", "line\nnext "]
HOSTILE_BYTES = [b"\x1b", b"\x07", b"\r", "\x9b".encode(), "\u202e".encode()]


def assert_inert(output: bytes) -> None:
    for raw in HOSTILE_BYTES:
        assert raw not in output, f"{raw!r} reached the terminal: {output[-1500:]!r}"


def test_watch_prints_the_live_text_inert_as_it_comes_and_ends_with_the_run(
        start: StartWorker, client: TaskLoop, probe: redis.Redis, redis_server: RedisServer) -> None:
    start(pool="threads")
    run = client.start("streamed", {"tokens": HOSTILE, "holds": [4]})
    env = {**os.environ, "PYTHONPATH": str(REPO), "TASKLOOP_REDIS_URL": redis_server.url, "COLUMNS": "200"}
    watcher = subprocess.Popen([sys.executable, "-m", "taskloop", "watch", run.run_id[:10]], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    output = bytearray()

    def read() -> None:
        assert watcher.stdout is not None
        for piece in iter(lambda: watcher.stdout.read1(4096), b""):  # type: ignore[union-attr]
            output.extend(piece)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # Given the attempt held after four tokens, the watch shows them already (piped: no styles)
        wait_until(lambda: b"<script>alert(1)</script> " in output or watcher.poll() is not None, 30,
                   "the first tokens in taskloop watch")
        assert watcher.poll() is None, watcher.stderr.read()  # type: ignore[union-attr]
        assert bytes(output).startswith("── write · round 1 · attempt ──\nplain ".encode())
        go(probe, run.run_id, 4)
        assert watcher.wait(30) == 0
    finally:
        watcher.kill()
        watcher.wait(10)
        err = watcher.stderr.read()  # type: ignore[union-attr]
        watcher.stdout.close()  # type: ignore[union-attr]
        watcher.stderr.close()  # type: ignore[union-attr]
    reader.join(5)
    assert not err, err
    # Then it ended with the run, its status last, and every hostile byte escaped or shown as text
    assert_inert(bytes(output))
    text = bytes(output).decode()
    assert "\\x1b[31mred\\x1b[0m [red]markup[/red] [link=https://evil.example/]x[/link] <script>" in text
    assert "\\x1b]8;;https://evil/\\x07link \\r\\x1b[2Kgone \\u202eevil \\x9b31m line\nnext " in text
    assert "── write · round 1 · check ──\n[review of round 1:" in text
    assert "[review of round 1: 155 characters]\n\nstatus done\n  write = " in text
    assert text.endswith('usage {"attempts": 1, "tokens": {"input": 0, "cached": 0, "output": 0}}\n')

    # On a real terminal (colours on), the same text is inert once taskloop's own styles are taken away
    code, shown = on_terminal(["watch", run.run_id], {**env, "TERM": "xterm-256color", "LINES": "50"})
    assert code == 0, shown[-2000:]
    assert b"\x1b]8;" not in shown and b"\x07" not in shown and b"\x1b[31mred" not in shown
    assert_inert(re.sub(rb"\x1b\[[0-9;]*m", b"", shown).replace(b"\r\n", b"\n"))
    assert b"[red]markup[/red]" in shown and b"<script>alert(1)</script>" in shown

    # As JSON: one chunk a line, the text whole in it, then the status
    done = subprocess.run([sys.executable, "-m", "taskloop", "watch", run.run_id, "--json", "--task", "write"],
                          cwd=REPO, env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert_inert(done.stdout)
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert "".join(c["text"] for c in lines[:-1] if c["phase"] == "attempt") == "".join(HOSTILE)
    assert lines[-1] == {"run_id": run.run_id, "status": "done", "termination": None}

    # An unknown run: one line, exit 1
    missing = subprocess.run([sys.executable, "-m", "taskloop", "watch", "no-such-run"], cwd=REPO, env=env,
                             capture_output=True, timeout=60)
    assert missing.returncode == 1 and b"Traceback" not in missing.stderr
    assert missing.stderr.decode().strip().startswith("Error: RunNotFound: run 'no-such-run' not found")


def test_a_phase_replayed_after_a_crash_starts_a_new_segment(start: StartWorker, client: TaskLoop,
                                                             probe: redis.Redis, redis_server: RedisServer) -> None:
    start(concurrency=1)  # prefork: the main process replays a phase whose pool process died, at once
    run = client.start("streamed", {"count": 10, "holds": [5]})
    follower = Follower(client, run.run_id)
    wait_until(lambda: follower.text(1) == "w0 w1 w2 w3 w4 ", 30, "the first five tokens")

    # When the pool process that streams them is killed mid-phase
    [first] = recorded(probe, run.run_id, "calls")
    os.kill(first["pid"], signal.SIGKILL)

    # Then the phase runs again (through, this time), and its text starts again as segment 2
    result = run.wait(60)
    assert result.status == "done" and result.values["write"] == "".join(f"w{i} " for i in range(10))
    chunks = [c for c in follower.ended(60) if c.phase == "attempt"]
    assert [c["attempt"] for c in recorded(probe, run.run_id, "calls")] == [1, 2]  # the attempt ran twice
    first_segment = "".join(c.text for c in chunks if c.segment == 1)
    again = "".join(c.text for c in chunks if c.segment == 2)
    assert first_segment == "w0 w1 w2 w3 w4 " and again == result.values["write"]
    assert [c.replay for c in chunks] == [c.segment == 2 for c in chunks] and chunks[-1].replay
    assert {c.segment for c in chunks} == {1, 2}
    # and taskloop watch says where it started over
    env = {**os.environ, "PYTHONPATH": str(REPO), "TASKLOOP_REDIS_URL": redis_server.url}
    shown = subprocess.run([sys.executable, "-m", "taskloop", "watch", run.run_id], cwd=REPO, env=env,
                           capture_output=True, timeout=60).stdout.decode()
    assert ("── write · round 1 · attempt ──\nw0 w1 w2 w3 w4 \n── write · round 1 · attempt · executed again "
            "(segment 2): its text starts over ──\nw0 w1 ") in shown


def test_the_live_text_is_kept_while_its_phase_runs_and_expires_the_grace_after(
        start: StartWorker, client: TaskLoop, probe: redis.Redis) -> None:
    # TASKLOOP_STREAM_GRACE_S, short for this test only: the live text expires 1.5 s after its last write
    start(pool="threads", env={"TASKLOOP_STREAM_GRACE_S": "1.5"})
    run = client.start("streamed", {"count": 3, "holds": [1]})
    key = f"tl:{{{run.run_id}}}:stream"
    wait_until(lambda: probe.exists(key), 30, "the first token's write")

    # Given the attempt quiet (held) for twice the grace after its first token: its live text stays
    time.sleep(3.0)
    assert probe.exists(key) and 0 < probe.pttl(key) <= 1500
    go(probe, run.run_id, 1)
    assert run.wait(30).status == "done"
    assert "".join(c.text for c in run.stream() if c.phase == "attempt") == "w0 w1 w2 "

    # Then once the run is over it expires the grace after the last phase's end
    assert 0 < probe.pttl(key) <= 1500
    wait_until(lambda: not probe.exists(key), 5, "the live text to expire")
    assert list(run.stream()) == []
    assert client.inspect(run.run_id).tasks["write"].rounds[0].output == "w0 w1 w2 "  # what lasts

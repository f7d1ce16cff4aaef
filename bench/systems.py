"""The systems bench/run.py measures: each starts its workers, starts N loops, checks that every
one ended right, and times one loop. ``Baseline`` is the hand-rolled loop on plain Celery
(bench/baseline.py), ``BaselineKombu`` the same with taskloop's kombu fix, ``DurableFloor`` the
loop plus one Lua compare-and-set and one XADD per step (bench/durable.py), ``TaskLoopSystem``
taskloop itself (bench/flows.py)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from taskloop.ops.embedded import RedisServer, free_port, wait_until_ready

REPO = Path(__file__).resolve().parent.parent
STEPS_PER_LOOP = 6
ROUNDS_PER_LOOP = 3
POLL_S = 0.005
IGNORED_COMMANDS = {"info", "llen", "ping"}  # the benchmark's own polling


def bench_redis(baseline_kombu_env: bool = True) -> tuple[RedisServer, Path, dict[str, str]]:
    """The benchmark's own redis-server (AOF on, in a temporary directory, which also holds the
    workers' logs) and the environment its workers and this process run with: the store and the
    broker on that server, this repository on the path; with ``baseline_kombu_env`` the hand-rolled
    loop's workers run without taskloop's kombu fix unless a system asks for it
    (``BaselineKombu``)."""
    server = RedisServer().start()
    env = {**os.environ, "TASKLOOP_REDIS_URL": server.url, "PYTHONPATH": str(REPO)}
    if baseline_kombu_env:
        env["BENCH_BASELINE_KOMBU_CLIENTS"] = "0"
    env.pop("TASKLOOP_BROKER_URL", None)
    os.environ.update({k: v for k, v in env.items() if k.startswith("TASKLOOP_")})
    return server, Path(server.directory), env


class Failure(Exception):
    """A run or loop ended in the wrong state."""


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def commandstats(r: redis.Redis) -> dict[str, int]:
    stats = r.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def counted(before: dict[str, int], after: dict[str, int], memory_before: int, memory_after: int,
            n: int) -> dict[str, Any]:
    """What Redis did for ``n`` loops between two readings of its command counts and memory: the
    commands per round, each command's share, and the memory per loop."""
    calls = {c: after.get(c, 0) - before.get(c, 0) for c in after if c not in IGNORED_COMMANDS}
    calls = {c: v for c, v in calls.items() if v > 0}
    rounds = n * ROUNDS_PER_LOOP
    return {"commands_per_round": round(sum(calls.values()) / rounds, 2),
            "commands": {c: round(v / rounds, 2) for c, v in sorted(calls.items(), key=lambda kv: -kv[1])},
            "memory_per_run_bytes": round((memory_after - memory_before) / n)}


def median_of(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The sample with the median throughput (its other figures come with it)."""
    ranked = sorted(samples, key=lambda r: r["steps_per_s"])
    chosen = dict(ranked[len(ranked) // 2])
    chosen["samples_steps_per_s"] = [r["steps_per_s"] for r in samples]
    return chosen


def wait_finished(r: redis.Redis, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while r.llen("bench:finished") < n:
        if time.monotonic() > deadline:
            raise Failure(f"only {r.llen('bench:finished')} of {n} finished within {timeout} s")
        time.sleep(POLL_S)


class System:
    name = ""

    def __init__(self, server: RedisServer, env: dict[str, str], logdir: Path) -> None:
        self.url = server.url
        assert server.process is not None
        self.redis_pid = server.process.pid
        self.env = env
        self.logdir = logdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.r = redis.Redis.from_url(self.url, decode_responses=True)
        self.extra: dict[str, list[int]] = {}  # more processes to measure (a separate broker's redis-server)

    def worker_args(self, concurrency: int, node: str, events: bool) -> list[str]:
        raise NotImplementedError

    def start_workers(self, concurrency: int = 2, nodes: int = 1, events: bool = False) -> None:
        self.stop_workers()
        for n in range(nodes):
            log = self.logdir / f"{self.name}-{n}-{uuid.uuid4().hex[:6]}.log"
            args = [sys.executable, "-m", *self.worker_args(concurrency, f"{self.name}{n}", events),
                    "--logfile", str(log)]
            proc = subprocess.Popen(args, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            wait_until_ready(proc, log)
            self.procs.append(proc)

    def stop_workers(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(60)
        self.procs = []

    def start_loops(self, mode: str, n: int) -> list[str]:
        raise NotImplementedError

    def verify(self, mode: str, ids: list[str]) -> None:
        raise NotImplementedError

    def one_latency(self) -> float:
        raise NotImplementedError

    def processes(self) -> dict[str, list[int]]:
        """Every process of the workers: the pool processes (the leaves of each worker's process
        tree) and the rest ("worker main": Celery's main process, and for ``taskloop worker`` also
        its supervisor, the parent of Celery's main process)."""
        main, pool = [], []
        todo = [proc.pid for proc in self.procs]
        while todo:
            pid = todo.pop()
            children = children_of(pid)
            (main if children else pool).append(pid)
            todo += children
        return {"worker main": main, "worker pool": pool, "redis-server": [self.redis_pid], **self.extra,
                "client": [os.getpid()]}

    def counts(self) -> tuple[dict[str, int], int]:
        """The store's command counts and its used memory, read before and after a measurement."""
        return commandstats(self.r), int(self.r.info("memory")["used_memory"])

    def throughput(self, mode: str, n: int, timeout: float = 1800) -> dict[str, Any]:
        self.r.delete("bench:finished")
        before, memory_before = self.counts()
        procs = self.processes()
        cpu_before = {name: sum(cpu_seconds(p) for p in pids) for name, pids in procs.items()}
        started = time.perf_counter()
        ids = self.start_loops(mode, n)
        wait_finished(self.r, n, timeout)
        seconds = time.perf_counter() - started
        cpu = {name: (sum(cpu_seconds(p) for p in pids) - cpu_before[name]) * 1000 / (n * STEPS_PER_LOOP)
               for name, pids in procs.items()}
        after, memory_after = self.counts()
        self.verify(mode, ids)
        return {
            "n": n, "mode": mode, "seconds": round(seconds, 3),
            "steps_per_s": round(n * STEPS_PER_LOOP / seconds, 1),
            **counted(before, after, memory_before, memory_after, n),
            "cpu_ms_per_step": {name: round(v, 3) for name, v in cpu.items()},
        }


class Baseline(System):
    """The hand-rolled loop on plain Celery (bench/baseline.py); subclasses change the module that
    defines the loop, its queue and the worker's environment."""

    name = "baseline"
    module = "bench.baseline"  # a Celery app with tasks attempt and check
    queue = "bench"

    def worker_args(self, concurrency: int, node: str, events: bool) -> list[str]:
        return ["celery", "-A", self.module, "worker", "-c", str(concurrency), "-Q", self.queue,
                "--loglevel", "INFO", "--without-gossip", "--without-mingle", "-n", f"{node}@%h",
                *(["-E"] if events else [])]

    def prepare(self, loop_ids: list[str]) -> None:
        """What is written before the loops' first attempts are sent (nothing for the plain loop)."""

    def send(self, loop_id: str, mode: str) -> None:
        importlib.import_module(self.module).attempt.apply_async((loop_id, 1, mode), queue=self.queue)

    def start_loops(self, mode: str, n: int) -> list[str]:
        ids = [uuid.uuid4().hex for _ in range(n)]
        self.prepare(ids)
        for loop_id in ids:
            self.send(loop_id, mode)
        return ids

    def verify(self, mode: str, ids: list[str]) -> None:
        finished = [line.split() for line in self.r.lrange("bench:finished", 0, -1)]
        expected = "done" if mode == "accept" else "exhausted"
        wrong = [f for f in finished if f[1:] != [expected, "3"]]
        if wrong or sorted(f[0] for f in finished) != sorted(ids):
            raise Failure(f"{self.name} {mode}: {len(wrong)} loops ended wrong, e.g. {wrong[:3]}")

    def one_latency(self) -> float:
        loop_id = f"lat-{uuid.uuid4().hex}"
        self.prepare([loop_id])
        started = time.perf_counter()
        self.send(loop_id, "accept")
        if self.r.blpop([f"bench:result:{loop_id}"], timeout=30) is None:
            raise Failure(f"a {self.name} latency loop did not finish")
        return time.perf_counter() - started


class BaselineKombu(Baseline):
    """The hand-rolled loop with taskloop's kombu fix (one Redis client per channel,
    taskloop/celery_fixes/transport.py): not Celery's defaults, it isolates taskloop's own cost."""

    name = "baseline-kombu"
    queue = "bench-kombu"

    def __init__(self, server: RedisServer, env: dict[str, str], logdir: Path) -> None:
        super().__init__(server, {**env, "BENCH_BASELINE_KOMBU_CLIENTS": "1", "BENCH_QUEUE": self.queue}, logdir)


class DurableFloor(Baseline):
    """The hand-rolled loop plus one Lua compare-and-set and one XADD per step (bench/durable.py)."""

    name = "durable"
    module = "bench.durable"
    queue = "durable"

    def prepare(self, loop_ids: list[str]) -> None:
        from bench.durable import begin

        pipe = self.r.pipeline(transaction=False)
        for loop_id in loop_ids:
            begin(pipe, loop_id)
        pipe.execute()


class TaskLoopSystem(System):
    name = "taskloop"

    def __init__(self, server: RedisServer, env: dict[str, str], logdir: Path,
                 broker: RedisServer | None = None) -> None:
        super().__init__(server, env, logdir)
        from taskloop import TaskLoop

        self.client = TaskLoop(self.url, broker.url if broker else None)
        if broker is not None:
            assert broker.process is not None
            self.extra = {"broker redis-server": [broker.process.pid]}

    metrics_port = False  # the rss section measures a worker with --metrics-port too

    def worker_args(self, concurrency: int, node: str, events: bool) -> list[str]:
        metrics = ["--metrics-port", str(free_port())] if self.metrics_port else []
        return ["taskloop", "worker", "--import", "bench.flows", "-c", str(concurrency), "--loglevel", "INFO",
                "-n", f"{node}@%h", *(["-E"] if events else []), *metrics]

    def start_loops(self, mode: str, n: int) -> list[str]:
        from bench.flows import accept, exhaust

        workflow = accept if mode == "accept" else exhaust
        return [self.client.start(workflow).run_id for _ in range(n)]

    def verify(self, mode: str, ids: list[str]) -> None:
        from taskloop.core import fields as fld

        names = [fld.F_STATUS, fld.F_TERMINATION, fld.value_field("loop"), fld.task_field("loop")]
        # the store's reads: a run that ended may be compacted already (taskloop/store/compacted.py)
        rows = [self.client.store.hmget(run_id, names) for run_id in ids]
        wrong = []
        for run_id, (status, term, value, raw) in zip(ids, rows, strict=True):
            assert raw is not None
            record = json.loads(raw)
            if mode == "accept":
                ok = (status, term, value, record.get("round")) == ("done", None, "3", 3)
            else:
                ok = (status, term, record.get("round")) == ("failed", "failed", 3) and \
                    record["error"]["type"] == "LoopTaskExhausted"
            if not ok:
                wrong.append((run_id, status, term, value))
        if wrong:
            raise Failure(f"taskloop {mode}: {len(wrong)} runs ended wrong, e.g. {wrong[:3]}")

    def one_latency(self) -> float:
        from bench.flows import accept

        started = time.perf_counter()
        result = self.client.start(accept).wait(timeout=30)
        elapsed = time.perf_counter() - started
        if result.status != "done" or result.values != {"loop": 3}:
            raise Failure(f"a taskloop latency run ended wrong: {result}")
        return elapsed


def _memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in kB (PSS shares the pages a forked pool shares with its parent)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(status.split("VmRSS:")[1].split()[0])
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return rss, int(rollup.split("\nPss:")[1].split()[0])


def worker_memory(system: System) -> dict[str, Any]:
    pids = [pid for name in ("worker main", "worker pool") for pid in system.processes()[name]]
    sizes = [_memory_kb(pid) for pid in pids]
    return {"processes": len(pids), "rss_mb": round(sum(r for r, _ in sizes) / 1024, 1),
            "pss_mb": round(sum(p for _, p in sizes) / 1024, 1),
            "per_process_rss_mb": sorted(round(r / 1024, 1) for r, _ in sizes)}

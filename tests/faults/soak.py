"""The chaos soak: a seeded stream of workflows under a random mix of every fault kind, then an
offline proof that every run ended correctly.

    python -m tests.faults.soak --faults 1000 --seed 2112 --report /tmp/soak-1000.md

One run of it:

1. **Start** a private redis-server (AOF on, a free port; never the one on 6379) and
   ``--workers`` `taskloop worker` processes (2 pool processes each) at the shipped defaults
   (``--timers defaults``: 30 s running lease, 300 s queued lease, reconciler every 5 s), or with
   the short timers of tests/faults/harness.py (``--timers short``: 2 s, 6 s, 0.5 s), importing
   tests.faults.flows and tests.faults.soak_flows. The workers reach Redis
   (store and broker) through a TCP proxy (tests/proxy.py) that the network faults control; the
   driver and the callbacks' log talk to Redis directly.
2. **Inject** ``--faults`` faults, one about every ``--pace`` seconds, their kinds drawn by the
   seed (tests/faults/injectors.py: every kind at least once), while the driver keeps ``--live``
   runs going: loops that accept, exhaust or raise, a task that retries twice, gates it approves or
   rejects, and runs it cancels part-way (tests/faults/soak_flows.py).
   A worker that dies on its own (not by an injected fault) is a problem: it is reported with its
   last log lines and replaced, so the soak goes on with the whole fleet.
3. **Drain**: no new runs and no new faults; stopped processes are continued, replacement workers
   come up, every run must end within ``--drain-timeout`` seconds.
4. **Check the fleet**: every worker that should live lives with its whole pool, answers a ping,
   and runs part of a final batch of runs.
5. **Check** every run offline (tests/faults/checker.py) and write the report (``--report``).

The exit status is 0 only when the checker found nothing. The seed fixes the sequence of fault
kinds, the mix of runs, and each choice among what the fleet offers at that moment; the moments
themselves depend on the machine. The working directory (worker logs, the Redis AOF, the faults
and runs as JSON lines) is kept when the soak fails, or with ``--keep``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from taskloop.base.errors import GateRefused, StoreUnavailable, TaskLoopError
from taskloop.core import fields as fld
from taskloop.core.snapshot import RunMeta
from taskloop.ops.embedded import wait_until_ready
from taskloop.runtime import starting
from taskloop.runtime.client import TaskLoop
from tests.faults import soak_flows
from tests.faults.checker import TERMINAL, Run, Verdict, check, malformed, render
from tests.faults.harness import PROFILES, Cluster, client_settings, timer
from tests.faults.injectors import Fault, Injector, plan
from tests.proxy import FaultProxy
from tests.workers import WorkerProcess, alive

MODULES = ["tests.faults.flows", "tests.faults.soak_flows"]
READY_TIMEOUT_S = 90.0


def ppids() -> dict[int, int]:
    """pid -> parent pid of every process (one pass over /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def worker_tree(root: int, parents: dict[int, int]) -> tuple[list[int], int, list[int]]:
    """The processes of one ``taskloop worker``: (its supervisor if it has one, the Celery worker
    process, its pool). A supervised worker runs the Celery worker as ``python -P
    taskloop/worker/boot.py`` (which runs ``taskloop.worker`` in that process) in a child process;
    an unsupervised one is the Celery worker itself."""
    kids = [pid for pid, parent in parents.items() if parent == root]
    celery = [pid for pid in kids if "-m taskloop.worker" in cmdline(pid) or "taskloop/worker/boot.py" in cmdline(pid)]
    if celery:
        main = celery[0]
        return [root], main, [pid for pid, parent in parents.items() if parent == main]
    return [], root, kids


class SoakCluster(Cluster):
    """The harness's cluster, with workers that import the soak's workflows too, started without
    blocking (a replacement comes up while the soak goes on) and named s1, s2, ..."""

    def __init__(self, tmp: Path, seed: int, size: int = 3, concurrency: int = 2,
                 timers: dict[str, str] | None = None) -> None:
        super().__init__(tmp, seed, timers=PROFILES["defaults"] if timers is None else timers)
        self.size = size
        self.concurrency = concurrency
        self.retired: set[str] = set()  # killed on purpose
        self.starting: dict[str, float] = {}  # name -> monotonic time of its spawn
        self.serial = 0
        # a client that retries briefly: the driver rides out Redis restarts without blocking long
        self.soak_probe = redis.Redis.from_url(
            self.redis.url, decode_responses=True, retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
            retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])
        self.celery_pids: dict[str, int] = {}  # the Celery worker process of each worker, once ready
        self.proxy: FaultProxy | None = None  # between the workers and Redis (the network faults)

    def start(self, workers: tuple[str, ...] = (), concurrency: int = 2) -> SoakCluster:
        self.redis.start()
        self.proxy = FaultProxy("127.0.0.1", self.redis.port).start()
        names = [self.spawn_next() for _ in range(self.size)]
        for name in names:
            wait_until_ready(self.workers[name], self.tmp / f"{name}.log", READY_TIMEOUT_S)
        self.client = TaskLoop(self.redis.url, config=client_settings(self.redis.url, self.timers))
        self.probe = redis.Redis.from_url(self.redis.url, decode_responses=True)
        for name in names:
            self._ready(name)
        return self

    def start_worker(self, name: str, concurrency: int = 2) -> None:
        self.spawn(name, concurrency)
        wait_until_ready(self.workers[name], self.tmp / f"{name}.log", READY_TIMEOUT_S)
        self._ready(name)

    def _ready(self, name: str) -> None:
        self.starting.pop(name, None)
        self.celery_pids[name] = self.processes(name)[1]

    def processes(self, name: str) -> tuple[list[int], int, list[int]]:
        return worker_tree(self.workers[name].pid, ppids())

    def spawn(self, name: str, concurrency: int | None = None) -> None:
        assert self.proxy is not None
        url = self.proxy.url_for(0)
        self.workers[name] = WorkerProcess(url, MODULES, self.tmp / f"{name}.log", name=name, broker_url=url,
                                           concurrency=concurrency or self.concurrency,
                                           env={**self.env, "FAULT_PROBE_URL": self.redis.url})
        self.starting[name] = time.monotonic()

    def spawn_next(self) -> str:
        self.serial += 1
        name = f"s{self.serial}"
        self.spawn(name)
        return name

    def poll_starting(self, problems: list[str]) -> None:
        for name, since in list(self.starting.items()):
            log = self.tmp / f"{name}.log"
            if log.exists() and " ready." in log.read_text():
                self._ready(name)
            elif self.workers[name].poll() is not None or time.monotonic() - since > READY_TIMEOUT_S:
                problems.append(f"fleet: worker {name} did not start (exit {self.workers[name].poll()}); "
                                f"log tail: {log.read_text()[-500:] if log.exists() else ''}")
                del self.starting[name]
                self.retire(name)
                self.spawn_next()

    def watch(self, problems: list[str]) -> None:
        """A worker that died on its own (not killed by an injector) is a problem: note it with its
        last log lines, and replace it so that the soak goes on with the whole fleet."""
        for name in self.live_nodes():
            proc = self.workers[name]
            first = self.celery_pids.get(name)
            if proc.poll() is None and (first is None or alive(first)):
                continue
            tail = [line for line in self.log(name).splitlines() if line.startswith("[")][-3:]
            problems.append(f"fleet: worker {name} died on its own at {time.strftime('%H:%M:%S')} (`taskloop "
                            f"worker` exit status {proc.poll()}, Celery worker pid {first}); last log lines: "
                            + " | ".join(line[:200] for line in tail))
            self.retire(name)
            self.spawn_next()

    def retire(self, name: str) -> None:
        """Take a worker out of the fleet for good (its processes are killed if they still run)."""
        self.retired.add(name)
        proc = self.workers[name]
        if proc.poll() is None:
            supervisor, main, pool = self.processes(name)
            for pid in [*supervisor, main, *pool]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait(10)

    def live_nodes(self) -> list[str]:
        """Workers that are up (not killed, not still starting)."""
        return [name for name in self.workers if name not in self.retired and name not in self.starting]

    def pools(self) -> dict[int, str]:
        """Pool process pid -> its worker, for the workers that are up."""
        parents = ppids()
        found = {}
        for name in self.live_nodes():
            for pid in worker_tree(self.workers[name].pid, parents)[2]:
                found[pid] = name
        return found

    def stop(self) -> None:
        self.soak_probe.close()
        if self.probe is not None:
            self.probe.close()
        if self.proxy is not None:
            self.proxy.heal()  # a warm shutdown needs Redis
        try:
            super().stop()
        finally:
            if self.proxy is not None:
                self.proxy.stop()


def _never_send(workflow: Any, run_id: str, dispatches: list[Any]) -> None:
    """A sender that loses every message: the process "died" between the write and the send."""


class Driver:
    """Keeps runs going, decides gates, cancels runs, injects the faults, then drains."""

    def __init__(self, cluster: SoakCluster, seed: int, faults: int, live: int = 30, pace: float = 0.7,
                 kinds: tuple[str, ...] | None = None) -> None:
        self.cluster = cluster
        self.seed = seed
        self.rng = random.Random(seed)
        self.run_rng = random.Random(f"runs-{seed}")
        self.kinds = deque(plan(faults, self.rng, kinds))
        self.live_target = live
        self.pace = pace
        self.runs: list[Run] = []
        self.pending_starts: list[Run] = []
        self.cancels: list[Run] = []  # runs to cancel once their time comes
        self.faults: list[Fault] = []
        self.notes: list[str] = []
        self.injector = Injector(self)
        self.topping_up = True
        self.serial = 0

    @property
    def client(self) -> TaskLoop:
        assert self.cluster.client is not None
        return self.cluster.client

    def note(self, message: str) -> None:
        self.notes.append(f"{time.strftime('%H:%M:%S')} {message}")

    def live_runs(self) -> list[Run]:
        return [run for run in self.runs if run.status not in TERMINAL]

    # runs -------------------------------------------------------------------------------------
    def new_run(self, final: bool = False) -> Run:
        self.serial += 1
        rng = self.run_rng
        hold = rng.choice([0.1, 0.15, 0.2, 0.3])
        case = "final" if final else rng.choices(
            ["accept", "exhaust", "raise", "retry", "approve", "reject"], [30, 10, 10, 15, 12, 8])[0]
        data: dict[str, Any]
        if case == "final":
            workflow, data = "soak-loop", {"mode": "accept", "accept_round": 2, "hold_s": 0.05}
        elif case in ("accept", "exhaust", "raise"):
            workflow, data = "soak-loop", {"mode": case, "hold_s": hold}
            if case == "accept":
                data["accept_round"] = rng.randint(1, soak_flows.MAX_ROUNDS)
            if case == "raise":
                data.update(raise_round=rng.randint(1, soak_flows.MAX_ROUNDS),
                            raise_phase=rng.choice(["attempt", "check"]))
        elif case == "retry":
            workflow, data = "soak-retry", {"hold_s": hold}
        else:
            workflow, data = "soak-gate", {"decision": case, "hold_s": hold,
                                           "decide_after_s": round(rng.uniform(0.0, 0.6), 2)}
        cancel_after = round(rng.uniform(0.3, 3.0), 2) if not final and rng.random() < 0.12 else None
        label = soak_flows.expected(workflow, data).label + (" (final batch)" if final else "")
        if cancel_after is not None:
            label += " + cancel"
        return Run(f"s{self.seed}-{self.serial:05d}", workflow, data, label, cancel_after=cancel_after, final=final)

    def start_run(self, unsent: bool = False, final: bool = False, run: Run | None = None) -> Run | None:
        """Start a new run (or retry the start of ``run`` under its own id). ``unsent``: its first
        message is never sent. None when Redis is away (the start is retried later)."""
        if run is None:
            run = self.new_run(final)
            run.unsent = unsent
        workflow = soak_flows.WORKFLOWS[run.workflow]
        run.started = time.time()
        try:
            if run.unsent:
                starting.start_defined(self.client.store, _never_send, workflow, run.input, run.run_id,
                                       self.client.settings)
            else:
                self.client.start(workflow, input=run.input, run_id=run.run_id)
        except StoreUnavailable:
            if run not in self.pending_starts:
                self.pending_starts.append(run)
            return None
        if run in self.pending_starts:
            self.pending_starts.remove(run)
            run.unsent = False  # it may have been sent by an earlier try: not counted as a fault
        self.runs.append(run)
        if run.cancel_after is not None:
            self.cancels.append(run)
        return run

    def top_up(self) -> None:
        for run in list(self.pending_starts):
            if self.start_run(run=run) is None:
                return
        missing = self.live_target - len(self.live_runs())
        for _ in range(min(missing, 4)):
            if self.start_run() is None:
                return

    def poll(self) -> None:
        live = self.live_runs()
        if not live:
            return
        rows = self.client.store.run_metas([run.run_id for run in live])
        for run, row in zip(live, rows, strict=True):
            if row[1] is None:
                run.status = "missing"
                continue
            run.status = RunMeta.from_fields(run.run_id, dict(zip(fld.META_FIELDS, row, strict=True))).status.value

    def act(self) -> None:
        now, mono = time.time(), time.monotonic()
        for run in list(self.cancels):  # due whether the run is still live or not
            if now < run.started + (run.cancel_after or 0.0):
                continue
            run.cancel_calls += 1
            try:
                run.cancel = self.client.cancel(run.run_id, "soak driver")
                run.cancel_at = time.time()
                self.cancels.remove(run)
            except StoreUnavailable:
                pass
            except TaskLoopError as exc:
                self.note(f"cancel {run.run_id}: {exc!r}")
                self.cancels.remove(run)
        for run in self.live_runs():
            if run.workflow != "soak-gate" or run.status != "waiting" or run.cancel is not None:
                run.seen_waiting = None
                continue
            if run.seen_waiting is None:
                run.seen_waiting = mono
            elif mono - run.seen_waiting >= run.input["decide_after_s"]:
                run.seen_waiting = mono  # decide again only if it is still waiting a moment later
                try:
                    self.client.decide(run.run_id, "approval", run.input["decision"], actor=soak_flows.GATE_ACTOR)
                    run.decisions += 1
                except (StoreUnavailable, GateRefused):
                    pass
                except TaskLoopError as exc:
                    self.note(f"decide {run.run_id}: {exc!r}")

    def tick(self) -> None:
        try:
            self.poll()
        except StoreUnavailable:
            pass
        self.act()
        if self.topping_up:
            self.top_up()
        self.injector.tick()

    # the phases of the soak -------------------------------------------------------------------
    def inject_all(self) -> None:
        next_at = time.monotonic() + 1.0
        # a bound on the time, whatever happens: five times the planned pace, plus two minutes (a
        # CI run on a slow day injected 57 of 60 faults in the earlier bound of three times plus one)
        give_up = time.monotonic() + 5 * self.pace * len(self.kinds) + 120
        while self.kinds:
            self.tick()
            now = time.monotonic()
            if now > give_up:
                self.injector.problems.append(f"harness: only {len(self.faults)} of "
                                              f"{len(self.faults) + len(self.kinds)} faults injected in time")
                break
            if now >= next_at:
                fault = self._inject_next()
                if fault is None:
                    next_at = now + 0.1
                else:
                    self.faults.append(fault)
                    next_at = max(next_at + self.rng.uniform(0.4, 1.6) * self.pace, now - 2 * self.pace)
                    if len(self.faults) % 100 == 0:
                        self.note(f"{len(self.faults)} faults injected, {len(self.runs)} runs started")
            time.sleep(0.03)

    def _inject_next(self) -> Fault | None:
        """The next kind in the sequence that the fleet offers a target for (looking 4 ahead)."""
        for i, kind in enumerate(list(self.kinds)[:4]):
            fault = self.injector.inject(kind)
            if fault is not None:
                del self.kinds[i]
                return fault
        return None

    def drain(self, timeout: float) -> None:
        self.topping_up = False
        self.injector.settle()
        deadline = time.monotonic() + timeout
        while (self.live_runs() or self.pending_starts or self.cancels) and time.monotonic() < deadline:
            self.tick()
            for run in list(self.pending_starts):
                self.start_run(run=run)
            time.sleep(0.1)
        for run in self.live_runs():
            self.note(f"drain: {run.run_id} ({run.label}) still {run.status} after {timeout:.0f}s")

    def check_fleet(self) -> list[str]:
        """Every worker that should be alive is, with its whole pool; each answers a ping and runs
        part of a final batch of runs."""
        cluster = self.cluster
        problems = list(self.injector.problems)
        nodes = cluster.live_nodes()
        if len(nodes) != cluster.size:
            problems.append(f"fleet: {len(nodes)} workers up, expected {cluster.size}: {nodes}")
        deadline = time.monotonic() + 20
        while True:
            pools = cluster.pools()
            short = {name: sum(1 for node in pools.values() if node == name) for name in nodes}
            short = {name: n for name, n in short.items() if n != cluster.concurrency}
            if not short or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for name in nodes:
            proc = cluster.workers[name]
            supervisor, main, _ = cluster.processes(name)
            first = cluster.celery_pids.get(name)
            if proc.poll() is not None:
                problems.append(f"fleet: worker {name} died (`taskloop worker` pid {proc.pid} exited with status "
                                f"{proc.poll()}; its Celery worker was pid {first})")
            elif first is None or not alive(first):
                now = main if supervisor else None
                problems.append(f"fleet: the Celery worker of {name} (pid {first}) died; "
                                + (f"restarted as pid {now}" if now else "not running now"))
            log = cluster.log(name)
            for bad in ("Unrecoverable error", "exited unexpectedly"):
                if bad in log:
                    problems.append(f"fleet: worker {name} logged {bad!r}")
        problems += [f"fleet: worker {name} has {n} pool processes, expected {cluster.concurrency}"
                     for name, n in short.items()]
        host = socket.gethostname()
        expected = {f"{name}@{host}" for name in nodes}
        answered: set[str] = set()
        for _ in range(3):
            replies = self.client.app.control.ping(timeout=3.0) or []
            answered |= {name for reply in replies for name in reply}
            if expected <= answered:
                break
        if not expected <= answered:
            problems.append(f"fleet: no ping answer from {sorted(expected - answered)}")
        consumed: set[str] = set()
        for _attempt in range(3):
            batch = [r for r in (self.start_run(final=True) for _ in range(4 * len(nodes))) if r is not None]
            deadline = time.monotonic() + 60
            while any(r.status not in TERMINAL for r in batch) and time.monotonic() < deadline:
                self.tick()
                time.sleep(0.1)
            if any(r.status != "done" for r in batch):
                problems.append("fleet: the final batch did not complete: "
                                + ", ".join(f"{r.run_id}={r.status}" for r in batch if r.status != "done"))
                break
            ids = {r.run_id for r in batch}
            pools = cluster.pools()
            for raw in cluster.soak_probe.lrange(soak_flows.EXECS, 0, -1):
                entry = json.loads(raw)
                if entry["ev"] == "exec" and entry["run"] in ids and entry["pid"] in pools:
                    consumed.add(pools[entry["pid"]])
            if set(nodes) <= consumed:
                break
        if not set(nodes) <= consumed:
            problems.append(f"fleet: workers {sorted(set(nodes) - consumed)} ran nothing of 3 final batches")
        return problems


@dataclasses.dataclass
class SoakResult:
    verdict: Verdict
    faults: list[Fault]
    runs: list[Run]
    report: str
    tmp: Path


def soak(faults: int, seed: int, tmp: Path, *, workers: int = 3, live: int = 30, pace: float = 0.7,
         drain_timeout: float | None = None, command: str = "", echo: Any = print,
         kinds: tuple[str, ...] | None = None, timers: str = "defaults") -> SoakResult:
    """Run the soak in ``tmp`` and return the checker's verdict and the report (``timers``: a
    profile of tests/faults/harness.py PROFILES)."""
    t0 = time.monotonic()
    cluster = SoakCluster(tmp, seed, size=workers, timers=PROFILES[timers])
    if drain_timeout is None:  # a lost message waits for its queued lease, a stopped process for its lease
        drain_timeout = (timer(cluster.timers, "TASKLOOP_QUEUED_LEASE_S")
                         + 4 * timer(cluster.timers, "TASKLOOP_LEASE_S") + 60.0)
    try:
        cluster.start()
        t_start = time.monotonic()
        echo(f"soak: seed {seed}, {faults} faults, {workers} workers, {live} live runs; working in {tmp}")
        driver = Driver(cluster, seed, faults, live=live, pace=pace, kinds=kinds)
        driver.inject_all()
        t_inject = time.monotonic()
        echo(f"soak: {len(driver.faults)} faults injected in {t_inject - t_start:.0f}s; draining")
        driver.drain(drain_timeout)
        t_drain = time.monotonic()
        fleet = driver.check_fleet()
        t_fleet = time.monotonic()
        echo(f"soak: fleet checked in {t_fleet - t_drain:.0f}s; checking {len(driver.runs)} runs")
        log: list[str] = cluster.soak_probe.lrange(soak_flows.EXECS, 0, -1)  # type: ignore[assignment]
        verdict = check(driver.client, driver.runs, driver.faults, log)
        for problem in fleet:
            verdict.add("harness" if problem.startswith(("redis-kill", "harness")) else "fleet", problem)
        t_check = time.monotonic()
        bad = malformed(verdict, driver.faults, [cluster.log(name) for name in cluster.workers],
                        [cluster.log(name) for name in cluster.retired])
        meta = {
            "seed": seed, "command": command or f"python -m tests.faults.soak --faults {faults} --seed {seed}",
            "cores": os.cpu_count(), "workers": workers, "concurrency": cluster.concurrency,
            "workers_started": len(cluster.workers), "live": live,
            "timers": ", ".join(f"{name}={value}" for name, value in cluster.timers.items()) or "the shipped defaults",
            "total_s": t_check - t0, "start_s": t_start - t0, "inject_s": t_inject - t_start,
            "drain_s": t_drain - t_inject, "fleet_s": t_fleet - t_drain, "check_s": t_check - t_fleet,
        }
        report = render(verdict, driver.faults, driver.runs, meta, bad)
        with open(tmp / "faults.jsonl", "w") as out:
            for fault in driver.faults:
                out.write(json.dumps(dataclasses.asdict(fault)) + "\n")
        with open(tmp / "runs.jsonl", "w") as out:
            for run in driver.runs:
                row = dataclasses.asdict(run)
                row["cancel"] = dataclasses.asdict(run.cancel) if run.cancel else None
                out.write(json.dumps(row) + "\n")
        for entry in verdict.carried_starts:
            driver.note("callback started after its cancelled run ended (a fresh carried message): "
                        + json.dumps(entry))
        for entry in verdict.late_ends:
            if entry["why"] == "unexplained":
                driver.note(f"late end, unexplained: {json.dumps(entry)}")
        (tmp / "notes.txt").write_text("\n".join(driver.notes) + "\n")
        (tmp / "execs.jsonl").write_text("".join(line + "\n" for line in log))
        _dump_problem_runs(driver.client, verdict, tmp / "problem-runs.jsonl")
        return SoakResult(verdict, driver.faults, driver.runs, report, tmp)
    finally:
        _continue_all(cluster)
        cluster.stop()


def _dump_problem_runs(client: TaskLoop, verdict: Verdict, path: Path) -> None:
    """The history of every run the checker complained about, for a reproduction."""
    ids = sorted({message.split(" ", 1)[0].rstrip(":") for found in verdict.problems.values() for message in found
                  if message.startswith("s")})
    with open(path, "w") as out:
        for run_id in ids:
            try:
                events = [e.model_dump() for e in client.events(run_id)]
            except TaskLoopError:
                continue
            out.write(json.dumps({"run": run_id, "events": events}) + "\n")


def _continue_all(cluster: SoakCluster) -> None:
    """No process may stay stopped (a stopped pool process would hang the workers' shutdown)."""
    pools = cluster.pools()
    for pid in pools:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=1000, help="faults to inject (default 1000)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: time-based, printed)")
    parser.add_argument("--report", type=Path, default=None, help="write the markdown report here too")
    parser.add_argument("--workers", type=int, default=3, help="worker nodes (2 pool processes each)")
    parser.add_argument("--live", type=int, default=30, help="runs kept live at a time")
    parser.add_argument("--pace", type=float, default=0.7, help="mean seconds between two faults")
    parser.add_argument("--drain-timeout", type=float, default=None,
                        help="seconds for every run to end (default: the queued lease + 4 running leases + 60 s)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory even on success")
    parser.add_argument("--timers", choices=sorted(PROFILES), default="defaults",
                        help="leases and reconcile interval: the shipped defaults, or short ones (default: defaults)")
    parser.add_argument("--kinds", default=None,
                        help="comma-separated fault kinds to draw from (default: every kind)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    tmp = Path(tempfile.mkdtemp(prefix=f"taskloop-soak-{seed}-"))
    command = " ".join(["python -m tests.faults.soak", *(argv if argv is not None else sys.argv[1:])])
    if args.seed is None:
        command += f" (seed {seed})"
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip()) if args.kinds else None
    result = soak(args.faults, seed, tmp, workers=args.workers, live=args.live, pace=args.pace,
                  drain_timeout=args.drain_timeout, command=command, kinds=kinds, timers=args.timers)
    print(result.report)
    if args.report is not None:
        args.report.write_text(result.report)
    if result.verdict.ok and not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"working directory kept: {tmp}")
    return 0 if result.verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Driver", "SoakCluster", "SoakResult", "main", "soak"]

"""The fault-injection harness: a private cluster, fault injectors, and the offline checker.

A `Cluster` is one redis-server (AOF on) plus `taskloop worker` processes at the shipped
defaults, or on a profile of short timers. Injectors kill, pause or duplicate real things. The checker
reads the event history and the final records of every run and reports what the guarantees
forbid: runs not terminal, a phase committed twice, rounds with gaps or past `max_rounds`,
more executions in a round than one plus the faults injected into it, an unbalanced ledger.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from taskloop.base.config import Settings
from taskloop.base.errors import StoreUnavailable
from taskloop.ops.embedded import RedisServer
from taskloop.runtime.client import TaskLoop
from taskloop.runtime.models import executions
from tests.faults import flows
from tests.ledger import ledger_problems
from tests.workers import WorkerProcess, alive, children_of, kill_left

REPO = Path(__file__).resolve().parents[2]
TERMINAL = {"done", "failed", "cancelled", "rejected"}

# Short timers: a second profile, with more recoveries in the same time (the shipped defaults, the
# profile users run and the one every fault test runs with, are 30 s / 300 s / 5 s / 0.2 s).
FAULT_ENV = {
    "TASKLOOP_LEASE_S": "2",
    "TASKLOOP_QUEUED_LEASE_S": "6",
    "TASKLOOP_RECONCILE_INTERVAL_S": "0.5",
    "TASKLOOP_WATCH_INTERVAL_S": "0.1",
}
PROFILES = {"defaults": {}, "short": FAULT_ENV}  # python -m tests.faults.soak --timers ...
_DEFAULTS = Settings(redis_url="redis://unused")


def timer(timers: dict[str, str], name: str) -> float:
    """A lease or interval of a profile: its own value, or the shipped default."""
    defaults = {"TASKLOOP_LEASE_S": _DEFAULTS.running_lease_s, "TASKLOOP_QUEUED_LEASE_S": _DEFAULTS.queued_lease_s,
                "TASKLOOP_RECONCILE_INTERVAL_S": _DEFAULTS.reconcile_interval_s,
                "TASKLOOP_WATCH_INTERVAL_S": _DEFAULTS.watch_interval_s}
    return float(timers[name]) if name in timers else defaults[name]


def client_settings(url: str, timers: dict[str, str]) -> Settings:
    """The settings of a test's client: the same leases as its workers (it writes the first ones)."""
    return Settings(redis_url=url, running_lease_s=timer(timers, "TASKLOOP_LEASE_S"),
                    queued_lease_s=timer(timers, "TASKLOOP_QUEUED_LEASE_S"))


@dataclass
class Fault:
    kind: str
    at: float
    targets: list[tuple[str, str, int, str]] = field(default_factory=list)  # (run, key, round, phase)


@dataclass
class Outcome:
    scenario: str
    seed: int | None  # None: nothing random in the scenario
    runs: int
    faults: int
    lost: int = 0
    duplicate_commits: int = 0
    max_recovery_s: float = 0.0
    stale_rejections: int = 0
    replays: int = 0
    problems: list[str] = field(default_factory=list)

    def row(self) -> str:
        seed = "-" if self.seed is None else self.seed
        return (f"| {self.scenario} | {seed} | {self.runs} | {self.faults} | {self.lost} | "
                f"{self.duplicate_commits} | {self.max_recovery_s:.2f} | {self.replays} | {self.stale_rejections} |")


RESULTS: list[Outcome] = []  # every scenario's outcome, printed at the end of the session
HEADER = ("| scenario | seed | runs | faults | lost | duplicate commits | max recovery s | replays "
          "| stale rejections |\n|---|---|---|---|---|---|---|---|---|")


class Cluster:
    """``timers``: the lease and reconcile settings of the workers and the client (FAULT_ENV, or
    ``{}`` for the shipped defaults: the profile users run)."""

    def __init__(self, tmp: Path, seed: int, env: dict[str, str] | None = None,
                 imports: tuple[str, ...] = ("tests.faults.flows",), timers: dict[str, str] | None = None,
                 appendfsync: str = "everysec", pool: str | None = None) -> None:
        self.imports = imports
        self.pool = pool  # a Celery pool class for the workers (None: taskloop worker's default)
        self.tmp = tmp
        self.rng = random.Random(seed)
        self.seed = seed
        self.timers = FAULT_ENV if timers is None else timers
        self.env = {**self.timers, "PYTHONPATH": str(REPO), **(env or {})}
        self.redis = RedisServer(tmp / "redis", appendfsync=appendfsync)
        (tmp / "redis").mkdir(exist_ok=True)
        self.workers: dict[str, Any] = {}
        self.celery_pids: dict[str, int] = {}  # each worker's Celery process when it became ready
        self.concurrency: dict[str, int] = {}
        self.killed: set[str] = set()  # workers a test killed on purpose (the fleet check skips them)
        self.client: TaskLoop | None = None
        self.probe: redis.Redis | None = None

    # lifecycle ------------------------------------------------------------------------------
    def start(self, workers: tuple[str, ...] = ("f1", "f2"), concurrency: int = 2) -> Cluster:
        self.redis.start()
        for name in workers:
            self.start_worker(name, concurrency)
        # the client writes the first leases: it uses the same timers as the workers
        self.client = TaskLoop(self.redis.url, config=client_settings(self.redis.url, self.timers))
        self.probe = redis.Redis.from_url(self.redis.url, decode_responses=True)
        return self

    def start_worker(self, name: str, concurrency: int = 2) -> None:
        worker = WorkerProcess(self.redis.url, self.imports, self.tmp / f"{name}.log", name=name,
                               concurrency=concurrency, env=self.env, pool=self.pool)
        self.workers[name] = worker
        worker.ready(30)
        self.celery_pids[name] = self.celery_pid(name)
        self.concurrency[name] = concurrency

    def celery_pid(self, name: str) -> int:
        """The Celery worker process of ``taskloop worker`` ``name`` (its supervisor's child)."""
        [child] = [pid for pid in children_of(self.workers[name].pid) if alive(pid)]
        return child

    def tree(self, name: str) -> list[int]:
        """Every process of a worker: its supervisor, the Celery worker, and the pool."""
        main = self.celery_pid(name)
        return [self.workers[name].pid, main, *children_of(main)]

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def stop(self) -> None:
        families = [pid for proc in self.workers.values() for pid in proc.processes()]
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.workers.values():
            try:
                proc.wait(20)
            except Exception:  # a worker that does not stop in time: killed, and reaped (an unreaped
                proc.kill()  # process is a ResourceWarning in whichever later test collects it)
                proc.wait(20)
        kill_left(families)
        if self.client is not None:
            self.client.close()
        self.redis.stop()

    def assert_fleet_whole(self, timeout: float = 15.0) -> None:
        """Every worker a test did not kill on purpose is still the same Celery process (not
        restarted by its supervisor, no unrecoverable error), has its whole pool back (Celery
        replaces a killed pool process), and consumes: a final batch of runs ends done."""
        assert self.client is not None
        for name, proc in self.workers.items():
            if name in self.killed:
                continue
            pid = self.celery_pids[name]
            assert proc.poll() is None, f"the supervisor of worker {name} exited ({proc.returncode})"
            assert alive(pid) and self.celery_pid(name) == pid, f"worker {name}'s Celery process {pid} died"
            log = self.log(name)
            for sign in ("Unrecoverable error", "exited unexpectedly"):
                assert sign not in log, f"worker {name}: {sign}\n{log[-3000:]}"
            deadline = time.monotonic() + timeout
            while len([p for p in children_of(pid) if alive(p)]) < self.concurrency[name]:
                assert time.monotonic() < deadline, f"worker {name} did not get its pool back"
                time.sleep(0.1)
        after = self.start_runs(2 * len(self.workers), hold_s=0.05)
        self.wait_all(after, timeout=60)
        assert {self.client.status(run_id) for run_id in after} == {"done"}, "the fleet stopped consuming"

    # running --------------------------------------------------------------------------------
    def start_runs(self, n: int, **input: Any) -> list[str]:
        assert self.client is not None
        return [self.client.start(flows.grind, input={"hold_s": 0.3, "accept_round": 3, **input}).run_id
                for _ in range(n)]

    def wait_all(self, run_ids: list[str], timeout: float = 120.0) -> None:
        assert self.client is not None
        deadline = time.monotonic() + timeout
        pending = list(run_ids)
        while pending and time.monotonic() < deadline:
            try:
                statuses = [self.client.status(rid) for rid in pending]
            except StoreUnavailable:
                time.sleep(0.2)
                continue
            pending = [rid for rid, status in zip(pending, statuses, strict=True) if status not in TERMINAL]
            time.sleep(0.1)

    def running(self) -> dict[int, dict[str, Any]]:
        """Executions inside a callback right now: pid -> (run, key, round, phase)."""
        assert self.probe is not None
        return {int(pid): json.loads(raw) for pid, raw in self.probe.hgetall("fault:running").items()}

    def pick_running(self, phase: str | None = None, pids: set[int] | None = None,
                     timeout: float = 10.0) -> tuple[int, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            candidates = [(pid, what) for pid, what in sorted(self.running().items())
                          if alive(pid) and (phase is None or what["phase"] == phase)
                          and (pids is None or pid in pids)]
            if candidates:
                return self.rng.choice(candidates)
            time.sleep(0.02)
        raise AssertionError(f"no execution of {phase or 'any phase'} to hit")

    # the offline checker --------------------------------------------------------------------
    def check(self, scenario: str, run_ids: list[str], faults: list[Fault], max_rounds: int) -> Outcome:
        assert self.client is not None
        outcome = Outcome(scenario, self.seed, len(run_ids), len(faults))
        injected = Counter(t for f in faults for t in f.targets)
        for run_id in run_ids:
            view = self.client.inspect(run_id)
            if view.status not in TERMINAL:
                outcome.lost += 1
                outcome.problems.append(f"{run_id}: not terminal ({view.status})")
                continue
            events = self.client.events(run_id)
            commits = Counter((e.key, e.round, e.phase) for e in events if e.type == "phase")
            duplicates = {k: n for k, n in commits.items() if n > 1}
            outcome.duplicate_commits += sum(n - 1 for n in duplicates.values())
            outcome.problems += [f"{run_id}: {k} committed {n} times" for k, n in duplicates.items()]
            rounds = sorted({e.round for e in events if e.type == "phase" and e.key == "work" and e.round})
            if rounds != list(range(1, len(rounds) + 1)) or len(rounds) > max_rounds:
                outcome.problems.append(f"{run_id}: rounds {rounds} not contiguous within 1..{max_rounds}")
            ran = [(key, e) for key, found in executions(events).items() for e in found]
            execs = Counter((key, e.round, e.phase) for key, e in ran)
            outcome.replays += sum(1 for _, e in ran if e.replay)
            for (key, round_, phase), n in execs.items():
                allowed = 1 + injected[(run_id, key, round_, phase)]
                if n > allowed:
                    outcome.problems.append(f"{run_id}: {key} {round_}/{phase} executed {n} times, allowed {allowed}")
            outcome.problems += [f"{run_id}: {p}" for p in ledger_problems(events)]
            for fault in faults:
                for target in fault.targets:
                    if target[0] != run_id:
                        continue
                    later = [e.began_at for key, e in ran if key == target[1] and e.began_at is not None
                             and e.began_at > fault.at]
                    if later:
                        outcome.max_recovery_s = max(outcome.max_recovery_s, min(later) - fault.at)
        outcome.stale_rejections = stale_rejections(self.client.store.stats())
        return outcome


def stale_rejections(stats: dict[str, str]) -> int:
    """The deliveries and commits the fleet refused as stale (tl:stats)."""
    return int(stats.get("stale_deliveries", 0)) + int(stats.get("stale_commits", 0))


def in_flight(cluster: Cluster, run_ids: list[str]) -> list[tuple[str, str, int, str]]:
    """The phases of the runs' ``work`` task not ended yet: (run, key, round, phase)."""
    assert cluster.client is not None
    found = []
    for run_id in run_ids:
        record = cluster.client.store.snapshot(run_id).record("work")
        if record is not None and record.phase is not None and not record.terminal:
            found.append((run_id, "work", record.round, record.phase.value))
    return found

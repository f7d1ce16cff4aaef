"""Loops that wait on models (issue 42, SPEC §12): N loops of 3 rounds whose every attempt and
check waits ``phase_s`` seconds, with ``in_flight`` phases at once in one worker process. The
limit of such a workload is ``in_flight / phase_s`` steps/s: the CPU is idle but for the
scheduling. Measured, in the same invocation and on the same redis-server (AOF everysec):

- the hand-rolled Celery loop (bench/model_baseline.py) at Celery's defaults on ``-P threads``
  and on ``-P gevent``, ``-c in_flight``;
- taskloop's ``taskloop worker -P threads`` and ``-P gevent`` with sync callbacks, and
  ``-P asyncio`` with ``async def`` callbacks (bench/model_flows.py), ``-c in_flight``.

For each: steps/s, the fraction of the limit, the ratio to the hand-rolled loop on the same pool
(the async pool against Celery's threads), the worker's CPU per step (every process of the worker:
taskloop's supervisor included), Redis's CPU per step, and the worker's peak RSS (VmHWM summed
over its processes). Each system gets a fresh worker, warmed with short loops, and the others'
workers are stopped meanwhile. A system that does not finish within its time box (three times
the ideal, at least a minute more) is reported with the loops it finished.

    python -m bench.models                     # 100/0.5 s, 1,000/2 s and 10,000/20 s (about 35 minutes)
    python -m bench.models --workloads 1000    # one workload
    python -m bench.models --systems taskloop-threads,celery-threads
    python -m bench.run --only models          # the same, as a section of the full run
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.systems import Failure, System, bench_redis, cpu_seconds
from taskloop.ops.embedded import RedisServer

STEPS = 6  # 3 rounds: attempt and check


@dataclass(frozen=True)
class Workload:
    in_flight: int
    phase_s: float
    loops: int

    @property
    def limit(self) -> float:
        return self.in_flight / self.phase_s

    @property
    def ideal_s(self) -> float:
        return self.loops * STEPS / self.limit

    @property
    def label(self) -> str:
        return f"{self.loops:,} loops, {self.in_flight:,} in flight, {self.phase_s:g} s phases"


WORKLOADS = {100: Workload(100, 0.5, 600), 1000: Workload(1000, 2.0, 3000), 10_000: Workload(10_000, 20.0, 10_000)}
WARM_PHASE_S = 0.05


class CeleryLoop(System):
    """The hand-rolled loop on plain Celery, on one pool."""

    def __init__(self, server: RedisServer, env: dict[str, str], logdir: Path, pool: str) -> None:
        super().__init__(server, env, logdir)
        self.pool = pool
        self.name = f"celery-{pool}"

    def worker_args(self, concurrency: int, node: str, events: bool) -> list[str]:
        from bench.model_baseline import QUEUE

        return ["celery", "-A", "bench.model_baseline", "worker", "-P", self.pool, "-c", str(concurrency),
                "-Q", QUEUE, "--loglevel", "INFO", "--without-gossip", "--without-mingle", "-n", f"{node}@%h"]

    def start_model_loops(self, n: int, phase_s: float) -> list[str]:
        from bench.model_baseline import attempt

        ids = [uuid.uuid4().hex for _ in range(n)]
        for loop_id in ids:
            attempt.apply_async((loop_id, 1, phase_s))
        return ids

    def verify_model(self, ids: list[str]) -> None:
        finished = [line.split() for line in self.r.lrange("bench:finished", 0, -1)]
        mine = [f for f in finished if f[0] in set(ids)]  # (a warm-up loop may still finish a second time)
        wrong = [f for f in mine if f[1:] != ["done", "3"]]
        missing = set(ids) - {f[0] for f in mine}
        if wrong or missing:
            raise Failure(f"{self.name}: {len(wrong)} loops ended wrong (e.g. {wrong[:3]}), {len(missing)} missing")


class TaskLoopLoop(System):
    """taskloop's loop on one pool: sync callbacks on threads and gevent, async ones on asyncio."""

    def __init__(self, server: RedisServer, env: dict[str, str], logdir: Path, pool: str) -> None:
        super().__init__(server, env, logdir)
        from taskloop import TaskLoop

        self.pool = pool
        self.kind = "async" if pool == "asyncio" else "sync"
        self.name = f"taskloop-{pool}"
        self.client = TaskLoop(self.url)

    def worker_args(self, concurrency: int, node: str, events: bool) -> list[str]:
        return ["taskloop", "worker", "--import", "bench.model_flows", "-P", self.pool, "-c", str(concurrency),
                "--loglevel", "INFO", "-n", f"{node}@%h"]

    def start_model_loops(self, n: int, phase_s: float) -> list[str]:
        from bench.model_flows import WORKFLOWS, name

        workflow = WORKFLOWS[name(self.kind, phase_s)]
        return [self.client.start(workflow).run_id for _ in range(n)]

    def verify_model(self, ids: list[str]) -> None:
        from taskloop.core import fields as fld

        names = [fld.F_STATUS, fld.value_field("loop")]
        rows = [self.client.store.hmget(run_id, names) for run_id in ids]
        wrong = [(run_id, status, value) for run_id, (status, value) in zip(ids, rows, strict=True)
                 if (status, value) != ("done", "3")]
        if wrong:
            raise Failure(f"{self.name}: {len(wrong)} runs ended wrong, e.g. {wrong[:3]}")


SYSTEMS = ("celery-threads", "celery-gevent", "taskloop-threads", "taskloop-gevent", "taskloop-asyncio")
BASELINE_OF = {"taskloop-threads": "celery-threads", "taskloop-gevent": "celery-gevent",
               "taskloop-asyncio": "celery-threads"}


def make(name: str, server: RedisServer, env: dict[str, str], logdir: Path) -> System:
    kind, _, pool = name.partition("-")
    return (CeleryLoop if kind == "celery" else TaskLoopLoop)(server, env, logdir, pool)


def _peak_rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += int(status.split("VmHWM:")[1].split()[0])
    return round(total / 1024, 1)


def _worker_pids(system: System) -> list[int]:
    procs = system.processes()
    return [*procs["worker main"], *procs["worker pool"]]


def _run(system: Any, n: int, phase_s: float, timeout: float) -> tuple[float, int, list[str], int]:
    """Start ``n`` loops and wait for them: the seconds taken, the distinct loops of this run
    finished (all of them, or as many as had finished when the time box closed), and how many
    finishes were of a loop that had finished already (the hand-rolled loop runs some twice: see
    docs/benchmarks.md; only distinct loops count as work done)."""
    system.r.delete("bench:finished")
    started = time.perf_counter()
    ids = system.start_model_loops(n, phase_s)
    wanted = set(ids)
    deadline = started + timeout
    done, read, seen, twice = 0, 0, set(), 0
    while time.perf_counter() < deadline:
        for line in system.r.lrange("bench:finished", read, -1):
            read += 1
            loop_id = line.split()[0] if line else ""
            if loop_id in seen:
                twice += 1
            elif loop_id in wanted:
                seen.add(loop_id)
        done = len(seen)
        if done >= n:
            break
        time.sleep(0.05)
    return time.perf_counter() - started, done, ids, twice


def _keep_logs(system: System) -> str:
    """The worker logs of a system that did not finish, copied out of the benchmark's temporary folder."""
    kept = Path(tempfile.mkdtemp(prefix=f"bench-models-{system.name}-"))
    for log in system.logdir.glob(f"{system.name}-*.log"):
        shutil.copy(log, kept / log.name)
    return str(kept)


def measure(system: Any, load: Workload) -> dict[str, Any]:
    system.start_workers(load.in_flight)
    try:
        warm = min(load.in_flight, 500)
        seconds, done, ids, _ = _run(system, warm, WARM_PHASE_S, 300)
        if done < warm:
            raise Failure(f"{system.name}: the warm-up finished {done} of {warm} loops in {seconds:.0f} s")
        pids = _worker_pids(system)
        cpu_before = sum(cpu_seconds(p) for p in pids)
        redis_before = cpu_seconds(system.redis_pid)
        timeout = max(3 * load.ideal_s, load.ideal_s + 60)
        seconds, done, ids, twice = _run(system, load.loops, load.phase_s, timeout)
        steps = done * STEPS
        found: dict[str, Any] = {
            "loops": load.loops, "finished": done, "seconds": round(seconds, 2),
            "steps_per_s": round(steps / seconds, 1), "limit": load.limit,
            "fraction_of_limit": round(steps / seconds / load.limit, 3),
            "worker_cpu_ms_per_step": round((sum(cpu_seconds(p) for p in pids) - cpu_before) * 1000 / max(steps, 1), 3),
            "redis_cpu_ms_per_step": round((cpu_seconds(system.redis_pid) - redis_before) * 1000 / max(steps, 1), 3),
            "worker_peak_rss_mb": _peak_rss_mb(pids),
            "worker_processes": len(pids),
            "finished_twice": twice,
        }
        if done >= load.loops:
            system.verify_model(ids)
        else:
            found["timed_out_s"] = round(timeout)
            found["logs"] = _keep_logs(system)
        return found
    finally:
        system.stop_workers()


def section(args: argparse.Namespace, server: RedisServer | None = None) -> dict[str, Any]:
    own = server is None
    if server is None:
        server, logdir, env = bench_redis()
    else:
        logdir = Path(server.directory)
        env = {**__import__("os").environ, "TASKLOOP_REDIS_URL": server.url}
    workloads = [WORKLOADS[w] for w in args.workloads]
    out: dict[str, Any] = {}
    try:
        for load in workloads:
            print(f"  {load.label} (limit {load.limit:g} steps/s)", flush=True)
            results: dict[str, Any] = {}
            for name in args.systems:
                system = make(name, server, env, logdir)
                try:
                    results[name] = measure(system, load)
                except Failure as exc:
                    results[name] = {"failed": str(exc)}
                    print(f"    {name:18} FAILED: {exc}", flush=True)
                    continue
                finally:
                    if hasattr(system, "client"):
                        system.client.close()
                row = results[name]
                print(f"    {name:18} {row['steps_per_s']:>7} steps/s  {row['fraction_of_limit']:.3f} of the limit  "
                      f"worker {row['worker_cpu_ms_per_step']} ms CPU/step  redis {row['redis_cpu_ms_per_step']} "
                      f"ms/step  peak RSS {row['worker_peak_rss_mb']} MB  run twice {row['finished_twice']}"
                      + (f"  (finished {row['finished']} of {row['loops']}; logs in {row['logs']})"
                         if "timed_out_s" in row else ""),
                      flush=True)
            for name, base in BASELINE_OF.items():
                mine, theirs = results.get(name, {}), results.get(base, {})
                if "steps_per_s" in mine and theirs.get("steps_per_s"):
                    mine["ratio"] = {base: round(mine["steps_per_s"] / theirs["steps_per_s"], 3)}
            out[str(load.in_flight)] = {"workload": load.__dict__, "limit": load.limit, "systems": results}
    finally:
        if own:
            server.stop()
    return out


def report(results: dict[str, Any]) -> list[str]:
    lines = ["### Loops that wait on models (one worker process, in flight = concurrency)", "",
             "| workload | system | steps/s | of the limit | ÷ Celery, same pool | worker CPU ms/step | "
             "Redis CPU ms/step | worker peak RSS MB | loops run twice |", "|---|---|---|---|---|---|---|---|---|"]
    for found in results.values():
        load = Workload(**found["workload"])
        for name, row in found["systems"].items():
            if "failed" in row:
                lines.append(f"| {load.label} | {name} | failed: {row['failed']} | | | | | | |")
                continue
            ratio = next(iter(row.get("ratio", {}).values()), "")
            done = "" if "timed_out_s" not in row else f" ({row['finished']} of {row['loops']} loops in " \
                                                       f"{row['timed_out_s']} s)"
            lines.append(f"| {load.label} | {name} | {row['steps_per_s']}{done} | {row['fraction_of_limit']} | "
                         f"{ratio} | {row['worker_cpu_ms_per_step']} | {row['redis_cpu_ms_per_step']} | "
                         f"{row['worker_peak_rss_mb']} | {row.get('finished_twice', 0)} |")
    return [*lines, ""]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default=None, type=lambda s: [int(p) for p in s.split(",") if p],
                        help="phases in flight, from 100, 1000, 10000 (default: all; --quick: 100,1000)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), type=lambda s: [p for p in s.split(",") if p],
                        help=f"from {', '.join(SYSTEMS)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    add_arguments(parser)
    args = parser.parse_args()
    if args.workloads is None:
        args.workloads = [100, 1000] if args.quick else list(WORKLOADS)
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    results = section(args)
    print()
    print("\n".join(report(results)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()

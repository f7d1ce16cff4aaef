"""taskloop against a hand-rolled Celery loop, in one invocation, on one redis-server.

    python -m bench.run                 # the full set (N = 300 and 1,000, accept and exhaust,
                                        # latency, Redis cost, a 10,000-loop flood)
    python -m bench.run --quick         # N = 300 only, 20 latency runs, a 2,000-loop flood
    python -m bench.run --no-events     # both systems without Celery task events

Both systems get the same redis-server (started here, AOF on), the same Celery settings and one
worker with 2 pool processes. The workload is N independent loops of 3 rounds (6 steps: attempt,
check, x3), accepted in round 3, or (exhaust) never accepted with max_rounds=3. The script exits
non-zero if any run or loop ends in the wrong state, so speed can never hide a wrong answer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from taskloop.embedded import wait_until_ready

REPO = Path(__file__).resolve().parent.parent
STEPS_PER_LOOP = 6
ROUNDS_PER_LOOP = 3
POLL_S = 0.005
IGNORED_COMMANDS = {"info", "llen", "ping"}  # the benchmark's own polling


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


def wait_finished(r: redis.Redis, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while r.llen("bench:finished") < n:
        if time.monotonic() > deadline:
            raise Failure(f"only {r.llen('bench:finished')} of {n} loops finished within {timeout} s")
        time.sleep(POLL_S)


class System:
    name = ""

    def __init__(self, url: str, env: dict[str, str], logdir: Path, redis_pid: int) -> None:
        self.url = url
        self.redis_pid = redis_pid
        self.env = env
        self.logdir = logdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.r = redis.Redis.from_url(url, decode_responses=True)

    def worker_args(self) -> list[str]:
        raise NotImplementedError

    def start_worker(self) -> None:
        log = self.logdir / f"{self.name}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", *self.worker_args(), "--logfile", str(log)],
                                     env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_until_ready(self.proc, log)

    def stop_worker(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(60)

    def start_loops(self, mode: str, n: int) -> list[str]:
        raise NotImplementedError

    def verify(self, mode: str, ids: list[str]) -> None:
        raise NotImplementedError

    def one_latency(self) -> float:
        raise NotImplementedError

    def processes(self) -> dict[str, list[int]]:
        assert self.proc is not None
        return {"worker main": [self.proc.pid], "worker pool": children_of(self.proc.pid),
                "redis-server": [self.redis_pid], "client": [os.getpid()]}

    def throughput(self, mode: str, n: int, timeout: float = 600) -> dict[str, Any]:
        self.r.delete("bench:finished")
        before, memory_before = commandstats(self.r), int(self.r.info("memory")["used_memory"])
        procs = self.processes()
        cpu_before = {name: sum(cpu_seconds(p) for p in pids) for name, pids in procs.items()}
        started = time.perf_counter()
        ids = self.start_loops(mode, n)
        wait_finished(self.r, n, timeout)
        seconds = time.perf_counter() - started
        cpu = {name: (sum(cpu_seconds(p) for p in pids) - cpu_before[name]) * 1000 / (n * STEPS_PER_LOOP)
               for name, pids in procs.items()}
        after, memory_after = commandstats(self.r), int(self.r.info("memory")["used_memory"])
        self.verify(mode, ids)
        calls = {c: after.get(c, 0) - before.get(c, 0) for c in after if c not in IGNORED_COMMANDS}
        calls = {c: n for c, n in calls.items() if n > 0}
        rounds = n * ROUNDS_PER_LOOP
        return {
            "n": n, "mode": mode, "seconds": round(seconds, 3),
            "steps_per_s": round(n * STEPS_PER_LOOP / seconds, 1),
            "commands_per_round": round(sum(calls.values()) / rounds, 2),
            "commands": {c: round(v / rounds, 2) for c, v in sorted(calls.items(), key=lambda kv: -kv[1])},
            "memory_per_run_bytes": round((memory_after - memory_before) / n),
            "cpu_ms_per_step": {name: round(v, 3) for name, v in cpu.items()},
        }


class Baseline(System):
    name = "baseline"

    def worker_args(self) -> list[str]:
        return ["celery", "-A", "bench.baseline", "worker", "-c", "2", "-Q", "bench", "--loglevel", "INFO",
                "--without-gossip", "--without-mingle", "-n", "baseline@%h"]

    def start_loops(self, mode: str, n: int) -> list[str]:
        from bench.baseline import attempt

        ids = [uuid.uuid4().hex for _ in range(n)]
        for loop_id in ids:
            attempt.delay(loop_id, 1, mode)
        return ids

    def verify(self, mode: str, ids: list[str]) -> None:
        finished = [line.split() for line in self.r.lrange("bench:finished", 0, -1)]
        expected = "done" if mode == "accept" else "exhausted"
        wrong = [f for f in finished if f[1:] != [expected, "3"]]
        if wrong or sorted(f[0] for f in finished) != sorted(ids):
            raise Failure(f"baseline {mode}: {len(wrong)} loops ended wrong, e.g. {wrong[:3]}")

    def one_latency(self) -> float:
        from bench.baseline import attempt

        loop_id = f"lat-{uuid.uuid4().hex}"
        started = time.perf_counter()
        attempt.delay(loop_id, 1, "accept")
        if self.r.blpop([f"bench:result:{loop_id}"], timeout=30) is None:
            raise Failure("a baseline latency loop did not finish")
        return time.perf_counter() - started


class TaskLoopSystem(System):
    name = "taskloop"

    def __init__(self, url: str, env: dict[str, str], logdir: Path, redis_pid: int) -> None:
        super().__init__(url, env, logdir, redis_pid)
        from taskloop import TaskLoop

        self.client = TaskLoop(url)

    def worker_args(self) -> list[str]:
        return ["taskloop", "worker", "--import", "bench.flows", "-c", "2", "--loglevel", "INFO", "-n", "taskloop@%h"]

    def start_loops(self, mode: str, n: int) -> list[str]:
        from bench.flows import accept, exhaust

        workflow = accept if mode == "accept" else exhaust
        return [self.client.start(workflow).run_id for _ in range(n)]

    def verify(self, mode: str, ids: list[str]) -> None:
        from taskloop.store import keys as k

        pipe = self.r.pipeline(transaction=False)
        for run_id in ids:
            pipe.hmget(k.RunKeys.of(run_id).run, [k.F_STATUS, k.F_TERMINATION, k.value_field("loop"),
                                                  k.task_field("loop")])
        replies = pipe.execute()
        wrong = []
        for run_id, (status, term, value, raw) in zip(ids, replies, strict=True):
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


def median_of(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The sample with the median throughput (its other figures come with it)."""
    ranked = sorted(samples, key=lambda r: r["steps_per_s"])
    chosen = dict(ranked[len(ranked) // 2])
    chosen["samples_steps_per_s"] = [r["steps_per_s"] for r in samples]
    return chosen


def run(args: argparse.Namespace) -> dict[str, Any]:
    from taskloop.embedded import RedisServer

    sizes = [300] if args.quick else [300, 1000]
    flood = 2000 if args.quick else 10_000
    latency_runs = 20 if args.quick else 50
    server = RedisServer().start()
    logdir = Path(server.directory)
    env = {**os.environ, "TASKLOOP_REDIS_URL": server.url, "PYTHONPATH": str(REPO),
           "BENCH_EVENTS": "1" if args.events else "0"}
    env.pop("TASKLOOP_BROKER_URL", None)
    if not args.events:
        env["TASKLOOP_CELERY_CONFIG"] = "bench.no_events"
    os.environ.update({k: v for k, v in env.items() if k.startswith(("TASKLOOP_", "BENCH_"))})
    assert server.process is not None
    systems = [Baseline(server.url, env, logdir, server.process.pid),
               TaskLoopSystem(server.url, env, logdir, server.process.pid)]
    results: dict[str, Any] = {"redis": server.url, "events": args.events, "repeats": args.repeats,
                               "systems": {s.name: {"throughput": []} for s in systems}}
    try:
        for system in systems:  # both workers stay up; the one not measured is idle
            system.start_worker()
            system.throughput("accept", 50)  # warm-up: imports, connections, scripts
        for mode in ("accept", "exhaust"):
            for n in sizes:
                samples: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
                for i in range(args.repeats):  # interleaved, so that drift hits both alike
                    for system in systems if i % 2 == 0 else systems[::-1]:
                        samples[system.name].append(system.throughput(mode, n))
                pairs = [t["steps_per_s"] / b["steps_per_s"]
                         for b, t in zip(samples["baseline"], samples["taskloop"], strict=True)]
                results.setdefault("paired_ratios", {})[f"{mode} N={n}"] = {
                    "median": round(statistics.median(pairs), 3), "samples": [round(p, 3) for p in pairs]}
                for system in systems:
                    chosen = median_of(samples[system.name])
                    results["systems"][system.name]["throughput"].append(chosen)
                    print(f"{system.name:9} {mode:8} N={n:<6} {chosen['steps_per_s']:>8} steps/s "
                          f"(samples {chosen['samples_steps_per_s']})", flush=True)
        latencies: dict[str, list[float]] = {s.name: [] for s in systems}
        for _ in range(latency_runs):
            for system in systems:
                latencies[system.name].append(system.one_latency())
        for system in systems:
            ordered = sorted(latencies[system.name])
            results["systems"][system.name]["latency"] = {
                "runs": latency_runs, "p50_ms": round(statistics.median(ordered) * 1000, 2),
                "p95_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1000, 2)}
            print(f"{system.name:9} latency p50 {results['systems'][system.name]['latency']['p50_ms']} ms",
                  flush=True)
        for system in systems:
            out = system.throughput("accept", flood, timeout=1800)
            results["systems"][system.name]["flood"] = out
            print(f"{system.name:9} flood N={flood} {out['seconds']} s", flush=True)
    finally:
        for system in systems:
            system.stop_worker()
        server.stop()
    return results


def report(results: dict[str, Any]) -> str:
    base, tl = results["systems"]["baseline"], results["systems"]["taskloop"]
    lines = ["| measure | baseline (hand-rolled Celery) | taskloop | taskloop / baseline |", "|---|---|---|---|"]
    for b, t in zip(base["throughput"], tl["throughput"], strict=True):
        lines.append(f"| steps/s, {b['mode']}, N={b['n']} | {b['steps_per_s']} | {t['steps_per_s']} | "
                     f"{t['steps_per_s'] / b['steps_per_s']:.2f} |")
    bf, tf = base["flood"], tl["flood"]
    lines.append(f"| flood of {bf['n']} loops: wall time s | {bf['seconds']} | {tf['seconds']} | "
                 f"{tf['seconds'] / bf['seconds']:.2f} |")
    lines.append(f"| flood: steps/s | {bf['steps_per_s']} | {tf['steps_per_s']} | "
                 f"{tf['steps_per_s'] / bf['steps_per_s']:.2f} |")
    bl, tll = base["latency"], tl["latency"]
    lines.append(f"| latency of one 3-round loop, p50 ms | {bl['p50_ms']} | {tll['p50_ms']} | "
                 f"{tll['p50_ms'] / bl['p50_ms']:.2f} |")
    lines.append(f"| latency, p95 ms | {bl['p95_ms']} | {tll['p95_ms']} | {tll['p95_ms'] / bl['p95_ms']:.2f} |")
    def largest_accept(system: dict[str, Any]) -> dict[str, Any]:
        return max((t for t in system["throughput"] if t["mode"] == "accept"), key=lambda t: t["n"])

    b1000, t1000 = largest_accept(base), largest_accept(tl)
    lines.append(f"| Redis commands per round (accept, N={b1000['n']}) | {b1000['commands_per_round']} | "
                 f"{t1000['commands_per_round']} | {t1000['commands_per_round'] / b1000['commands_per_round']:.2f} |")
    lines.append(f"| Redis memory held per finished run, bytes (flood) | {bf['memory_per_run_bytes']} | "
                 f"{tf['memory_per_run_bytes']} | |")
    for name in b1000["cpu_ms_per_step"]:
        bv, tv = b1000["cpu_ms_per_step"][name], t1000["cpu_ms_per_step"][name]
        lines.append(f"| CPU ms per step, {name} (accept, N={b1000['n']}) | {bv:.2f} | {tv:.2f} | |")
    bt, tt = sum(b1000["cpu_ms_per_step"].values()), sum(t1000["cpu_ms_per_step"].values())
    lines.append(f"| CPU ms per step, all processes | {bt:.2f} | {tt:.2f} | {tt / bt:.2f} |")
    lines.append("")
    lines.append("ratios of runs made back to back (taskloop / baseline), median and samples:")
    for label, paired in results.get("paired_ratios", {}).items():
        lines.append(f"- {label}: {paired['median']} {paired['samples']}")
    lines.append("")
    lines.append(f"commands per round, baseline: {b1000['commands']}")
    lines.append(f"commands per round, taskloop: {t1000['commands']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--events", action=argparse.BooleanOptionalAction, default=True,
                        help="Celery task events on both systems (default on, as taskloop ships)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each throughput figure")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args()
    try:
        results = run(args)
    except Failure as exc:
        print(f"WRONG RESULT: {exc}", file=sys.stderr)
        sys.exit(2)
    print()
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

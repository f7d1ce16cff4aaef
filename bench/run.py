"""taskloop against a hand-rolled Celery loop, in one invocation, on one redis-server.

    python -m bench.run                       # every section below (about 10 minutes on 2 cores)
    python -m bench.run --quick               # smaller sizes, one repeat (about 4 minutes)
    python -m bench.run --only loops,sizes    # some sections: loops, events, workers, sizes, cancel
    python -m bench.run --json out.json       # also keep the raw figures
    python -m bench.run --only loops --baseline-kombu-clients   # the baseline with taskloop's kombu fix too

Both systems run with Celery's own defaults (prefetch 4, fair scheduling, task events off),
JSON, ``acks_late``, one worker with 2 pool processes unless a section says otherwise, on the
same redis-server (started here, AOF everysec). Sections:

- ``loops``: N independent loops of 3 rounds (6 steps), accepted in round 3 or exhausted;
  steps/s, paired ratios, p50/p95 latency of one loop, Redis commands per round, memory per run.
- ``events``: the same with task events on in both workers (``-E``: the cost under Flower).
- ``workers``: steps/s with 1, 2 and 4 pool processes, and with two worker nodes.
- ``sizes``: one run of 1, 100, 1,000 and 10,000 independent tasks against as many one-task
  runs; a 1,000-task chain; tasks/s and the time of ``start()``.
- ``cancel``: a 10,000-task run under full load: how long ``cancel()`` takes to land, and how
  long until the run has ended.

The script exits non-zero if any run or loop ends in the wrong state, so speed never hides a
wrong answer.
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

from taskloop.embedded import RedisServer, wait_until_ready

REPO = Path(__file__).resolve().parent.parent
STEPS_PER_LOOP = 6
ROUNDS_PER_LOOP = 3
POLL_S = 0.005
IGNORED_COMMANDS = {"info", "llen", "ping"}  # the benchmark's own polling
SECTIONS = ("loops", "events", "workers", "sizes", "cancel")


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
        return {"worker main": main, "worker pool": pool, "redis-server": [self.redis_pid], "client": [os.getpid()]}

    def throughput(self, mode: str, n: int, timeout: float = 1800) -> dict[str, Any]:
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

    def worker_args(self, concurrency: int, node: str, events: bool) -> list[str]:
        return ["celery", "-A", "bench.baseline", "worker", "-c", str(concurrency), "-Q", "bench",
                "--loglevel", "INFO", "--without-gossip", "--without-mingle", "-n", f"{node}@%h",
                *(["-E"] if events else [])]

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

    def __init__(self, server: RedisServer, env: dict[str, str], logdir: Path) -> None:
        super().__init__(server, env, logdir)
        from taskloop import TaskLoop

        self.client = TaskLoop(self.url)

    def worker_args(self, concurrency: int, node: str, events: bool) -> list[str]:
        return ["taskloop", "worker", "--import", "bench.flows", "-c", str(concurrency), "--loglevel", "INFO",
                "-n", f"{node}@%h", *(["-E"] if events else [])]

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
        wrong = []
        for run_id, (status, term, value, raw) in zip(ids, pipe.execute(), strict=True):
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


def compare(systems: list[System], mode: str, n: int, repeats: int) -> dict[str, Any]:
    """Interleaved repeats of one throughput figure (drift hits both alike); paired ratios."""
    samples: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    for i in range(repeats):
        for system in systems if i % 2 == 0 else systems[::-1]:
            samples[system.name].append(system.throughput(mode, n))
    pairs = [t["steps_per_s"] / b["steps_per_s"] for b, t in zip(samples["baseline"], samples["taskloop"], strict=True)]
    out = {s.name: median_of(samples[s.name]) for s in systems}
    out["ratio"] = {"median": round(statistics.median(pairs), 3), "samples": [round(p, 3) for p in pairs]}
    print(f"  {mode:8} N={n:<6} baseline {out['baseline']['steps_per_s']:>7} steps/s  taskloop "
          f"{out['taskloop']['steps_per_s']:>7} steps/s  ratio {out['ratio']['median']} {out['ratio']['samples']}",
          flush=True)
    return out


def latency(systems: list[System], runs: int) -> dict[str, Any]:
    found: dict[str, list[float]] = {s.name: [] for s in systems}
    for _ in range(runs):
        for system in systems:
            found[system.name].append(system.one_latency())
    out: dict[str, Any] = {}
    for name, values in found.items():
        ordered = sorted(values)
        out[name] = {"runs": runs, "p50_ms": round(statistics.median(ordered) * 1000, 2),
                     "p95_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1000, 2)}
    out["ratio_p50"] = round(out["taskloop"]["p50_ms"] / out["baseline"]["p50_ms"], 3)
    print(f"  latency p50 baseline {out['baseline']['p50_ms']} ms, taskloop {out['taskloop']['p50_ms']} ms "
          f"({out['ratio_p50']}x)", flush=True)
    return out


def section_loops(systems: list[System], args: argparse.Namespace, events: bool) -> dict[str, Any]:
    n = 300 if args.quick else 1000
    repeats = 1 if args.quick else args.repeats
    for system in systems:
        system.start_workers(2, events=events)
        system.throughput("accept", 50)  # warm-up: imports, connections, scripts
    out = {mode: compare(systems, mode, n, repeats) for mode in ("accept", "exhaust")}
    out["latency"] = latency(systems, 20 if args.quick else 50)
    return out


def section_workers(systems: list[System], args: argparse.Namespace) -> dict[str, Any]:
    n = 300 if args.quick else 1000
    out = {}
    for label, concurrency, nodes in (("1 process", 1, 1), ("2 processes", 2, 1), ("4 processes", 4, 1),
                                      ("2 nodes x 2 processes", 2, 2)):
        print(f"  {label}", flush=True)
        for system in systems:
            system.start_workers(concurrency, nodes)
            system.throughput("accept", 30)
        out[label] = compare(systems, "accept", n, 1)
    return out


def _run_wide(tl: TaskLoopSystem, workflow: Any, n: int) -> dict[str, Any]:
    started = time.perf_counter()
    handle = tl.client.start(workflow)
    start_s = time.perf_counter() - started
    result = handle.wait(timeout=3600)
    seconds = time.perf_counter() - started
    if result.status != "done" or len(result.values) != n:
        raise Failure(f"{workflow.name}: {result.status}, {len(result.values)} values")
    return {"tasks": n, "start_s": round(start_s, 3), "seconds": round(seconds, 3),
            "tasks_per_s": round(n / seconds, 1)}


def _run_singles(tl: TaskLoopSystem, n: int) -> dict[str, Any]:
    from bench.flows import single

    tl.r.delete("bench:finished")
    started = time.perf_counter()
    ids = [tl.client.start(single).run_id for _ in range(n)]
    start_s = time.perf_counter() - started
    wait_finished(tl.r, n, 3600)
    seconds = time.perf_counter() - started
    statuses = {tl.client.status(run_id) for run_id in ids[:: max(1, n // 200)]}
    if statuses != {"done"}:
        raise Failure(f"one-task runs ended {statuses}")
    return {"tasks": n, "start_s": round(start_s, 3), "seconds": round(seconds, 3),
            "tasks_per_s": round(n / seconds, 1)}


def section_sizes(tl: TaskLoopSystem, args: argparse.Namespace) -> dict[str, Any]:
    from bench.flows import chain, wide

    tl.start_workers(2)
    _run_wide(tl, wide[100], 100)  # warm-up
    sizes = (1, 100, 1000) if args.quick else (1, 100, 1000, 10_000)
    out: dict[str, Any] = {"wide": {}, "singles": {}}
    for n in sizes:
        out["wide"][n] = _run_wide(tl, wide[n], n)
        print(f"  one run of {n} tasks: start() {out['wide'][n]['start_s']} s, {out['wide'][n]['tasks_per_s']} tasks/s",
              flush=True)
    biggest = sizes[-1]
    out["singles"][biggest] = _run_singles(tl, biggest)
    print(f"  {biggest} one-task runs: {out['singles'][biggest]['tasks_per_s']} tasks/s", flush=True)
    wide_rate, singles_rate = out["wide"][biggest]["tasks_per_s"], out["singles"][biggest]["tasks_per_s"]
    out["ratio_wide_to_singles"] = round(wide_rate / singles_rate, 3)
    length = 200 if args.quick else 1000
    out["chain"] = _run_wide(tl, chain[length], length)
    chain_out = out["chain"]
    print(f"  a chain of {length} tasks: {chain_out['seconds']} s ({chain_out['tasks_per_s']} tasks/s)", flush=True)
    return out


def section_cancel(tl: TaskLoopSystem, args: argparse.Namespace) -> dict[str, Any]:
    from bench.flows import held

    tl.start_workers(2, nodes=2)
    tries = []
    for _ in range(2 if args.quick else 3):
        handle = tl.client.start(held)
        time.sleep(3.0)  # every process busy, thousands of phases queued behind them
        started = time.perf_counter()
        outcome = tl.client.cancel(handle.run_id, "bench")
        landed = time.perf_counter() - started
        if not outcome.cancelled:
            raise Failure(f"cancel did not land: {outcome}")
        result = handle.wait(timeout=1800)
        ended = time.perf_counter() - started
        if result.status != "cancelled":
            raise Failure(f"a cancelled run ended {result.status}")
        done = sum(1 for _ in result.values)
        tries.append({"landed_s": round(landed, 4), "ended_s": round(ended, 2), "tasks_done_before": done})
        print(f"  cancel landed in {landed * 1000:.1f} ms; the run ended cancelled {ended:.1f} s later "
              f"({done} tasks had finished)", flush=True)
    return {"tries": tries, "max_landed_s": max(t["landed_s"] for t in tries)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    server = RedisServer().start()
    logdir = Path(server.directory)
    env = {**os.environ, "TASKLOOP_REDIS_URL": server.url, "PYTHONPATH": str(REPO),
           "BENCH_BASELINE_KOMBU_CLIENTS": "1" if args.baseline_kombu_clients else "0"}
    env.pop("TASKLOOP_BROKER_URL", None)
    os.environ.update({k: v for k, v in env.items() if k.startswith("TASKLOOP_")})
    baseline, tl = Baseline(server, env, logdir), TaskLoopSystem(server, env, logdir)
    systems: list[System] = [baseline, tl]
    results: dict[str, Any] = {"quick": args.quick, "repeats": args.repeats,
                               "baseline_kombu_clients": args.baseline_kombu_clients}
    try:
        for section in args.only:
            print(f"[{section}]", flush=True)
            if section == "loops":
                results["loops"] = section_loops(systems, args, events=False)
            elif section == "events":
                results["events"] = section_loops(systems, args, events=True)
            elif section == "workers":
                results["workers"] = section_workers(systems, args)
            elif section == "sizes":
                baseline.stop_workers()
                results["sizes"] = section_sizes(tl, args)
            elif section == "cancel":
                baseline.stop_workers()
                results["cancel"] = section_cancel(tl, args)
    finally:
        for system in systems:
            system.stop_workers()
        server.stop()
    return results


def report(results: dict[str, Any]) -> str:
    lines: list[str] = []
    for section, title in (("loops", "events off (as shipped)"), ("events", "task events on in both (-E)")):
        if section not in results:
            continue
        found = results[section]
        lines += [f"### Loops, {title}", "", "| measure | baseline | taskloop | taskloop / baseline |",
                  "|---|---|---|---|"]
        for mode in ("accept", "exhaust"):
            b, t, r = found[mode]["baseline"], found[mode]["taskloop"], found[mode]["ratio"]
            lines.append(f"| steps/s, {mode}, N={b['n']} | {b['steps_per_s']} | {t['steps_per_s']} | "
                         f"{r['median']} (samples {r['samples']}) |")
        lat = found["latency"]
        lines.append(f"| latency of one 3-round loop, p50 ms | {lat['baseline']['p50_ms']} | "
                     f"{lat['taskloop']['p50_ms']} | {lat['ratio_p50']} |")
        lines.append(f"| latency, p95 ms | {lat['baseline']['p95_ms']} | {lat['taskloop']['p95_ms']} | "
                     f"{lat['taskloop']['p95_ms'] / lat['baseline']['p95_ms']:.2f} |")
        b, t = found["accept"]["baseline"], found["accept"]["taskloop"]
        lines.append(f"| Redis commands per round (accept) | {b['commands_per_round']} | {t['commands_per_round']} "
                     f"| {t['commands_per_round'] / b['commands_per_round']:.2f} |")
        lines.append(f"| Redis memory held per finished run, bytes | {b['memory_per_run_bytes']} | "
                     f"{t['memory_per_run_bytes']} | |")
        for name in b["cpu_ms_per_step"]:
            lines.append(f"| CPU ms per step, {name} | {b['cpu_ms_per_step'][name]:.2f} | "
                         f"{t['cpu_ms_per_step'][name]:.2f} | |")
        lines += ["", f"commands per round, baseline: {b['commands']}", "",
                  f"commands per round, taskloop: {t['commands']}", ""]
    if "workers" in results:
        lines += ["### Workers (accept)", "", "| workers | baseline steps/s | taskloop steps/s | ratio |",
                  "|---|---|---|---|"]
        for label, found in results["workers"].items():
            lines.append(f"| {label} | {found['baseline']['steps_per_s']} | {found['taskloop']['steps_per_s']} | "
                         f"{found['ratio']['median']} |")
        lines.append("")
    if "sizes" in results:
        sizes = results["sizes"]
        lines += ["### Run sizes (taskloop, 2 pool processes, no-op tasks)", "",
                  "| run | start() s | total s | tasks/s |", "|---|---|---|---|"]
        for n, found in sizes["wide"].items():
            lines.append(f"| one run of {n} tasks | {found['start_s']} | {found['seconds']} | {found['tasks_per_s']} |")
        for n, found in sizes["singles"].items():
            lines.append(f"| {n} runs of 1 task | {found['start_s']} (all starts) | {found['seconds']} | "
                         f"{found['tasks_per_s']} |")
        chain = sizes["chain"]
        lines.append(f"| a chain of {chain['tasks']} tasks | {chain['start_s']} | {chain['seconds']} | "
                     f"{chain['tasks_per_s']} |")
        lines += ["", f"largest run / as many one-task runs, tasks/s: {sizes['ratio_wide_to_singles']}", ""]
    if "cancel" in results:
        lines += ["### Cancel of a 10,000-task run under full load (2 nodes x 2 processes)", "",
                  "| try | cancel() landed, ms | run ended cancelled, s | tasks done before |", "|---|---|---|---|"]
        for i, found in enumerate(results["cancel"]["tries"], 1):
            lines.append(f"| {i} | {found['landed_s'] * 1000:.1f} | {found['ended_s']} | "
                         f"{found['tasks_done_before']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        type=lambda s: [p for p in s.split(",") if p],
                        help=f"comma-separated sections, from {', '.join(SECTIONS)}")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each loop figure")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    parser.add_argument("--baseline-kombu-clients", action="store_true",
                        help="give the baseline taskloop's kombu client reuse too (taskloop/worker/kombu_clients.py): "
                             "not Celery's defaults any more, it isolates taskloop's own cost")
    args = parser.parse_args()
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    try:
        results = run(args)
    except Failure as exc:
        print(f"WRONG RESULT: {exc}", file=sys.stderr)
        sys.exit(2)
    print()
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()

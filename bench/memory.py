"""What a run costs in Redis memory, and how retention bounds it.

    python -m bench.memory                 # 1,000 runs of each workflow (about 2 minutes on 2 cores)
    python -m bench.memory --runs 200      # fewer runs
    python -m bench.memory --json out.json # also keep the raw figures

Starts its own redis-server (no AOF, so that its buffers do not blur the figures) and one
``taskloop worker`` with 2 pool processes, then for each workflow: starts N runs, waits for all
of them, and reports the growth of ``used_memory`` per run (and per task), with what each of a
run's keys holds (``MEMORY USAGE``, sampled), its event count and the global index entries; first
as the runs ended (the worker's reconciler is off), then once a reconcile pass has compacted them
(taskloop/store/compacted.py): what a finished run holds for the rest of its retention.

- ``loop3``: one loop task accepted in round 3 (small candidates, a short feedback);
- ``chain10``: ten plain tasks in a chain, each returning a 1 KB string (a realistic output).

Last, the ``retention`` section runs the loop again with a worker whose TASKLOOP_RETENTION_S is
a few seconds and shows the memory coming back once the finished runs expire and a reconcile
pass trims the runs index: what Redis holds is (runs finished per retention period) x (bytes per
run), plus the runs still going.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

import taskloop as tl
from taskloop.ops.embedded import RedisServer, spawn_worker, wait_until_ready

REPO = Path(__file__).resolve().parent.parent
OUTPUT_BYTES = 1024
SAMPLE = 50  # runs whose keys are measured one by one

# --- the workflows (imported by the worker too) ---------------------------------------------------


def _attempt(ctx: tl.LoopContext, feedback: str | None) -> int:
    return ctx.round


def _accept_at_3(ctx: tl.LoopContext, candidate: int) -> tl.LoopCheck:
    if candidate >= 3:
        return tl.LoopCheck(done=True)
    return tl.LoopCheck(done=False, feedback="not yet: the score is below 90, tighten the argument")


def _kilobyte(ctx: tl.TaskContext) -> str:
    return (f"{ctx.key}: " + "lorem ipsum dolor sit amet " * 64)[:OUTPUT_BYTES]


loop3 = tl.define_workflow("mem-loop3", version="1", tasks=[
    tl.define_loop_task("refine", max_rounds=3, attempt=_attempt, check=_accept_at_3),
])
chain10 = tl.define_workflow("mem-chain10", version="1", tasks=[
    tl.define_task(f"step{i}", run=_kilobyte, after=[f"step{i - 1}"] if i else []) for i in range(10)
])
WORKFLOWS = {"loop3": (loop3, 1), "chain10": (chain10, 10)}


# --- measuring --------------------------------------------------------------------------------------


def used_memory(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def commands(r: redis.Redis) -> int:
    """Every command Redis has run so far, counted as bench/run.py counts them (the commands inside
    scripts too, the benchmark's own polling left out)."""
    from bench.systems import IGNORED_COMMANDS, commandstats  # here: the worker imports this module too

    return sum(n for name, n in commandstats(r).items() if name not in IGNORED_COMMANDS)


def settle(r: redis.Redis) -> int:
    """used_memory once it stops moving (the worker's last acks and the reconciler's writes)."""
    last = used_memory(r)
    for _ in range(20):
        time.sleep(0.25)
        now = used_memory(r)
        if abs(now - last) < 4096:
            return now
        last = now
    return last


def key_sizes(r: redis.Redis, run_ids: list[str]) -> dict[str, Any]:
    from taskloop.store import keys as k

    sizes: dict[str, list[int]] = {"run hash": [], "events stream": [], "end list": [], "leases zset": [],
                                   "compact record": []}
    events: list[int] = []
    fields: list[int] = []
    ttls: list[int] = []
    for run_id in run_ids[:SAMPLE]:
        keys = k.RunKeys.of(run_id)
        for label, name in (("run hash", keys.run), ("events stream", keys.events), ("end list", keys.end),
                            ("leases zset", keys.leases), ("compact record", keys.compact)):
            sizes[label].append(int(r.memory_usage(name, samples=0) or 0))
        events.append(int(r.xlen(keys.events)))
        fields.append(int(r.hlen(keys.run)))
        ttls.append(int(r.ttl(keys.run)))
    out: dict[str, Any] = {f"{label} bytes": round(statistics.mean(v)) for label, v in sizes.items()}
    out["run keys bytes"] = sum(out[f"{label} bytes"] for label in sizes)
    out["events per run"] = round(statistics.mean(events), 1)
    out["bytes per event"] = round(out["events stream bytes"] / max(out["events per run"], 1))
    out["hash fields per run"] = round(statistics.mean(fields), 1)
    out["ttl s (retention)"] = min(ttls)
    return out


def median_ms(call: Callable[[str], object], run_ids: list[str]) -> float:
    """The median time of ``call(run_id)`` over ``run_ids``, in ms."""
    times = []
    for run_id in run_ids:
        started = time.perf_counter()
        call(run_id)
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 2)


class Bench:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server = RedisServer(tmp / "redis", appendonly=False)
        (tmp / "redis").mkdir()
        self.worker: subprocess.Popen[bytes] | None = None
        self.r: redis.Redis | None = None
        self.client: tl.TaskLoop | None = None

    def start(self) -> None:
        self.server.start()
        self.r = redis.Redis.from_url(self.server.url, decode_responses=True)
        self.client = tl.TaskLoop(self.server.url)

    def start_worker(self, env: dict[str, str] | None = None) -> None:
        self.stop_worker()
        log = self.tmp / f"worker-{time.monotonic_ns()}.log"
        self.worker = spawn_worker(self.server.url, ["bench.memory"], concurrency=2, name="mem@%h", loglevel="INFO",
                                   logfile=str(log), extra_env={"PYTHONPATH": str(REPO), **(env or {})})
        wait_until_ready(self.worker, log)

    def stop_worker(self) -> None:
        if self.worker is not None:
            self.worker.terminate()
            self.worker.wait(60)
            self.worker = None

    def stop(self) -> None:
        self.stop_worker()
        if self.client is not None:
            self.client.close()
        self.server.stop()

    def runs(self, workflow: tl.Workflow, n: int) -> list[str]:
        assert self.client is not None
        ids = [self.client.start(workflow).run_id for _ in range(n)]
        for run_id in ids:
            result = self.client.wait(run_id, timeout=600)
            if result.status != "done":
                raise SystemExit(f"run {run_id} of {workflow.name} ended {result.status}: {result.errors}")
        return ids

    def measure(self, name: str, n: int) -> dict[str, Any]:
        assert self.r is not None
        workflow, tasks = WORKFLOWS[name]
        self.runs(workflow, 5)  # warm up: scripts loaded, connections made
        self.compact_all()
        before = settle(self.r)
        started = time.perf_counter()
        ids = self.runs(workflow, n)
        seconds = time.perf_counter() - started
        ended = settle(self.r)
        ended_sizes = key_sizes(self.r, ids)
        inspect_live = self.inspect_ms(ids)
        calls_before = commands(self.r)
        took = self.compact_all()
        end_commands = (commands(self.r) - calls_before) / n
        after = settle(self.r)
        per_run = (after - before) / n
        inspect_compacted = self.inspect_ms(ids)
        fork = self.fork_ms(workflow, ids)
        return {"workflow": name, "runs": n, "tasks per run": tasks, "seconds": round(seconds, 1),
                "as ended: used_memory delta per run bytes": round((ended - before) / n),
                **{f"as ended: {label}": value for label, value in ended_sizes.items()},
                "compacted: used_memory delta per run bytes": round(per_run),
                "compacted: per task bytes": round(per_run / tasks),
                **{f"compacted: {label}": value for label, value in key_sizes(self.r, ids).items()},
                "compaction pass seconds": round(took, 2),
                "compaction pass: Redis commands per run (forget, count, compact)": round(end_commands, 2),
                "inspect ms, as ended": inspect_live, "inspect ms, compacted": inspect_compacted,
                **({"fork ms, compacted": fork} if fork is not None else {}),
                "tl:runs bytes per entry": round(int(self.r.memory_usage("tl:runs", samples=0) or 0)
                                                 / max(int(self.r.zcard("tl:runs")), 1))}

    def inspect_ms(self, ids: list[str]) -> float:
        """The median time of ``client.inspect`` on a sample of the runs."""
        assert self.client is not None
        return median_ms(self.client.inspect, ids[:SAMPLE])

    def fork_ms(self, workflow: tl.Workflow, ids: list[str]) -> float | None:
        """The median time of ``client.fork`` (the new run's one write) of a compacted loop at round 2."""
        if workflow is not loop3:
            return None
        client = self.client
        assert client is not None
        return median_ms(lambda run_id: client.fork(run_id, "refine", 2), ids[:20])

    def compact_all(self) -> float:
        """One reconcile pass that finds every finished run due (as the workers' passes do within a
        pass of each run's end), so that every finished run is compacted; how long it took."""
        from taskloop.base.config import Settings
        from taskloop.runtime.celery_app import PhaseSender
        from taskloop.worker.recovery.reconciler import reconcile

        assert self.client is not None
        settings = Settings(redis_url=self.server.url)
        started = time.perf_counter()
        reconcile(self.client.store, settings, PhaseSender(self.client.app, self.server.url), now=time.time() + 60,
                  batches=1000)
        return time.perf_counter() - started

    def retention(self, n: int, retention_s: int) -> dict[str, Any]:
        """Runs under a short retention: memory returns once they expire and the index is trimmed."""
        from taskloop.store import keys as k

        assert self.r is not None
        self.start_worker({"TASKLOOP_RETENTION_S": str(retention_s), "TASKLOOP_RECONCILE_INTERVAL_S": "1"})
        self.runs(loop3, 5)
        time.sleep(retention_s + 2)
        before = settle(self.r)
        ids = self.runs(loop3, n)
        peak = settle(self.r)
        deadline = time.monotonic() + retention_s + 30
        while time.monotonic() < deadline:  # Redis expires keys actively; the reconciler trims tl:runs
            time.sleep(1)
            if not any(self.r.exists(k.RunKeys.of(run_id).run) for run_id in ids[:: max(n // 20, 1)]) and \
                    self.r.zscore(k.RUNS_INDEX, ids[-1]) is None:
                break
        after = settle(self.r)
        return {"runs": n, "retention s": retention_s, "used_memory before": before, "peak": peak,
                "after expiry": after, "peak delta per run bytes": round((peak - before) / n),
                "left per run bytes": round((after - before) / n),
                "tl:runs entries left": int(self.r.zcard("tl:runs"))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--retention-s", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.pop("TASKLOOP_BROKER_URL", None)
    with tempfile.TemporaryDirectory(prefix="taskloop-memory-") as tmp:
        bench = Bench(Path(tmp))
        try:
            bench.start()
            assert bench.r is not None
            info = bench.r.info("server")
            print(f"redis {info['redis_version']}, {args.runs} runs per workflow, worker -c 2")
            bench.start_worker({"TASKLOOP_RECONCILE_INTERVAL_S": "0"})  # the bench compacts when it measures
            results: dict[str, Any] = {name: bench.measure(name, args.runs) for name in WORKFLOWS}
            results["retention"] = bench.retention(args.runs, args.retention_s)
        finally:
            bench.stop()
    for name, figures in results.items():
        print(f"\n## {name}")
        for label, value in figures.items():
            print(f"  {label}: {value:,}" if isinstance(value, int) else f"  {label}: {value}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""The latency of one 3-round loop on idle workers, alone: what ``bench.run``'s loops section
measures twice, repeated here to see its spread, and to compare two trees of the code.

    python -m bench.latency                  # 150 loops per system, twice (about 2 minutes)
    python -m bench.latency --runs 50 --repeats 4
    python -m bench.latency --alone          # taskloop only: p50 and min of each block of 50 loops
    python -m bench.latency --json out.json  # also keep the raw figures

Starts its own redis-server and, as ``bench.run`` does, workers with 2 pool processes for the
hand-rolled loop at Celery's defaults, the same with taskloop's kombu fix, and taskloop; waits
until taskloop's reconciler has forgotten every warm-up run (settled), then runs ``bench.run``'s
``latency`` (blocks of ten loops per system, interleaved, the others' workers paused) ``repeats``
times. To compare two trees, run it from each (``cd`` into a ``git worktree`` of the other
commit): the figures are paired ratios within one invocation, never across two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.run import latency, settle
from bench.systems import Baseline, BaselineKombu, System, TaskLoopSystem, bench_redis

ALONE_BLOCK = 50


def alone(tl: TaskLoopSystem, blocks: int) -> list[dict[str, float]]:
    """taskloop's loops one after another, no other system running: p50 and min per block."""
    found = []
    started = time.monotonic()
    for block in range(blocks):
        values = [tl.one_latency() for _ in range(ALONE_BLOCK)]
        row = {"at_s": round(time.monotonic() - started, 1), "p50_ms": round(statistics.median(values) * 1000, 2),
               "min_ms": round(min(values) * 1000, 2)}
        print(f"  block {block}: p50 {row['p50_ms']} ms, min {row['min_ms']} ms (at {row['at_s']} s)", flush=True)
        found.append(row)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=150, help="loops per system in each repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--alone", action="store_true", help="taskloop only, blocks of 50 loops")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    server, logdir, env = bench_redis()
    tl = TaskLoopSystem(server, env, logdir)
    systems: list[System] = [tl] if args.alone else [Baseline(server, env, logdir),
                                                     BaselineKombu(server, env, logdir), tl]
    out: dict[str, Any] = {"runs": args.runs, "repeats": args.repeats, "alone": args.alone}
    try:
        for system in systems:
            system.start_workers(2)
            system.throughput("accept", 50)  # warm-up: imports, connections, scripts
        settle(systems)
        if args.alone:
            out["blocks"] = alone(tl, max(1, args.runs * args.repeats // ALONE_BLOCK))
        else:
            out["repeats_found"] = []
            for _ in range(args.repeats):
                found = latency(systems, args.runs)
                print(f"  taskloop / {found['ratios_p50']}", flush=True)
                out["repeats_found"].append(found)
    finally:
        for system in systems:
            system.stop_workers()
        tl.client.close()
        server.stop()
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""The latency of one 3-round loop on idle workers, alone: what ``bench.run``'s loops section
measures twice, repeated here to see its spread, and to compare two trees of the code.

    python -m bench.latency                  # 150 loops per system, twice (about 2 minutes)
    python -m bench.latency --runs 50 --repeats 4
    python -m bench.latency --alone          # taskloop only: p50 and min of each block of 50 loops
    python -m bench.latency --json out.json  # also keep the raw figures
    python -m bench.latency --wake           # what the round trip after the wake costs (paired)

Starts its own redis-server and, as ``bench.run`` does, workers with 2 pool processes for the
hand-rolled loop at Celery's defaults, the same with taskloop's kombu fix, and taskloop; waits
until taskloop's reconciler has forgotten every warm-up run (settled), then runs ``bench.run``'s
``latency`` (blocks of ten loops per system, interleaved, the others' workers paused) ``repeats``
times. To compare two trees, run it from each (``cd`` into a ``git worktree`` of the other
commit): the figures are paired ratios within one invocation, never across two.

``--wake`` compares, on taskloop alone, the two ways ``wait()`` reads a run that ended: the read
after the wake (``block_end``, then ``meta_and_result``: what every block but the first does) and
the read riding on the wake (``woken_result``: the first block), in alternating order, one loop
of each per pair, and reports the median of the paired differences.
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


def wake(tl: TaskLoopSystem, pairs: int) -> dict[str, float]:
    """Loops waited for with the read after the wake and with the read riding on it, alternating."""
    from bench.flows import accept
    from taskloop.runtime import views

    store = tl.client.store

    def after_wake(run_id: str) -> Any:
        while not store.block_end(run_id, 5000):
            pass
        return views.meta_and_result(store, run_id)

    def riding(run_id: str) -> Any:
        while (woken := views.woken_result(store, run_id, 5000)) is None:
            pass
        return woken

    found: dict[str, list[float]] = {"after the wake": [], "riding on the wake": []}
    reads = {"after the wake": after_wake, "riding on the wake": riding}
    for i in range(pairs):
        for name in (list(reads) if i % 2 else list(reads)[::-1]):
            started = time.perf_counter()
            run_id = tl.client.start(accept).run_id
            tl.client._meta(run_id)  # as wait() does first
            _, result = reads[name](run_id)
            found[name].append(time.perf_counter() - started)
            if result is None or result.values != {"loop": 3}:
                raise RuntimeError(f"a loop ended wrong: {result}")
    out = {f"p50_ms {name}": round(statistics.median(v) * 1000, 3) for name, v in found.items()}
    diffs = [a - b for a, b in zip(found["after the wake"], found["riding on the wake"], strict=True)]
    out["median paired difference ms"] = round(statistics.median(diffs) * 1000, 3)
    print(f"  {pairs} pairs: {out}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=150, help="loops per system in each repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--alone", action="store_true", help="taskloop only, blocks of 50 loops")
    parser.add_argument("--wake", action="store_true", help="taskloop only: the read after the wake against "
                        "the read riding on it, --runs pairs per repeat")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    server, logdir, env = bench_redis()
    tl = TaskLoopSystem(server, env, logdir)
    systems: list[System] = [tl] if args.alone or args.wake else [Baseline(server, env, logdir),
                                                     BaselineKombu(server, env, logdir), tl]
    out: dict[str, Any] = {"runs": args.runs, "repeats": args.repeats, "alone": args.alone, "wake": args.wake}
    try:
        for system in systems:
            system.start_workers(2)
            system.throughput("accept", 50)  # warm-up: imports, connections, scripts
        settle(systems)
        if args.wake:
            out["wake"] = [wake(tl, args.runs) for _ in range(args.repeats)]
        elif args.alone:
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

"""taskloop against a hand-rolled Celery loop, in one invocation, on one redis-server.

    python -m bench.run                       # every section below (about 10 minutes on 2 cores)
    python -m bench.run --quick               # smaller sizes, one repeat (about 4 minutes)
    python -m bench.run --only loops,sizes    # some sections: loops, events, workers, rss, ceiling, scaling,
                                              # sizes, cancel, models
    python -m bench.run --only models --workloads 1000 --systems celery-threads,taskloop-asyncio
    python -m bench.run --json out.json       # also keep the raw figures
    python -m bench.run --only loops --tracing   # and taskloop with OpenTelemetry tracing on (taskloop[otel])

The loops are measured against three systems (issue 24), each in the same invocation:
``baseline``, a hand-rolled Celery loop at Celery's own defaults (bench/baseline.py);
``baseline-kombu``, the same with taskloop's kombu fix (one Redis client per channel), which
isolates taskloop's own cost; and ``durable``, the durable floor: the hand-rolled loop plus one
Lua compare-and-set and one XADD per step (bench/durable.py). The other sections compare with
``baseline``. All run with Celery's own defaults (prefetch 4, fair scheduling, task events
off), JSON, ``acks_late``, one worker with 2 pool processes unless a section says otherwise, on
the same redis-server (started here, AOF everysec). Sections:

- ``loops``: N independent loops of 3 rounds (6 steps), accepted in round 3 or exhausted;
  steps/s, paired ratios, p50/p95 latency of one loop (right after the throughput runs, while
  taskloop's reconciler still compacts them, and again once it has: *settled*), Redis commands
  per round, memory per run; and taskloop's commands per round and memory per finished run *all
  in*: counted until the reconciler has forgotten and compacted every run.
- ``events``: the same with task events on in both workers (``-E``: the cost under Flower).
- ``workers``: steps/s with 1, 2 and 4 pool processes, and with two worker nodes.
- ``ceiling``: taskloop with its store and its broker on two redis-servers: each one's CPU per
  step, and the steps/s one core would carry at that cost.
- ``scaling``: the store on a Redis Cluster of 1, 2 and 3 masters and the broker on its own
  redis-server, each server held to the same slice of one core (bench/scaling.py): how steps/s
  grows with the store's masters, and which server bounds it.
- ``rss``: the memory of one worker with 2 and with 4 pool processes after 300 loops (RSS and
  PSS, summed over every process of the worker: taskloop's supervisor included), and of a
  ``taskloop worker --metrics-port`` (prometheus-client loaded in every process).
- ``sizes``: one run of 1, 100, 1,000 and 10,000 independent tasks against as many one-task
  runs; a 1,000-task chain; tasks/s and the time of ``start()``.
- ``cancel``: a 10,000-task run under full load: how long ``cancel()`` takes to land, and how
  long until the run has ended.
- ``models``: loops that wait like a model call (bench/models.py): 100, 1,000 and 10,000 phases
  in flight in one worker process with 0.5, 2 and 20 s phases; taskloop on threads, gevent and
  asyncio against the hand-rolled Celery loop on threads and gevent at the same concurrency; the
  fraction of the limit (concurrency / phase time), the ratio, worker CPU per step and peak RSS.
  About 35 minutes in all (10,000 in flight: 20 s phases).

With ``--tracing`` (``loops``), a fifth system, ``taskloop-traced``, is taskloop with tracing on
(SPEC §14): its workers export every span over OTLP/HTTP to a sink on 127.0.0.1
(bench/otlp_sink.py), which counts them, and the ratios ``taskloop / taskloop-traced`` are paired
within the invocation, interleaved like the others. This process, which starts both taskloops'
runs, traces then (a run's context, each message's header: a few microseconds per start).

The script exits non-zero if any run or loop ends in the wrong state, so speed never hides a
wrong answer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import models, scaling
from bench.systems import (
    REPO,
    Baseline,
    BaselineKombu,
    DurableFloor,
    Failure,
    System,
    TaskLoopSystem,
    bench_redis,
    commandstats,
    counted,
    median_of,
    wait_finished,
    worker_memory,
)
from taskloop.ops.embedded import RedisServer

SECTIONS = ("loops", "events", "workers", "rss", "ceiling", "scaling", "sizes", "cancel", "models")


class alone:
    """While one system is measured, the others' workers are paused (SIGSTOP, then SIGCONT): idle
    Celery workers still poll and tick, and on 2 cores four idle workers took a share of the CPU
    from the one being measured."""

    def __init__(self, measured: System, systems: list[System]) -> None:
        self.pids = [pid for s in systems if s is not measured
                     for name in ("worker main", "worker pool") for pid in s.processes()[name]]

    def _signal(self, signum: int) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def __enter__(self) -> None:
        self._signal(signal.SIGSTOP)

    def __exit__(self, *_: object) -> None:
        self._signal(signal.SIGCONT)


def compare(systems: list[System], mode: str, n: int, repeats: int) -> dict[str, Any]:
    """Interleaved repeats of one throughput figure (drift hits all alike); paired ratios."""
    samples: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    for i in range(repeats):
        for system in systems if i % 2 == 0 else systems[::-1]:
            with alone(system, systems):
                samples[system.name].append(system.throughput(mode, n))
    out: dict[str, Any] = {s.name: median_of(samples[s.name]) for s in systems}
    out["ratios"] = {}
    for other in (s.name for s in systems if s.name != "taskloop"):
        pairs = [t["steps_per_s"] / b["steps_per_s"] for b, t in zip(samples[other], samples["taskloop"], strict=True)]
        out["ratios"][other] = {"median": round(statistics.median(pairs), 3), "samples": [round(p, 3) for p in pairs]}
    out["ratio"] = out["ratios"]["baseline"]  # against the hand-rolled loop at Celery's defaults
    print(f"  {mode:8} N={n:<6} " + "  ".join(f"{s.name} {out[s.name]['steps_per_s']:>7}" for s in systems)
          + " steps/s  taskloop / " + ", ".join(f"{k} {v['median']}" for k, v in out["ratios"].items()), flush=True)
    return out


def latency(systems: list[System], runs: int) -> dict[str, Any]:
    """Blocks of ten loops per system, interleaved and in alternating order, so that the machine's
    drift over the section hits every system alike (as the throughput figures' repeats do)."""
    found: dict[str, list[float]] = {s.name: [] for s in systems}
    block = 10
    for i in range(max(1, runs // block)):
        for system in systems if i % 2 == 0 else systems[::-1]:
            with alone(system, systems):
                system.one_latency()  # not counted: the first loop after the system was paused
                for _ in range(block):
                    found[system.name].append(system.one_latency())
    out: dict[str, Any] = {}
    for name, values in found.items():
        ordered = sorted(values)
        out[name] = {"runs": runs, "p50_ms": round(statistics.median(ordered) * 1000, 2),
                     "p95_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1000, 2)}
    out["ratio_p50"] = round(out["taskloop"]["p50_ms"] / out["baseline"]["p50_ms"], 3)
    out["ratios_p50"] = {name: round(out["taskloop"]["p50_ms"] / out[name]["p50_ms"], 3)
                         for name in found if name != "taskloop"}
    print("  latency p50 " + ", ".join(f"{name} {out[name]['p50_ms']} ms" for name in found), flush=True)
    return out


def section_loops(systems: list[System], args: argparse.Namespace, events: bool) -> dict[str, Any]:
    n = 300 if args.quick else 1000
    repeats = 1 if args.quick else args.repeats
    for system in systems:
        system.start_workers(2, events=events)
        system.throughput("accept", 50)  # warm-up: imports, connections, scripts
    out = {mode: compare(systems, mode, n, repeats) for mode in ("accept", "exhaust")}
    runs = 20 if args.quick else 150  # 15 blocks of ten per system: a slow stretch of the machine weighs less
    # right after the throughput runs: taskloop's reconciler is still forgetting and compacting them
    # (a worker's main process; the systems not measured are paused, so that work waits for its turn)
    out["latency"] = latency(systems, runs)
    settle(systems)
    out["latency_settled"] = latency(systems, runs)
    out["all_in"] = all_in(systems, n)
    return out


def all_in(systems: list[System], n: int) -> dict[str, Any]:
    """taskloop's Redis commands per round and memory per finished run with the reconciler's pass
    that forgets and compacts the runs counted in full: N accepted loops, counted from before the
    first start until every run is compacted and a further pass has gone by (the idle fleet's own
    polls in that time included). The throughput figures count only until the last loop ends, when
    part of that pass is still to come."""
    tl = next(s for s in systems if isinstance(s, TaskLoopSystem))
    with alone(tl, systems):
        tl.r.delete("bench:finished")
        before, memory_before = commandstats(tl.r), int(tl.r.info("memory")["used_memory"])
        ids = tl.start_loops("accept", n)
        wait_finished(tl.r, n, timeout=1800)
        settle([tl])
        after, memory_after = commandstats(tl.r), int(tl.r.info("memory")["used_memory"])
        tl.verify("accept", ids)  # after the count: the bench's own reads are not taskloop's
    found = {"n": n, **counted(before, after, memory_before, memory_after, n)}
    print(f"  all in (the pass that forgets and compacts included): {found['commands_per_round']} Redis commands "
          f"per round, {found['memory_per_run_bytes']} bytes per finished run", flush=True)
    return found


def settle(systems: list[System], timeout: float = 120.0) -> None:
    """Wait until taskloop's reconciler has forgotten (and compacted) every finished run, and one
    more pass has gone by: what a loop started on a quiet fleet meets."""
    from taskloop.store.keys import LIVE_INDEX

    tl = next(s for s in systems if isinstance(s, TaskLoopSystem))
    deadline = time.monotonic() + timeout
    while tl.r.zcard(LIVE_INDEX) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(6.0)  # a reconcile pass (every 5 s) that finds nothing


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


def section_rss(systems: list[System], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tl = next(s for s in systems if isinstance(s, TaskLoopSystem))
    for concurrency in (2, 4):
        found: dict[str, Any] = {}
        for system in systems:
            system.start_workers(concurrency)
            system.throughput("accept", 300)  # warm: every pool process has run phases
            found[system.name] = worker_memory(system)
        found["ratio_rss"] = round(found["taskloop"]["rss_mb"] / found["baseline"]["rss_mb"], 2)
        found["ratio_pss"] = round(found["taskloop"]["pss_mb"] / found["baseline"]["pss_mb"], 2)
        out[f"{concurrency} processes"] = found
    tl.metrics_port = True
    try:
        tl.start_workers(2)
        tl.throughput("accept", 300)
        with_metrics = worker_memory(tl)
    finally:
        tl.metrics_port = False
    base = out["2 processes"]["baseline"]
    out["2 processes, --metrics-port"] = {"taskloop": with_metrics, "baseline": base,
                                          "ratio_rss": round(with_metrics["rss_mb"] / base["rss_mb"], 2),
                                          "ratio_pss": round(with_metrics["pss_mb"] / base["pss_mb"], 2)}
    for system in systems:
        system.stop_workers()
    return out


def section_ceiling(args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """taskloop with its store and its broker on two redis-servers: the CPU each spends per step,
    and the steps/s one redis-server at 100% of a core would carry at that cost (1,000 / ms per
    step: an extrapolation from the measured cost, not a measured ceiling; this machine has 2
    cores for everything). The baseline's own Redis cost per step is in the loops section."""
    n = 300 if args.quick else 1000
    store, broker = RedisServer().start(), RedisServer().start()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TASKLOOP_REDIS_URL": store.url, "TASKLOOP_BROKER_URL": broker.url}
    tl = TaskLoopSystem(store, env, logdir, broker=broker)
    try:
        tl.start_workers(2)
        tl.throughput("accept", 50)
        samples = [tl.throughput("accept", n) for _ in range(1 if args.quick else 3)]
        found = median_of(samples)
        per_step = found["cpu_ms_per_step"]
        cpu = {"store": per_step["redis-server"], "broker": per_step["broker redis-server"]}
        return {"n": n, "steps_per_s": found["steps_per_s"], "cpu_ms_per_step": cpu,
                "ceiling_steps_per_s": {name: round(1000 / ms) if ms else None for name, ms in cpu.items()},
                "store_commands_per_round": found["commands_per_round"]}
    finally:
        tl.stop_workers()
        tl.client.close()
        store.stop()
        broker.stop()


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


def traced(env: dict[str, str]) -> tuple[dict[str, str], Any]:
    """taskloop's environment with tracing on, exporting to a sink of its own (``--tracing``); this
    process traces too (its starts)."""
    import importlib.util

    from bench.otlp_sink import Sink

    sink = Sink().start()
    found = importlib.util.find_spec("opentelemetry.sdk")
    assert found is not None and found.submodule_search_locations, "--tracing needs taskloop[otel]"
    where = str(Path(found.submodule_search_locations[0]).parents[1])
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_SERVICE_NAME": "bench"}
    os.environ.update(otel)
    return {**env, **otel, "PYTHONPATH": f"{env['PYTHONPATH']}:{where}"}, sink


class TracedTaskLoop(TaskLoopSystem):
    """taskloop with tracing on (``--tracing``), on a queue of its own (bench/traced_config.py)."""

    name = "taskloop-traced"
    queue = "taskloop-traced"

    def __init__(self, server: RedisServer, env: dict[str, str], logdir: Path) -> None:
        from taskloop import TaskLoop
        from taskloop.runtime.celery_app import make_app

        super().__init__(server, {**env, "TASKLOOP_CELERY_CONFIG": "bench.traced_config"}, logdir)
        self.client.close()
        app = make_app(self.client.settings)
        app.conf.task_default_queue = self.queue
        self.client = TaskLoop(self.url, app=app)


def run(args: argparse.Namespace) -> dict[str, Any]:
    server, logdir, env = bench_redis()
    baseline, tl = Baseline(server, env, logdir), TaskLoopSystem(server, env, logdir)
    pair: list[System] = [baseline, tl]
    # the loops are measured against three: Celery's defaults, the same with taskloop's kombu fix,
    # and the durable floor (issue 24); the other sections against Celery's defaults
    systems: list[System] = [baseline, BaselineKombu(server, env, logdir), DurableFloor(server, env, logdir), tl]
    sink = None
    if args.tracing:
        traced_env, sink = traced(env)
        systems.append(TracedTaskLoop(server, traced_env, logdir))
    results: dict[str, Any] = {"quick": args.quick, "repeats": args.repeats}
    try:
        for section in args.only:
            print(f"[{section}]", flush=True)
            if section == "loops":
                results["loops"] = section_loops(systems, args, events=False)
            elif section == "events":
                results["events"] = section_loops(systems, args, events=True)
            elif section == "workers":
                for system in systems:
                    system.stop_workers()
                results["workers"] = section_workers(pair, args)
            elif section == "ceiling":
                for system in systems:
                    system.stop_workers()
                results["ceiling"] = section_ceiling(args, logdir)
            elif section == "scaling":
                for system in systems:
                    system.stop_workers()
                results["scaling"] = scaling.section(args)
            elif section == "rss":
                for system in systems:
                    system.stop_workers()
                results["rss"] = section_rss(pair, args)
            elif section == "sizes":
                baseline.stop_workers()
                results["sizes"] = section_sizes(tl, args)
            elif section == "cancel":
                baseline.stop_workers()
                results["cancel"] = section_cancel(tl, args)
            elif section == "models":  # loops that wait on models: threads, gevent, asyncio (bench/models.py)
                for system in systems:
                    system.stop_workers()
                if args.workloads is None:
                    args.workloads = [100, 1000] if args.quick else list(models.WORKLOADS)
                results["models"] = models.section(args, server)
    finally:
        for system in systems:
            system.stop_workers()
        server.stop()
        if sink is not None:
            results["spans_exported"] = sink.spans
            print(f"tracing: {sink.spans} spans exported to the sink", flush=True)
            sink.stop()
    return results


def _ratio(found: dict[str, Any]) -> str:
    return f"{found['median']} ({', '.join(map(str, found['samples']))})"


def report(results: dict[str, Any]) -> str:
    lines: list[str] = []
    for section, title in (("loops", "events off (as shipped)"), ("events", "task events on in both (-E)")):
        if section not in results:
            continue
        found = results[section]
        names = [n for n in ("baseline", "baseline-kombu", "durable", "taskloop-traced", "taskloop")
                 if n in found["accept"]]
        heads = {"baseline": "hand-rolled, Celery defaults", "baseline-kombu": "hand-rolled + kombu fix",
                 "durable": "durable floor (+ Lua CAS + XADD)", "taskloop-traced": "taskloop, tracing on",
                 "taskloop": "taskloop"}
        others = [n for n in names if n != "taskloop"]
        lines += [f"### Loops, {title}", "",
                  "| measure | " + " | ".join(heads[n] for n in names) + " | "
                  + " | ".join(f"taskloop / {heads[n]}" for n in others) + " |",
                  "|---|" + "---|" * (len(names) + len(others))]
        for mode in ("accept", "exhaust"):
            row = found[mode]
            lines.append(f"| steps/s, {mode}, N={row['taskloop']['n']} | "
                         + " | ".join(str(row[n]["steps_per_s"]) for n in names) + " | "
                         + " | ".join(_ratio(row["ratios"][n]) for n in others) + " |")
        for key, when in (("latency", "right after the throughput runs"), ("latency_settled", "settled")):
            if key not in found:
                continue
            lat = found[key]
            lines.append(f"| latency of one 3-round loop, {when}, p50 ms | "
                         + " | ".join(str(lat[n]["p50_ms"]) for n in names)
                         + " | " + " | ".join(str(lat["ratios_p50"][n]) for n in others) + " |")
            lines.append(f"| latency, {when}, p95 ms | " + " | ".join(str(lat[n]["p95_ms"]) for n in names)
                         + " | " + " | ".join(f"{lat['taskloop']['p95_ms'] / lat[n]['p95_ms']:.2f}" for n in others)
                         + " |")
        acc = found["accept"]
        lines.append("| Redis commands per round (accept) | "
                     + " | ".join(str(acc[n]["commands_per_round"]) for n in names) + " | "
                     + " | ".join(f"{acc['taskloop']['commands_per_round'] / acc[n]['commands_per_round']:.2f}"
                                  for n in others) + " |")
        lines.append("| Redis memory held per finished run, bytes | "
                     + " | ".join(str(acc[n]["memory_per_run_bytes"]) for n in names) + " |" + " |" * len(others))
        for proc in acc["taskloop"]["cpu_ms_per_step"]:
            lines.append(f"| CPU ms per step, {proc} | "
                         + " | ".join(f"{acc[n]['cpu_ms_per_step'][proc]:.2f}" for n in names) + " |"
                         + " |" * len(others))
        for n in names:
            lines += ["", f"commands per round, {n}: {acc[n]['commands']}"]
        if "all_in" in found:
            every = found["all_in"]
            lines += ["", f"taskloop, all in (N={every['n']} accepted loops, counted until the reconciler has "
                      f"forgotten and compacted every run and one more pass has gone by): "
                      f"**{every['commands_per_round']} Redis commands per round**, "
                      f"**{every['memory_per_run_bytes']} bytes held per finished run**; {every['commands']}"]
        lines.append("")
    if "workers" in results:
        lines += ["### Workers (accept)", "", "| workers | baseline steps/s | taskloop steps/s | ratio |",
                  "|---|---|---|---|"]
        for label, found in results["workers"].items():
            lines.append(f"| {label} | {found['baseline']['steps_per_s']} | {found['taskloop']['steps_per_s']} | "
                         f"{found['ratio']['median']} |")
        lines.append("")
    if "rss" in results:
        lines += ["### Worker memory (RSS and PSS summed over the worker's processes, after 300 loops)", "",
                  "| worker | baseline RSS MB | taskloop RSS MB | ratio | baseline PSS MB | taskloop PSS MB | ratio |",
                  "|---|---|---|---|---|---|---|"]
        for label, found in results["rss"].items():
            b, t = found["baseline"], found["taskloop"]
            lines.append(f"| {label} | {b['rss_mb']} | {t['rss_mb']} | {found['ratio_rss']} | {b['pss_mb']} | "
                         f"{t['pss_mb']} | {found['ratio_pss']} |")
        lines += ["", "per process, RSS MB: " + "; ".join(
            f"{label}: baseline {found['baseline']['per_process_rss_mb']}, taskloop "
            f"{found['taskloop']['per_process_rss_mb']}" for label, found in results["rss"].items()), ""]
    if "ceiling" in results:
        found = results["ceiling"]
        lines += [f"### One redis-server's ceiling (taskloop, accept, N={found['n']}, store and broker on two "
                  "redis-servers)", "",
                  "| redis-server | CPU ms per step | steps/s one core would carry at that cost |", "|---|---|---|"]
        for name, ms in found["cpu_ms_per_step"].items():
            lines.append(f"| taskloop's {name} | {ms:.3f} | {found['ceiling_steps_per_s'][name]} |")
        if "loops" in results:
            ms = results["loops"]["accept"]["baseline"]["cpu_ms_per_step"]["redis-server"]
            lines.append(f"| the baseline's one Redis (loops section) | {ms:.3f} | {round(1000 / ms) if ms else '-'} |")
        lines += ["", f"steps/s measured here: {found['steps_per_s']} (2 pool processes on 2 cores: the workers, not "
                      f"Redis, are the bound); store commands per round {found['store_commands_per_round']}", ""]
    if "scaling" in results:
        lines += scaling.report(results["scaling"])
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
    if "models" in results:
        lines += models.report(results["models"])
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
    parser.add_argument("--tracing", action="store_true",
                        help="loops: also taskloop with OpenTelemetry tracing on, exporting to a local sink "
                             "(taskloop[otel])")
    scaling.add_arguments(parser)
    models.add_arguments(parser)
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

"""What fleet limits cost and deliver (issue "fleet flow control"), on a real redis-server and
real workers (two nodes x two pool processes: a fleet, not one worker):

    python -m bench.limits                    # every section (about 5 minutes on 2 cores)
    python -m bench.limits --only rate        # one section: rate, release, admission

- ``rate``: a backlog of 10 x R single-task runs (``--windows``) under ``tl.RateLimit(rate=R,
  per_s=1)`` for R = 20, 50 and 100 starts/s, queued before the fleet starts, then again started
  into the running fleet: the rate the fleet reaches as a share of R, two ways: *steady*, the
  starts after the first window (which the backlog fills at once) over the whole time, and
  *sustained*, R over a window's mean period (start k to start k + R: what the fleet keeps up
  window after window, without the first window's spread, which *steady* carries once); and the
  most starts in any one-second window (must be <= R). Beside
  it, Celery's own ``rate_limit="R/s"`` on the same two nodes at Celery's defaults: what a
  hand-rolled task gets (Celery's limit is per worker node), waited for up to 120 s.
- ``release``: a chain of runs on one concurrency key (limit 1), each holding 0.2 s: the time
  from one phase's callback returning to the next phase's callback starting (the outcome's
  commit with the release, the message sent again, the begin that takes the slot): p50 and p95.
- ``admission``: how many starts per second one limit admits when it is the only thing
  working: ``limits.lua`` called in a loop by 4 client processes against one redis-server, for a
  rate limit (acquire) and a concurrency limit (acquire and release). A limit lives in one hash
  slot, so this is also what one limit admits on a Redis Cluster node.

Unlimited tasks are measured by ``python -m bench.run --only loops`` against the commit before
flow control (docs/benchmarks.md, *Fleet limits*).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from bench.systems import Failure, bench_redis
from taskloop.ops.embedded import wait_until_ready
from taskloop.store.keys import LimitKeys

SECTIONS = ("rate", "release", "admission")
RATES = (20, 50, 100)
WINDOWS = 10  # each rate's backlog: this many windows of starts (--windows)


def _workers(env: dict[str, str], logdir: Path, args: list[list[str]]) -> list[subprocess.Popen[bytes]]:
    procs = []
    for n, extra in enumerate(args):
        log = logdir / f"w{n}-{uuid.uuid4().hex[:6]}.log"
        proc = subprocess.Popen([sys.executable, "-m", *extra, "--logfile", str(log)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_until_ready(proc, log)
        procs.append(proc)
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(60)


def _windows(starts: list[float]) -> int:
    """The most starts in any window of one second, (t - 1, t]: the window the limit keeps."""
    return max((sum(1 for t in starts if s - 1.0 < t <= s) for s in starts), default=0)


def _rates(starts: list[float], rate: int, n: int) -> dict[str, Any]:
    """The backlog's starts (the callbacks' clocks): how many started (within 120 s), the steady
    rate (the starts after the first window, which the backlog fills at once, over the whole
    time), its share of the limit, the most in any second."""
    steady = (len(starts) - rate) / (starts[-1] - starts[0]) if len(starts) > rate + 1 else 0.0
    return {"runs": n, "started": len(starts), "steady": round(steady, 1), "share": round(steady / rate, 3),
            **_sustained(starts, rate),
            "most_in_one_s": _windows(starts)}


def _sustained(starts: list[float], rate: int) -> dict[str, Any]:
    """The rate the fleet keeps up, window after window: start k + R can begin no sooner than one
    window after start k, so R starts take one *period*, start k to start k + R, averaged over the
    backlog (1 s when every window's room is taken the moment it reopens). Unlike ``share``, it
    does not carry the first window's spread, which the backlog's size weighs (a sliding window
    repeats that spread in every window, so a backlog of W windows keeps at most
    (W - 1) / (W - 1 + spread) of R over the whole backlog)."""
    periods = [starts[k + rate] - starts[k] for k in range(len(starts) - rate)]
    if not periods:
        return {}
    period = statistics.fmean(periods)
    return {"period_s": round(period, 4), "sustained_share": round(1.0 / period, 3)}


def _line(found: dict[str, Any], rate: int) -> str:
    sustained = (f", sustained window to window {found['sustained_share']:.1%} (a window's period "
                 f"{found['period_s']} s)" if "sustained_share" in found else "")
    return (f"{found['started']} of {found['runs']} started, steady {found['steady']}/s ({found['share']:.1%} of "
            f"{rate}/s){sustained}, most in one second {found['most_in_one_s']}")


def _taskloop_nodes() -> list[list[str]]:
    return [["taskloop", "worker", "--import", "bench.limit_flows", "-c", "2", "-n", f"tl{n}@%h"] for n in range(2)]


def _rate_run(url: str, r: redis.Redis, client: Any, workflow: Any, rate: int, n: int,
              start_fleet: Any = None) -> tuple[dict[str, Any], list[subprocess.Popen[bytes]]]:
    """One backlog of ``n`` runs under ``rate``/s: started, then (``start_fleet``) the fleet started
    after them, or into the running fleet. Returns the figures of ``_rates`` and the admissions,
    and the fleet it started."""
    r.delete("bench:limits:starts")
    window = LimitKeys.of(f"bench-rate-{rate}").use
    admitted: dict[str, float] = {}  # the limit's own log, sampled while it lasts (entries live >= 1 s)
    sampling = threading.Event()

    def sample() -> None:
        sampler = redis.Redis.from_url(url, decode_responses=True)
        while not sampling.is_set():
            admitted.update(sampler.zrange(window, 0, -1, withscores=True))
            time.sleep(0.03)
        admitted.update(sampler.zrange(window, 0, -1, withscores=True))
        sampler.close()

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    handles = [client.start(workflow, input={}) for _ in range(n)]
    procs = start_fleet() if start_fleet is not None else []
    deadline = time.monotonic() + 120
    while r.llen("bench:limits:starts") < n and time.monotonic() < deadline:
        time.sleep(0.05)
    for handle in handles:
        if handle.wait(timeout=60).status != "done":
            raise Failure(f"a run under {rate}/s did not end done")
    sampling.set()
    thread.join()
    ours = {handle.run_id for handle in handles}  # the window may still hold the last backlog's starts
    admitted = {member: at for member, at in admitted.items() if member.split("|", 1)[0] in ours}
    starts = sorted(float(t) for t in r.lrange("bench:limits:starts", 0, -1))
    found = {**_rates(starts, rate, n), "most_admitted_in_one_s": _windows(sorted(admitted.values())),
             "admissions_seen": len(admitted), "first_window_spread_s": round(starts[rate - 1] - starts[0], 3),
             **_reopen_lag(sorted(admitted.values()), rate, n)}
    return found, procs


def _reopen_lag(admissions: list[float], rate: int, n: int) -> dict[str, Any]:
    """How long after a window had room again the next start was admitted: admission k against
    admission k - R (the start whose leaving made the room) + 1 s. Only when the sampled log holds
    every admission."""
    if len(admissions) != n:
        return {}
    by_k = [(admissions[k] - admissions[k - rate] - 1.0) * 1000 for k in range(rate, len(admissions))]
    lags = sorted(by_k)
    return {"reopen_lag_ms_p50": round(statistics.median(lags), 1),
            "reopen_lag_ms_p90": round(statistics.quantiles(lags, n=10)[8], 1),
            # where the lag is: its mean in each window after the first
            "reopen_lag_ms_mean_by_window": [round(statistics.fmean(by_k[w:w + rate]), 1)
                                             for w in range(0, len(by_k), rate)]}


def section_rate(url: str, env: dict[str, str], logdir: Path, windows: int = WINDOWS) -> dict[str, Any]:
    """Each rate twice: a backlog queued before the fleet starts (the issue's case: the first
    window's starts come together), and a backlog started into the running fleet (the first
    window's starts spread over the time the client takes to start the runs, and a sliding window
    repeats that spread every window: the steady share is then at most (N - R) / (N/R - 1 + spread))."""
    from bench import limit_flows as lf
    from taskloop import TaskLoop

    r = redis.Redis.from_url(url, decode_responses=True)
    client = TaskLoop(url)
    found: dict[str, Any] = {}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rate in RATES:
            n = rate * windows
            first, procs = _rate_run(url, r, client, lf.rated[rate], rate, n,
                                     start_fleet=lambda: _workers(env, logdir, _taskloop_nodes()))
            second, _ = _rate_run(url, r, client, lf.rated[rate], rate, n)
            _stop(procs)
            procs = []
            found[str(rate)] = {"queued_first": first, "into_running_fleet": second}
            for label, figures in (("queued first", first), ("into the running fleet", second)):
                lag = (f"; a window's room to the next admission p50 {figures['reopen_lag_ms_p50']} ms, p90 "
                       f"{figures['reopen_lag_ms_p90']} ms" if "reopen_lag_ms_p50" in figures else "")
                print(f"  taskloop {rate}/s, backlog {label}: {_line(figures, rate)}; first window's starts over "
                      f"{figures['first_window_spread_s']} s; admissions (the limit's log, "
                      f"{figures['admissions_seen']} seen): most in one second {figures['most_admitted_in_one_s']}"
                      f"{lag}", flush=True)
    finally:
        _stop(procs)
        client.close()
    celery: dict[str, Any] = {}
    if os.environ.get("BENCH_LIMITS_NO_BASELINE") == "1":  # for trying changes quickly; figures need both
        return {"taskloop": found}
    procs = _workers(env, logdir, [["celery", "-A", "bench.limit_baseline", "worker", "-c", "2", "-n",
                                    f"cel{n}@%h", "--loglevel", "INFO"] for n in range(2)])
    try:
        from bench.limit_baseline import app

        for rate in RATES:
            r.delete("bench:limits:starts")
            n = rate * windows
            for _ in range(n):
                app.send_task(f"bench.rated{rate}", ignore_result=True)
            deadline = time.monotonic() + 120
            while r.llen("bench:limits:starts") < n and time.monotonic() < deadline:
                time.sleep(0.05)
            starts = sorted(float(t) for t in r.lrange("bench:limits:starts", 0, -1))
            celery[str(rate)] = _rates(starts, rate, n)
            print(f"  celery rate_limit={rate}/s on 2 nodes: {_line(celery[str(rate)], rate)}", flush=True)
            app.control.purge()
    finally:
        _stop(procs)
    return {"taskloop": found, "celery_rate_limit": celery}


def section_release(url: str, env: dict[str, str], logdir: Path, runs: int = 60) -> dict[str, Any]:
    from bench import limit_flows as lf
    from taskloop import TaskLoop

    r = redis.Redis.from_url(url, decode_responses=True)
    r.delete("bench:limits:spans")
    client = TaskLoop(url)
    procs = _workers(env, logdir, _taskloop_nodes())
    try:
        handles = [client.start(lf.one_at_a_time, input={}) for _ in range(runs)]
        for handle in handles:
            if handle.wait(timeout=120).status != "done":
                raise Failure("a run on the concurrency key did not end done")
    finally:
        _stop(procs)
        client.close()
    spans = sorted(tuple(json.loads(raw)) for raw in r.lrange("bench:limits:spans", 0, -1))
    gaps = [(b[0] - a[1]) * 1000 for a, b in itertools.pairwise(spans)]
    overlaps = sum(1 for g in gaps if g < 0)
    if overlaps:
        raise Failure(f"{overlaps} phases overlapped under a concurrency limit of 1")
    found = {"runs": runs, "p50_ms": round(statistics.median(gaps), 1),
             "p95_ms": round(statistics.quantiles(gaps, n=20)[18], 1), "max_ms": round(max(gaps), 1)}
    print(f"  slot freed -> next phase's callback: p50 {found['p50_ms']} ms, p95 {found['p95_ms']} ms, "
          f"max {found['max_ms']} ms", flush=True)
    return found


def _admit(url: str, kind: str, seconds: float, queue: Any) -> None:
    from taskloop.core.limits import Spec, Waiter
    from taskloop.store.redis_store import RedisStore

    store = RedisStore(url)
    spec = Spec("rate", "bench-admit", rate=1_000_000, per_s=1.0) if kind == "rate" else \
        Spec("conc", "bench-admit-slots", limit=100_000)
    done, pid, end = 0, os.getpid(), time.monotonic() + seconds
    while time.monotonic() < end:
        now = time.time()
        member = Waiter(f"r{pid}-{done}", "t", "run", 1, 1, "bench").member()
        if not store.acquire([spec], member, f"r{pid}-{done}|t", now + 30, now).admitted:
            raise Failure("a start was refused by a limit with room")
        if kind == "conc":
            store.wake([spec], now, f"r{pid}-{done}|t")
        done += 1
    queue.put(done)


def section_admission(url: str, seconds: float = 5.0, clients: int = 4) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for kind in ("rate", "conc"):
        queue: Any = multiprocessing.Queue()
        procs = [multiprocessing.Process(target=_admit, args=(url, kind, seconds, queue)) for _ in range(clients)]
        for proc in procs:
            proc.start()
        total = sum(queue.get(timeout=seconds + 30) for _ in procs)
        for proc in procs:
            proc.join()
        found[kind] = round(total / seconds)
        what = "starts/s (acquire)" if kind == "rate" else "phases/s (acquire + release)"
        print(f"  one {'rate' if kind == 'rate' else 'concurrency'} limit admits {found[kind]:,} {what} "
              f"from {clients} clients", flush=True)
    redis.Redis.from_url(url).flushdb()  # the private server's entries (a rate window of a million)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), type=lambda s: [p for p in s.split(",") if p])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--windows", type=int, default=WINDOWS,
                        help="the rate section's backlog, in windows of R starts (default %(default)s)")
    args = parser.parse_args()
    server, logdir, env = bench_redis(baseline_kombu_env=False)
    results: dict[str, Any] = {}
    try:
        for section in args.only:
            print(f"[{section}]", flush=True)
            if section == "rate":
                results["rate"] = section_rate(server.url, env, logdir, args.windows)
            elif section == "release":
                results["release"] = section_release(server.url, env, logdir)
            elif section == "admission":
                results["admission"] = section_admission(server.url)
    finally:
        server.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

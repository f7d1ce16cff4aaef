"""What the run UI costs (issue "run UI"), on a real redis-server, real workers and a real
`taskloop ui` process:

    python -m bench.ui                 # every section (about 4 minutes on 2 cores)
    python -m bench.ui --only pages    # one section: render, list, pages

- ``render``: server time of one run page (``GET /runs/<id>``, the whole response) for finished
  runs of 1, 100, 1,000 and 10,000 tasks, and of a 40-round loop: median of 10 requests each.
- ``list``: time of one page of the runs list (``GET /`` and ``/api/runs``) with 100, 1,000 and
  10,000 runs in the store: the first page, a page in the middle, the last page, and a page
  filtered by status and workflow. The lists are sorted sets in Redis: a page should cost the
  same whatever the number of runs.
- ``pages``: steps/s of the loops of ``bench.run`` (N = 1,000 loops of 3 rounds, accepted in round
  3) plus 20 long loops (40 rounds), with no UI, and with a UI that has 20 live pages open on the
  20 long loops (server-sent event streams read by this script, as a browser's EventSource
  would; every write to those runs makes the UI render the page again and send it). The
  hand-rolled Celery loop of bench.run at Celery's defaults runs in the same invocation, for the
  ratio. Interleaved repeats; the UI process's CPU is reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx

from bench.systems import Baseline, Failure, TaskLoopSystem, bench_redis, cpu_seconds, wait_finished
from taskloop.ops.embedded import free_port

SECTIONS = ("render", "list", "pages")
PAGES = 20


class UIProcess:
    def __init__(self, env: dict[str, str], logdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (logdir / f"ui-{self.port}.log").open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "taskloop", "ui", "--port", str(self.port), "--read-only"],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise Failure("taskloop ui did not start") from None
                time.sleep(0.1)

    def get_ms(self, path: str, times: int = 10) -> float:
        """Median wall time of ``times`` GETs of ``path`` (status 200 checked)."""
        found = []
        with httpx.Client(base_url=self.url, timeout=60) as client:
            for _ in range(times):
                started = time.perf_counter()
                reply = client.get(path)
                found.append((time.perf_counter() - started) * 1000)
                if reply.status_code != 200:
                    raise Failure(f"GET {path}: {reply.status_code}")
        return round(statistics.median(found), 1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def section_render(tl: TaskLoopSystem, ui: UIProcess) -> dict[str, Any]:
    from bench.flows import watched, wide

    out: dict[str, Any] = {}
    for n in (1, 100, 1000, 10_000):
        result = tl.client.start(wide[n]).wait(timeout=600)
        if result.status != "done":
            raise Failure(f"wide run of {n}: {result.status}")
        ms = ui.get_ms(f"/runs/{result.run_id}", times=5 if n == 10_000 else 10)
        size = len(httpx.get(f"{ui.url}/runs/{result.run_id}", timeout=60).content)
        out[f"{n} tasks"] = {"ms": ms, "bytes": size}
        print(f"  run page of a {n}-task run: {ms} ms ({size:,} bytes)", flush=True)
    tl.r.delete("bench:finished")
    loop = tl.client.start(watched).wait(timeout=120)
    out["40-round loop"] = {"ms": ui.get_ms(f"/runs/{loop.run_id}"),
                            "bytes": len(httpx.get(f"{ui.url}/runs/{loop.run_id}").content)}
    print(f"  run page of a 40-round loop: {out['40-round loop']['ms']} ms", flush=True)
    return out


def section_list(tl: TaskLoopSystem, ui: UIProcess) -> dict[str, Any]:
    from bench.flows import single

    out: dict[str, Any] = {}
    have = 0
    for total in (100, 1000, 10_000):
        tl.r.delete("bench:finished")
        for _ in range(total - have):
            tl.client.start(single)
        wait_finished(tl.r, total - have, 600)
        have = total
        listed = tl.client.run_page(limit=1).total or 0
        figures = {
            "first page": ui.get_ms("/"),
            "middle page": ui.get_ms(f"/?offset={listed // 2}"),
            "last page": ui.get_ms(f"/?offset={max(listed - 50, 0)}"),
            "done runs of one workflow": ui.get_ms("/?status=done&workflow=bench-single"),
            "api, 500 runs": ui.get_ms("/api/runs?limit=500"),
        }
        out[f"{listed} runs"] = figures
        print(f"  {listed} runs: " + ", ".join(f"{k} {v} ms" for k, v in figures.items()), flush=True)
    return out


def _watch(url: str, stop: threading.Event, counts: list[int], index: int) -> None:
    """One open live page: read the SSE stream, count the page renders it sends."""
    with httpx.Client(timeout=httpx.Timeout(30, read=None)) as client, client.stream("GET", url) as reply:
        for line in reply.iter_lines():
            if line == "event: run":
                counts[index] += 1
            if stop.is_set():
                return


def _load(tl: TaskLoopSystem, ui: UIProcess | None, n: int) -> dict[str, Any]:
    from bench.flows import WATCHED_ROUNDS, accept, watched

    tl.r.delete("bench:finished")
    watched_ids = [tl.client.start(watched).run_id for _ in range(PAGES)]
    stop = threading.Event()
    counts = [0] * PAGES
    threads = []
    if ui is not None:
        for i, run_id in enumerate(watched_ids):
            thread = threading.Thread(target=_watch, args=(f"{ui.url}/runs/{run_id}/live", stop, counts, i),
                                      daemon=True)
            thread.start()
            threads.append(thread)
        deadline = time.monotonic() + 10
        while json.loads(httpx.get(f"{ui.url}/api/fleet").content)["ui"]["streams_open"] < PAGES:
            if time.monotonic() > deadline:
                raise Failure("the UI did not open 20 streams")
            time.sleep(0.05)
    procs = tl.processes()
    cpu_before = {name: sum(cpu_seconds(p) for p in pids) for name, pids in procs.items()}
    ui_before = cpu_seconds(ui.proc.pid) if ui else 0.0
    started = time.perf_counter()
    for _ in range(n):
        tl.client.start(accept)
    wait_finished(tl.r, n + PAGES, 1800)
    seconds = time.perf_counter() - started
    steps = n * 6 + PAGES * WATCHED_ROUNDS * 2
    cpu = {name: round((sum(cpu_seconds(p) for p in pids) - cpu_before[name]) * 1000 / steps, 3)
           for name, pids in procs.items()}
    ui_cpu = round((cpu_seconds(ui.proc.pid) - ui_before) * 1000 / steps, 3) if ui else None
    stop.set()
    for run_id in watched_ids:
        if tl.client.inspect(run_id).status != "done":
            raise Failure(f"watched run {run_id} did not end done")
    time.sleep(0.5)  # the last renders arrive
    return {"steps_per_s": round(steps / seconds, 1), "seconds": round(seconds, 2), "cpu_ms_per_step": cpu,
            "ui_cpu_ms_per_step": ui_cpu, "renders_sent": sum(counts) if ui else None}


def section_pages(tl: TaskLoopSystem, baseline: Baseline, env: dict[str, str], logdir: Path,
                  repeats: int) -> dict[str, Any]:
    n = 1000
    tl.start_workers(2)
    baseline.start_workers(2)
    _load(tl, None, 50)
    baseline.throughput("accept", 50)
    samples: dict[str, list[dict[str, Any]]] = {"no ui": [], "ui, 20 live pages": [], "baseline": []}
    ui = UIProcess(env, logdir)
    try:
        for i in range(repeats):
            order = ["no ui", "ui, 20 live pages", "baseline"]
            for label in order if i % 2 == 0 else order[::-1]:
                if label == "baseline":
                    found = baseline.throughput("accept", n)
                else:
                    found = _load(tl, ui if label != "no ui" else None, n)
                samples[label].append(found)
                print(f"  {label}: {found['steps_per_s']} steps/s"
                      + (f", {found['renders_sent']} page renders sent, UI CPU {found['ui_cpu_ms_per_step']} "
                         "ms/step" if found.get("renders_sent") is not None else ""), flush=True)
    finally:
        ui.stop()
    pairs = [u["steps_per_s"] / b["steps_per_s"] for u, b in zip(samples["ui, 20 live pages"], samples["no ui"],
                                                                   strict=True)]
    out: dict[str, Any] = {label: {"steps_per_s": statistics.median(s["steps_per_s"] for s in found),
                                   "samples": [s["steps_per_s"] for s in found]} for label, found in samples.items()}
    out["ui over no ui"] = {"median": round(statistics.median(pairs), 3), "samples": [round(p, 3) for p in pairs]}
    out["ui cpu ms per step"] = [s["ui_cpu_ms_per_step"] for s in samples["ui, 20 live pages"]]
    out["renders sent"] = [s["renders_sent"] for s in samples["ui, 20 live pages"]]
    print(f"  with 20 live pages / without: {out['ui over no ui']['median']} {out['ui over no ui']['samples']}",
          flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), type=lambda s: [p for p in s.split(",") if p])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    server, logdir, env = bench_redis()
    tl, baseline = TaskLoopSystem(server, env, logdir), Baseline(server, env, logdir)
    results: dict[str, Any] = {}
    try:
        if "render" in args.only or "list" in args.only:
            tl.start_workers(2)
            ui = UIProcess(env, logdir)
            try:
                for section in ("render", "list"):
                    if section in args.only:
                        print(f"[{section}]", flush=True)
                        results[section] = (section_render if section == "render" else section_list)(tl, ui)
            finally:
                ui.stop()
        if "pages" in args.only:
            print("[pages]", flush=True)
            results["pages"] = section_pages(tl, baseline, env, logdir, args.repeats)
    except Failure as exc:
        print(f"WRONG RESULT: {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        tl.stop_workers()
        baseline.stop_workers()
        server.stop()
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Past one Redis (issue 24, point 4): the store on a Redis Cluster of 1, 2 and 3 masters and the
broker on a redis-server of its own, each redis-server held to the same slice of one core by a
CPU quota of its own (a cgroup), and how steps/s grows with the store's masters.

Why a slice and not a core: this machine has 2 cores, and the workers need about 2 ms of CPU per
step against the store's 0.3 ms, so with whole cores Redis never becomes the bound and adding
masters could show nothing. Held to a slice (``--share``, 4 % of a core by default), each
redis-server is the bound, as a full core is the bound of a fleet with enough workers; the
figure that carries over is the ratio between master counts, not the steps/s. The throttled
share of each server's quota periods says which one held the fleet back.

It needs a writable cgroup CPU controller (root, on cgroup v1 or v2); without one it says so
and measures nothing. Run alone: ``python -m bench.scaling`` (or ``python -m bench.run --only
scaling``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from bench.systems import REPO, STEPS_PER_LOOP, TaskLoopSystem, median_of
from taskloop.ops.embedded import RedisServer, find_redis_server

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")
SLOTS = 16384


class CpuCap:
    """A cgroup of its own holding one process to ``share`` of one core: cgroup v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, or cgroup v2's ``cpu.max``."""

    def __init__(self, share: float, period_us: int = 50_000) -> None:
        self.share = share
        self.v1 = (V1_ROOT / "cpu.cfs_quota_us").exists()
        root = V1_ROOT if self.v1 else V2_ROOT
        self.path = root / f"taskloop-bench-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        quota = max(1000, int(share * period_us))
        if self.v1:
            (self.path / "cpu.cfs_period_us").write_text(str(period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} {period_us}")

    @staticmethod
    def unavailable() -> str | None:
        """Why no process can be capped here, or None when it can."""
        if (V1_ROOT / "cpu.cfs_quota_us").exists():
            root = V1_ROOT
        elif (V2_ROOT / "cgroup.subtree_control").exists() and \
                "cpu" in (V2_ROOT / "cgroup.subtree_control").read_text().split():
            root = V2_ROOT
        else:
            return "no cgroup CPU controller (cgroup v1's cpu, or cpu in cgroup v2's subtree_control)"
        if not os.access(root, os.W_OK):
            return f"{root} is not writable (run as root)"
        return None

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def throttled(self) -> tuple[int, int]:
        """(quota periods the group ran in, periods it was throttled in) so far."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line.strip())
        return int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0))

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            for pid in (self.path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (self.path.parent / "cgroup.procs").write_text(pid)
            self.path.rmdir()


def _port_pair() -> int:
    """A free port P whose cluster bus port P + 10000 is free too."""
    for _ in range(200):
        with contextlib.closing(socket.socket()) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port > 55535:
            continue
        with contextlib.closing(socket.socket()) as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class BenchCluster:
    """``masters`` cluster-enabled redis-servers (AOF everysec, as the store's server elsewhere in
    the benchmark), the slots split evenly between them with ``CLUSTER ADDSLOTS`` and joined
    with ``CLUSTER MEET`` (``redis-cli --cluster create`` wants three masters at least)."""

    def __init__(self, masters: int) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="taskloop-cluster-")
        self.ports = [_port_pair() for _ in range(masters)]
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def owner(self, key: str) -> int:
        """Which master (1, 2, ...) holds ``key``: the slot ranges start() assigned."""
        with redis.Redis(port=self.ports[0]) as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
        return min(slot // (SLOTS // len(self.ports)), len(self.ports) - 1) + 1

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def clients(self) -> list[redis.Redis]:
        return [redis.Redis(port=port, decode_responses=True) for port in self.ports]

    def start(self) -> BenchCluster:
        binary = find_redis_server()
        for i, port in enumerate(self.ports):
            where = Path(self._tmp.name) / f"node{i}"
            where.mkdir()
            self.processes.append(subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(where), "--save", "",
                 "--appendonly", "yes", "--appendfsync", "everysec", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--protected-mode", "no",
                 "--logfile", str(where / "redis.log")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        clients = self.clients()
        deadline = time.monotonic() + 30
        for client in clients:
            while True:
                try:
                    client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("a cluster node did not start") from None
                    time.sleep(0.05)
        per = SLOTS // len(clients)
        for i, client in enumerate(clients):
            low, high = i * per, (SLOTS - 1 if i == len(clients) - 1 else (i + 1) * per - 1)
            client.execute_command("CLUSTER", "ADDSLOTS", *range(low, high + 1))  # ADDSLOTSRANGE: Redis 7 only
            client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        for port in self.ports[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        while True:
            infos = [str(c.execute_command("CLUSTER", "INFO")) for c in clients]
            if all("cluster_state:ok" in info and f"cluster_known_nodes:{len(clients)}" in info
                   for info in infos):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the bench cluster did not reach cluster_state:ok: {infos}")
            time.sleep(0.1)
        for client in clients:
            client.close()
        return self

    def stop(self) -> None:
        for proc in self.processes:
            proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._tmp.cleanup()


class ClusterTaskLoop(TaskLoopSystem):
    """taskloop with its store on a BenchCluster and its broker on a redis-server of its own; the
    bench's list of finished runs on a third server (``side``), outside the measured ones."""

    name = "taskloop-cluster"

    def __init__(self, cluster: BenchCluster, broker: RedisServer, side: RedisServer, env: dict[str, str],
                 logdir: Path) -> None:
        from taskloop import TaskLoop

        assert broker.process is not None and side.process is not None
        self.url = cluster.url
        self.env = env
        self.logdir = logdir
        self.procs = []
        self.r = redis.Redis.from_url(side.url, decode_responses=True)
        self.cluster = cluster
        self.redis_pid = cluster.pids[0]
        self.extra = {"broker redis-server": [broker.process.pid]}
        self.client = TaskLoop(cluster.url, broker.url)

    def processes(self) -> dict[str, list[int]]:
        found = super().processes()
        del found["redis-server"]
        for i, pid in enumerate(self.cluster.pids):
            found[f"store master {i + 1}"] = [pid]
        return found

    def counts(self) -> tuple[dict[str, int], int]:
        calls: dict[str, int] = {}
        memory = 0
        for client in self.cluster.clients():
            for name, value in client.info("commandstats").items():
                key = name.removeprefix("cmdstat_")
                calls[key] = calls.get(key, 0) + int(value["calls"])
            memory += int(client.info("memory")["used_memory"])
            client.close()
        return calls, memory


def measure(masters: int, share: float, broker_share: float, n: int, repeats: int,
            concurrency: int, nodes: int) -> dict[str, Any]:
    """steps/s (accept, median of ``repeats``) with the store on ``masters`` masters, each server
    capped, and what each server spent and how often its quota ran out."""
    logdir = Path(tempfile.mkdtemp(prefix="taskloop-scaling-"))
    (logdir / "side").mkdir()
    (logdir / "broker").mkdir()
    side = RedisServer(logdir / "side", appendonly=False).start()
    broker = RedisServer(logdir / "broker").start()
    cluster = BenchCluster(masters).start()
    caps: dict[str, CpuCap] = {}
    env = {**os.environ, "PYTHONPATH": str(REPO), "TASKLOOP_REDIS_URL": cluster.url,
           "TASKLOOP_BROKER_URL": broker.url, "BENCH_FINISHED_URL": side.url}
    system = ClusterTaskLoop(cluster, broker, side, env, logdir)
    try:
        for i, pid in enumerate(cluster.pids):
            caps[f"store master {i + 1}"] = CpuCap(share)
            caps[f"store master {i + 1}"].add(pid)
        assert broker.process is not None
        caps["broker"] = CpuCap(broker_share)
        caps["broker"].add(broker.process.pid)
        system.start_workers(concurrency, nodes=nodes)
        system.throughput("accept", min(50, n))
        before = {name: cap.throttled() for name, cap in caps.items()}
        samples = [system.throughput("accept", n) for _ in range(repeats)]
        after = {name: cap.throttled() for name, cap in caps.items()}
        found = median_of(samples)
        throttled = {name: round((after[name][1] - before[name][1]) / max(1, after[name][0] - before[name][0]), 3)
                     for name in caps}
        cpu = found["cpu_ms_per_step"]
        per_master = [cpu[f"store master {i + 1}"] for i in range(masters)]
        return {"masters": masters, "share": share, "broker_share": broker_share, "n": n,
                "steps_per_s": found["steps_per_s"], "samples": [s["steps_per_s"] for s in samples],
                "cpu_ms_per_step": cpu, "store_cpu_ms_per_step": round(sum(per_master), 3),
                "store_cpu_ms_per_step_per_master": per_master,
                "global_keys_on_master": cluster.owner("tl:live"),
                "throttled_share_of_periods": throttled, "commands_per_round": found["commands_per_round"],
                "steps": n * STEPS_PER_LOOP}
    finally:
        system.stop_workers()
        system.client.close()
        for cap in caps.values():
            cap.remove()
        cluster.stop()
        broker.stop()
        side.stop()


def section(args: argparse.Namespace) -> dict[str, Any]:
    """The scaling sweep: 1, 2 and 3 store masters with the broker at the same slice, then 3
    masters with the broker at twice it (a broker given more room: a faster core, or the queues
    split over brokers)."""
    why = CpuCap.unavailable()
    if why:
        return {"skipped": why}
    n = 150 if args.quick else 400
    repeats = 1 if args.quick else 3
    share = args.share
    runs = [measure(m, share, share, n, repeats, args.concurrency, args.nodes) for m in (1, 2, 3)]
    runs.append(measure(3, share, 2 * share, n, repeats, args.concurrency, args.nodes))
    first = runs[0]["steps_per_s"]
    for found in runs:
        found["growth"] = round(found["steps_per_s"] / first, 2) if first else None
    return {"share": share, "concurrency": args.concurrency, "nodes": args.nodes, "runs": runs}


def report(found: dict[str, Any]) -> list[str]:
    if "skipped" in found:
        return ["### Past one Redis: the store on a Cluster", "", f"not measured: {found['skipped']}", ""]
    share = found["share"]
    lines = ["### Past one Redis: the store on a Cluster, every redis-server held to "
             f"{share * 100:g} % of a core", "",
             f"(workers: {found['nodes']} node(s) x {found['concurrency']} processes; accept, median of "
             "the samples; CPU in ms per step; * the master that holds tl:live)", "",
             "| store masters | broker's slice | steps/s | ratio to 1 master | store CPU, each master | "
             "broker CPU | worker CPU, main + pool | throttled periods: each master / broker | "
             "store commands per round |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run in found["runs"]:
        cpu = run["cpu_ms_per_step"]
        throttled = run["throttled_share_of_periods"]
        hot = run["global_keys_on_master"]
        each = " + ".join(f"{ms}{'*' if i + 1 == hot else ''}"
                          for i, ms in enumerate(run["store_cpu_ms_per_step_per_master"]))
        masters = " ".join(f"{v:.2f}" for k, v in throttled.items() if k.startswith("store"))
        workers = round(cpu["worker main"] + cpu["worker pool"], 2)
        lines.append(f"| {run['masters']} | {run['broker_share'] * 100:g} % | {run['steps_per_s']} "
                     f"({', '.join(str(s) for s in run['samples'])}) | {run['growth']} | {each} | "
                     f"{cpu['broker redis-server']} | {workers} | {masters} / {throttled['broker']:.2f} | "
                     f"{run['commands_per_round']} |")
    lines.append("")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--share", type=float, default=0.04, help="each redis-server's slice of one core")
    parser.add_argument("--concurrency", type=int, default=2, help="pool processes per worker node")
    parser.add_argument("--nodes", type=int, default=2, help="worker nodes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    add_arguments(parser)
    args = parser.parse_args()
    found = section(args)
    print("\n".join(report(found)))
    if args.json:
        args.json.write_text(json.dumps(found, indent=2))
    if "skipped" in found:
        sys.exit(3)


if __name__ == "__main__":
    main()

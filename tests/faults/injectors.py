"""The soak's fault injectors: every kind of docs/reliability.md's table, on real processes and queues.

Each injector either does its fault and returns a `Fault` (kind, wall-clock time, the phases it hit
as ``(run, key, round, phase)`` targets, a detail) or returns None when the fleet offers nothing to
hit right now (no callback running, an empty queue, a worker restart still under way); the driver
then tries again a moment later. The fleet is kept whole: a killed worker is replaced under a new
name, a stopped process is continued once past its running lease.

============== =================================================================================
pool-kill      SIGKILL a pool process inside a callback (found via ``soak:running``); one in five
               times any pool process, wherever it is (idle, beginning a phase, committing one)
worker-kill    SIGKILL a worker's main process and its pool; start a replacement under a new name
sigstop        SIGSTOP a pool process inside a callback past its lease (TASKLOOP_LEASE_S, plus two
               reconcile passes and 0.5 s), then SIGCONT
duplicate      send a copy of a live phase message (the record's current token)
replay         re-send a message whose phase was committed long ago (a later round, or a finished run)
redis-kill     SIGKILL redis-server, restart it from its AOF after 1 s
lost-message   remove a phase message from the broker's queue list (LREM on ``taskloop``), or, when
               none is queued, start a run whose first message is never sent
malformed      put a broken message on the queue: bad JSON, unknown task, wrong args, a pickle body
black-hole     the proxy between the workers and Redis (tests/proxy.py; store and broker) forwards
               nothing and closes nothing for 3-6 s; then the connections from before are cut with
               an RST, or (one time in two) stay silent for good, so that only the workers' own
               timeouts can tell them the connection is dead
latency        the proxy delays every chunk by 200 ms each way for 3 s
rst            the proxy cuts every connection between the workers and Redis with a TCP RST
============== =================================================================================
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from taskloop.base.errors import StoreUnavailable, TaskLoopError
from taskloop.core import fields as fld
from taskloop.core.begin import Dispatch
from taskloop.core.records import TaskRecord
from taskloop.core.states import QUEUED_STATES, RUNNING_STATES
from taskloop.runtime.celery_app import send_phase
from tests.faults import soak_flows
from tests.faults.harness import timer
from tests.workers import alive

if TYPE_CHECKING:
    from tests.faults.soak import Driver

Target = tuple[str, str, int, str]  # (run, key, round, phase)

# kind -> (label in the report, weight in the random mix). Every kind is drawn at least once.
KINDS: dict[str, tuple[str, int]] = {
    "pool-kill": ("SIGKILL pool process", 22),
    "worker-kill": ("SIGKILL whole worker, start a replacement", 5),
    "sigstop": ("SIGSTOP past the lease, then SIGCONT", 10),
    "duplicate": ("duplicate delivery", 18),
    "replay": ("replay after commit", 14),
    "redis-kill": ("kill -9 redis-server, restart from AOF", 4),
    "lost-message": ("lost message (dequeued or never sent)", 13),
    "malformed": ("malformed message", 14),
    "black-hole": ("proxy black hole 3-6 s (RST or silent after)", 3),
    "latency": ("proxy latency 200 ms for 3 s", 3),
    "rst": ("proxy RST of every connection", 4),
}
# Kinds whose faults interrupt an execution or a message: their recovery time is measured.
RECOVERING = ("pool-kill", "worker-kill", "sigstop", "duplicate", "redis-kill", "lost-message", "black-hole",
              "latency", "rst")
PROXY_KINDS = ("black-hole", "latency", "rst")  # faults of the network between the workers and Redis



def stop_s(timers: dict[str, str]) -> float:
    """How long a SIGSTOP lasts: past the lease and a reconcile pass, so the phase is replayed elsewhere."""
    return timer(timers, "TASKLOOP_LEASE_S") + 2 * timer(timers, "TASKLOOP_RECONCILE_INTERVAL_S") + 0.5
MAX_STOPPED = 2  # processes stopped at once (the fleet keeps most of its capacity)
QUEUE = "taskloop"  # the Celery queue: a Redis list, kombu LPUSHes and RPOPs
PHASE_TASKS = {"taskloop.attempt": "attempt", "taskloop.check": "check", "taskloop.run": "run"}
ORIGIN = "taskloop-soak-malformed"  # the origin header of the malformed messages
MALFORMED = ("bad-json", "unknown-task", "too-few-args", "bad-round", "extra-kwargs", "pickle")


@dataclass
class Fault:
    kind: str
    at: float  # wall clock (time.time()), like every timestamp taskloop records
    targets: list[Target] = field(default_factory=list)
    detail: str = ""
    recovery_s: float | None = None  # filled in by the checker


def plan(n: int, rng: Any, only: tuple[str, ...] | None = None) -> list[str]:
    """The seeded sequence of fault kinds (of ``only``, or all): each kind once, the rest drawn by
    weight, shuffled."""
    kinds = [kind for kind in KINDS if only is None or kind in only]
    weights = [KINDS[kind][1] for kind in kinds]
    sequence = kinds[:n] if n < len(kinds) else kinds + rng.choices(kinds, weights, k=n - len(kinds))
    rng.shuffle(sequence)
    return sequence


def _target(what: dict[str, Any]) -> Target:
    return (what["run"], what["key"], int(what["round"]), what["phase"])


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "T"
    except OSError:
        return False


class Injector:
    """Injects faults into the driver's cluster; keeps the fleet alive between faults."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.cluster = driver.cluster
        self.rng = driver.rng
        self.stopped: dict[int, float] = {}  # pid -> monotonic time of its SIGCONT
        self.history: deque[tuple[float, str, str, Dispatch]] = deque(maxlen=400)  # (sent, workflow, run, d)
        self.last_redis_kill = 0.0
        self.last_network = 0.0  # the last proxy fault (one every 5 s at most, as Redis kills)
        self.next_watch = 0.0
        self.problems: list[str] = []

    # upkeep ---------------------------------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        for pid, due in list(self.stopped.items()):
            if now >= due:
                self._cont(pid)
        self.cluster.poll_starting(self.problems)
        if now >= self.next_watch:
            self.next_watch = now + 1.0
            self.cluster.watch(self.problems)

    def settle(self, timeout: float = 90.0) -> None:
        """Continue every stopped process and wait for the replacement workers to be ready."""
        for pid in list(self.stopped):
            self._cont(pid)
        deadline = time.monotonic() + timeout
        while self.cluster.starting and time.monotonic() < deadline:
            self.cluster.poll_starting(self.problems)
            time.sleep(0.2)
        for name in list(self.cluster.starting):
            self.problems.append(f"fleet: replacement worker {name} not ready after {timeout:.0f}s")

    def _cont(self, pid: int) -> None:
        self.stopped.pop(pid, None)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed meanwhile (pool-kill or worker-kill)

    def running(self) -> dict[int, tuple[str, dict[str, Any]]]:
        """Executions inside a callback now, in pool processes of live workers: pid -> (node, what)."""
        try:
            raw = self.cluster.soak_probe.hgetall(soak_flows.RUNNING)
        except redis.exceptions.RedisError:
            return {}
        pools = self.cluster.pools()
        found = {}
        for pid_text, what in raw.items():
            pid = int(pid_text)
            node = pools.get(pid)
            if node is not None and alive(pid) and pid not in self.stopped and not _stopped(pid):
                found[pid] = (node, json.loads(what))
        return found

    def _forget(self, pids: list[int]) -> None:
        try:
            if pids:
                self.cluster.soak_probe.hdel(soak_flows.RUNNING, *[str(p) for p in pids])
        except redis.exceptions.RedisError:
            pass

    # the injectors --------------------------------------------------------------------------
    def inject(self, kind: str) -> Fault | None:
        try:
            fault: Fault | None = getattr(self, kind.replace("-", "_"))()
            return fault
        except (StoreUnavailable, redis.exceptions.RedisError) as exc:
            self.driver.note(f"{kind}: Redis unavailable, retrying later ({exc.__class__.__name__})")
            return None
        except Exception as exc:  # a bug of the injector: reported (the soak fails), the soak goes on
            self.problems.append(f"harness: injector {kind} raised {exc!r}")
            self.driver.note(f"{kind}: {traceback.format_exc()}")
            return None

    def pool_kill(self) -> Fault | None:
        running = self.running()
        if self.rng.random() < 0.2:
            # any pool process, wherever it is: between two messages, beginning a phase, or writing an
            # outcome (the callback returned, the commit is under way); no phase known to be hit
            pools = {pid: node for pid, node in self.cluster.pools().items()
                     if alive(pid) and pid not in running and pid not in self.stopped and not _stopped(pid)}
            if pools:
                pid = self.rng.choice(sorted(pools))
                os.kill(pid, signal.SIGKILL)
                return Fault("pool-kill", time.time(), [], f"pid {pid} of {pools[pid]}, outside a callback")
        if not running:
            return None
        pid = self.rng.choice(sorted(running))
        node, what = running[pid]
        os.kill(pid, signal.SIGKILL)
        at = time.time()
        self._forget([pid])
        return Fault("pool-kill", at, [_target(what)], f"pid {pid} of {node} in {what['key']} "
                                                       f"{what['round']}/{what['phase']}")

    def worker_kill(self) -> Fault | None:
        cluster = self.cluster
        if cluster.starting or len(cluster.live_nodes()) < cluster.size:
            return None  # one replacement at a time: the fleet never drops below size - 1 nodes
        running = self.running()
        busy = sorted({node for node, _ in running.values()})
        if not busy:
            return None
        name = self.rng.choice(busy)
        proc = cluster.workers[name]
        supervisor, main, pool = cluster.processes(name)
        # Hit: what its pool runs, and every queued phase (the messages it had prefetched die with it,
        # and which ones those are is not known; they come back when their queued lease expires).
        hit = [_target(what) for pid, (node, what) in running.items() if node == name]
        for run in self.driver.live_runs():
            hit += [(run.run_id, r.key, r.round, r.phase.value) for r in self._in_flight(run.run_id)
                    if r.state in QUEUED_STATES and r.phase is not None]
        for pid in [*supervisor, main, *pool]:  # the whole machine goes: supervisor, worker, pool
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        at = time.time()
        proc.wait(10)
        for pid in pool:
            self.stopped.pop(pid, None)
        self._forget(pool)
        cluster.retire(name)
        replacement = cluster.spawn_next()
        return Fault("worker-kill", at, hit, f"{name} (worker {main}, pool {pool}) -> {replacement}")

    def sigstop(self) -> Fault | None:
        if len(self.stopped) >= MAX_STOPPED:
            return None
        running = self.running()
        if not running:
            return None
        pid = self.rng.choice(sorted(running))
        node, what = running[pid]
        os.kill(pid, signal.SIGSTOP)
        at = time.time()
        stop = stop_s(self.cluster.timers)
        self.stopped[pid] = time.monotonic() + stop
        return Fault("sigstop", at, [_target(what)], f"pid {pid} of {node} for {stop:.1f}s")

    def _in_flight(self, run_id: str) -> list[TaskRecord]:
        assert self.cluster.client is not None
        fields = self.cluster.client.store.scan_fields(run_id, fld.TASK_PREFIX)
        records = [TaskRecord.load(raw) for raw in fields.values()]
        return [r for r in records if r.state in QUEUED_STATES or r.state in RUNNING_STATES]

    def duplicate(self) -> Fault | None:
        assert self.cluster.client is not None
        live = self.driver.live_runs()
        for run in self.rng.sample(live, min(5, len(live))):
            records = self._in_flight(run.run_id)
            if not records:
                continue
            record = self.rng.choice(records)
            assert record.phase is not None
            token = record.token if record.state in QUEUED_STATES else record.token - 1
            dispatch = Dispatch(record.key, record.phase, record.round, token)
            workflow = soak_flows.WORKFLOWS[run.workflow]
            send_phase(self.cluster.client.app, workflow, run.run_id, dispatch)
            at = time.time()
            self.history.append((time.monotonic(), run.workflow, run.run_id, dispatch))
            state = "queued" if record.state in QUEUED_STATES else "running"
            return Fault("duplicate", at, [(run.run_id, record.key, record.round, record.phase.value)],
                         f"copy of a {state} message, token {token}")
        return None

    def replay(self) -> Fault | None:
        assert self.cluster.client is not None
        now = time.monotonic()
        old = [entry for entry in self.history if now - entry[0] > 1.0]
        self.rng.shuffle(old)
        for sent, workflow_name, run_id, dispatch in old[:10]:
            fields = self.cluster.client.store.hmget(run_id, [fld.task_field(dispatch.key), fld.F_STATUS])
            if fields[0] is None:
                continue
            record = TaskRecord.load(fields[0])
            if record.token <= dispatch.token + 1 and not record.terminal:
                continue  # not committed yet: that would be a duplicate, not a replay
            send_phase(self.cluster.client.app, soak_flows.WORKFLOWS[workflow_name], run_id, dispatch)
            at = time.time()
            finished = fields[1] in ("done", "failed", "cancelled", "rejected")
            return Fault("replay", at, [(run_id, dispatch.key, dispatch.round, dispatch.phase.value)],
                         f"message sent {now - sent:.1f}s ago, token {dispatch.token} (record token "
                         f"{record.token}{', run finished' if finished else ''})")
        # nothing old enough yet: remember the live messages of a few runs, to replay them later
        for run in self.rng.sample(self.driver.live_runs(), min(3, len(self.driver.live_runs()))):
            for record in self._in_flight(run.run_id):
                assert record.phase is not None
                token = record.token if record.state in QUEUED_STATES else record.token - 1
                self.history.append((now, run.workflow, run.run_id,
                                     Dispatch(record.key, record.phase, record.round, token)))
        return None

    def redis_kill(self) -> Fault | None:
        cluster = self.cluster
        assert cluster.client is not None
        if time.monotonic() - self.last_redis_kill < 5.0:
            return None
        hit: list[Target] = []
        for run in self.driver.live_runs():
            for record in self._in_flight(run.run_id):
                assert record.phase is not None
                hit.append((run.run_id, record.key, record.round, record.phase.value))
        cluster.redis.kill()
        at = time.time()
        # while Redis is away, client calls fail with StoreUnavailable (no hang, no other error)
        try:
            cluster.client.status(self.driver.runs[-1].run_id if self.driver.runs else "none")
            self.problems.append("redis-kill: a client call succeeded while Redis was down")
        except StoreUnavailable:
            pass
        except TaskLoopError as exc:
            self.problems.append(f"redis-kill: a client call failed with {exc!r} instead of StoreUnavailable")
        time.sleep(1.0)
        cluster.redis.start(timeout=60)
        self.last_redis_kill = time.monotonic()
        return Fault("redis-kill", at, hit, f"{len(hit)} phases in flight; down {time.time() - at:.1f}s")

    def _all_in_flight(self) -> list[Target]:
        hit: list[Target] = []
        for run in self.driver.live_runs():
            for record in self._in_flight(run.run_id):
                assert record.phase is not None
                hit.append((run.run_id, record.key, record.round, record.phase.value))
        return hit

    def _network(self, kind: str, fault: Any) -> Fault | None:
        """A fault of the proxy between every worker and Redis; it hits every phase in flight."""
        if time.monotonic() - self.last_network < 5.0:
            return None
        hit = self._all_in_flight()
        at = time.time()
        detail = fault(self.cluster.proxy)
        self.last_network = time.monotonic()
        return Fault(kind, at, hit, f"{len(hit)} phases in flight; {detail}")

    def black_hole(self) -> Fault | None:
        seconds = round(self.rng.uniform(3.0, 6.0), 1)
        cut = self.rng.random() < 0.5

        def fault(proxy: Any) -> str:
            proxy.black_hole()
            time.sleep(seconds)
            proxy.heal(cut=cut)
            return f"{seconds:.1f}s, then {'RST' if cut else 'silent for good'}"
        return self._network("black-hole", fault)

    def latency(self) -> Fault | None:
        def fault(proxy: Any) -> str:
            proxy.latency(200)
            time.sleep(3.0)
            proxy.heal()
            return "200 ms each way for 3 s"
        return self._network("latency", fault)

    def rst(self) -> Fault | None:
        def fault(proxy: Any) -> str:
            open_ = proxy.open_connections
            proxy.reset()
            return f"{open_} connections cut"
        return self._network("rst", fault)

    def lost_message(self) -> Fault | None:
        if self.rng.random() < 0.5:
            fault = self._dequeue()
            if fault is not None:
                return fault
        run = self.driver.start_run(unsent=True)
        if run is None:
            return None
        at = time.time()  # the start's write is done: its message would have been sent now
        key, phase = {"soak-loop": ("work", "attempt"), "soak-retry": ("fetch", "run"),
                      "soak-gate": ("draft", "run")}[run.workflow]
        return Fault("lost-message", at, [(run.run_id, key, 1, phase)],
                     f"first message of a new {run.workflow} run never sent")

    def _dequeue(self) -> Fault | None:
        probe = self.cluster.soak_probe
        queued: list[str] = probe.lrange(QUEUE, 0, -1)  # type: ignore[assignment]
        ours = {run.run_id for run in self.driver.live_runs()}
        candidates = []
        for raw in queued:
            try:
                message = json.loads(raw)
                headers = message["headers"]
                phase = PHASE_TASKS.get(headers["task"])
                args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
            except (ValueError, KeyError, TypeError, IndexError):
                continue
            if headers.get("origin") == ORIGIN or kwargs or phase is None:
                continue  # one of the malformed messages (their refusal is checked), or not a phase
            if isinstance(args, list) and len(args) == 4 and args[0] in ours:
                candidates.append((raw, (args[0], args[1], args[2], phase), args[3]))
        if not candidates:
            return None
        raw, target, token = self.rng.choice(candidates)
        if probe.lrem(QUEUE, 1, raw) != 1:
            return None  # consumed meanwhile
        return Fault("lost-message", time.time(), [target],
                     f"message (token {token}) removed from the queue ({len(queued)} queued)")

    def malformed(self) -> Fault | None:
        assert self.cluster.client is not None
        live = self.driver.live_runs()
        run_id = self.rng.choice(live).run_id if live else "no-such-run"
        variant = self.rng.choice(MALFORMED)
        task, body, content_type = {
            "bad-json": ("taskloop.attempt", b'{"not": json', "application/json"),
            "unknown-task": ("taskloop.nope", _json([run_id, "work", 1, 0]), "application/json"),
            "too-few-args": ("taskloop.attempt", _json([run_id]), "application/json"),
            "bad-round": ("taskloop.check", _json([run_id, "work", "one", None]), "application/json"),
            "extra-kwargs": ("taskloop.run", _json([run_id, "fetch", 1, 0], {"extra": True}), "application/json"),
            "pickle": ("taskloop.attempt", pickle.dumps(((run_id, "work", 1, 0), {}, {})),
                       "application/x-python-serialize"),
        }[variant]
        app = self.cluster.client.app
        message_id = str(uuid.uuid4())
        headers = {"lang": "py", "task": task, "id": message_id, "root_id": None, "parent_id": None,
                   "group": None, "argsrepr": "", "kwargsrepr": "", "origin": ORIGIN}
        with app.connection_for_write() as conn:
            conn.Producer().publish(body, exchange=QUEUE, routing_key=QUEUE, content_type=content_type,
                                    content_encoding="utf-8", headers=headers, declare=[app.amqp.queues[QUEUE]],
                                    retry=False)
        return Fault("malformed", time.time(), [], f"{variant} ({task}, run {run_id}) id {message_id}")


def _json(args: Any, kwargs: Any = None) -> bytes:
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    return json.dumps([args, kwargs or {}, embed]).encode()

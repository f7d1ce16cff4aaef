"""The store's global keys (store/keys.py): the indexes and lists of runs, the fleet counters, the
reconciler's notes, the definitions' shapes. They live outside every run's slot, so the run
scripts never touch them on a Cluster: they are read and written here, by plain commands. Mixed
into RedisStore, whose client and URL they use."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from taskloop.base import clock
from taskloop.connections import clients
from taskloop.core import fields as fld
from taskloop.core.batch import Listed
from taskloop.core.states import RunStatus
from taskloop.store import keys as k
from taskloop.store.calls import wrap

STORED_STATUSES = tuple(s.value for s in RunStatus if s is not RunStatus.WAITING)  # "waiting" is derived
LIVE_STATUSES = (RunStatus.PENDING.value, RunStatus.RUNNING.value)
NAME_AGAIN_S = 60.0  # a process names a workflow it lists runs of at most once in this time


class Indexes:
    """The global-key methods of RedisStore."""

    client: Any
    url: str
    _named: dict[str, float]  # workflow -> when this process last named it (workflows_to_name)
    _legacy_deleted: bool  # the earlier versions' lists are gone (trim_runs_index)

    def compacted_fields(self, run_id: str) -> dict[str, str]:
        raise NotImplementedError  # RedisStore has it from store/compacted.py

    def compact_records(self, run_ids: Sequence[str]) -> list[Any]:
        raise NotImplementedError  # RedisStore has it from store/compacted.py

    # fleet counters and indexes (outside the run scripts: a run keeps to one slot) -------------
    @wrap
    def incr_stat(self, name: str, amount: int = 1) -> None:
        self.client.hincrby(k.STATS, name, amount)

    @wrap
    def stats(self) -> dict[str, str]:
        return dict(self.client.hgetall(k.STATS))

    # worker presence (taskloop/worker/liveness/presence.py) ---------------------------------------------
    @wrap
    def note_worker(self, node: str, info: str, held: str | None = None) -> None:
        """Record a worker's heartbeat, and what it holds (kept apart: the holdings of a worker with
        thousands of phases in flight are large, and only the reconciler reads them)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(k.WORKERS, node, info)
        if held is not None:
            pipe.hset(k.HELD, node, held)
        pipe.execute()

    @wrap
    def forget_workers(self, *nodes: str) -> None:
        if nodes:
            pipe = self.client.pipeline(transaction=False)
            pipe.hdel(k.WORKERS, *nodes)
            pipe.hdel(k.HELD, *nodes)
            pipe.execute()

    @wrap
    def workers_seen(self) -> dict[str, str]:
        """Each worker's last heartbeat (node -> JSON), stale ones included."""
        return dict(self.client.hgetall(k.WORKERS))

    @wrap
    def holdings_seen(self) -> tuple[dict[str, str], dict[str, str]]:
        """Each worker's last heartbeat and what it held then (node -> compact JSON), read together."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(k.WORKERS)
        pipe.hgetall(k.HELD)
        beats, held = pipe.execute()
        return dict(beats), dict(held)

    @wrap
    def count_finished(self, metas: Sequence[Any]) -> None:
        """Count finished runs in the fleet counters (as the reconciler forgets them)."""
        if not metas:
            return
        counts: Counter[str] = Counter()
        for meta in metas:
            termination = meta.termination.value if meta.termination else ""
            planned = meta.fingerprint is not None  # set when a worker plans the run (or forks it)
            counts[fld.finished_stat(meta.workflow, meta.stored_status, termination, planned)] += 1
        pipe = self.client.pipeline(transaction=False)
        for stat, n in counts.items():  # one HINCRBY per counter, not per run
            pipe.hincrby(k.STATS, stat, n)
        pipe.execute()

    @wrap
    def fleet_view(self, now: float, sample: int = 1000) -> dict[str, Any]:
        """What the fleet exporter reports: live runs, expired leases (over at most ``sample`` due
        runs), the last reconcile pass, the fleet counters."""
        due = list(self.client.zrangebyscore(k.LIVE_INDEX, "-inf", now, start=0, num=sample))
        pipe = self.client.pipeline(transaction=False)
        pipe.zcard(k.LIVE_INDEX)
        pipe.get(k.RECONCILER_LAST)
        pipe.hgetall(k.STATS)
        for run_id in due:
            pipe.zcount(k.RunKeys.of(run_id).leases, "-inf", now)
        live, last, stats, *expired = pipe.execute()
        return {"live": int(live), "expired_leases": sum(int(n) for n in expired),
                "last_pass_at": json.loads(last)["at"] if last else None,
                "stats": {name: int(value) for name, value in stats.items() if value.lstrip("-").isdigit()}}

    @wrap
    def unlive(self, run_ids: Sequence[str]) -> None:
        if run_ids:
            self.client.zrem(k.LIVE_INDEX, *run_ids)

    @wrap
    def due_entries(self, now: float, limit: int) -> list[tuple[str, float]]:
        """Live runs the reconciler should look at now, with their scores (core/batch.py
        ``is_ended_score``: the runs that ended are listed below every time)."""
        rows = self.client.zrangebyscore(k.LIVE_INDEX, "-inf", now, start=0, num=limit, withscores=True)
        return [(run_id, float(score)) for run_id, score in rows]

    @wrap
    def look_again(self, run_id: str, at: float) -> None:
        """When the reconciler should look at a live run next (only if it is still listed)."""
        self.client.zadd(k.LIVE_INDEX, {run_id: at}, xx=True)

    @wrap
    def live_page(self, start: int, count: int) -> list[str]:
        """Live runs ``start`` .. ``start + count - 1`` of the live index (an outage sweep reads them all)."""
        return list(self.client.zrange(k.LIVE_INDEX, start, start + count - 1))

    @wrap
    def server_started(self) -> tuple[str, float]:
        """Which Redis process this is and when it started: INFO's ``run_id`` and the time now minus
        ``uptime_in_seconds`` (for a Cluster: every master's run id, and the latest start)."""
        now = clock.now()
        if clients.is_cluster(self.client):
            found = self.client.info("server", target_nodes=self.client.PRIMARIES)
            infos = list(found.values()) if isinstance(found, dict) and "run_id" not in found else [found]
        else:
            infos = [self.client.info("server")]
        identity = ",".join(sorted(str(info["run_id"]) for info in infos))
        return identity, now - min(float(info["uptime_in_seconds"]) for info in infos)

    @wrap
    def swap_server_seen(self, identity: str) -> str | None:
        """Record the Redis identity a reconciler saw and return the one recorded before (SET ... GET:
        of several reconcilers that see a restart, one gets the old identity back)."""
        found: str | None = self.client.set(k.SERVER_SEEN, identity, get=True)
        return found

    @wrap
    def live_count(self) -> int:
        return int(self.client.zcard(k.LIVE_INDEX))

    @wrap
    def note_reconcile(self, report_json: str) -> None:
        """What the last reconcile pass did (read by ``taskloop status``)."""
        self.client.set(k.RECONCILER_LAST, report_json)

    @wrap
    def last_reconcile(self) -> str | None:
        found: str | None = self.client.get(k.RECONCILER_LAST)
        return found

    @wrap
    def run_ids(self, limit: int, offset: int = 0) -> list[str]:
        return list(self.client.zrevrange(k.RUNS_INDEX, offset, offset + limit - 1))

    @wrap
    def put_shape(self, fingerprint: str, shape_json: str, ttl_s: int) -> None:
        self.client.set(k.shape_key(fingerprint), shape_json, ex=ttl_s)

    @wrap
    def shape(self, fingerprint: str) -> str | None:
        found: str | None = self.client.get(k.shape_key(fingerprint))
        return found

    @wrap
    def task_records(self, run_ids: Sequence[str], per_run: int = 200) -> list[list[str]]:
        """The task records (JSON) of each run, in one pipelined read: one HSCAN step of about
        ``per_run`` fields each (all of a small run's; the first of a large run's)."""
        pipe = self.client.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.hscan(k.RunKeys.of(run_id).run, 0, match=f"{fld.TASK_PREFIX}*", count=per_run)
            pipe.hmget(k.RunKeys.of(run_id).run, [fld.F_COMPACT])
        replies = pipe.execute()
        # a compacted run's records are in its compact record (store/compacted.py): all of a page's
        # in one more round trip
        compacted = [run_id for run_id, (marker,) in zip(run_ids, replies[1::2], strict=True) if marker is not None]
        moved = dict(zip(compacted, self.compact_records(compacted), strict=True))
        found: list[list[str]] = []
        for run_id, (_, records) in zip(run_ids, replies[::2], strict=True):
            if run_id in moved:
                record = moved[run_id]
                records = {} if record is None else {name: value for name, value in record.fields.items()
                                                     if name.startswith(fld.TASK_PREFIX)}
            found.append(list(records.values())[:per_run])
        return found

    @wrap
    def run_ids_with_prefix(self, prefix: str, limit: int = 2) -> list[str]:
        """Run ids that start with ``prefix`` (lexicographic ZSCAN of the runs index)."""
        found: list[str] = []
        for member, _ in self.client.zscan_iter(k.RUNS_INDEX, match=f"{_glob_escape(prefix)}*", count=1000):
            found.append(member)
            if len(found) >= limit:
                break
        return found

    @wrap
    def run_metas(self, run_ids: Iterable[str]) -> list[list[str | None]]:
        pipe = self.client.pipeline(transaction=False)
        for run_id in run_ids:
            pipe.hmget(k.RunKeys.of(run_id).run, list(fld.META_FIELDS))
        return list(pipe.execute())

    @wrap
    def trim_runs_index(self, before: float) -> int:
        """Drop the entries of runs created before ``before`` (their records have expired) from the
        runs index and every run list; a workflow whose lists are empty leaves the list of listed
        workflows."""
        dropped = int(self.client.zremrangebyscore(k.RUNS_INDEX, "-inf", before))
        workflows = sorted(self.client.smembers(k.LISTED_WORKFLOWS))
        lists = [Listed(wf, status, None) for wf in workflows for status in STORED_STATUSES]
        pipe = self.client.pipeline(transaction=False)
        legacy = () if self._legacy_deleted else k.LEGACY_STATUS_LISTS  # earlier versions' (store/keys.py)
        for key in legacy:  # one key a command: a Cluster holds them in other slots
            pipe.delete(key)
        for entry in [*lists, *(Listed(wf, None, None) for wf in workflows)]:
            pipe.zremrangebyscore(k.run_list(entry), "-inf", before)
        for wf in workflows:
            pipe.zcard(k.run_list(Listed(wf, None, None)))
        replies = pipe.execute()
        self._legacy_deleted = True
        left = replies[-len(workflows):] if workflows else []
        empty = [wf for wf, count in zip(workflows, left, strict=True) if not count]
        if empty:
            self.client.srem(k.LISTED_WORKFLOWS, *empty)
        return dropped

    @wrap
    def relist(self, finished: Sequence[tuple[str, str, str, float]]) -> None:
        """Make the run lists agree with finished runs ``(run_id, workflow, status, created)``, as the
        reconciler takes them off the live index: on a Cluster, whatever a write did not list (a crash
        between the script and its lists) is listed now; everywhere, the workflows are named for
        trimming."""
        if not finished:
            return
        pipe = self.client.pipeline(transaction=False)
        # On one Redis every write lists its run in the same script call (cas.lua "k"): the lists
        # cannot lag behind the run, and only the workflows are named (one command per batch).
        for run_id, workflow, status, created in finished if clients.is_cluster(self.client) else ():
            for live in LIVE_STATUSES:
                pipe.zrem(k.run_list(Listed(workflow, live, None)), run_id)
            for entry in (Listed(workflow, status, created), Listed(workflow, None, created)):
                pipe.zadd(k.run_list(entry), {run_id: created})
        pipe.sadd(k.LISTED_WORKFLOWS, *{workflow for _, workflow, _, _ in finished})
        pipe.execute()

    @wrap
    def list_page(self, status: str | None, workflow: str | None, offset: int, limit: int) -> tuple[list[str], int]:
        """Run ids ``offset .. offset + limit - 1`` of a run list, newest first, and the list's length
        (no filter: the runs index). A status across workflows has no list of its own: its page is
        the newest ``offset + limit`` of each workflow's list of that status, merged (a page costs
        one range read per workflow)."""
        if status is None or workflow is not None:
            key = k.RUNS_INDEX if status is None and workflow is None else k.run_list(Listed(workflow, status, None))
            pipe = self.client.pipeline(transaction=False)
            pipe.zrevrange(key, offset, offset + limit - 1)
            pipe.zcard(key)
            ids, total = pipe.execute()
            return list(ids), int(total)
        keys = [k.run_list(Listed(wf, status, None)) for wf in sorted(self.client.smembers(k.LISTED_WORKFLOWS))]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.zrevrange(key, 0, offset + limit - 1, withscores=True)
            pipe.zcard(key)
        replies = pipe.execute()
        rows = sorted((row for rows in replies[::2] for row in rows), key=lambda row: (-row[1], row[0]))
        return [run_id for run_id, _ in rows[offset:offset + limit]], sum(int(n) for n in replies[1::2])

    @wrap
    def list_lengths(self, statuses: Sequence[str]) -> dict[str, int]:
        """How many runs each stored status's run lists hold (summed over the workflows)."""
        workflows = sorted(self.client.smembers(k.LISTED_WORKFLOWS))
        pipe = self.client.pipeline(transaction=False)
        for status in statuses:
            for wf in workflows:
                pipe.zcard(k.run_list(Listed(wf, status, None)))
        counts = iter(pipe.execute())
        return {status: sum(int(next(counts)) for _ in workflows) for status in statuses}

    def workflows_to_name(self, workflows: Iterable[str]) -> list[str]:
        """Of the workflows a write lists runs of, those this process has not named in the set of
        listed workflows within ``NAME_AGAIN_S`` (store.apply names them in the same round trip).
        Naming again now and then puts back a workflow that the reconciler's trim took off."""
        now = time.monotonic()
        return [wf for wf in dict.fromkeys(workflows) if now - self._named.get(wf, -NAME_AGAIN_S) >= NAME_AGAIN_S]

    def workflows_named(self, workflows: Iterable[str]) -> None:
        """The workflows were named (the round trip that named them went through)."""
        now = time.monotonic()
        self._named.update((wf, now) for wf in workflows)

    @wrap
    def queue_lengths(self, names: Sequence[str]) -> dict[str, int]:
        """The lengths of broker lists (this store used as the broker)."""
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.llen(name)
        return {name: int(n) for name, n in zip(names, pipe.execute(), strict=True)}

    @wrap
    def listed_workflows(self) -> list[str]:
        return sorted(self.client.smembers(k.LISTED_WORKFLOWS))


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)



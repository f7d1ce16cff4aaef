"""The soak's offline checker and its report.

After the soak, with no fault injected any more and every run ended, it reads each run's history
(``client.events``), its final records (``client.inspect``, ``client.result``) and the callbacks'
own log of their real executions (``soak:execs``, tests/faults/soak_flows.py), and proves for
every run:

- **terminal and correct**: the run ended, with the status, termination, values and first error
  that its input prescribes (`soak_flows.expected`), or cancelled/aborted when the driver's cancel
  landed (a ``run.cancel`` event); the driver's `CancelResult` agrees with the history;
- **no commit twice**: each ``(task, round, phase)`` ``phase`` event appears at most once, and
  ``run.finished`` exactly once;
- **no round went backwards**: per task, the rounds of its ``phase`` events never decrease, are
  contiguous from 1 and within the task's bound (and reach the bound the input prescribes); the
  real executions (the callbacks' log), in the order they began, never go back to an earlier
  (round, phase) either;
- **the ledger is balanced** (tests/ledger.py: every phase opened is closed exactly once);
- **no phase ran after its run ended**: no real execution began after the run's finish time
  (``finished_at``), and no execution that taskloop recorded did.

It also measures the recovery of each fault (see `recovery`) and sums up replays and stale
rejections, and renders the markdown report.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from taskloop.base.errors import RunNotFound
from taskloop.core.events import Event
from taskloop.core.reads import CARRY_FRESH_S
from taskloop.runtime.client import CancelResult, TaskLoop
from taskloop.runtime.models import executions
from tests.faults import soak_flows
from tests.faults.injectors import KINDS, RECOVERING, Fault
from tests.ledger import ledger_problems

TERMINAL = {"done", "failed", "cancelled", "rejected"}
PHASE_ORDER = {"attempt": 0, "run": 0, "check": 1, "complete": 2}
LIMITS = {"work": soak_flows.MAX_ROUNDS, "fetch": soak_flows.RETRY_ATTEMPTS}  # other tasks: 1 round
# One line per guarantee, in the order of the verdict table.
CHECKS = {
    "lost": "runs not terminal (lost)",
    "outcome": "runs with a wrong outcome",
    "duplicate": "duplicate commits",
    "rounds": "rounds backwards, with gaps or out of bounds",
    "ledger": "unbalanced ledgers",
    "after-end": "phases begun after their run ended",
    "cancel": "cancel results contradicted by the history",
    "fleet": "fleet problems (dead workers, final batch)",
    "harness": "injector problems, malformed messages unaccounted for",
}


@dataclass
class Run:
    """One run the driver started, and what the driver did to it."""

    run_id: str
    workflow: str
    input: dict[str, Any]
    label: str
    started: float = 0.0  # wall clock, just before the start call
    cancel_after: float | None = None  # the driver cancels it this long after its start
    unsent: bool = False  # its first message was never sent (a lost-message fault)
    final: bool = False  # part of the final batch (the fleet check)
    status: str = "running"  # as last polled by the driver
    seen_waiting: float | None = None
    decisions: int = 0
    cancel_calls: int = 0
    cancel: CancelResult | None = None
    cancel_at: float | None = None


@dataclass
class Verdict:
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (label, status) -> runs
    replays: int = 0  # executions taskloop recorded as replays (not a phase's first execution)
    lost_execs: int = 0  # executions taskloop recorded as lost (dead worker, expired lease)
    real_execs: int = 0  # real executions (the callbacks' log)
    re_executions: int = 0  # real executions beyond the first of their (task, round, phase)
    late_ends: list[dict[str, Any]] = field(default_factory=list)  # real executions that ended after their run
    # ended (they began before it): executions that were paused or cut off from Redis, then discarded
    # real executions that began after their cancelled run ended, on a message queued before the
    # cancel and taken while fresh: it runs on the fields it carries (docs/controls.md, Cancellation)
    carried_starts: list[dict[str, Any]] = field(default_factory=list)
    abandoned: int = 0  # runs failed with PhaseAbandoned after 5 lost executions of a hit phase
    stats: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(self.problems.values())

    def add(self, check: str, message: str) -> None:
        self.problems[check].append(message)


def parse_execs(entries: list[str]) -> dict[str, dict[str, Any]]:
    """The callbacks' log: execution id -> its begin entry, with ``end`` (None: it never returned)."""
    execs: dict[str, dict[str, Any]] = {}
    ends: dict[str, float] = {}
    for raw in entries:
        entry = json.loads(raw)
        if entry["ev"] == "exec":
            execs.setdefault(entry["id"], {**entry, "end": None})
        else:
            ends.setdefault(entry["id"], entry["at"])
    for exec_id, at in ends.items():
        if exec_id in execs:
            execs[exec_id]["end"] = at
    return execs


def check(client: TaskLoop, runs: list[Run], faults: list[Fault], exec_log: list[str]) -> Verdict:
    verdict = Verdict()
    execs = parse_execs(exec_log)
    verdict.real_execs = len(execs)
    by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in execs.values():
        by_run[entry["run"]].append(entry)
    hit_runs = {target[0] for fault in faults for target in fault.targets}
    history: dict[str, list[Event]] = {}
    for run in runs:
        events = _check_run(client, run, by_run.get(run.run_id, []), run.run_id in hit_runs, verdict)
        if events is not None:
            history[run.run_id] = events
    recovery(faults, history, execs)
    explain_late_ends(verdict, faults)
    verdict.stats = {name: int(value) for name, value in client.store.stats().items()}
    return verdict


def _check_run(client: TaskLoop, run: Run, real: list[dict[str, Any]], hit: bool,
               verdict: Verdict) -> list[Event] | None:
    rid = run.run_id
    try:
        view = client.inspect(rid)
        events = client.events(rid)
    except RunNotFound:
        verdict.add("lost", f"{rid} ({run.label}): not found")
        return None
    verdict.outcomes[(run.label, view.status)] += 1
    if view.status not in TERMINAL:
        verdict.add("lost", f"{rid} ({run.label}): not terminal ({view.status}); tasks "
                    + ", ".join(f"{t.key}={t.status}/{t.phase}/{t.round}" for t in view.tasks.values()))
        return events
    result = client.result(rid)
    assert result is not None
    cancelled = any(e.type == "run.cancel" for e in events)
    exp = soak_flows.expected(run.workflow, run.input)

    # terminal and correct ---------------------------------------------------------------------
    if cancelled:
        if (view.status, view.termination_code) != ("cancelled", "aborted"):
            verdict.add("outcome", f"{rid} ({run.label}): cancelled, but ended {view.status}/{view.termination_code}")
    else:
        got = (result.status, result.termination_code)
        first_error = (result.errors[0].key, result.errors[0].type) if result.errors else None
        if result.status == "failed" and first_error is not None and first_error[1] == "PhaseAbandoned" and hit:
            verdict.abandoned += 1  # the redelivery cap: five executions of one phase were lost to faults
            verdict.outcomes[(run.label, "failed: PhaseAbandoned")] += 1
        elif got != (exp.status, exp.termination):
            verdict.add("outcome", f"{rid} ({run.label}): ended {got}, expected {(exp.status, exp.termination)}; "
                        f"errors {[(e.key, e.type, e.message[:80]) for e in result.errors]}")
        elif exp.status != "failed" and result.values != exp.values:
            verdict.add("outcome", f"{rid} ({run.label}): values {result.values}, expected {exp.values}")
        elif exp.error is not None and first_error != exp.error:
            verdict.add("outcome", f"{rid} ({run.label}): first error {first_error}, expected {exp.error}")
    if run.cancel is not None:
        if run.cancel.cancelled and not cancelled:
            verdict.add("cancel", f"{rid}: cancel() said cancelled, but the history has no run.cancel")
        if not run.cancel.cancelled and cancelled and run.cancel_calls == 1:
            verdict.add("cancel", f"{rid}: cancel() said {run.cancel.message!r}, but the history has run.cancel")
    elif cancelled and run.cancel_calls == 0:
        verdict.add("cancel", f"{rid}: run.cancel in the history, but the driver never cancelled it")

    # no commit twice ----------------------------------------------------------------------------
    commits = Counter((e.key, e.round, e.phase) for e in events if e.type == "phase")
    for (key, round_, phase), n in commits.items():
        if n > 1:
            verdict.add("duplicate", f"{rid}: {key} {round_}/{phase} committed {n} times")
    finished = [e for e in events if e.type == "run.finished"]
    if len(finished) != 1:
        verdict.add("duplicate", f"{rid}: {len(finished)} run.finished events")

    # no round went backwards --------------------------------------------------------------------
    for key in sorted({e.key for e in events if e.type == "phase" and e.key}):
        seq = [(e.round or 0, PHASE_ORDER.get(e.phase or "", 0)) for e in events if e.type == "phase" and e.key == key]
        rounds = sorted({r for r, _ in seq})
        limit = LIMITS.get(key, 1)
        if seq != sorted(seq):
            verdict.add("rounds", f"{rid}: {key} phases went backwards: {seq}")
        if rounds != list(range(1, len(rounds) + 1)) or rounds[-1] > limit:
            verdict.add("rounds", f"{rid}: {key} rounds {rounds} not contiguous within 1..{limit}")
        elif not cancelled and result.status == exp.status and key in exp.rounds and rounds[-1] != exp.rounds[key]:
            verdict.add("rounds", f"{rid}: {key} reached round {rounds[-1]}, expected {exp.rounds[key]}")
    order: dict[str, tuple[int, int, float]] = {}
    for entry in sorted(real, key=lambda e: e["at"]):
        step = (entry["round"], PHASE_ORDER[entry["phase"]])
        last = order.get(entry["key"])
        if last is not None and step < last[:2]:
            verdict.add("rounds", f"{rid}: {entry['key']} execution of {step} began at {entry['at']:.3f}, after "
                        f"one of {last[:2]} (at {last[2]:.3f})")
        if last is None or step > last[:2]:
            order[entry["key"]] = (*step, entry["at"])

    # the ledger -------------------------------------------------------------------------------
    for problem in ledger_problems(events):
        verdict.add("ledger", f"{rid}: {problem}")

    # nothing ran after the end ------------------------------------------------------------------
    end = view.finished_at
    if end is None:
        verdict.add("after-end", f"{rid}: terminal without finished_at")
        return events
    cancels = [e.at for e in events if e.type == "run.cancel"]
    for entry in real:
        if entry["at"] > end and cancels and entry["at"] <= cancels[0] + CARRY_FRESH_S + CARRIED_PREP_S:
            verdict.carried_starts.append({**entry, "after_end_s": round(entry["at"] - end, 3)})
        elif entry["at"] > end:
            verdict.add("after-end", f"{rid}: {entry['key']} {entry['round']}/{entry['phase']} began at "
                        f"{entry['at']:.3f} in pid {entry['pid']}, after the run ended at {end:.3f}")
        elif entry["end"] is not None and entry["end"] > end:
            verdict.late_ends.append(entry)
    recorded = [(key, e) for key, found in executions(events).items() for e in found]
    for key, e in recorded:
        if e.began_at is not None and e.began_at > end:
            verdict.add("after-end", f"{rid}: taskloop recorded {key} {e.round}/{e.phase} beginning at "
                        f"{e.began_at:.3f}, after the run ended at {end:.3f}")
    verdict.replays += sum(1 for _, e in recorded if e.replay)
    verdict.lost_execs += sum(1 for _, e in recorded if e.lost)
    seen = Counter((e["key"], e["round"], e["phase"]) for e in real)
    verdict.re_executions += sum(n - 1 for n in seen.values())
    return events


def explain_late_ends(verdict: Verdict, faults: list[Fault]) -> None:
    """Why an execution outlived its run: it was the one a SIGSTOP paused (its phase was replayed
    elsewhere and the run went on), or Redis was killed while it ran (its callback waited for Redis,
    its lease expired, the phase was replayed). Any other case is worth a look: listed in the notes."""
    stops = {(f.targets[0], f.at) for f in faults if f.kind == "sigstop" and f.targets}
    kills = [f.at for f in faults if f.kind == "redis-kill"]
    for entry in verdict.late_ends:
        target = (entry["run"], entry["key"], entry["round"], entry["phase"])
        if any(t == target and entry["at"] <= at <= entry["end"] for t, at in stops):
            entry["why"] = "sigstop"
        elif any(entry["at"] <= at <= entry["end"] for at in kills):
            entry["why"] = "redis-kill"
        else:
            entry["why"] = "unexplained"


def recovery(faults: list[Fault], history: dict[str, list[Event]], execs: dict[str, dict[str, Any]]) -> None:
    """Recovery time of each fault that interrupts an execution or a message (`RECOVERING`).

    For one target (run, task, round, phase) hit at time T, it is the time from T to the first
    sign that the phase moved again: the earliest of (a) a real execution of that same
    (run, task, round, phase) beginning after T (the callbacks' log), and (b) a ``phase`` or
    ``task`` event of that task committed after T (the phase completed, the task ended, e.g.
    cancelled). A ``lost`` event is not recovery: it only says the loss was noticed. A fault's
    recovery is the longest over its targets (a Redis kill or a worker kill hits many phases at
    once); a target whose run had ended before T gives no sample, nor does a fault with no target.
    """
    begins: dict[tuple[str, str, int, str], list[float]] = defaultdict(list)
    for entry in execs.values():
        begins[(entry["run"], entry["key"], entry["round"], entry["phase"])].append(entry["at"])
    for fault in faults:
        if fault.kind not in RECOVERING:
            continue
        samples = []
        for target in fault.targets:
            run_id, key = target[0], target[1]
            events = history.get(run_id, [])
            ended = [e.at for e in events if e.type == "run.finished"]
            if ended and ended[0] <= fault.at:
                continue
            later = [at for at in begins.get(target, []) if at > fault.at]
            later += [e.at for e in events if e.key == key and e.type in ("phase", "task") and e.at > fault.at]
            if later:
                samples.append(min(later) - fault.at)
        fault.recovery_s = max(samples) if samples else None


REFUSALS = ("malformed taskloop.", "Received unregistered task", "Can't decode message body",
            "Received invalid task message")


# A carried message (taken less than CARRY_FRESH_S after it was queued, before the cancel) starts
# its callback after the preparation of its phase: at most this long on a loaded worker.
CARRIED_PREP_S = 1.0

AOF_WINDOW_S = 2.0  # appendfsync everysec: what a kill -9 of redis-server may lose (up to 2 s, Redis's docs)


def malformed(verdict: Verdict, faults: list[Fault], logs: list[str], killed_logs: list[str]) -> dict[str, int]:
    """Account for every malformed message: refused with a log line by a worker (taskloop's own
    "malformed taskloop.<phase> message dropped", Celery's "Received unregistered task" and "Can't
    decode message body" and "Received invalid task message" (a pickle body)), or received by a
    worker that was killed before it got to it (its log says "[<id>] received"): kombu keeps no
    copy of a message a worker took (ack emulation off), so it went with the worker, and it names
    no phase for the store to send again. Or, third, pushed in the last AOF_WINDOW_S before a
    redis-server was killed: redis-server fsyncs its AOF once a second (``appendfsync everysec``,
    the shipped setting), so a kill -9 may lose the last writes, and a malformed message, unlike a
    phase's, cannot be made again from the store. Anything else was dropped silently: a problem."""
    ids = {f.detail.rpartition(" id ")[2] for f in faults if f.kind == "malformed"}
    refused = sum(1 for text in logs for line in text.splitlines()
                  if line.startswith("[") and any(phrase in line for phrase in REFUSALS))
    held = sum(1 for message_id in ids if any(f"[{message_id}] received" in text for text in killed_logs))
    kills = [f.at for f in faults if f.kind == "redis-kill"]
    in_aof_window = sum(1 for f in faults if f.kind == "malformed"
                        and any(0.0 <= at - f.at <= AOF_WINDOW_S for at in kills))
    if refused + held + in_aof_window < len(ids):
        verdict.add("harness", f"malformed: {len(ids)} injected, {refused} refused with a log line, {held} held "
                    f"by killed workers, {in_aof_window} pushed just before a Redis kill: "
                    f"{len(ids) - refused - held - in_aof_window} unaccounted for")
    return {"injected": len(ids), "refused": refused, "held": held, "aof_window": in_aof_window}


# --- the report -----------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))
    return ordered[int(rank) - 1]


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(verdict: Verdict, faults: list[Fault], runs: list[Run], meta: dict[str, Any],
           bad: dict[str, int]) -> str:
    lines = [f"# taskloop chaos soak: seed {meta['seed']}, {len(faults)} faults", ""]
    lines += [f"`{meta['command']}`", ""]
    lines += [f"- machine: {meta['cores']} cores; fleet: {meta['workers']} workers x {meta['concurrency']} pool "
              f"processes (each killed worker replaced: {meta['workers_started']} workers started in all); "
              f"{meta['live']} runs live at a time; timers {meta['timers']}",
              f"- time: {meta['total_s']:.0f} s in all: start {meta['start_s']:.0f} s, injection "
              f"{meta['inject_s']:.0f} s, drain {meta['drain_s']:.0f} s, fleet check {meta['fleet_s']:.0f} s, "
              f"checker {meta['check_s']:.0f} s",
              f"- runs: {len(runs)}; real executions (callbacks' log): {verdict.real_execs}", ""]
    lines += ["## Faults by kind", "",
              "| kind | faults | phases hit | recovery p50 s | p95 s | max s |", "|---|---|---|---|---|---|"]
    by_kind: dict[str, list[Fault]] = defaultdict(list)
    for fault in faults:
        by_kind[fault.kind].append(fault)
    for kind, (label, _) in KINDS.items():
        found = by_kind.get(kind, [])
        times = [f.recovery_s for f in found if f.recovery_s is not None]
        hits = sum(len(f.targets) for f in found)
        stats = (_s(percentile(times, 50)), _s(percentile(times, 95)), _s(max(times))) if times else ("-",) * 3
        lines.append(f"| {label} (`{kind}`) | {len(found)} | {hits} | {' | '.join(stats)} |")
    all_times = [f.recovery_s for f in faults if f.recovery_s is not None]
    total = (_s(percentile(all_times, 50)), _s(percentile(all_times, 95)), _s(max(all_times))) \
        if all_times else ("-",) * 3
    lines.append(f"| **all** | {len(faults)} | {sum(len(f.targets) for f in faults)} | {' | '.join(total)} |")
    lines += ["", "Recovery: from the fault to the first sign that a hit phase moved again (a new execution of "
              "that phase began, or the task committed its next phase or ended); per fault the longest over "
              "the phases it hit. Replays after commit and malformed messages interrupt nothing: no recovery.", ""]
    lines += ["## Runs by outcome", "", "| case | runs | " + " | ".join(sorted(TERMINAL)) + " | other |",
              "|---|---|" + "---|" * (len(TERMINAL) + 1)]
    labels = sorted({label for label, _ in verdict.outcomes})
    for label in labels:
        counts = {status: n for (lab, status), n in verdict.outcomes.items() if lab == label}
        other = sum(n for status, n in counts.items() if status not in TERMINAL)
        lines.append(f"| {label} | {sum(counts.values())} | "
                     + " | ".join(str(counts.get(s, 0)) for s in sorted(TERMINAL)) + f" | {other} |")
    cancels = [r for r in runs if r.cancel is not None]
    landed = sum(1 for r in cancels if r.cancel is not None and r.cancel.cancelled)
    lines += ["", f"Cancels: {len(cancels)} sent, {landed} landed mid-run, {len(cancels) - landed} after the end. "
              f"Gate decisions: {sum(r.decisions for r in runs)}. Runs whose first message was never sent: "
              f"{sum(1 for r in runs if r.unsent)}.", ""]
    counters = verdict.stats
    why = Counter(entry["why"] for entry in verdict.late_ends)
    late = f"{len(verdict.late_ends)}" + (f" ({', '.join(f'{n} {w}' for w, n in sorted(why.items()))})" if why else "")
    lines += ["## Recovery machinery", "", "| measure | count |", "|---|---|",
              f"| replays recorded by taskloop (executions after a phase's first) | {verdict.replays} |",
              f"| executions recorded lost (dead worker, expired lease) | {verdict.lost_execs} |",
              f"| real re-executions (callbacks' log, beyond the first per phase) | {verdict.re_executions} |",
              f"| callbacks started after a cancel ended the run, on a fresh carried message | "
              f"{len(verdict.carried_starts)} |",
              f"| stale deliveries refused (`stale_deliveries`) | {counters.get('stale_deliveries', 0)} |",
              f"| stale commits refused (`stale_commits`) | {counters.get('stale_commits', 0)} |",
              f"| stale rejections in all | {counters.get('stale_deliveries', 0) + counters.get('stale_commits', 0)} |",
              f"| malformed messages refused with a log line (of {bad['injected']}) | {bad['refused']} |",
              f"| malformed messages received by a worker that was then killed | {bad['held']} |",
              f"| malformed messages pushed in the {AOF_WINDOW_S:.0f} s before a Redis kill (AOF everysec) "
              f"| {bad['aof_window']} |",
              f"| executions still running when their run ended (began before; discarded) | {late} |",
              f"| runs failed PhaseAbandoned (a hit phase lost 5 times) | {verdict.abandoned} |", ""]
    lines += ["## Checker verdict", "", "| guarantee | violations |", "|---|---|"]
    for name, label in CHECKS.items():
        lines.append(f"| {label} | {len(verdict.problems.get(name, []))} |")
    lines += ["", f"**{'PASS' if verdict.ok else 'FAIL'}**", ""]
    if not verdict.ok:
        lines += ["## Problems", ""]
        for name in CHECKS:
            for message in verdict.problems.get(name, [])[:40]:
                lines.append(f"- [{name}] {message}")
        lines.append("")
    return "\n".join(lines)

"""Fuzzing what a loop task's ``check`` returns (on a real ``taskloop worker``) and gate decisions
(``client.decide``) on runs that wait at a gate.

Properties:

* checks: whatever ``check`` returns (LoopCheck, dicts with or without the right keys and types,
  bools, None, strings, sets, objects, feedback with lone surrogates) or raises, the run ends,
  and as SPEC §3 says: accepted -> done with the candidate as the value; rejected in every round
  -> LoopTaskExhausted with the last feedback; anything else -> the task fails with
  InvalidCheckResult (``loop check must return done=True or done=False with a feedback
  string``), or with the check's own exception type. A candidate that is not lossless JSON fails
  with InvalidOutput before check runs. The worker never dies.
* gates: a random sequence of decisions (actions, gate keys, actors, reasons, values, run ids:
  right, wrong and malformed) on a waiting run. Each call either applies (exactly when nothing
  about it is wrong) or raises GateRefused, InvalidInput or RunNotFound; a decision applies to
  one activation only; the run then ends as the decision says (done, with the value of a
  resumed gate, or rejected).

Examples are few in CI (each one is a real run); ``TASKLOOP_FUZZ_PROFILE=long python -m pytest
tests/fuzz/test_fuzz_checks_gates.py`` runs hundreds.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from taskloop.base.errors import GateRefused, InvalidCheckResult, InvalidInput, RunNotFound, TaskLoopError
from taskloop.define.options import CHECK_RESULT_MESSAGE, LoopCheck
from taskloop.runtime.client import TaskLoop
from tests.fuzz import TIMEOUT, fuzz
from tests.fuzz.conftest import FuzzWorker
from tests.fuzz.flows import CHECKS, GATE_ACTORS, GATES, build
from tests.fuzz.strategies import is_lossless, jsonish, lossless_json, same_json
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(TIMEOUT), pytest.mark.usefixtures("fuzz_worker")]

_serial = itertools.count()


def _run_id(what: str) -> str:
    return f"fuzz-{what}-{next(_serial)}"


# --- recipes of values (see tests/fuzz/flows.py) ------------------------------------------------

CODE_POINTS = st.lists(st.one_of(st.integers(0x20, 0x7E), st.sampled_from([0x0A, 0xD800, 0xDFFF, 0xE9, 0x1F4A5]),
                                 st.integers(0, 0x10FFFF)), max_size=8)
TEXT = st.one_of(st.text(max_size=20).map(lambda s: {"json": s}), CODE_POINTS.map(lambda cps: {"str": cps}))
GARBAGE = st.one_of(
    st.builds(lambda v: {"json": v}, st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8),
                                               st.lists(st.integers(), max_size=2))),
    st.builds(lambda v: {"set": v}, st.lists(st.integers(), max_size=3)),
    st.builds(lambda v: {"bytes": v.hex()}, st.binary(max_size=4)),
    st.sampled_from([{"float": "nan"}, {"float": "inf"}, {"float": "-0.0"}, {"bigint": 4301}, {"object": None},
                     {"tuple": [{"json": True}]}]),
)
DONE = st.one_of(st.booleans().map(lambda b: {"json": b}), GARBAGE)
FEEDBACK = st.one_of(TEXT, st.none().map(lambda _: {"json": None}), GARBAGE)


def _dict_recipe(items: list[tuple[Any, Any]]) -> dict[str, Any]:
    return {"dict": [[k, v] for k, v in items]}


VALID_CHECKS = st.one_of(
    st.just({"loopcheck": {"done": {"json": True}}}),
    st.builds(lambda fb: {"loopcheck": {"done": {"json": False}, "feedback": {"json": fb}}}, st.text(max_size=20)),
    st.builds(lambda fb: {"dict": [[{"json": "done"}, {"json": False}], [{"json": "feedback"}, {"json": fb}]]},
              st.text(max_size=20)),
    st.just({"json": {"done": True}}),
    st.just({"json": {"done": True, "feedback": None}}),
)
CHECK_RECIPES = st.integers(0, 4).flatmap(lambda n: VALID_CHECKS if n < 2 else HOSTILE_CHECKS)
HOSTILE_CHECKS = st.one_of(
    # LoopCheck(...), which raises InvalidCheckResult itself when its arguments are wrong
    st.builds(lambda done, fb: {"loopcheck": {"done": done, "feedback": fb}}, DONE, FEEDBACK),
    st.builds(lambda done: {"loopcheck": {"done": done}}, DONE),
    # a dict: the right keys, missing ones, extra ones, keys that are not str
    st.builds(_dict_recipe, st.lists(st.tuples(
        st.one_of(st.sampled_from(["done", "feedback", "extra", "Done"]).map(lambda s: {"json": s}),
                  st.sampled_from([{"json": 1}, {"tuple": []}])),
        st.one_of(DONE, FEEDBACK)), max_size=3)),
    # plain values, and exceptions (with messages a logger or Redis may choke on)
    GARBAGE,
    st.builds(lambda msg: {"raise": msg}, TEXT),
)
CANDIDATES = st.integers(0, 7).flatmap(
    lambda n: GARBAGE if n == 0 else lossless_json(max_leaves=6).map(lambda v: {"json": v}))


def expected_check_outcome(candidate_recipe: Any, check_recipe: Any) -> tuple[str, Any]:
    """What SPEC §3 says the run comes to, computed here from the same Python values."""
    candidate = build(candidate_recipe)
    if not is_lossless(candidate):
        return "failed", ("InvalidOutput", "outputs must be lossless JSON values")
    try:
        returned = build(check_recipe)
    except Exception as exc:  # the check raises (LoopCheck(...) refusing its arguments included)
        return "failed", (type(exc).__name__, None)
    try:
        check = LoopCheck.coerce(returned)
    except InvalidCheckResult:
        return "failed", ("InvalidCheckResult", CHECK_RESULT_MESSAGE)
    if check.done:
        return "done", candidate
    return "exhausted", check.feedback


@given(candidate=CANDIDATES, check=CHECK_RECIPES)
@example(candidate={"json": 1}, check={"raise": {"str": [0x61, 0xD800]}})
@example(candidate={"json": 1}, check={"loopcheck": {"done": {"json": False}, "feedback": {"json": "again"}}})
@example(candidate={"str": [0xDFFF]}, check={"loopcheck": {"done": {"json": True}}})
@fuzz(ci=40, long=1000, live=True)
def test_whatever_a_check_returns_the_run_ends_as_the_spec_says(fuzz_client: TaskLoop, candidate: Any,
                                                                check: Any) -> None:
    kind, detail = expected_check_outcome(candidate, check)
    event(kind if kind != "failed" else f"failed: {detail[0]}")
    result = fuzz_client.start(CHECKS, {"candidate": candidate, "check": check}, run_id=_run_id("check")).wait(30)
    if kind == "done":
        assert result.status == "done", result
        assert same_json(result.values["judged"], detail)
        return
    assert result.status == "failed", result
    [error] = result.errors
    if kind == "exhausted":
        assert error.type == "LoopTaskExhausted" and error.message == "Loop task judged exhausted its 2 rounds"
        assert (error.details or {}).get("feedback") == detail
        return
    error_type, message = detail
    assert error.type == error_type, error
    if message is not None:
        assert message in error.message, error.message


def test_an_exception_message_with_a_lone_surrogate_is_recorded(fuzz_client: TaskLoop) -> None:
    """Regression (found by the fuzzer): a callback raising an exception whose message holds a lone
    surrogate made the worker fail to record the outcome (PydanticSerializationError) and left the
    run running until its lease expired; the message is recorded with the surrogate escaped."""
    check = {"raise": {"str": [0x61, 0xD800]}}
    result = fuzz_client.start(CHECKS, {"check": check}, run_id=_run_id("raise")).wait(30)
    assert result.status == "failed", result
    assert (result.errors[0].type, result.errors[0].message) == ("ValueError", "a\\ud800")
    assert "ValueError: a\\ud800" in (result.errors[0].details or {})["traceback"]


def test_a_check_feedback_with_a_lone_surrogate_is_an_invalid_check_result(fuzz_client: TaskLoop) -> None:
    """Regression (found by the fuzzer): feedback that UTF-8 cannot encode could not be stored;
    it is InvalidCheckResult now, like any other feedback that is not a usable string."""
    for check in ({"loopcheck": {"done": {"json": False}, "feedback": {"str": [0x61, 0xD800]}}},
                  {"dict": [[{"json": "done"}, {"json": False}], [{"json": "feedback"}, {"str": [0xDFFF]}]]}):
        result = fuzz_client.start(CHECKS, {"check": check}, run_id=_run_id("surrogate")).wait(30)
        assert result.status == "failed" and result.errors[0].type == "InvalidCheckResult", result
        assert "lone surrogate" in result.errors[0].message


# --- gates --------------------------------------------------------------------------------------

ACTIONS = st.one_of(st.sampled_from(["approve", "reject", "resume"]),
                    st.sampled_from(["APPROVE", "", "approve\n", "cancel"]), st.none(), st.integers())
KEYS = st.one_of(st.sampled_from(["gate", "gate", "prep", "after", "nope", "gate@1", "gate\n"]), st.none(),
                 st.lists(st.just("gate"), max_size=1), st.integers())
ACTORS = st.one_of(st.sampled_from(["alice", "bob", "carol", "mallory", ""]), st.text(max_size=5),
                   st.just("al\ud800ce"), st.none(), st.integers())
REASONS = st.one_of(st.just(""), st.text(max_size=10), st.just("\udfff"), st.none(), st.integers())
VALUES = st.one_of(lossless_json(max_leaves=5), jsonish(max_leaves=4))
RUN_IDS = st.sampled_from(["own", "own", "own", "own", "unknown", "malformed", "other"])


@st.composite
def decisions(draw: st.DrawFn) -> dict[str, Any]:
    return {"run": draw(RUN_IDS), "key": draw(KEYS), "action": draw(ACTIONS), "actor": draw(ACTORS),
            "reason": draw(REASONS), "value": draw(VALUES)}


def refusals(d: dict[str, Any], kind: str, gate_open: bool) -> set[type[TaskLoopError]]:
    """The errors a decision may be refused with; empty when it must apply."""
    found: set[type[TaskLoopError]] = set()
    if d["action"] not in ("approve", "reject", "resume"):
        found.add(GateRefused)
    if not isinstance(d["key"], str):
        found.add(GateRefused)
    for text in (d["actor"], d["reason"]):
        if not isinstance(text, str) or not is_lossless(text):
            found.add(InvalidInput)
    if not is_lossless(d["value"]):
        found.add(InvalidInput)
    if d["run"] == "malformed":
        found.add(InvalidInput)
    elif d["run"] == "unknown":
        found.add(RunNotFound)
    elif d["run"] == "other" or d["key"] != "gate":
        found.add(GateRefused)  # another run's gate is not waiting; other keys are not gates
    if GATE_ACTORS[kind] and d["actor"] not in GATE_ACTORS[kind]:
        found.add(GateRefused)
    if d["action"] == "resume" and kind == "approval":
        found.add(GateRefused)
    if not gate_open:
        found.add(GateRefused)
    return found


def sane_decisions(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    """Decisions a careful operator makes on the waiting run: the gate, an action it takes, an
    allowed actor, a str reason and a JSON value."""
    actions = ["approve", "reject"] if kind == "approval" else ["approve", "reject", "resume", "resume"]
    actors = list(GATE_ACTORS[kind]) or ["anyone", "dave"]
    return st.fixed_dictionaries({
        "run": st.just("own"), "key": st.just("gate"), "action": st.sampled_from(actions),
        "actor": st.sampled_from(actors), "reason": st.text(max_size=10), "value": lossless_json(max_leaves=5)})


@st.composite
def decision_lists(draw: st.DrawFn, kind: str) -> list[dict[str, Any]]:
    return draw(st.lists(st.one_of(decisions(), sane_decisions(kind)), min_size=1, max_size=4))


@given(kind=st.sampled_from(sorted(GATES)), data=st.data())
@fuzz(ci=25, long=600, live=True)
def test_gate_decisions_apply_once_or_are_refused_clearly(fuzz_client: TaskLoop, kind: str,
                                                          data: st.DataObject) -> None:
    calls = data.draw(decision_lists(kind), "decisions")
    workflow = GATES[kind]
    own = fuzz_client.start(workflow, {}, run_id=_run_id(f"gate-{kind}")).run_id
    other = fuzz_client.start(workflow, {}, run_id=_run_id(f"gate-{kind}-other")).run_id
    fuzz_client.cancel(other, "only here to be decided on by mistake")
    wait_until(lambda: fuzz_client.inspect(own).tasks["gate"].status == "paused", what="the gate to wait")
    ids = {"own": own, "other": other, "unknown": "fuzz-gate-no-such-run", "malformed": "bad run\nid"}
    decided: dict[str, Any] | None = None
    for d in calls:
        allowed = refusals(d, kind, decided is None)
        try:
            fuzz_client.decide(ids[d["run"]], d["key"], d["action"], d["actor"], d["reason"], d["value"])
        except TaskLoopError as exc:
            event(f"refused: {type(exc).__name__}")
            assert allowed, f"a valid decision {d} was refused: {exc!r}"
            assert isinstance(exc, tuple(allowed)), f"{d}: {exc!r} is none of {allowed}"
            assert str(exc).strip()
            continue
        event(f"applied: {d['action']}")
        assert not allowed, f"a decision that should be refused ({allowed}) applied: {d}"
        decided = d
    if decided is None:
        assert fuzz_client.inspect(own).status in ("waiting", "running")
        fuzz_client.cancel(own, "fuzz example over")
        return
    result = fuzz_client.wait(own, timeout=30)
    if decided["action"] == "reject":
        assert (result.status, result.termination_code) == ("rejected", "rejected"), result
        return
    assert result.status == "done", result
    if decided["action"] == "resume":
        assert same_json(result.values["gate"], decided["value"])
        assert same_json(result.values["after"]["gate"], decided["value"])


def test_the_worker_survived(fuzz_worker: FuzzWorker) -> None:
    """Every process the module's worker started is still the same one (nothing was killed)."""
    assert fuzz_worker.processes() == fuzz_worker.pids
    assert "Traceback" not in fuzz_worker.log(), fuzz_worker.log()[-3000:]

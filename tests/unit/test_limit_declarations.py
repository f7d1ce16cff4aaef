"""tl.RateLimit and tl.Concurrency at definition time: numbers, names, units and keys checked with
messages that name the field and the fix; one name, one set of numbers across workflows; where
limits may go (tasks, loop phases, graph steps, flow loops; never gates); the fingerprint covers
them only when set; the key value a Concurrency's key gives."""

from __future__ import annotations

import re

import pytest

import taskloop as tl
from taskloop.core.limits import Spec, Waiter, key_value, spec_of


def _loop(**given):  # type: ignore[no-untyped-def]
    return tl.define_loop_task("l", max_rounds=2, attempt=lambda ctx, feedback: 1,
                               check=lambda ctx, candidate: tl.LoopCheck(done=True), **given)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: tl.RateLimit("r", rate=0), "rate must be an integer from 1 to 1,000,000"),
    (lambda: tl.RateLimit("r", rate=True), "rate must be an integer"),
    (lambda: tl.RateLimit("r", rate=1.5), "rate must be an integer"),
    (lambda: tl.RateLimit("r", rate=5, per_s=0), "per_s must be a number of seconds from 0.001"),
    (lambda: tl.RateLimit("r", rate=5, per_s=float("inf")), "per_s must be a number of seconds"),
    (lambda: tl.RateLimit("r", rate=5, unit="requests"), "unit must be one of ['starts', 'tokens']"),
    (lambda: tl.RateLimit("bad name", rate=5), "RateLimit name 'bad name' is invalid"),
    (lambda: tl.Concurrency("c", limit=0), "limit must be an integer from 1 to 100,000"),
    (lambda: tl.Concurrency("c", limit=1, key="doc_id"), "key must be a callable (ctx) -> str"),
    (lambda: tl.Concurrency("c|x", limit=1), "Concurrency name 'c|x' is invalid"),
])
def test_bad_numbers_names_and_keys_are_refused_with_the_fix(make, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(tl.DefinitionError) as raised:
        make()
    assert message in str(raised.value)


def test_one_name_one_set_of_numbers() -> None:
    tl.define_task("a", lambda ctx: 1, limits=[tl.RateLimit("unit-shared", rate=3, per_s=1)])
    tl.define_task("b", lambda ctx: 1, limits=[tl.RateLimit("unit-shared", rate=3, per_s=1)])  # the same: fine
    with pytest.raises(tl.DefinitionError, match="limit 'unit-shared' is declared twice with different settings"):
        tl.define_task("c", lambda ctx: 1, limits=[tl.RateLimit("unit-shared", rate=4, per_s=1)])


def test_where_limits_go() -> None:
    rate = tl.RateLimit("unit-where", rate=5)
    slot = tl.Concurrency("unit-where-slot", limit=1)
    loop = _loop(limits=[rate], check_limits=[slot])
    assert loop.limits_of("attempt") == (rate,) and loop.limits_of("check") == (rate, slot)
    assert tl.define_task("t", lambda ctx: 1, limits=[slot]).limits_of("run") == (slot,)
    assert tl.step(run=lambda ctx: 1, limits=[rate]).task.limits == (rate,)
    assert tl.step(attempt=lambda ctx, feedback: 1, check=lambda ctx, candidate: tl.LoopCheck(done=True),
                   max_rounds=2, attempt_limits=[slot]).task.limits_of("attempt") == (slot,)
    assert tl.loop("f", lambda ctx, state: state, limits=[rate]).limits == (rate,)
    with pytest.raises(tl.DefinitionError, match="a gate starts no phase, so it takes no limits"):
        tl.step(gate="approval", prompt="ok?", limits=[rate])
    with pytest.raises(tl.DefinitionError, match="attempt_limits and check_limits are for loop steps"):
        tl.step(run=lambda ctx: 1, attempt_limits=[rate])
    with pytest.raises(tl.DefinitionError, match="is in limits= and in a phase's limits"):
        _loop(limits=[rate], attempt_limits=[rate])
    with pytest.raises(tl.DefinitionError, match=re.escape("must be a list of limits, e.g. limits=[unit-where]")):
        tl.define_task("t", lambda ctx: 1, limits=rate)  # type: ignore[arg-type]
    with pytest.raises(tl.DefinitionError, match="names a limit twice"):
        tl.define_task("t", lambda ctx: 1, limits=[rate, rate])
    with pytest.raises(tl.DefinitionError, match=re.escape("must list tl.RateLimit or tl.Concurrency objects")):
        tl.define_task("t", lambda ctx: 1, limits=["openai"])  # type: ignore[list-item]


def test_the_fingerprint_covers_limits_only_when_set() -> None:
    plain = tl.define_task("t", lambda ctx: 1)
    assert "limits" not in plain.describe()
    limited = tl.define_task("t", lambda ctx: 1, limits=[tl.RateLimit("unit-fp", rate=2, per_s=0.5)])
    assert limited.describe()["limits"] == {"every": [{"name": "unit-fp", "kind": "rate", "rate": 2, "per_s": 0.5,
                                                       "unit": "starts"}]}


def test_key_values_and_wait_members() -> None:
    keyed = tl.Concurrency("unit-key", limit=1, key=lambda ctx: ctx)
    assert key_value(keyed, "doc-1") == "doc-1" and key_value(keyed, 42) == "42"
    assert key_value(keyed, "x" * 500).startswith("sha1-") and key_value(keyed, "a\nb").startswith("sha1-")
    for bad in (None, "", True, 1.5, ["a"]):
        with pytest.raises(ValueError, match="Concurrency unit-key: key\\(ctx\\) must return a non-empty string"):
            key_value(keyed, bad)
    assert spec_of(tl.Concurrency("unit-nokey", limit=2)) == Spec("conc", "unit-nokey", "", limit=2)
    waiter = Waiter("run-1", "draft", "attempt", 3, 17, "essay", "gpu|fast")
    assert Waiter.parse(waiter.member()) == waiter and waiter.holder == "run-1|draft"
    assert Waiter.parse("not|a|member") is None

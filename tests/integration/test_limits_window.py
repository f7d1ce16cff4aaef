"""limits.lua against its plain-Python model (taskloop/core/limits.py), on a real redis-server:
random sequences of acquisitions, releases and token reports at random times, for rate limits in
starts and in tokens and for concurrency limits; the script must admit exactly the phases the
model admits, and a window must never hold more than its rate."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskloop.core.limits import Model, Spec, Waiter
from taskloop.ops.embedded import RedisServer
from taskloop.store import keys as k
from taskloop.store.redis_store import RedisStore


@pytest.fixture(scope="module")
def store(redis_server: RedisServer) -> Iterator[RedisStore]:  # module-scoped (hypothesis refuses a function scope)
    found = RedisStore(redis_server.url)
    yield found
    found.close()


SPECS = st.one_of(
    st.builds(lambda r, p: Spec("rate", "", rate=r, per_s=p), st.integers(1, 6), st.sampled_from([0.5, 1.0, 2.5])),
    st.builds(lambda r, p: Spec("rate", "", rate=r, per_s=p, unit="tokens"), st.integers(10, 200),
              st.sampled_from([1.0, 3.0])),
    st.builds(lambda n: Spec("conc", "", value="v", limit=n), st.integers(1, 4)),
)
STEPS = st.lists(st.tuples(st.sampled_from(["acquire", "release", "tokens", "wake"]), st.integers(0, 7),
                           st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.5, 6.0]), st.integers(1, 120)),
                 min_size=1, max_size=60)


def _clear(store: RedisStore, name: str, value: str) -> None:
    store.client.delete(*k.LimitKeys.of(name, value).all())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=SPECS, steps=STEPS, case=st.integers(0, 10**9))
def test_the_script_admits_what_the_model_admits(store: RedisStore, spec: Spec, steps: list, case: int) -> None:
    spec = Spec(spec.kind, f"prop-{case}", spec.value, spec.rate, spec.per_s, spec.unit, spec.limit)
    _clear(store, spec.name, spec.value)
    model = Model(spec)
    now = 1_000_000.0
    for op, who, gap, amount in steps:
        now += gap
        member = Waiter(f"run{who}", "t", "run", 1, 1, "wf").member()
        holder = f"run{who}|t"
        if op == "acquire":
            expected = model.acquire(now, member, holder, now + 2.0)
            got = store.acquire([spec], member, holder, now + 2.0, now).admitted
            assert got == expected, (op, who, now, model)
            if got and not spec.tokens and spec.kind == "rate":  # the window never holds more than the rate
                use = k.LimitKeys.of(spec.name, spec.value).use
                assert store.client.zcount(use, f"({now - spec.per_s!r}", "+inf") <= spec.rate
        elif op == "release" and spec.kind == "conc":
            assert store.wake([spec], now, holder) == model.wake(now, holder)
        elif op == "wake":
            assert store.wake([spec], now) == model.wake(now)
        elif op == "tokens" and spec.tokens:
            model.report(now, amount, member)
            store.count_tokens([spec], member, amount, now)
    _clear(store, spec.name, spec.value)


def test_a_call_with_an_earlier_clock_cannot_overfill_a_window(store: RedisStore) -> None:
    """A worker that read its clock before a round trip (or whose host's clock is behind) acts at the
    latest time the limit has seen: its start cannot land in a window that a later call pruned."""
    spec = Spec("rate", "clock-skew", rate=2, per_s=1.0)
    _clear(store, spec.name, spec.value)
    use = k.LimitKeys.of(spec.name, spec.value).use
    t = 2_000_000.0
    admitted: dict[str, float] = {}
    # two starts at t and t + 0.02; a call at t + 1.03 prunes both and starts; then a call whose
    # clock still reads t + 0.99 asks
    for who, at in (("m0", t), ("m1", t + 0.02), ("a", t + 1.03), ("b", t + 0.99)):
        member = Waiter(who, "t", "run", 1, 1, "wf").member()
        if store.acquire([spec], member, f"{who}|t", at + 5, at).admitted:
            admitted[who] = float(store.client.zscore(use, member) or 0.0)
    assert set(admitted) == {"m0", "m1", "a", "b"}
    # the late call's start counts at t + 1.03, not at t + 0.99, where (t - 0.01, t + 0.99] held two
    assert admitted["b"] == admitted["a"] == t + 1.03
    starts = sorted(admitted.values())
    assert all(sum(1 for x in starts if s - 1.0 < x <= s) <= 2 for s in starts), admitted
    _clear(store, spec.name, spec.value)


def test_a_wake_counts_a_waiter_on_its_way_once(store: RedisStore) -> None:
    """A rate limit counts a waiter's start when a wake picks it. While its message is on its way
    back to a worker, a later wake sees that start in the window already: it takes no room a
    second time, and the room left goes to the next waiters (before, a window that reopened while
    the waiters picked earlier were on their way was left partly unused)."""
    spec = Spec("rate", "on-the-way", rate=6, per_s=1.0)
    _clear(store, spec.name, spec.value)
    model = Model(spec)
    t = 3_000_000.0

    def member(who: str) -> str:
        return Waiter(who, "t", "run", 1, 1, "wf").member()

    for who, at in (("a0", t), ("a1", t), *((f"a{i}", t + 0.5) for i in range(2, 6))):
        assert store.acquire([spec], member(who), f"{who}|t", at + 5, at).admitted
        assert model.acquire(at, member(who), f"{who}|t", at + 5)
    for i in range(1, 7):  # six phases find the window full and wait
        assert not store.acquire([spec], member(f"w{i}"), f"w{i}|t", t + 5.6, t + 0.6).admitted
        assert not model.acquire(t + 0.6, member(f"w{i}"), f"w{i}|t", t + 5.6)
    # a0 and a1 leave the window: two waiters are picked, and their starts count at once
    assert store.wake([spec], t + 1.05) == model.wake(t + 1.05) == [member("w1"), member("w2")]
    # a2..a5 leave: four more fit beside w1 and w2, which are still on their way
    picked = [member(f"w{i}") for i in range(3, 7)]
    assert store.wake([spec], t + 1.55) == model.wake(t + 1.55) == picked
    use = k.LimitKeys.of(spec.name, spec.value).use
    assert store.client.zcount(use, f"({t + 0.55!r}", "+inf") == 6  # the window holds its rate, no more
    _clear(store, spec.name, spec.value)


def test_a_picked_waiter_counts_from_its_start(store: RedisStore) -> None:
    """A wake counts a waiter's start when it picks it; when the waiter's message reaches a worker
    and the phase begins, its start counts from then: the window holds the callbacks' starts, so a
    late arrival of one window and the next window's waiters cannot begin in the same second."""
    spec = Spec("rate", "from-its-start", rate=1, per_s=1.0)
    _clear(store, spec.name, spec.value)
    model = Model(spec)
    t = 4_000_000.0
    use = k.LimitKeys.of(spec.name, spec.value).use
    first, late, next_one = (Waiter(who, "t", "run", 1, 1, "wf").member() for who in ("a", "late", "next"))
    assert store.acquire([spec], first, "a|t", t + 5, t).admitted and model.acquire(t, first, "a|t", t + 5)
    for member, holder in ((late, "late|t"), (next_one, "next|t")):
        assert not store.acquire([spec], member, holder, t + 5.1, t + 0.1).admitted
        assert not model.acquire(t + 0.1, member, holder, t + 5.1)
    assert store.wake([spec], t + 1.01) == model.wake(t + 1.01) == [late]  # counted at t + 1.01
    # its message takes 0.6 s to reach a worker: its start counts from t + 1.61
    assert store.acquire([spec], late, "late|t", t + 6.6, t + 1.61).admitted
    assert model.acquire(t + 1.61, late, "late|t", t + 6.6)
    assert float(store.client.zscore(use, late) or 0) == t + 1.61
    # so the next waiter is not sent at t + 2.01, when the pick's second would have ended, but once
    # the late one's callback has had its second
    assert store.wake([spec], t + 2.05) == model.wake(t + 2.05) == []
    assert store.wake([spec], t + 2.62) == model.wake(t + 2.62) == [next_one]
    _clear(store, spec.name, spec.value)

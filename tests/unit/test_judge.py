"""The model a context brings (define/context.py's ``Judge``, filled by runtime/judge.py): until_llm,
tl.llm_check and tl.llm_score decide on what it answers, record the exchange with the phase and count
its tokens, without any client in the declarations; the runtime's judge bounds the client's timeout by
the round's deadline and reads a score from a grading reply."""

from __future__ import annotations

from typing import Any

import pytest

import taskloop as tl
from taskloop.base import clock
from taskloop.base.errors import LLMNotConfigured
from taskloop.connections import llm
from taskloop.define.context import Judgement, LoopContext, Signal
from taskloop.runtime import judge as runtime_judge

NOW = 1_700_000_000.0
RECORD = {"question": "q", "reply": "r"}


class Usage:
    def __init__(self) -> None:
        self.reports: list[dict[str, int]] = []

    def report(self, counts: dict[str, int]) -> None:
        self.reports.append(counts)

    def report_once(self, receipt: str, counts: dict[str, int]) -> bool:
        raise AssertionError("a model's judgement is reported with report()")


class Model:
    """A judge that answers ``reply`` (and ``score``) and remembers what it was asked."""

    def __init__(self, reply: str, affirmative: bool, score: float | None = None) -> None:
        self.judgement = Judgement(reply=reply, affirmative=affirmative, score=score,
                                   usage={"input": 12, "cached": 4, "output": 3}, record=RECORD)
        self.asked: list[tuple[str, Any, float | None, float | None]] = []

    def __call__(self, question: str, state: Any, *, deadline: float | None,
                 scale: float | None = None) -> Judgement:
        self.asked.append((question, state, deadline, scale))
        return self.judgement


def _ctx(model: Model | None, round: int = 1) -> tuple[LoopContext, Usage]:
    usage = Usage()
    ctx = LoopContext(round=round, phase="check", run_id="r1", workflow="w", key="essay", load_input=lambda: "draft",
                      attempt=1, signal=Signal(), idempotency_key=f"r1/essay/{round}/check", after=(),
                      load_value=lambda key: None, usage=usage, deadline=NOW + 30, judge=model)
    return ctx, usage


def test_llm_check_decides_on_the_contexts_model() -> None:
    model = Model("Yes, it is clear.", affirmative=True)
    ctx, usage = _ctx(model)

    found = tl.llm_check("Is the essay clear?")(ctx, {"text": "draft"})

    assert found == tl.LoopCheck(done=True, feedback="Yes, it is clear.")
    assert model.asked == [("Is the essay clear?", {"text": "draft"}, NOW + 30, None)]
    assert ctx.notes == {"llm": RECORD}  # recorded with the phase
    assert usage.reports == [{"input": 12, "cached": 4, "output": 3}]


def test_llm_score_takes_the_score_of_the_judgement() -> None:
    model = Model("score: 7\nCite a source.", affirmative=False, score=7.0)
    ctx, usage = _ctx(model)

    passed = tl.llm_score("How clear is it?", passing=7)(ctx, "draft")
    failed = tl.llm_score("How clear is it?", passing=8, scale=10)(ctx, "draft")

    assert passed == tl.LoopCheck(done=True, feedback="score: 7\nCite a source.", score=7.0)
    assert failed == tl.LoopCheck(done=False, feedback="score: 7\nCite a source.", score=7.0)
    assert [scale for *_, scale in model.asked] == [10.0, 10.0]
    assert len(usage.reports) == 2


def test_until_llm_stops_the_loop_when_the_model_says_yes() -> None:
    task = tl.loop("improve", lambda ctx, state: state, until_llm="Is it good?", max_iterations=4)
    assert task.check is not None

    go_on = task.check(_ctx(Model("no", affirmative=False), round=2)[0], "draft")
    stop = task.check(_ctx(Model("Yes, publish.", affirmative=True), round=2)[0], "draft")

    assert go_on == tl.LoopCheck(done=False, feedback="iteration 2: go on")
    assert stop == tl.LoopCheck(done=True, feedback="until_llm: Yes, publish.")


def test_a_context_without_a_model_refuses_clearly() -> None:
    ctx, usage = _ctx(None)

    with pytest.raises(LLMNotConfigured, match=r"^until_llm requires a model"):
        tl.llm_check("Done?")(ctx, "draft")
    assert ctx.notes == {} and usage.reports == []


@pytest.mark.parametrize(("deadline", "timeout"), [(None, llm.DEFAULT_TIMEOUT_S), (NOW + 5, 5.0),
                                                   (NOW + 600, llm.DEFAULT_TIMEOUT_S), (NOW - 1, 0.1)])
def test_the_runtimes_judge_is_bounded_by_the_rounds_deadline(monkeypatch: pytest.MonkeyPatch,
                                                              deadline: float | None, timeout: float) -> None:
    asked: list[dict[str, Any]] = []
    verdict = llm.LLMVerdict(question="Done?", messages=llm.build_messages("Done?", 1), reply="Score: 6.5/10 ok",
                             affirmative=False, usage=llm.LLMUsage(input=9, cached=1, output=2), model="m",
                             latency_s=0.5)

    def ask(question: str, state: Any, **options: Any) -> llm.LLMVerdict:
        asked.append({"question": question, "state": state, **options})
        return verdict

    monkeypatch.setattr(clock, "now", lambda: NOW)
    monkeypatch.setattr(llm, "ask", ask)

    found = runtime_judge.judge("Done?", 1, deadline=deadline, scale=10.0)

    assert asked == [{"question": "Done?", "state": 1, "timeout": timeout, "scale": 10.0}]
    assert found == Judgement(reply="Score: 6.5/10 ok", affirmative=False, score=6.5,
                              usage={"input": 9, "cached": 1, "output": 2}, record=verdict.model_dump(mode="json"))
    assert runtime_judge.judge("Done?", 1, deadline=deadline).score is None  # a yes/no question has no score

"""The model the runtime gives callbacks' contexts (define/context.py's ``Judge``): one question
about a state to the chat-completions client of connections/llm.py, bounded by the round's
deadline. ``until_llm``, ``tl.llm_check`` and ``tl.llm_score`` reach it through ``ctx``, so
declarations import no client."""

from __future__ import annotations

from typing import Any

from taskloop.base import clock
from taskloop.connections import llm
from taskloop.define.context import Judgement


def judge(question: str, state: Any, *, deadline: float | None, scale: float | None = None) -> Judgement:
    """Ask the model of TASKLOOP_LLM_BASE_URL (with ``scale``: for a score from 0 to ``scale``);
    raise LLMNotConfigured or LLMCallFailed."""
    timeout = llm.DEFAULT_TIMEOUT_S
    if deadline is not None:  # the round's timeout bounds the call too
        timeout = max(min(timeout, deadline - clock.now()), 0.1)
    verdict = llm.ask(question, state, timeout=timeout, scale=scale)
    return Judgement(reply=verdict.reply, affirmative=verdict.affirmative,
                     score=None if scale is None else llm.parse_score(verdict.reply, scale),
                     usage=verdict.usage.model_dump(), record=verdict.model_dump(mode="json"))

"""The model the runtime gives callbacks' contexts (define/context.py's ``Judge``): one question
about a state to the chat-completions client of connections/llm.py, bounded by the round's
deadline. ``until_llm``, ``tl.llm_check`` and ``tl.llm_score`` reach it through ``ctx``, so
declarations import no client. The hooks hear of each call (``model_asked``: tracing makes it a
CLIENT span under the phase's)."""

from __future__ import annotations

import os
from typing import Any

from taskloop.base import clock
from taskloop.connections import llm
from taskloop.define.context import Judgement
from taskloop.ops.hooks import ModelAsked
from taskloop.runtime.instruments import hooks


def judge(question: str, state: Any, *, deadline: float | None, scale: float | None = None) -> Judgement:
    """Ask the model of TASKLOOP_LLM_BASE_URL (with ``scale``: for a score from 0 to ``scale``);
    raise LLMNotConfigured or LLMCallFailed."""
    timeout = llm.DEFAULT_TIMEOUT_S
    if deadline is not None:  # the round's timeout bounds the call too
        timeout = max(min(timeout, deadline - clock.now()), 0.1)
    told = hooks()
    asked = clock.now()
    try:
        verdict = llm.ask(question, state, timeout=timeout, scale=scale)
    except Exception as exc:  # LLMNotConfigured, LLMCallFailed: told, then raised as before
        if told.wants("model_asked"):
            told.model_asked(ModelAsked(os.environ.get(llm.ENV_MODEL) or None, asked, clock.now(),
                                        error=str(exc), error_type=type(exc).__name__))
        raise
    if told.wants("model_asked"):
        told.model_asked(ModelAsked(verdict.model, asked, clock.now(), verdict.usage.model_dump()))
    return Judgement(reply=verdict.reply, affirmative=verdict.affirmative,
                     score=None if scale is None else llm.parse_score(verdict.reply, scale),
                     usage=verdict.usage.model_dump(), record=verdict.model_dump(mode="json"))

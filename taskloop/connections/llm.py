"""A small OpenAI-compatible chat-completions client: the model behind ``until_llm`` and ``tl.llm_check``.

``ask(question, state)`` sends one yes/no question about a state to ``{TASKLOOP_LLM_BASE_URL}/chat/completions``
(model ``TASKLOOP_LLM_MODEL``, optional bearer key ``TASKLOOP_LLM_API_KEY``; the environment is read at call
time) and returns an ``LLMVerdict``. The state is JSON-dumped and cut to ``MAX_STATE_CHARS`` characters (its
head is kept). ``is_affirmative`` is Go Micro's rule (flow/loop.go ``isAffirmative``): strip surrounding
whitespace, lowercase, and the reply is affirmative when it starts with yes, done, true, complete or finished.
Retries are the caller's (a Retry policy); the task's timeout and cancellation are the caller's too.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, SecretStr

from taskloop.base.errors import LLMCallFailed, LLMNotConfigured

if TYPE_CHECKING:
    import httpx

ENV_BASE_URL, ENV_MODEL, ENV_API_KEY = "TASKLOOP_LLM_BASE_URL", "TASKLOOP_LLM_MODEL", "TASKLOOP_LLM_API_KEY"
AFFIRMATIVE_PREFIXES = ("yes", "done", "true", "complete", "finished")
MAX_STATE_CHARS = 16_000  # about 4k tokens of state in the prompt; the rest is cut (and the cut is said)
MAX_REPLY_TOKENS = 16  # enough for "yes"/"no" and a few words of reason
DEFAULT_TIMEOUT_S = 60.0
SYSTEM_PROMPT = "You judge whether a goal is met. Start your reply with yes or no."
YES_NO = 'Answer "yes" or "no".'
SCORE_PROMPT = "You grade work. Start your reply with the score, as score: N, then say what to improve."
SCORE_REPLY_TOKENS = 200  # a score and a few sentences of feedback
_SCORE = re.compile(r"score\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


class LLMConfig(BaseModel):
    """Where to ask: an OpenAI-compatible base URL (``http://127.0.0.1:8000/v1``), a model and an optional key."""

    model_config = ConfigDict(frozen=True)
    base_url: str
    model: str
    api_key: SecretStr | None = None

    @classmethod
    def from_env(cls) -> LLMConfig:
        base_url, model = os.environ.get(ENV_BASE_URL, "").strip(), os.environ.get(ENV_MODEL, "").strip()
        if not base_url or not model:
            missing = " and ".join(name for name, value in ((ENV_BASE_URL, base_url), (ENV_MODEL, model)) if not value)
            raise LLMNotConfigured(
                f"until_llm requires a model: set {ENV_BASE_URL} and {ENV_MODEL} (an OpenAI-compatible endpoint, "
                f"e.g. http://127.0.0.1:8000/v1; {ENV_API_KEY} is optional); missing: {missing}"
            )
        key = os.environ.get(ENV_API_KEY, "").strip()
        return cls(base_url=base_url, model=model, api_key=SecretStr(key) if key else None)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"


class Message(BaseModel):
    model_config = ConfigDict(frozen=True)
    role: str
    content: str


class LLMUsage(BaseModel):
    """Token counts in taskloop's names (``ctx.report_usage(**usage.model_dump())``). ``input`` is the
    endpoint's prompt_tokens, which includes the ``cached`` ones."""

    model_config = ConfigDict(frozen=True)
    input: int = 0
    cached: int = 0
    output: int = 0


class LLMVerdict(BaseModel):
    """One yes/no judgement: what was sent, what came back, and what it cost (JSON-safe, recorded per round)."""

    model_config = ConfigDict(frozen=True)
    question: str
    messages: list[Message]
    reply: str
    affirmative: bool
    usage: LLMUsage
    model: str
    latency_s: float


def is_affirmative(reply: str) -> bool:
    """Go Micro's ``isAffirmative``: after trimming whitespace and lowercasing, the reply starts with yes, done,
    true, complete or finished. A plain prefix test: "Yes, the goal is met." and "DONE" count; "no", "not yet",
    "" and a reply that opens with punctuation ('"yes"', "**Yes**") do not."""
    return reply.strip().lower().startswith(AFFIRMATIVE_PREFIXES)


def render_state(state: Any, max_chars: int = MAX_STATE_CHARS) -> str:
    """The state as JSON (non-JSON leaves as their repr), cut to ``max_chars`` characters with a note."""
    text = json.dumps(state, ensure_ascii=False, sort_keys=True, default=repr)
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[truncated: the first {max_chars} of {len(text)} characters]"


def build_messages(question: str, state: Any, max_state_chars: int = MAX_STATE_CHARS,
                   instruction: str = YES_NO, system: str = SYSTEM_PROMPT) -> list[Message]:
    """The prompt (after Go Micro's askDone): the question, the latest state, and an instruction
    (a yes/no answer; for a score, ``score_instruction``)."""
    user = f"{question}\n\nLatest state (JSON):\n{render_state(state, max_state_chars)}\n\n{instruction}"
    return [Message(role="system", content=system), Message(role="user", content=user)]


def score_instruction(scale: float) -> str:
    return f"Give a score from 0 to {scale:g} as 'score: N' on the first line, then what to improve."


def parse_score(reply: str, scale: float) -> float | None:
    """The score a grading reply gives ("score: 7", "Score = 6.5/10"), within [0, scale]; None when
    it gives none."""
    found = _SCORE.search(reply)
    if found is None:
        return None
    return min(max(float(found.group(1)), 0.0), scale)


def parse_usage(body: Any) -> LLMUsage:
    """``usage.prompt_tokens`` / ``completion_tokens`` / ``prompt_tokens_details.cached_tokens`` (absent: 0)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}

    def count(value: Any) -> int:
        return value if type(value) is int and value >= 0 else 0

    return LLMUsage(input=count(usage.get("prompt_tokens")), cached=count(details.get("cached_tokens")),
                    output=count(usage.get("completion_tokens")))


def _shown(url: str) -> str:
    """The URL without any user:password part (it goes into error messages)."""
    import httpx

    try:
        return str(httpx.URL(url).copy_with(userinfo=b""))
    except httpx.InvalidURL:
        return url.rpartition("@")[2]


def ask(question: str, state: Any, *, config: LLMConfig | None = None, timeout: float = DEFAULT_TIMEOUT_S,
        client: httpx.Client | None = None, max_tokens: int = MAX_REPLY_TOKENS,
        scale: float | None = None) -> LLMVerdict:
    """Ask the model a yes/no ``question`` about ``state`` (with ``scale``: for a score from 0 to
    ``scale`` and what to improve); raise LLMNotConfigured or LLMCallFailed. ``timeout`` (seconds)
    bounds connecting, sending and each read; ``client`` is reused when given."""
    import httpx  # here, not at the top: httpx (with the click and rich its CLI module imports)
    # is about 16 MB per process, paid only by processes that ask a model (docs/benchmarks.md)

    config = config or LLMConfig.from_env()
    if scale is None:
        messages = build_messages(question, state)
    else:
        messages = build_messages(question, state, instruction=score_instruction(scale), system=SCORE_PROMPT)
        max_tokens = max(max_tokens, SCORE_REPLY_TOKENS)
    key = config.api_key.get_secret_value() if config.api_key else ""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    payload = {"model": config.model, "messages": [m.model_dump() for m in messages],
               "max_tokens": max_tokens, "temperature": 0}
    url = _shown(config.url)

    def failed(problem: str, fix: str, status: int | None = None, retryable: bool = False) -> LLMCallFailed:
        message = f"LLM call failed: POST {url} {problem}; {fix}"
        return LLMCallFailed(message.replace(key, "***") if key else message, url=url, status=status,
                             retryable=retryable)

    started = time.perf_counter()
    try:
        if client is None:
            with httpx.Client() as own:
                response = own.post(config.url, json=payload, headers=headers, timeout=timeout)
        else:
            response = client.post(config.url, json=payload, headers=headers, timeout=timeout)
    except httpx.TimeoutException as exc:
        raise failed(f"timed out after {timeout:g}s", "check that the server is up, or pass a longer timeout",
                     retryable=True) from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise failed(f"failed ({type(exc).__name__}: {exc})",
                     f"check that an OpenAI-compatible server listens at {ENV_BASE_URL}", retryable=True) from exc
    latency = time.perf_counter() - started
    status = response.status_code
    if status >= 400:
        fix = {401: f"check {ENV_API_KEY}", 403: f"check {ENV_API_KEY}",
               404: f"check {ENV_BASE_URL} (usually ending in /v1) and {ENV_MODEL}"}.get(status, "see the server's log")
        raise failed(f"answered HTTP {status} ({response.text[:200]!r})", fix, status,
                     retryable=status == 429 or status >= 500)
    try:
        body = response.json()
        reply = body["choices"][0]["message"]["content"]
        if not isinstance(reply, str):
            raise TypeError(f"content is {type(reply).__name__}, not a string")
    except (ValueError, LookupError, TypeError) as exc:
        raise failed(f"returned a malformed reply ({type(exc).__name__}: {exc}; body {response.text[:200]!r})",
                     f"check that {ENV_BASE_URL} points at an OpenAI-compatible endpoint", status) from exc
    return LLMVerdict(question=question, messages=messages, reply=reply, affirmative=is_affirmative(reply),
                      usage=parse_usage(body), model=config.model, latency_s=round(latency, 6))
